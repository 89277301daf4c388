"""The W8A8 FP8 path: ``quantize_weight(w, "fp8_e4m3")`` and ``quant_gemm`` with it.

- The e4m3 codec (``_fp8_codec``, which the host quantization and the ``pack_e4m3x2`` twin use)
  bit for bit against torch's float8_e4m3fn over every e4m3 value, the midpoints between
  neighbours and their float32 neighbours, saturation, subnormals and random float32 bits.
- ``dequantize()`` within half an e4m3 step of w; torch quantization equal to NumPy's.
- The activation kernel's codes and row scales equal the NumPy reference's bits (16-byte and
  scalar loads, rows in registers and streamed).
- ``quant_gemm`` against float64 ``(dequantized x) @ qw.dequantize().T`` with x quantized by the
  NumPy reference, and loosely against the unquantized ``x @ w.T``. Outputs are poisoned first.

Under the simulator the wgmma kernel runs through the PTX twins on its 64 x 16 simulator tile
(shapes of one to three blocks); the GPU suite (``-m gpu``) runs the 128 x 256 tile with M up
to 300 and the issue's sizes.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import llmspeed_numba as lsn
from llmspeed_numba import SIMULATOR
from llmspeed_numba._arrays import kernel_buffer, numpy_dtype, to_host
from llmspeed_numba._checks import tensor
from llmspeed_numba._fp8_codec import E4M3_VALUES, decode_e4m3, encode_e4m3, quantize_rows
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import _fp8_quant
from llmspeed_numba.reference.gemm import gemm_plain, gemm_reference
from llmspeed_numba.testing import assert_close, f64, poison, random_array
from test_quant import _empty, device

X_DTYPES = ("float16", "bfloat16")
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}
#: Relative precision of the sums of the FP8 MMA, as a fraction of sum |products|: the twins sum
#: in float64 (float32 at each k32 step): 2^-20; Hopper's FP8 wgmma keeps fewer accumulator bits
#: than fp32 adds, each k32 step truncating the running sum: 2^-13 a step. Measured on the H200
#: (benchmarks/NOTES.md): K = 256 (8 steps) up to 2^-10.5 of the sum, within 8 x 2^-13.
_ACC_REL_STEP = 2.0 ** -13


def acc_rel(k):
    """The accumulator bound's factor of sum |products| for a K-long sum."""
    return 2.0 ** -20 if SIMULATOR else _ACC_REL_STEP * max(1, -(-k // 32))


def _torch_e4m3(x32):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(np.ascontiguousarray(x32, np.float32)).clamp(-448, 448)
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# ---- the codec -------------------------------------------------------------------------------

def _edge_values():
    v = np.unique(E4M3_VALUES[np.isfinite(E4M3_VALUES)].astype(np.float64))
    mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)          # exact in float32: ties
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    extra = np.array([0.0, -0.0, 448, 449, 464, -464, 479.9, 480, 1e6, -3.4e38, 2.0 ** -10,
                      2.0 ** -11, 1e-45, -1e-45, 2.0 ** -6, 2.0 ** -7 * 1.5], np.float32)
    return np.concatenate([v.astype(np.float32), mids, up, down, extra])


def test_encode_e4m3_matches_torch_bit_for_bit(rng):
    """Every e4m3 value, every midpoint between neighbours (ties to even) and its float32
    neighbours, saturation, subnormals, and random float32 bit patterns / magnitudes."""
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits)]
    scaled = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-4, 4, 200_000)
              ).astype(np.float32)
    for name, x in (("edges", _edge_values()), ("bits", bits), ("scaled", scaled)):
        ours, theirs = encode_e4m3(x), _torch_e4m3(x)
        bad = np.nonzero(ours != theirs)[0]
        assert bad.size == 0, (f"{name}: {bad.size} codes differ, first at {x[bad[:4]]}: "
                               f"ours {ours[bad[:4]]}, torch {theirs[bad[:4]]}")


def test_encode_saturates_and_maps_nan():
    x = np.array([np.inf, -np.inf, 1e30, -500, np.nan], np.float32)
    assert encode_e4m3(x).tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F]


def test_decode_e4m3_matches_torch():
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(decode_e4m3(codes), theirs)   # NaN codes compare equal too
    finite = np.isfinite(theirs)
    np.testing.assert_array_equal(encode_e4m3(theirs[finite]), codes[finite])


# ---- quantize_weight / dequantize --------------------------------------------------------------

