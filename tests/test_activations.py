"""silu_and_mul, gelu_and_mul and gelu against float64 references."""

import contextlib
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.activations import gelu, gelu_and_mul, silu_and_mul
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import derived_check, poison, random_array
from rowwise_testing import DTYPES, dev, host


OPS = ["silu", "gelu_none", "gelu_tanh"]


def small_blocks(**more):
    """Blocks of 32 threads under the simulator; ``more``: other activations knobs."""
    if SIMULATOR:
        return overrides(activations={"block_threads": 32, **more})
    return overrides(activations=more) if more else contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _small_blocks():
    with small_blocks():
        yield


def _call(name, x, gated_op, **kw):
    if gated_op:
        if name == "silu":
            return silu_and_mul(x, **kw)
        return gelu_and_mul(x, approximate=name.split("_")[1], **kw)
    assert name != "silu"
    return gelu(x, approximate=name.split("_")[1], **kw)


def _case(name, gated_op, shape, dtype, rng, offset=0, scale=2.0, in_place=False):
    x_h = random_array(shape, dtype, rng, scale=scale)
    x = dev(x_h, offset)
    out_shape = shape[:-1] + (shape[-1] // 2,) if gated_op else shape
    out = x if in_place else poison(dev(np.empty(out_shape, x_h.dtype), offset))
    got = _call(name, x, gated_op, out=out)
    assert got is out
    if gated_op:
        expected, plain = ref.gated(x_h, name), ref.gated_plain(x_h, name)
    else:
        expected, plain = ref.activation(x_h, name), ref.activation_plain(x_h, name)
    derived_check(host(got), expected, plain, name=name)
    if not in_place:
        np.testing.assert_array_equal(host(x).view(np.uint8), x_h.view(np.uint8))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_small(name, dtype, rng):
    _case(name, True, (2, 48), dtype, rng)           # 16-byte chunks (d = 24)
    _case(name, True, (3, 2 * 5), dtype, rng)        # d = 5: the scalar kernel


@pytest.mark.parametrize("name", ["gelu_none", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_small(name, dtype, rng):
    _case(name, False, (2, 37), dtype, rng)          # rows of 37: scalar (row stride 37)
    _case(name, False, (1, 45), dtype, rng)          # one row: 16-byte chunks + scalar tail
    _case(name, False, (2, 16), dtype, rng, offset=1)  # misaligned: scalar


def test_gelu_in_place_and_leading_dims(rng):
    _case("gelu_none", False, (2, 3, 16), "bfloat16", rng, in_place=True)
    _case("silu", True, (2, 2, 16), "float16", rng)


# The simulator does device arithmetic in NumPy, which reports the fp32 overflow of exp(-x) that
# these inputs rely on (silu(x) = x / (1 + inf) = -0); a GPU reports nothing.
@pytest.mark.filterwarnings("ignore:.*overflow encountered:RuntimeWarning")
def test_activation_tails_of_the_range(rng):
    # large |x|: exp overflow (silu -> -0, gelu -> 0 or x), and values near 0
    x_h = np.array([[-100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0, 60000.0,
                     -60000.0, 3.0, -3.0, 0.5, -0.5, 1.0]], np.float16)
    for name in OPS:
        for dtype in ("float16", "float32"):
            xd = x_h.astype(dtype)
            if dtype == "float32" and SIMULATOR:
                # the fp32 path's libdevice-style helpers call math.exp, which raises
                # OverflowError in the simulator (Python floats) instead of returning inf
                xd = xd[:, np.abs(x_h[0]) < 1000]
            got = host(_call(name, dev(xd), False) if name != "silu" else
                       silu_and_mul(dev(np.concatenate([xd, np.ones_like(xd)], axis=1))))
            exp = (ref.activation(xd, name) if name != "silu" else
                   ref.gated(np.concatenate([xd, np.ones_like(xd)], axis=1), name))
            assert np.all(np.isfinite(got))
            plain = (ref.activation_plain(xd, name) if name != "silu" else
                     ref.gated_plain(np.concatenate([xd, np.ones_like(xd)], axis=1), name))
            # at most the error of torch's formulation, plus a rounding; results below the
            # normal range may flush to zero
            tol = (2 * np.abs(plain - exp) + np.abs(exp) * (1e-3 if dtype == "float16" else 1e-6)
                   + np.finfo(dtype).tiny)
            assert np.all(np.abs(got - exp) <= tol), (name, dtype, got, exp)


@given(name=st.sampled_from(OPS), gated_op=st.booleans(), rows=st.integers(1, 3),
       half=st.integers(1, 40), dtype=st.sampled_from(DTYPES), misaligned=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_activations_hypothesis_small(name, gated_op, rows, half, dtype, misaligned, seed):
    if name == "silu":
        gated_op = True
    rng = np.random.default_rng(seed)
    with small_blocks():
        _case(name, gated_op, (rows, 2 * half), dtype, rng, offset=int(misaligned))


def test_activation_bad_inputs(rng):
    x = dev(random_array((2, 16), "float16", rng))
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        silu_and_mul([1.0, 2.0])
    with pytest.raises(TypeError, match="x: expected dtype in"):
        silu_and_mul(dev(np.ones((2, 16), np.int32)))
    with pytest.raises(ValueError, match="x: expected an even last dimension"):
        silu_and_mul(dev(random_array((2, 15), "float16", rng)))
    with pytest.raises(ValueError, match="x: expected an even last dimension"):
        gelu_and_mul(dev(random_array((2, 15), "float16", rng)))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\)"):
        silu_and_mul(x, out=dev(random_array((2, 16), "float16", rng)))
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        silu_and_mul(x, out=dev(random_array((2, 8), "float32", rng)))
    with pytest.raises(ValueError, match="approximate: expected one of"):
        gelu(x, approximate="erf")
    with pytest.raises(ValueError, match="approximate: expected one of"):
        gelu_and_mul(x, approximate=None)
    with pytest.raises(ValueError, match="x: expected the last dimension to be contiguous"):
        gelu(dev(random_array((16, 2), "float16", rng)).T)
    assert host(silu_and_mul(dev(random_array((0, 16), "float16", rng)))).shape == (0, 8)


# ---- GPU: real sizes ------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=20)  # each new shape may compile a kernel variant
@given(name=st.sampled_from(OPS), gated_op=st.booleans(), rows=st.integers(1, 300),
       half=st.one_of(st.integers(1, 6000), st.sampled_from([4096, 11008, 14336])),
       dtype=st.sampled_from(DTYPES), misaligned=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_activations_gpu_hypothesis(name, gated_op, rows, half, dtype, misaligned, seed):
    if name == "silu":
        gated_op = True
    _case(name, gated_op, (rows, 2 * half), dtype, np.random.default_rng(seed),
          offset=int(misaligned))


def _fast_erf(monkeypatch):
    """The reference's erf is ``math.erf`` per element; SciPy's (when installed) is the same
    float64 function, vectorised. Arguments are taken to float64 as ``math.erf`` does (SciPy
    would compute fp32 arguments in fp32)."""
    try:
        from scipy.special import erf
    except ImportError:
        return
    monkeypatch.setattr(ref, "_erf", lambda v: erf(np.asarray(v, np.float64)))


def _benchmark_case(name, gated_op, shape, dtype, bench):
    """Whole output written and finite, x unchanged, float64 reference on sampled rows (see
    ``BenchmarkData`` in conftest.py)."""
    import torch

    x = bench.normal(shape, dtype, scale=2.0)
    x_before = x.clone()
    out_shape = shape[:-1] + (shape[-1] // 2,) if gated_op else shape
    out = poison(torch.empty(out_shape, dtype=x.dtype, device=x.device))
    got = _call(name, x, gated_op, out=out)
    assert got is out
    bench.assert_finite(out, name)
    bench.assert_same_bits(x, x_before, "x")
    rows = bench.rows(shape[0])
    x_h = bench.take(x, rows)
    if gated_op:
        expected, plain = ref.gated(x_h, name), ref.gated_plain(x_h, name)
    else:
        expected, plain = ref.activation(x_h, name), ref.activation_plain(x_h, name)
    derived_check(bench.take(out, rows), expected, plain, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_gpu_benchmark_shapes(name, dtype, bench_data, monkeypatch):
    """The benchmark shapes, 8192 rows: every output checked written and finite, the float64
    comparison on 66 rows (first, last, 64 random). Each element depends only on its own
    inputs and every row runs the same code over all column chunks, so the sampled rows cover
    every chunk position of the grid."""
    _fast_erf(monkeypatch)
    _benchmark_case(name, True, (8192, 2 * 14336), dtype, bench_data)
    if name != "silu":
        _benchmark_case(name, False, (8192, 4096), dtype, bench_data)


@pytest.fixture
def fast_thread_switching():
    """The simulator runs a block's threads as Python threads; at the default 5 ms switch
    interval a kernel with many barriers waits out whole intervals (the test below: 112 s,
    ~10 s at 0.1 ms). Set for single tests only: others ran slower with it."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


def test_activations_rows_beyond_the_grid(rng, fast_thread_switching):
    # more row blocks than the grid's y dimension holds (65535; 2 here): the kernel loops
    with small_blocks(max_grid_y=2):
        _case("silu", True, (300, 2 * 8), "float16", rng)
        _case("gelu_tanh", False, (300, 20), "bfloat16", rng)
