"""softmax (fused single-pass and split-row two-kernel paths) and argmax (single block per row
and split rows merged by atomics) against float64 references, including the special rows."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba.ops import _rowwise
from llmspeed_numba.ops import softmax as sm_mod
from llmspeed_numba.ops.softmax import argmax, softmax
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import (derived_check, host_copy, poison, random_array,
                                    to_device_copy)

DTYPES = ["float16", "bfloat16", "float32"]
KIND = "numpy" if SIMULATOR else "torch"


def dev(host_array, offset=0):
    return to_device_copy(host_array, KIND, offset)


host = host_copy


def _small(mp, split):
    """Simulator-sized launches; ``split`` forces rows over several blocks (or one)."""
    mp.setattr(_rowwise, "MIN_BLOCK_THREADS", 32)
    mp.setattr(_rowwise, "TARGET_CHUNKS_PER_THREAD", 8)
    mp.setattr(sm_mod, "SPLIT_THREADS", 8)
    mp.setattr(sm_mod, "MIN_CHUNKS_PER_THREAD", 1)
    mp.setattr(sm_mod, "BLOCKS_PER_SM", 8 if split else 0)


@pytest.fixture(params=["fused", "split"])
def path(request, monkeypatch):
    if SIMULATOR:
        _small(monkeypatch, request.param == "split")
    else:
        monkeypatch.setattr(sm_mod, "BLOCKS_PER_SM", 64 if request.param == "split" else 0)
    return request.param


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


def _argmax_case(rng, shape, dtype, offset=0, ties=False):
    x_h = random_array(shape, dtype, rng)
    if ties:  # few distinct values: many tied maxima
        x_h = np.round(x_h.astype(np.float32)).astype(x_h.dtype)
    x = dev(x_h, offset)
    got = host(argmax(x))
    np.testing.assert_array_equal(got, ref.argmax(x_h))
    assert got.dtype == np.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_paths(path, dtype, rng):
    _softmax_case(rng, (3, 200), dtype)                     # 16-byte chunks
    _softmax_case(rng, (2, 77), dtype, temperature=0.7)     # scalar (row stride 77)
    _softmax_case(rng, (1, 203), dtype, out_dtype="float32")  # chunks + tail, fp32 out


def test_softmax_misaligned_and_leading_dims(path, rng):
    _softmax_case(rng, (2, 64), "bfloat16", offset=1)
    _softmax_case(rng, (2, 2, 40), "float16", temperature=2.0)


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_paths(path, dtype, rng):
    _argmax_case(rng, (3, 200), dtype)
    _argmax_case(rng, (2, 77), dtype, ties=True)
    _argmax_case(rng, (2, 203), dtype, offset=1)


def test_argmax_special_values_and_ties(path):
    inf, nan = np.inf, np.nan
    rows = [[-inf] * 40,                                       # all -inf: 0
            [1.0] * 40,                                        # all tied: 0
            [0.0] * 10 + [nan] + [9.0] * 28 + [nan],           # NaN is the max: 10
            [-0.0, 0.0] + [-1.0] * 38,                         # -0 == 0: 0
            [-5.0] * 39 + [inf],                               # 39
            [3.0] * 17 + [4.0] + [2.0] * 10 + [4.0] * 12]      # first of the max: 17
    x_h = np.array(rows, np.float32)
    want = [0, 0, 10, 0, 39, 17]
    np.testing.assert_array_equal(host(argmax(dev(x_h))), want)
    # again (the split path's per-row keys and tickets were reset), and as fp16
    np.testing.assert_array_equal(host(argmax(dev(x_h))), want)
    np.testing.assert_array_equal(host(argmax(dev(x_h.astype(np.float16)))), want)


def test_argmax_one_dimensional_and_out(rng):
    x_h = random_array((50,), "float32", rng)
    got = argmax(dev(x_h))
    assert host(got).shape == () and int(host(got)) == int(np.argmax(x_h))
    out = dev(np.full((2,), -7, np.int64))
    y_h = random_array((2, 30), "float16", rng)
    assert argmax(dev(y_h), out=out) is out
    np.testing.assert_array_equal(host(out), np.argmax(y_h.astype(np.float32), axis=-1))


@given(rows=st.integers(1, 3), vocab=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       split=st.booleans(), misaligned=st.booleans(), out_f32=st.booleans(),
       temperature=st.sampled_from([1.0, 0.5, 3.0]), seed=st.integers(0, 2**32 - 1))
def test_softmax_argmax_hypothesis_small(rows, vocab, dtype, split, misaligned, out_f32,
                                         temperature, seed):
    rng = np.random.default_rng(seed)
    with pytest.MonkeyPatch.context() as mp:
        if SIMULATOR:
            _small(mp, split)
        else:
            mp.setattr(sm_mod, "BLOCKS_PER_SM", 64 if split else 0)
        _softmax_case(rng, (rows, vocab), dtype, temperature=temperature,
                      out_dtype="float32" if out_f32 else None, offset=int(misaligned))
        _argmax_case(rng, (rows, vocab), dtype, offset=int(misaligned), ties=bool(seed % 2))


def test_softmax_argmax_bad_inputs(rng):
    x = dev(random_array((2, 16), "float16", rng))
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        softmax([[1.0]])
    with pytest.raises(TypeError, match="x: expected dtype in"):
        argmax(dev(np.ones((2, 16), np.int32)))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        softmax(dev(random_array((2, 0), "float16", rng)))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        argmax(dev(random_array((2, 0), "float16", rng)))
    with pytest.raises(ValueError, match="temperature: expected a finite float > 0"):
        softmax(x, temperature=0.0)
    with pytest.raises(TypeError, match="temperature: expected a float"):
        softmax(x, temperature="hot")
    with pytest.raises(TypeError, match="dtype: expected float16"):
        softmax(x, dtype="bfloat16")
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        softmax(x, dtype="float16", out=dev(random_array((2, 16), "float32", rng)))
    with pytest.raises(ValueError, match="out: expected shape"):
        softmax(x, out=dev(random_array((2, 8), "float16", rng)))
    with pytest.raises(TypeError, match="out: expected dtype int64"):
        argmax(x, out=dev(np.zeros((2,), np.int32)))
    with pytest.raises(ValueError, match=r"out: expected shape \(2,\)"):
        argmax(x, out=dev(np.zeros((3,), np.int64)))
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
def test_softmax_argmax_gpu_hypothesis(rows, vocab, dtype, misaligned, out_f32, temperature,
                                       seed):
    if rows * vocab > 20_000_000:
        rows = max(1, 20_000_000 // vocab)
    rng = np.random.default_rng(seed)
    _softmax_case(rng, (rows, vocab), dtype, temperature=temperature,
                  out_dtype="float32" if out_f32 else None, offset=int(misaligned))
    _argmax_case(rng, (rows, vocab), dtype, offset=int(misaligned), ties=bool(seed % 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_argmax_gpu_benchmark_shape(dtype, rng):
    _softmax_case(rng, (64, 128256), dtype)
    _argmax_case(rng, (64, 128256), dtype)
    _argmax_case(rng, (64, 128256), dtype, ties=True)
