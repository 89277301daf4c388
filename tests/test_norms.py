"""rms_norm and layer_norm (with and without the fused residual add) against float64 references.

Simulator tests run a small launch configuration (``small_plan``: blocks of 32 threads, 8..64
threads per row) so every code path (rows per block > 1, multi-warp reductions, streaming rows,
16-byte chunks with a scalar tail, the scalar kernel for misaligned rows) runs on rows of a few
hundred elements. GPU tests cover real sizes.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import rms_norm as rms_norm_module
from llmspeed_numba.ops.layer_norm import layer_norm
from llmspeed_numba.ops.rms_norm import prepare_norm, rms_norm
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import derived_check, poison, random_array, to_device
from rowwise_testing import DTYPES, dev, host


#: Launch configurations small enough for the simulator.
SMALL_PLAN = {"min_block_threads": 32, "target_chunks_per_thread": 2}


@pytest.fixture
def small_plan():
    with overrides(rowwise=SMALL_PLAN):
        yield


@pytest.fixture
def streaming():
    """Force the streaming kernel (rows too long for registers) on short rows."""
    with overrides(rowwise={"max_chunks_per_thread": 0}):
        yield


def _norm_case(op, rng, shape, dtype, *, residual, weight_f32=False, offset=0, in_place=False,
               bias=True, pad=0):
    """One call checked against float64; ``pad`` > 0: x, residual and out are the first
    ``shape[-1]`` columns of arrays ``pad`` columns wider (a row stride apart from the width)."""
    hidden = shape[-1]
    wdtype = "float32" if weight_f32 else dtype
    full = shape[:-1] + (hidden + pad,)

    def columns(a):
        return a[..., :hidden]

    x_full = random_array(full, dtype, rng)
    r_full = random_array(full, dtype, rng) if residual else None
    x_h = np.ascontiguousarray(columns(x_full))
    r_h = np.ascontiguousarray(columns(r_full)) if residual else None
    w_h = random_array((hidden,), wdtype, rng, scale=0.5)
    b_h = random_array((hidden,), wdtype, rng) if (op == "layer_norm" and bias) else None
    x = columns(dev(x_full, offset))
    r = columns(dev(r_full, offset)) if residual else None
    w = dev(w_h)
    b = None if b_h is None else dev(b_h)
    out_full = poison(dev(np.empty(full, x_h.dtype), offset))
    out = x if in_place else columns(out_full)
    if pad:
        assert prepare_norm(x, w, b, r, out)["vec"] > 1, "padded case not on 16-byte chunks"
    eps = 1e-5
    if op == "rms_norm":
        got = rms_norm(x, w, eps, residual=r, out=out)
        expected, r_after = ref.rms_norm(x_h, w_h, eps, r_h)
        plain = ref.rms_norm_plain(x_h, w_h, eps, r_h)
    else:
        got = layer_norm(x, w, b, eps, residual=r, out=out)
        expected, r_after = ref.layer_norm(x_h, w_h, b_h, eps, r_h)
        plain = ref.layer_norm_plain(x_h, w_h, b_h, eps, r_h)
    assert got is out
    derived_check(host(got), expected, plain, name=op)
    if pad and not in_place:
        assert np.isnan(host(out_full)[..., hidden:].astype(np.float32)).all(), "wrote past rows"
    # in place: residual updated exactly; x (unless it is out) and weight untouched
    if residual:
        np.testing.assert_array_equal(host(r).view(np.uint8), r_after.view(np.uint8))
    if not in_place:
        np.testing.assert_array_equal(host(x).view(np.uint8), x_h.view(np.uint8))
    np.testing.assert_array_equal(host(w).view(np.uint8), w_h.view(np.uint8))


OPS = ["rms_norm", "layer_norm"]


# ---- simulator: named odd cases, then hypothesis ------------------------------------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 13), (1, 64), (2, 200), (1, 296)],
                         ids=lambda s: "x".join(map(str, s)))
def test_norm_odd_shapes(op, shape, small_plan, rng):
    # 7: only a scalar tail; 13: one 16-byte chunk + tail (fp32), scalar (fp16: row stride 13);
    # 64: 8 threads/row, 4 rows/block; 200: 16 threads/row; 296: 2 warps/row (fp32)
    for dtype in ("float16", "float32"):
        _norm_case(op, rng, shape, dtype, residual=shape[-1] % 2 == 1)


@pytest.mark.parametrize("op", OPS)
def test_norm_streaming_rows(op, small_plan, streaming, rng):
    _norm_case(op, rng, (2, 152), "bfloat16", residual=True)
    _norm_case(op, rng, (1, 37), "float32", residual=False, offset=1)


@pytest.mark.parametrize("op", OPS)
def test_norm_in_place_and_fp32_weight(op, small_plan, rng):
    _norm_case(op, rng, (2, 48), "bfloat16", residual=True, weight_f32=True, in_place=True)
    _norm_case(op, rng, (1, 24), "float16", residual=False, weight_f32=True, offset=3)


@pytest.mark.parametrize("op", OPS)
def test_norm_chunks_with_tail(op, small_plan, rng):
    # (3, 83) columns of (3, 88) arrays, row stride 88: 10 16-byte chunks on 8 threads x 2 chunk
    # slots (dead slots), a scalar tail of 3 (it once overwrote the first chunk's first word),
    # 4 rows a block (one dead)
    for residual in (False, True):
        _norm_case(op, rng, (3, 83), "bfloat16", residual=residual, pad=5)


@pytest.mark.parametrize("schedule", rms_norm_module.SCHEDULES)
def test_rms_norm_schedules(schedule, small_plan, rng):
    # each schedule of register-held rows without the residual (the default picks by width)
    with overrides(rms_norm={"schedule": schedule}):
        _norm_case("rms_norm", rng, (3, 83), "float16", residual=False, pad=5)
        _norm_case("rms_norm", rng, (2, 48), "bfloat16", residual=False, weight_f32=True)


def test_rms_norm_schedule_override_checked():
    with pytest.raises(ValueError, match=r"rms_norm.schedule: expected one of \(None, "):
        with overrides(rms_norm={"schedule": "fastest"}):
            pass


def test_layer_norm_without_bias(small_plan, rng):
    _norm_case("layer_norm", rng, (2, 40), "float16", residual=False, bias=False)


def test_norm_leading_dims_and_row_stride(small_plan, rng):
    # (2, 2, 24) rows, and every other row of a (4, 24) array (row stride 48)
    x_h = random_array((2, 2, 24), "float16", rng)
    w_h = random_array((24,), "float16", rng)
    got = host(rms_norm(dev(x_h), dev(w_h)))
    expected, _ = ref.rms_norm(x_h, w_h, 1e-6)
    derived_check(got, expected, ref.rms_norm_plain(x_h, w_h, 1e-6))
    big = random_array((4, 24), "float32", rng)
    x = dev(big)[::2]
    got = host(layer_norm(x, dev(w_h.astype(np.float32)), None))
    expected, _ = ref.layer_norm(big[::2], w_h.astype(np.float32), None, 1e-5)
    derived_check(got, expected, ref.layer_norm_plain(big[::2], w_h.astype(np.float32), None,
                                                      1e-5))


@given(op=st.sampled_from(OPS), rows=st.integers(1, 3), hidden=st.integers(1, 160),
       dtype=st.sampled_from(DTYPES), residual=st.booleans(), misaligned=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_norm_hypothesis_small(op, rows, hidden, dtype, residual, misaligned, seed):
    rng = np.random.default_rng(seed)
    with overrides(rowwise=SMALL_PLAN):
        _norm_case(op, rng, (rows, hidden), dtype, residual=residual, offset=int(misaligned))


# ---- bad inputs -----------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_norm_bad_inputs(op, rng):
    def call(x, w, **kw):
        if op == "rms_norm":
            return rms_norm(x, w, **kw)
        return layer_norm(x, w, kw.pop("bias", None), **kw)

    x = dev(random_array((2, 16), "float16", rng))
    w = dev(random_array((16,), "float16", rng))
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        call([[1.0]], w)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        call(dev(np.ones((2, 16), np.int32)), w)
    with pytest.raises(ValueError, match=r"weight: expected shape \(16,\)"):
        call(x, dev(random_array((15,), "float16", rng)))
    with pytest.raises(ValueError, match="weight: expected 1 dimensions"):
        call(x, dev(random_array((1, 16), "float16", rng)))
    with pytest.raises(TypeError, match="weight: expected dtype float16"):
        call(x, dev(random_array((16,), "bfloat16", rng)))
    with pytest.raises(ValueError, match="residual: expected shape"):
        call(x, w, residual=dev(random_array((2, 8), "float16", rng)))
    with pytest.raises(TypeError, match="residual: expected dtype float16"):
        call(x, w, residual=dev(random_array((2, 16), "float32", rng)))
    with pytest.raises(ValueError, match="out: expected shape"):
        call(x, w, out=dev(random_array((16, 2), "float16", rng)))
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        call(x, w, out=dev(random_array((2, 16), "float32", rng)))
    with pytest.raises(ValueError, match="x: expected the last dimension to be contiguous"):
        call(dev(random_array((16, 2), "float16", rng)).T, w)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        call(dev(random_array((2, 0), "float16", rng)), dev(random_array((0,), "float16", rng)))
    with pytest.raises(ValueError, match="eps: expected a finite float >= 0"):
        call(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="eps: expected a float"):
        call(x, w, eps="1e-5")
    big = dev(random_array((4, 3, 16), "float16", rng))
    with pytest.raises(ValueError, match="do not collapse into one row stride"):
        call(big[:, :2], w)
    # out must not overlap residual (both are written): the same array, or rows shared
    r = dev(random_array((2, 16), "float16", rng))
    with pytest.raises(ValueError, match="out: expected an array that does not overlap "
                                         "residual, got one sharing its memory"):
        call(x, w, residual=r, out=r)
    rows3 = dev(random_array((3, 16), "float16", rng))
    with pytest.raises(ValueError, match="out: expected an array that does not overlap"):
        call(x, w, residual=rows3[:2], out=rows3[1:])
    with pytest.raises(TypeError, match=r"^weight: expected dtype float32, got float16$"):
        call(dev(random_array((2, 16), "float32", rng)), w)   # x's dtype named once
    with pytest.raises(TypeError, match=r"^weight: expected dtype float16 \(x's\) or float32, "
                                        r"got bfloat16$"):
        call(x, dev(random_array((16,), "bfloat16", rng)))
    if op == "layer_norm":
        with pytest.raises(ValueError, match=r"bias: expected shape \(16,\)"):
            call(x, w, bias=dev(random_array((8,), "float16", rng)))
        with pytest.raises(TypeError, match="bias: expected dtype float16 to match weight"):
            call(x, w, bias=dev(random_array((16,), "float32", rng)))


def test_norm_empty_rows(rng):
    x = dev(random_array((0, 16), "float16", rng))
    w = dev(random_array((16,), "float16", rng))
    assert host(rms_norm(x, w)).shape == (0, 16)
    assert host(layer_norm(x, w, None)).shape == (0, 16)


def test_norm_check_rejects_wrong_implementations(rng):
    # the derived tolerance catches an off-by-one mean square and an unbiased variance
    x = random_array((4, 64), "float16", rng)
    w = random_array((64,), "float16", rng)
    x64 = x.astype(np.float64)
    expected, _ = ref.rms_norm(x, w, 1e-6)
    off_by_one = x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True) / 63 + 1e-6) * w
    with pytest.raises(AssertionError):
        derived_check(off_by_one, expected, ref.rms_norm_plain(x, w, 1e-6))
    expected, _ = ref.layer_norm(x, w, None, 1e-5)
    unbiased = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(
        x64.var(-1, keepdims=True, ddof=1) + 1e-5) * w
    with pytest.raises(AssertionError):
        derived_check(unbiased, expected, ref.layer_norm_plain(x, w, None, 1e-5))


# ---- GPU: real sizes ------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=20)  # each new shape may compile a kernel variant
@given(op=st.sampled_from(OPS), rows=st.integers(1, 64),
       hidden=st.one_of(st.integers(1, 9000), st.sampled_from([4096, 5120, 8192, 14336, 70001])),
       dtype=st.sampled_from(DTYPES), residual=st.booleans(), weight_f32=st.booleans(),
       misaligned=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_norm_gpu_hypothesis(op, rows, hidden, dtype, residual, weight_f32, misaligned, seed):
    rng = np.random.default_rng(seed)
    _norm_case(op, rng, (rows, hidden), dtype, residual=residual, weight_f32=weight_f32,
               offset=int(misaligned))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("hidden", [4096, 14336])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_gpu_benchmark_shapes(op, hidden, dtype, bench_data):
    """The benchmark shapes, 8192 rows with the fused residual: every output checked written
    and finite, the residual checked bit-exact and x and weight unchanged on every row, the
    float64 reference on 66 rows (first, last, 64 random; see ``BenchmarkData`` in
    conftest.py). Rows are normalised independently by the same code, so each sampled row
    checks the whole reduction and every column chunk."""
    import torch

    bench = bench_data
    shape, eps = (8192, hidden), 1e-5
    x = bench.normal(shape, dtype)
    r = bench.normal(shape, dtype)
    w = bench.normal((hidden,), dtype, scale=0.5)
    b = bench.normal((hidden,), dtype) if op == "layer_norm" else None
    x0, r0, w0 = x.clone(), r.clone(), w.clone()
    out = poison(torch.empty_like(x))
    if op == "rms_norm":
        got = rms_norm(x, w, eps, residual=r, out=out)
    else:
        got = layer_norm(x, w, b, eps, residual=r, out=out)
    assert got is out
    bench.assert_finite(out, op)
    # the residual written back is x + residual added in fp32 and rounded once, on every row
    bench.assert_same_bits(r, (x0.float() + r0.float()).to(x.dtype), "residual")
    bench.assert_same_bits(x, x0, "x")
    bench.assert_same_bits(w, w0, "weight")
    rows = bench.rows(shape[0])
    x_h, r_h, w_h = bench.take(x0, rows), bench.take(r0, rows), host(w0)
    if op == "rms_norm":
        expected, r_after = ref.rms_norm(x_h, w_h, eps, r_h)
        plain = ref.rms_norm_plain(x_h, w_h, eps, r_h)
    else:
        b_h = host(b)
        expected, r_after = ref.layer_norm(x_h, w_h, b_h, eps, r_h)
        plain = ref.layer_norm_plain(x_h, w_h, b_h, eps, r_h)
    derived_check(bench.take(out, rows), expected, plain, name=op)
    np.testing.assert_array_equal(bench.take(r, rows).view(np.uint8), r_after.view(np.uint8))


@pytest.mark.gpu
def test_norm_gpu_torch_stream_and_kinds(rng):
    import torch
    from numba import cuda

    x_h = random_array((33, 1000), "float16", rng)
    w_h = random_array((1000,), "float16", rng)
    expected, _ = ref.rms_norm(x_h, w_h, 1e-6)
    plain = ref.rms_norm_plain(x_h, w_h, 1e-6)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = rms_norm(to_device(x_h, "torch"), to_device(w_h, "torch"))
    s.synchronize()
    assert isinstance(got, torch.Tensor)
    derived_check(host(got), expected, plain)
    got = rms_norm(cuda.to_device(x_h), cuda.to_device(w_h), stream=cuda.stream())
    cuda.synchronize()
    derived_check(host(got), expected, plain)
