"""softmax (fused single-pass; split rows in one kernel, span in registers or streamed) against
float64 references, including the special rows; the split paths agree bit for bit, whether a
block waits for its row or computes the other spans itself, and leave their counters zero."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR, _workspace
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import _rowwise
from llmspeed_numba.ops import softmax as sm_mod
from llmspeed_numba.ops.softmax import softmax
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import derived_check, poison, random_array
from rowwise_testing import DTYPES, IEEE_SPECIALS, dev, host, split_rows


@pytest.fixture(params=["fused", "split"])
def path(request):
    with split_rows(request.param == "split"):
        yield request.param


def _softmax_case(rng, shape, dtype, *, temperature=1.0, out_dtype=None, offset=0, scale=4.0):
    x_h = random_array(shape, dtype, rng, scale=scale)
    x = dev(x_h, offset)
    odt = out_dtype or dtype
    out = poison(dev(np.empty(shape, x_h.dtype if odt == dtype else np.float32), offset))
    got = softmax(x, temperature=temperature, out=out)
    assert got is out
    derived_check(host(got), ref.softmax(x_h, temperature),
                  ref.softmax_plain(x_h, temperature, odt), name="softmax")
    np.testing.assert_array_equal(host(x).view(np.uint8), x_h.view(np.uint8))
    return host(got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_paths(path, dtype, rng):
    _softmax_case(rng, (3, 200), dtype)                     # 16-byte chunks
    _softmax_case(rng, (2, 77), dtype, temperature=0.7)     # scalar (row stride 77)
    _softmax_case(rng, (1, 203), dtype, out_dtype="float32")  # chunks + tail, fp32 out


def test_softmax_misaligned_and_leading_dims(path, rng):
    _softmax_case(rng, (2, 64), "bfloat16", offset=1)
    _softmax_case(rng, (2, 2, 40), "float16", temperature=2.0)


@IEEE_SPECIALS
def test_softmax_special_rows(path):
    inf = np.inf
    x_h = np.array([[-inf] * 40,                               # all -inf: NaN (torch)
                    [0.0] * 39 + [np.nan],                     # a NaN: NaN
                    [1.0] * 20 + [-inf] * 20,                  # masked half: 1/20 and 0
                    [inf] + [0.0] * 39,                        # +inf: NaN
                    [5.0] + [-inf] * 39], np.float32)          # one finite: 1 and 0
    got = host(softmax(dev(x_h)))
    assert np.isnan(got[0]).all() and np.isnan(got[1]).all() and np.isnan(got[3]).all()
    np.testing.assert_allclose(got[2], [0.05] * 20 + [0.0] * 20, rtol=1e-6)
    np.testing.assert_array_equal(got[4], [1.0] + [0.0] * 39)


def small_split(**softmax):
    """Split rows with 4 blocks a row (simulator-sized under the simulator); ``softmax``: its
    other knobs (``split_path``, ``spin_polls``)."""
    knobs = {"softmax": {"splits": 4, **softmax}}
    return split_rows(True, **knobs) if SIMULATOR else overrides(**knobs)


@pytest.mark.parametrize("dtype, shape", [("bfloat16", (1, 203)),   # 25 chunks + a tail of 3
                                          ("float32", (3, 77))])    # scalar access
def test_softmax_split_paths_agree(dtype, shape, rng):
    # Every split path computes each span's online (max, sum) in the same order and merges the
    # partials in span order, so they agree bit for bit; a forced fallback (every block computes
    # the other spans itself, SPIN_POLLS < 0) too. The simulator runs blocks one after another:
    # there each row's last block is the only one that finds the row complete.
    x_h = random_array(shape, dtype, rng, scale=4.0)
    results = {}
    for path_, polls in (("resident", 2), ("resident", -1), ("streamed", 2)):
        with small_split(split_path=path_, spin_polls=polls):
            out = poison(dev(np.empty(shape, np.float32)))  # fp32: a last-bit difference shows
            results[path_, polls] = host(softmax(dev(x_h), temperature=0.7, out=out))
    derived_check(results["resident", 2], ref.softmax(x_h, 0.7),
                  ref.softmax_plain(x_h, 0.7, "float32"), name="softmax")
    for key, got in results.items():
        if SIMULATOR:  # a GPU may contract a product and a sum differently per kernel
            np.testing.assert_array_equal(got.view(np.uint8), results["resident", 2].view(np.uint8),
                                          err_msg=str(key))
        else:
            derived_check(got, ref.softmax(x_h, 0.7), ref.softmax_plain(x_h, 0.7, "float32"),
                          name=f"softmax {key}")


@IEEE_SPECIALS
def test_softmax_split_counters_reset_and_special_rows():
    # Two calls on one stream share the row counters: the last block of a row zeroes them.
    inf = np.inf
    x_h = np.array([[1.0] * 30 + [-inf] * 30,                 # a span of -inf only: 1/30, 0
                    [-inf] * 60,                              # all -inf: NaN
                    [0.0] * 59 + [np.nan]], np.float32)       # a NaN in the last span: NaN
    for path_ in ("resident", "streamed"):
        with small_split(split_path=path_):
            for _ in range(2):
                got = host(softmax(dev(x_h)))
                np.testing.assert_allclose(got[0], [1 / 30] * 30 + [0.0] * 30, rtol=1e-6)
                assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
        if SIMULATOR:
            counts = [v for k, v in _workspace._WORKSPACE.items() if k[2] == "softmax_counts"]
            assert counts and all(not np.asarray(c).any() for c in counts)


def test_split_plans():
    # 64 x 128256 in bf16 (16032 chunks a row) on 132 SMs: registers hold the span when 4 blocks
    # a row fit at once (two blocks of 512 an SM); otherwise it streams, one wave; fp32 streams.
    # (The SM count and the occupancy are given, so the plans are the same on the GPU and the
    # simulator.)
    def h200(resident):
        return overrides(device={"sm_count": 132}, split_rows={"resident_blocks": resident})

    bf16, f32 = _rowwise.KIND_BF16, _rowwise.KIND_F32
    with h200(264):
        _, splits, cpt = sm_mod._softmax_split_plan(64, 16032, bf16, bf16, 8)
        assert (splits, cpt) == (4, 8)
        _, splits, cpt = sm_mod._softmax_split_plan(64, 32064, f32, f32, 4)
        assert (splits, cpt) == (4, 0)
    with h200(200):  # 3 blocks a row fit: streamed
        _, splits, cpt = sm_mod._softmax_split_plan(64, 16032, bf16, bf16, 8)
        assert (splits, cpt) == (3, 0)


@given(rows=st.integers(1, 3), vocab=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       split=st.booleans(), misaligned=st.booleans(), out_f32=st.booleans(),
       temperature=st.sampled_from([1.0, 0.5, 3.0]), seed=st.integers(0, 2**32 - 1))
def test_softmax_hypothesis_small(rows, vocab, dtype, split, misaligned, out_f32, temperature,
                                  seed):
    rng = np.random.default_rng(seed)
    with split_rows(split):
        _softmax_case(rng, (rows, vocab), dtype, temperature=temperature,
                      out_dtype="float32" if out_f32 else None, offset=int(misaligned))


def test_softmax_bad_inputs(rng):
    x = dev(random_array((2, 16), "float16", rng))
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        softmax([[1.0]])
    with pytest.raises(ValueError, match="non-empty last dimension"):
        softmax(dev(random_array((2, 0), "float16", rng)))
    with pytest.raises(ValueError, match="temperature: expected a finite float > 0"):
        softmax(x, temperature=0.0)
    with pytest.raises(TypeError, match="temperature: expected a float"):
        softmax(x, temperature="hot")
    with pytest.raises(TypeError, match="temperature: expected a float, got int"):
        softmax(x, temperature=1)
    with pytest.raises(ValueError, match="temperature: expected a finite float > 0"):
        softmax(x, temperature=float("inf"))
    with pytest.raises(TypeError, match="dtype: expected a dtype"):
        softmax(x, dtype=object())
    with pytest.raises(TypeError, match=r"^dtype: expected float32, got float16$"):
        softmax(dev(random_array((2, 16), "float32", rng)), dtype=np.float16)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        softmax(dev(np.ones((2, 16), np.int32)))
    with pytest.raises(TypeError, match="dtype: expected float16"):
        softmax(x, dtype="bfloat16")
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        softmax(x, dtype="float16", out=dev(random_array((2, 16), "float32", rng)))
    with pytest.raises(ValueError, match="out: expected shape"):
        softmax(x, out=dev(random_array((2, 8), "float16", rng)))
    with pytest.raises(ValueError, match="x: expected the last dimension to be contiguous"):
        softmax(dev(random_array((16, 2), "float16", rng)).T)


def test_softmax_check_rejects_a_wrong_implementation(rng):
    # the derived tolerance is tight enough to catch fp16 accumulation of the sum
    x_h = random_array((2, 4000), "float16", rng, scale=0.1)
    e = np.exp(x_h.astype(np.float16) - x_h.max(axis=-1, keepdims=True))
    wrong = e / np.cumsum(e, axis=-1, dtype=np.float16)[..., -1:]
    with pytest.raises(AssertionError):
        derived_check(wrong.astype(np.float64), ref.softmax(x_h), ref.softmax_plain(x_h))


# ---- GPU: real sizes ------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=15)  # each new shape may compile a kernel variant
@given(rows=st.integers(1, 300), vocab=st.one_of(st.integers(1, 40000),
                                                 st.sampled_from([32000, 128256, 151936,
                                                                  262144])),
       dtype=st.sampled_from(DTYPES), misaligned=st.booleans(), out_f32=st.booleans(),
       temperature=st.sampled_from([1.0, 0.6, 1.3]), seed=st.integers(0, 2**32 - 1))
def test_softmax_gpu_hypothesis(rows, vocab, dtype, misaligned, out_f32, temperature, seed):
    if rows * vocab > 20_000_000:
        rows = max(1, 20_000_000 // vocab)
    rng = np.random.default_rng(seed)
    _softmax_case(rng, (rows, vocab), dtype, temperature=temperature,
                  out_dtype="float32" if out_f32 else None, offset=int(misaligned))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_gpu_benchmark_shape(dtype, rng):
    _softmax_case(rng, (64, 128256), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("split_path,dtype", [
    (p, d) for p in ("auto", "resident", "streamed") for d in DTYPES
    # an fp32 row of 128256 does not fit in registers over blocks that fit at once
    if (p, d) != ("resident", "float32")])
def test_softmax_gpu_split_paths(split_path, dtype, rng):
    # Each split path on the benchmark shape and on few rows (more blocks a row), then with the
    # fallback forced (every block computes the other spans itself) and repeated calls (the row
    # counters are reset by each call's last block).
    with overrides(softmax={"split_path": split_path}):
        for _ in range(2):
            _softmax_case(rng, (64, 128256), dtype, temperature=0.7)
        _softmax_case(rng, (3, 128256), dtype)
    with overrides(softmax={"split_path": split_path, "spin_polls": -1}):
        _softmax_case(rng, (8, 128256), dtype)
