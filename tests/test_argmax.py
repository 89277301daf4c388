"""argmax (one block a row, several rows a block, and rows split over blocks merged by atomics)
against NumPy, including special values, ties and the 64-bit keys' bit patterns."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR, ptx
from llmspeed_numba._env import cuda
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import _rowwise
from llmspeed_numba.ops import argmax as am_mod
from llmspeed_numba.ops.argmax import argmax
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import random_array
from rowwise_testing import DTYPES, IEEE_SPECIALS, dev, host, split_rows


@pytest.fixture(params=["fused", "split"])
def path(request):
    with split_rows(request.param == "split"):
        yield request.param


def _argmax_case(rng, shape, dtype, offset=0, ties=False):
    x_h = random_array(shape, dtype, rng)
    if ties:  # few distinct values: many tied maxima
        x_h = np.round(x_h.astype(np.float32)).astype(x_h.dtype)
    x = dev(x_h, offset)
    got = host(argmax(x))
    np.testing.assert_array_equal(got, ref.argmax(x_h))
    assert got.dtype == np.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_paths(path, dtype, rng):
    _argmax_case(rng, (3, 200), dtype)
    _argmax_case(rng, (2, 77), dtype, ties=True)
    _argmax_case(rng, (2, 203), dtype, offset=1)


@IEEE_SPECIALS
def test_argmax_special_values_and_ties(path):
    inf, nan = np.inf, np.nan
    rows = [[-inf] * 40,                                       # all -inf: 0
            [1.0] * 40,                                        # all tied: 0
            [0.0] * 10 + [nan] + [9.0] * 28 + [nan],           # NaN is the max: 10
            [-0.0, 0.0] + [-1.0] * 38,                         # -0 == 0: 0
            [-5.0] * 39 + [inf],                               # 39
            [3.0] * 17 + [4.0] + [2.0] * 10 + [4.0] * 12,      # first of the max: 17
            [-inf] * 9 + [-5.0] * 31,                          # after -inf chunks: 9
            [7.0] * 4 + [-inf, inf, 1.0, 2.0] + [0.0] * 32,    # inf - inf in a chunk's sum: 5
            [nan] + [1.0] * 38 + [nan]]                        # the first NaN: 0
    x_h = np.array(rows, np.float32)
    want = [0, 0, 10, 0, 39, 17, 9, 5, 0]
    np.testing.assert_array_equal(host(argmax(dev(x_h))), want)
    # again (the split path's per-row keys and tickets were reset), and as fp16
    np.testing.assert_array_equal(host(argmax(dev(x_h))), want)
    np.testing.assert_array_equal(host(argmax(dev(x_h.astype(np.float16)))), want)


def _key_reduce_kernel(threads):
    reduce = _rowwise.row_pair_reducer(threads, am_mod._key_max, False)
    slots = 2 * _rowwise.scratch_slots(threads, 1)

    @cuda.jit
    def kernel(hi, lo, out_hi, out_lo):
        scratch = cuda.shared.array(slots, np.float32)
        t = cuda.threadIdx.x
        h, lw = reduce(ptx.f32_from_bits(hi[t]), ptx.f32_from_bits(lo[t]), scratch)
        out_hi[t] = ptx.f32_bits(h)
        out_lo[t] = ptx.f32_bits(lw)

    return kernel


def test_argmax_key_reduction_keeps_nan_bit_patterns(rng):
    """argmax's 64-bit keys ride through the float32 pair reducer as bits: signalling-NaN
    patterns (the high word of a negative denormal, the low word of an index in [2^22, 2^23))
    must come out unchanged, the low word breaking ties of the high word, over two warps."""
    threads = 64
    # high words of x = -denormal (0x805FFFFF, 0x806FFFFF), -0.5 and -1.0 in argmax's order
    hi = rng.choice(np.array([0x7FA00000, 0x7F900000, 0x40FFFFFF, 0x407FFFFF], np.uint32),
                    threads)
    lo = (np.uint32(0xFFFFFFFF) - rng.integers(2**22, 2**23, threads)).astype(np.uint32)
    out_hi, out_lo = np.zeros_like(hi), np.zeros_like(lo)
    _key_reduce_kernel(threads)[1, threads](hi, lo, out_hi, out_lo)
    best = int(((hi.astype(np.uint64) << np.uint64(32)) | lo).max())
    np.testing.assert_array_equal(out_hi, np.full(threads, best >> 32, np.uint32))
    np.testing.assert_array_equal(out_lo, np.full(threads, best & 0xFFFFFFFF, np.uint32))


def test_argmax_plans():
    # 64 x 128256 in bf16 (16032 chunks a row) on 132 SMs: one wave, of at most
    # MAX_BLOCKS_PER_SM blocks an SM on a GPU; enough rows: one block a row. (The SM count and
    # the occupancy are given, so the plans are the same on the GPU and the simulator.)
    bf16 = _rowwise.KIND_BF16
    expected = 6 if SIMULATOR else am_mod.MAX_BLOCKS_PER_SM * 132 // 64
    with overrides(device={"sm_count": 132}, split_rows={"resident_blocks": 396}):
        assert am_mod._argmax_plan(64, 16032, bf16, 8)[1:] == (expected, 512, 1)
        assert am_mod._argmax_plan(1000, 16032, bf16, 8)[1] == 1


def test_argmax_one_dimensional_and_out(rng):
    x_h = random_array((50,), "float32", rng)
    got = argmax(dev(x_h))
    assert host(got).shape == () and int(host(got)) == int(np.argmax(x_h))
    out = dev(np.full((2,), -7, np.int64))
    y_h = random_array((2, 30), "float16", rng)
    assert argmax(dev(y_h), out=out) is out
    np.testing.assert_array_equal(host(out), np.argmax(y_h.astype(np.float32), axis=-1))


@given(rows=st.integers(1, 3), vocab=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       split=st.booleans(), misaligned=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_argmax_hypothesis_small(rows, vocab, dtype, split, misaligned, seed):
    rng = np.random.default_rng(seed)
    with split_rows(split):
        _argmax_case(rng, (rows, vocab), dtype, offset=int(misaligned), ties=bool(seed % 2))


def test_argmax_bad_inputs(rng):
    x = dev(random_array((2, 16), "float16", rng))
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        argmax([[1.0]])
    with pytest.raises(TypeError, match="x: expected dtype in"):
        argmax(dev(np.ones((2, 16), np.int32)))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        argmax(dev(random_array((2, 0), "float16", rng)))
    with pytest.raises(TypeError, match="out: expected dtype int64"):
        argmax(x, out=dev(np.zeros((2,), np.int32)))
    with pytest.raises(ValueError, match=r"out: expected shape \(2,\)"):
        argmax(x, out=dev(np.zeros((3,), np.int64)))
    with pytest.raises(ValueError, match="x: expected the last dimension to be contiguous"):
        argmax(dev(random_array((16, 2), "float16", rng)).T)


# ---- GPU: real sizes ------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=15)  # each new shape may compile a kernel variant
@given(rows=st.integers(1, 300), vocab=st.one_of(st.integers(1, 40000),
                                                 st.sampled_from([32000, 128256, 151936,
                                                                  262144])),
       dtype=st.sampled_from(DTYPES), misaligned=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_argmax_gpu_hypothesis(rows, vocab, dtype, misaligned, seed):
    if rows * vocab > 20_000_000:
        rows = max(1, 20_000_000 // vocab)
    rng = np.random.default_rng(seed)
    _argmax_case(rng, (rows, vocab), dtype, offset=int(misaligned), ties=bool(seed % 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_gpu_benchmark_shape(dtype, rng):
    _argmax_case(rng, (64, 128256), dtype)
    _argmax_case(rng, (64, 128256), dtype, ties=True)