def _dequantize_bound(w32, qw):
    """Half an e4m3 step: 2^-4 relative for normal codes, 2^-10 s below 2^-6 s; plus the
    float32 rounding of code x scale."""
    s = qw._values(qw.scales).T                                        # (N, 1)
    return np.abs(w32) * (2.0 ** -4 + 2.0 ** -22) + s * 2.0 ** -10 + 1e-38


@given(N=st.integers(1, 9), K=st.sampled_from((16, 48, 128)),
       dtype=st.sampled_from(("float16", "bfloat16", "float32")),
       scale=st.sampled_from((1e-3, 1.0, 300.0)), seed=st.integers(0, 2 ** 32 - 1))
def test_fp8_dequantize_within_rounding_bound(N, K, dtype, scale, seed):
    rng = np.random.default_rng(seed)
    w = random_array((N, K), dtype, rng, scale=scale)
    w[0, : K // 2] = 0                        # tiny against the row's max: subnormal codes
    if N > 2:
        w[2] = 0                              # an all-zero row: s = 0, zero codes
    qw = lsn.quantize_weight(w, "fp8_e4m3")
    assert qw.format == "fp8_e4m3" and qw.shape == (N, K) and qw.scale_dtype == "float32"
    w32 = w.astype(np.float32)
    got = qw.dequantize()
    assert got.dtype == np.float32 and got.shape == (N, K)
    err = np.abs(got.astype(np.float64) - w32)
    bound = _dequantize_bound(w32, qw)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"
    s = qw._values(qw.scales)[0]
    np.testing.assert_array_equal(s, (np.abs(w32).max(axis=1) / np.float32(448)))
    codes = qw.codes()
    assert codes.dtype == np.uint8 and codes.shape == (N, K)
    np.testing.assert_array_equal(got, decode_e4m3(codes) * s[:, None])
    if N > 2:
        assert not codes[2].any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_torch_quantization_equals_numpy(dtype, rng):
    torch = pytest.importorskip("torch")
    w = random_array((24, 64), dtype, rng, scale=0.5)
    w[3] = 0
    w[5, :4] = np.asarray([1, -1, 0.5, 1e-3], dtype=w.dtype)
    t = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else \
        torch.from_numpy(w)
    if not SIMULATOR:
        t = t.cuda()
    got = lsn.quantize_weight(t, "fp8_e4m3")
    want = lsn.quantize_weight(w, "fp8_e4m3")
    np.testing.assert_array_equal(got.codes(), want.codes())
    np.testing.assert_array_equal(got._values(got.scales), want._values(want.scales))
    np.testing.assert_array_equal(got.dequantize(), want.dequantize())


def test_fp8_quantize_errors():
    with pytest.raises(ValueError, match="K to be a multiple of 16.*K=40"):
        lsn.quantize_weight(np.ones((4, 40), np.float16), "fp8_e4m3")
    with pytest.raises(TypeError, match="w: expected dtype"):
        lsn.quantize_weight(np.ones((4, 64), np.int32), "fp8_e4m3")


# ---- the activation kernel ---------------------------------------------------------------------

def _quantize_rows_kernel(x_host, offset=0):
    """The row kernel on x (placed ``offset`` elements into its buffer: scalar loads when the
    rows are not 16-byte aligned); returns (codes (M, K) uint8, scales (M,) float32)."""
    M, K = x_host.shape
    flat = np.concatenate([np.ones(offset, x_host.dtype), x_host.ravel()])
    tx = tensor(device(flat)[offset:].reshape(M, K), "x")
    vec = int(tx.ptr % 16 == 0)
    codes = poison(_empty((M * K // 4,), "float32"))   # NaN bits: 00 00 c0 7f a word
    scales = poison(_empty((M,), "float32"))
    codes16 = kernel_buffer(tensor(codes, "codes"))
    codes16 = codes16.view(np.uint16) if SIMULATOR else type(codes16)(
        codes16.ptr, M * K // 2, np.dtype(np.uint16), codes16.owner)
    _fp8_quant.quantize_rows(kernel_buffer(tx), tx.dtype, M, K, K, vec, codes16,
                             kernel_buffer(tensor(scales, "scales")), 0)
    return (np.asarray(to_host(codes)).view(np.uint8).reshape(M, K),
            np.asarray(to_host(scales)), vec)


@pytest.mark.parametrize("dtype", X_DTYPES)
@pytest.mark.parametrize("offset", [0, 2])
@pytest.mark.parametrize("streamed", [False, True])
def test_activation_quantization_bits(dtype, offset, streamed, rng):
    M, K = 3, 96
    x = random_array((M, K), dtype, rng, scale=4.0)
    x[1] = 0                                               # s = 0, zero codes
    x[2, :5] = np.asarray([448, -1e-4, 3, 0, 1e-8], dtype=x.dtype)
    knobs = {"min_block_threads": 8, "max_chunks_per_thread": 0 if streamed else 8}
    with overrides(rowwise=knobs):
        codes, scales, vec = _quantize_rows_kernel(x, offset)
    assert vec == int(offset == 0)
    want_codes, want_scales = quantize_rows(x.astype(np.float32))
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    np.testing.assert_array_equal(codes, want_codes)


# ---- quant_gemm --------------------------------------------------------------------------------

def fp8_reference(x, qw):
    """float64 (dequantized x) @ qw.dequantize().T, x quantized per row by the NumPy reference;
    also the float64 sums of |products| (the accumulator bound's scale)."""
    codes, s = quantize_rows(np.asarray(x, np.float32))
    xd = decode_e4m3(codes).astype(np.float64) * s[:, None]
    wd = qw.dequantize().astype(np.float64)
    return xd, wd, xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def check_fp8(got, x, w, qw, *, out_dtype, bias=None, activation=None):
    xd, wd, _, mags = fp8_reference(x, qw)
    b64 = None if bias is None else np.asarray(bias).astype(np.float64)
    reference = gemm_reference(xd, wd.T, bias=b64, activation=activation)
    plain = gemm_plain(xd.astype(np.float32), wd.astype(np.float32).T,
                       bias=None if bias is None else np.asarray(bias), activation=activation,
                       out_dtype=numpy_dtype(out_dtype))
    got64 = f64(got)
    assert np.isfinite(got64).all(), "an output was not written (NaN poison left)"
    plain_err = np.abs(np.asarray(plain, np.float64) - reference)
    # the activations' slopes are at most about 1.1: the accumulator error passes through
    tol = 2 * plain_err + 1.2 * acc_rel(xd.shape[1]) * mags + 1e-30
    assert_close(got64, reference, tol)
    # loosely against the unquantized product: half an e4m3 step on each operand
    x64 = np.asarray(x, np.float64)
    sx = quantize_rows(np.asarray(x, np.float32))[1].astype(np.float64)
    sw = qw._values(qw.scales)[0].astype(np.float64)
    w64 = np.asarray(w, np.float64)
    exact = gemm_reference(x64, w64.T, bias=b64, activation=activation)
    loose = (1.2 * (2 ** -3 + 2 ** -8) * (np.abs(x64) @ np.abs(w64).T)
             + 1.2 * 2 ** -10 * (sx[:, None] * np.abs(w64).sum(1) + np.abs(x64).sum(1)[:, None]
                                 * sw) + tol + _EPS[out_dtype] * np.abs(exact))
    assert_close(got64, exact, loose, name="output against the unquantized x @ w.T")


def run_fp8(rng, M, N, K, dtype, *, out_dtype=None, bias_dtype=None, activation=None, x_pad=0,
            w_scale=0.05):
    w = random_array((N, K), dtype, rng, scale=w_scale)
    qw = lsn.quantize_weight(device(w), "fp8_e4m3")
    x_full = random_array((M, K + x_pad), dtype, rng)
    x = x_full[:, :K]
    bias = None if bias_dtype is None else random_array((N,), bias_dtype, rng)
    out_dtype = out_dtype or dtype
    out = poison(_empty((M, N), out_dtype))
    got = lsn.quant_gemm(device(x_full)[:, :K], qw, bias=None if bias is None else device(bias),
                         activation=activation, out=out)
    assert got is out
    check_fp8(got, x, w, qw, out_dtype=out_dtype, bias=bias, activation=activation)


#: Epilogues drawn (out dtype, bias dtype, activation): few, so the GPU compiles few kernels.
EPILOGUES = ((None, None, None), ("float32", "float32", "silu"), (None, "bfloat16", "gelu"))


@given(st.data())
def test_quant_gemm_fp8(data):
    """Shapes: on a GPU M 1..300, odd N, K multiples of 32 (and of 16); under the simulator
    one block row (M <= 64) and one to three 16-column blocks, K of one or two tiles."""
    if SIMULATOR:
        M = data.draw(st.sampled_from((1, 7, 64)), "M")
        N = data.draw(st.sampled_from((16, 23, 40)), "N")
        K = data.draw(st.sampled_from((32, 144)), "K")
    else:
        M = data.draw(st.integers(1, 300), "M")
        N = data.draw(st.integers(1, 300).map(lambda n: 2 * n + 1), "N")
        K = data.draw(st.sampled_from((32, 160, 256, 1024, 4096, 16 * 37)), "K")
    dtype = data.draw(st.sampled_from(X_DTYPES), "dtype")
    out_dtype, bias_dtype, activation = data.draw(st.sampled_from(EPILOGUES), "epilogue")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), "seed"))
    run_fp8(rng, M, N, K, dtype, out_dtype=out_dtype, bias_dtype=bias_dtype,
            activation=activation, x_pad=data.draw(st.sampled_from((0, 8, 3)), "x_pad"))


def test_quant_gemm_fp8_strided_out(rng):
    """A column-major ``out`` (scalar epilogue stores) and an unaligned x (scalar loads)."""
    M, N, K = 5, 16, 64
    w = random_array((N, K), "float16", rng, scale=0.05)
    qw = lsn.quantize_weight(device(w), "fp8_e4m3")
    x_full = random_array((M, K + 1), "float16", rng)
    x = x_full[:, 1:]
    out_t = poison(_empty((N, M), "float32"))
    got = lsn.quant_gemm(device(x_full)[:, 1:], qw, out=out_t.T)
    check_fp8(got, x, w, qw, out_dtype="float32")


def test_quant_gemm_fp8_gated(rng):
    """A gated activation on the FP8 path (gate and up rows interleaved before quantizing): the
    path's fp32 sums, equal to the plain call's, paired by gemm's reduce: ``silu(g + bg) *
    (u + bu)`` of the plain call's fp32 result (float64 here; libdevice's silu for fp32 out)."""
    M, K, inter = 3, 64, 16
    w = lsn.interleave_gate_up(random_array((inter, K), "bfloat16", rng, scale=0.05),
                               random_array((inter, K), "bfloat16", rng, scale=0.05))
    qw = lsn.quantize_weight(device(w), "fp8_e4m3")
    x = device(random_array((M, K), "bfloat16", rng))
    bias = random_array((2 * inter,), "float32", rng)
    plain = f64(lsn.quant_gemm(x, qw, out_dtype="float32"))
    got = lsn.quant_gemm(x, qw, bias=device(bias), activation="silu_and_mul",
                         out=poison(_empty((M, inter), "float32")))
    gate, up = lsn.deinterleave_gate_up(plain, dim=1)
    b_gate, b_up = lsn.deinterleave_gate_up(bias.astype(np.float64))
    g = gate + b_gate
    want = g / (1 + np.exp(-g)) * (up + b_up)
    assert_close(f64(got), want, 1e-30, rtol=4e-6)


def test_check_rejects_unquantized_activations(rng):
    """The check is sharp: the product of the unquantized x with the dequantized weight (what a
    kernel that forgot to quantize x would give) fails it."""
    M, N, K = 4, 8, 256
    x = random_array((M, K), "float16", rng)
    w = random_array((N, K), "float16", rng, scale=0.05)
    qw = lsn.quantize_weight(w, "fp8_e4m3")
    wrong = (x.astype(np.float64) @ qw.dequantize().astype(np.float64).T).astype(np.float32)
    with pytest.raises(AssertionError):
        check_fp8(wrong, x, w, qw, out_dtype="float32")


def test_quant_gemm_fp8_errors(rng):
    qw = lsn.quantize_weight(device(random_array((8, 64), "float16", rng)), "fp8_e4m3")
    with pytest.raises(ValueError, match=r"x: expected shape \(\*, 64\) to match qw's K"):
        lsn.quant_gemm(device(random_array((2, 48), "float16", rng)), qw)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        lsn.quant_gemm(device(random_array((2, 64), "float32", rng)), qw)


# ---- GPU only ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (300, 1024, 4096),
                                   (1000, 4096, 4096), (200, 14336, 4096)])
def test_quant_gemm_fp8_gpu_sizes(M, N, K, rng):
    run_fp8(rng, M, N, K, "bfloat16", w_scale=0.02)


@pytest.mark.gpu
def test_quant_gemm_fp8_gpu_replay(rng):
    import torch

    qw = lsn.quantize_weight(device(random_array((512, 1024), "bfloat16", rng)), "fp8_e4m3")
    x = device(random_array((64, 1024), "bfloat16", rng))
    first = lsn.quant_gemm(x, qw)
    assert isinstance(first, torch.Tensor) and first.dtype == torch.bfloat16
    assert torch.equal(first, lsn.quant_gemm(x, qw))
