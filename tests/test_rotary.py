"""rotary_embedding (neox / gptj, partial rotary dims, computed or cached cos / sin) against a
float64 reference; q and k are slices of a packed qkv buffer, so the test also checks that nothing
but the rotary part of q and k is written."""

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.rotary import rotary_embedding
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import derived_check, random_array
from rowwise_testing import DTYPES, dev, host


def small_blocks():
    """Blocks of at most 32 threads under the simulator."""
    if SIMULATOR:
        return overrides(rotary={"max_block_threads": 32})
    return contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _small_blocks():
    with small_blocks():
        yield


def _case(rng, tokens, nh_q, nh_k, headdim, dtype, style, *, rotary_dim=None, cache=None,
          pos_dtype="int64", offset=0, max_pos=64, base=10000.0, with_k=True):
    rd = headdim if rotary_dim is None else rotary_dim
    qkv_h = random_array((tokens, nh_q + 2 * nh_k, headdim), dtype, rng)
    qkv = dev(qkv_h, offset)
    q = qkv[:, :nh_q]
    k = qkv[:, nh_q:nh_q + nh_k] if with_k else None
    positions_h = rng.integers(0, max_pos, size=tokens).astype(pos_dtype)
    cache_h = None if cache is None else ref.rotary_cache(max_pos, rd, base, cache)
    got_q, got_k = rotary_embedding(
        q, k, dev(positions_h), base=base, style=style, rotary_dim=rotary_dim,
        cos_sin_cache=None if cache_h is None else dev(cache_h))
    assert got_q is q and got_k is k
    after = host(qkv)
    heads = [("q", slice(0, nh_q))] + ([("k", slice(nh_q, nh_q + nh_k))] if with_k else [])
    touched = np.zeros(after.shape, bool)
    for name, hs in heads:
        x = qkv_h[:, hs]
        expected = ref.rotary(x, positions_h, rd, style, base, cache_h)
        plain = ref.rotary_plain(x, positions_h, rd, style, base, cache_h)
        derived_check(after[:, hs].astype(np.float64), expected, plain, name=name)
        touched[:, hs, :rd] = True
    # everything else (v, k when None, dims past rotary_dim) is bit-identical
    np.testing.assert_array_equal(after.view(np.uint8).reshape(after.shape + (-1,))[~touched],
                                  qkv_h.view(np.uint8).reshape(after.shape + (-1,))[~touched])


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_vector_paths(style, dtype, rng):
    # headdim 32: 16-byte accesses (neox halves of 16, gptj 8 / 4 interleaved pairs)
    _case(rng, 2, 2, 1, 32, dtype, style)
    _case(rng, 1, 3, 2, 32, dtype, style, cache="float32", pos_dtype="int32")


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_scalar_paths(style, rng):
    _case(rng, 2, 2, 1, 12, "float16", style)                       # half 6: not 8-aligned
    _case(rng, 1, 2, 1, 32, "bfloat16", style, offset=1)              # misaligned buffer
    _case(rng, 2, 1, 1, 10, "float32", style, cache="bfloat16")       # fp32, half 5


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_partial_dims_and_no_k(style, rng):
    _case(rng, 2, 2, 1, 32, "float16", style, rotary_dim=16)         # vector, 50%
    _case(rng, 1, 2, 1, 24, "float32", style, rotary_dim=6, cache="float16")
    _case(rng, 2, 3, 1, 16, "bfloat16", style, with_k=False)


def test_rotary_large_positions(rng):
    # angles up to a million radians: the range reduction keeps fp32-plain accuracy
    _case(rng, 3, 1, 1, 16, "float32", "neox", max_pos=1 << 20, base=500000.0)


def test_rotary_positions_outside_the_cache(rng):
    qkv_h = random_array((3, 3, 16), "float32", rng)
    qkv = dev(qkv_h)
    cache = dev(ref.rotary_cache(8, 16))
    positions = dev(np.array([1, 8, -1], np.int64))
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 8\)"):
        rotary_embedding(qkv[:, :2], qkv[:, 2:], positions, cos_sin_cache=cache)
    np.testing.assert_array_equal(host(qkv), qkv_h)  # checked before anything is written
    # unchecked: the out-of-range tokens are left as they were, the valid one is rotated
    rotary_embedding(qkv[:, :2], qkv[:, 2:], positions, cos_sin_cache=cache, check_bounds=False)
    after = host(qkv)
    np.testing.assert_array_equal(after[1:], qkv_h[1:])
    expected = ref.rotary(qkv_h[:1], np.array([1]), 16, "neox", cos_sin_cache=ref.rotary_cache(
        8, 16))
    np.testing.assert_allclose(after[:1], expected, atol=1e-5)


@given(style=st.sampled_from(["neox", "gptj"]), tokens=st.integers(1, 2),
       nh_q=st.integers(1, 3), nh_k=st.integers(0, 2), half=st.integers(1, 12),
       extra=st.integers(0, 4), dtype=st.sampled_from(DTYPES),
       cache=st.sampled_from([None, "float32", "bfloat16"]), misaligned=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_rotary_hypothesis_small(style, tokens, nh_q, nh_k, half, extra, dtype, cache,
                                 misaligned, seed):
    rng = np.random.default_rng(seed)
    with small_blocks():
        _case(rng, tokens, nh_q, nh_k, 2 * half + extra, dtype, style, rotary_dim=2 * half,
              cache=cache, offset=int(misaligned), pos_dtype=str(rng.choice(["int32", "int64"])))


def test_rotary_bad_inputs(rng):
    q = dev(random_array((2, 4, 16), "float16", rng))
    k = dev(random_array((2, 2, 16), "float16", rng))
    pos = dev(np.array([0, 1], np.int64))
    with pytest.raises(TypeError, match="q: expected a CUDA array"):
        rotary_embedding([1.0], k, pos)
    with pytest.raises(ValueError, match="q: expected 3 dimensions"):
        rotary_embedding(dev(random_array((2, 64), "float16", rng)), k, pos)
    with pytest.raises(ValueError, match=r"k: expected shape \(2, \*, 16\)"):
        rotary_embedding(q, dev(random_array((2, 2, 8), "float16", rng)), pos)
    with pytest.raises(TypeError, match="k: expected dtype float16 to match q"):
        rotary_embedding(q, dev(random_array((2, 2, 16), "bfloat16", rng)), pos)
    with pytest.raises(TypeError, match="positions: expected dtype in"):
        rotary_embedding(q, k, dev(np.array([0.0, 1.0], np.float32)))
    with pytest.raises(ValueError, match=r"positions: expected shape \(2,\)"):
        rotary_embedding(q, k, dev(np.array([0, 1, 2], np.int32)))
    with pytest.raises(ValueError, match="rotary_dim: expected an even int"):
        rotary_embedding(q, k, pos, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim: expected an even int"):
        rotary_embedding(q, k, pos, rotary_dim=18)
    with pytest.raises(ValueError, match="rotary_dim: expected an even int"):
        rotary_embedding(q, k, pos, rotary_dim=0)
    with pytest.raises(TypeError, match="rotary_dim: expected an int"):
        rotary_embedding(q, k, pos, rotary_dim=8.0)
    odd = dev(random_array((2, 4, 7), "float16", rng))   # rotary_dim not given: blame q
    with pytest.raises(ValueError, match=r"q: expected an even headdim >= 2 .* got shape "
                                         r"\(2, 4, 7\)"):
        rotary_embedding(odd, None, pos)
    with pytest.raises(ValueError, match="base: expected a finite float > 0"):
        rotary_embedding(q, k, pos, base=float("inf"))
    with pytest.raises(TypeError, match="k: expected a CUDA array"):
        rotary_embedding(q, [1.0], pos)
    with pytest.raises(ValueError, match="style: expected one of"):
        rotary_embedding(q, k, pos, style="llama")
    with pytest.raises(ValueError, match="base: expected a finite float > 0"):
        rotary_embedding(q, k, pos, base=0.0)
    with pytest.raises(TypeError, match="base: expected a float"):
        rotary_embedding(q, k, pos, base="1e4")
    with pytest.raises(ValueError, match=r"cos_sin_cache: expected shape \(max_position, 16\)"):
        rotary_embedding(q, k, pos, cos_sin_cache=dev(ref.rotary_cache(8, 8)))
    with pytest.raises(TypeError, match="cos_sin_cache: expected dtype in"):
        rotary_embedding(q, k, pos, cos_sin_cache=dev(np.ones((8, 16), np.int32)))
    with pytest.raises(ValueError, match="q: expected the last dimension to be contiguous"):
        # swapaxes: the same call for a NumPy array (simulator) and a torch tensor (GPU)
        rotary_embedding(dev(random_array((2, 16, 4), "float16", rng)).swapaxes(1, 2), k, pos)


# ---- GPU: real sizes ------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=20)  # each new shape may compile a kernel variant
@given(style=st.sampled_from(["neox", "gptj"]), tokens=st.integers(1, 300),
       nh_q=st.integers(1, 40), nh_k=st.integers(0, 8),
       headdim=st.sampled_from([32, 64, 80, 96, 128, 256, 18]),
       partial=st.sampled_from([1.0, 0.5, 0.25]), dtype=st.sampled_from(DTYPES),
       cache=st.sampled_from([None, "float32", "bfloat16", "float16"]),
       misaligned=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rotary_gpu_hypothesis(style, tokens, nh_q, nh_k, headdim, partial, dtype, cache,
                               misaligned, seed):
    rd = max(2, int(headdim * partial) // 2 * 2)
    rng = np.random.default_rng(seed)
    _case(rng, tokens, nh_q, nh_k, headdim, dtype, style, rotary_dim=rd, cache=cache,
          offset=int(misaligned), max_pos=8192, pos_dtype=str(rng.choice(["int32", "int64"])))


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_gpu_benchmark_shape(style, dtype, rng, bench_data):
    """8192 tokens of a packed qkv (32 q, 8 k, 8 v heads of 128), computed and cached cos /
    sin: q and k checked finite and v unchanged on every token, the float64 reference on 66
    tokens (first, last, 64 random; see ``BenchmarkData`` in conftest.py). Tokens are rotated
    independently (by their own position) with the same code, so each sampled token checks
    every head and every dimension."""
    for cache in (None, "float32"):
        _benchmark_case(bench_data, rng, 8192, 32, 8, 128, dtype, style, cache=cache,
                        max_pos=8192)


def _benchmark_case(bench, rng, tokens, nh_q, nh_k, headdim, dtype, style, *, cache, max_pos):
    qkv = bench.normal((tokens, nh_q + 2 * nh_k, headdim), dtype)
    before = qkv.clone()
    q, k = qkv[:, :nh_q], qkv[:, nh_q:nh_q + nh_k]
    positions_h = rng.integers(0, max_pos, size=tokens).astype(np.int64)
    cache_h = None if cache is None else ref.rotary_cache(max_pos, headdim, dtype=cache)
    got_q, got_k = rotary_embedding(q, k, dev(positions_h), style=style,
                                    cos_sin_cache=None if cache_h is None else dev(cache_h))
    assert got_q is q and got_k is k
    bench.assert_finite(qkv[:, :nh_q + nh_k], "q and k")
    bench.assert_same_bits(qkv[:, nh_q + nh_k:], before[:, nh_q + nh_k:], "v")
    rows = bench.rows(tokens)
    after, x, positions = bench.take(qkv, rows), bench.take(before, rows), positions_h[rows]
    for name, hs in (("q", slice(0, nh_q)), ("k", slice(nh_q, nh_q + nh_k))):
        expected = ref.rotary(x[:, hs], positions, headdim, style, cos_sin_cache=cache_h)
        plain = ref.rotary_plain(x[:, hs], positions, headdim, style, cos_sin_cache=cache_h)
        derived_check(after[:, hs].astype(np.float64), expected, plain, name=name)
