"""Weight-only quantized GEMM: ``out = activation(x @ W^T + bias)``, W a ``QuantizedWeight``.

``x`` is (M, K) fp16 / bf16 with a contiguous last dimension (any row stride); W stands for the
(N, K) matrix ``qw.dequantize()`` (torch.nn.Linear's layout; formats in ``quant_weight``);
``bias`` (N,) fp16 / bf16 / fp32; ``out`` (M, N), any non-negative strides, fp16 / bf16 / fp32
(default: ``out``'s dtype when given, else x's).

Paths (kernels in ``_quant_kernels``):

- M <= ``DECODE_MAX_M`` (16, decode): the streaming SIMT kernel. Codes are unpacked in registers
  right before the math (bit operations and one FADD an element, the scale once per 16-byte chunk
  and row), products summed in fp32, the epilogue in fp32 with one rounding. Blocks of
  ``BLOCK_N`` output columns, K split over enough blocks to keep every SM's loads in flight
  (``BLOCKS_PER_SM``); with more than one split, fp32 partial sums and gemm's split-K reduce.
- M > 16: **interim path**: the weight is dequantized to x's dtype (one rounding of the exact
  value) into a scratch (N, K) matrix, in slabs of at most ``DEQUANT_SLAB_ELEMENTS``, and
  multiplied by ``gemm`` on Tensor Cores. Correct, but it reads and writes the full-precision
  weight once per call: at prefill sizes (M in the thousands) that is a small share of the
  GEMM; at M = 17..256 it is slower than a bf16 GEMM. The fused Tensor Core kernel (dequantize
  in registers before mma / wgmma) is not written yet.

Not yet: FP8 (W8A8), act-order GPTQ, AWQ's packing, a Tensor Core decode kernel (the SIMT one is
compute bound above M ~ 4 on an H200, below the memory speed the codes could stream at).
"""


from .. import compile_check
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import bias_vector, choice, last_dim_contiguous, output, result_dtype, shape, tensor
from .._env import SIMULATOR
from .._launch import sm_count
from .._overrides import Knobs
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, DTypeLike, StreamLike
from . import _quant_kernels as qk
from ._activations_device import ACTIVATIONS
from .gemm import gemm, launch_splitk_reduce, splitk_partials
from .quant_weight import QuantizedWeight, chunk_k

X_DTYPES = ("float16", "bfloat16")
OUT_DTYPES = ("float16", "bfloat16", "float32")
#: Largest M on the decode kernel: its accumulators are a compile-time 1, 2, 4, 8 or 16 rows.
DECODE_MAX_M = 16
#: Output columns (weight rows) per decode block, one a thread: 128 keeps a warp's 16-byte loads
#: on 512 contiguous bytes and a block's x tile shared by 4 warps (untuned: no GPU run yet).
BLOCK_N = 128
#: Target decode blocks per SM when choosing the split of K (untuned).
BLOCKS_PER_SM = 8
#: Scratch elements of the interim large-M path's dequantized weight per slab (128 MB in fp16).
DEQUANT_SLAB_ELEMENTS = 1 << 26
DEQUANT_THREADS = 256
#: ``splits``: None (planned) or a forced split count; ``block_n``: decode block width;
#: ``decode_max_m``: the largest M on the decode kernel (tests force either path with it).
TUNING = Knobs("quant_gemm", decode_max_m=DECODE_MAX_M, block_n=32 if SIMULATOR else BLOCK_N,
               splits=None, blocks_per_sm=BLOCKS_PER_SM)


def _cdiv(a, b):
    return -(-a // b)


def _m_block(M):
    """Rows of the decode kernel's accumulators: the power of two >= M."""
    return 1 << max(0, (M - 1).bit_length())


def decode_plan(qw, M):
    """(block_n, splits, k_split) of the decode kernel for ``qw`` and M rows."""
    block_n = TUNING.block_n
    tile_k = qk.tile_k(qw.bits)
    tiles = _cdiv(qw.K_padded, tile_k)
    if TUNING.splits is not None:
        splits = TUNING.splits
    else:
        want = _cdiv(TUNING.blocks_per_sm * sm_count(), _cdiv(qw.N, block_n))
        # partial sums (written and read: 8 bytes a row) at most a quarter of the codes' bytes
        cap = qw.K_padded * qw.bits // (256 * M)
        splits = min(want, cap)
    splits = max(1, min(splits, tiles))
    k_split = _cdiv(tiles, splits) * tile_k
    return block_n, _cdiv(qw.K_padded, k_split), k_split


def _buffers(qw):
    scales = kernel_buffer(tensor(qw.scales, "qw.scales"))
    aux = kernel_buffer(tensor(qw.aux, "qw.aux")) if qw.aux is not None else scales
    return kernel_buffer(tensor(qw.qweight, "qw.qweight")), scales, aux


def _decode(tx, qw, tbias, to, out_dtype, activation, stream):
    M, K = tx.shape
    N = qw.N
    block_n, splits, k_split = decode_plan(qw, M)
    bias_dtype = tbias.dtype if tbias is not None else None
    partial = splits > 1
    kernel = qk.decode_kernel(qw.bits, _m_block(M), block_n, qw.mode, qw.zero_point,
                              qw.scale_dtype, tx.dtype, out_dtype, bias_dtype, activation,
                              partial)
    codes, scales, aux = _buffers(qw)
    if partial:
        out_buf = bias_buf = splitk_partials(tx, stream, splits * M * N)
    else:
        out_buf = kernel_buffer(to)
        bias_buf = kernel_buffer(tbias) if tbias is not None else out_buf
    x_sm = tx.strides[0] if M > 1 else K
    so_m, so_n = to.strides
    kernel((_cdiv(N, block_n), splits), block_n,
           (kernel_buffer(tx), codes, scales, aux, out_buf, bias_buf, M, N, K, x_sm,
            qw.group_size, k_split, so_m, so_n), stream)
    if partial:
        launch_splitk_reduce(out_buf, to, None, tbias, M, N, N, splits, out_dtype, activation,
                             1.0, 0.0, stream)


def dequantize_rows(qw, tx, n0, rows, dtype, stream):
    """Rows ``n0 .. n0 + rows`` of the weight, dequantized on the device to ``dtype`` (fp16 /
    bf16): a new (rows, K_padded) array in ``tx``'s kind (the interim large-M path)."""
    kp = qw.K_padded
    buf = empty(tx, (rows, kp), dtype)
    codes, scales, aux = _buffers(qw)
    total = kp // chunk_k(qw.bits) * rows
    blocks = max(1, min(_cdiv(total, DEQUANT_THREADS), 16 * sm_count()))
    qk.dequant_kernel(qw.bits, qw.mode, qw.zero_point, qw.scale_dtype, dtype)(
        blocks, DEQUANT_THREADS,
        (codes, scales, aux, kernel_buffer(tensor(buf, "scratch")), qw.N, n0, rows, kp,
         qw.group_size), stream)
    return buf


def _dequant_gemm(x, tx, qw, bias, activation, out, out_dtype, stream, handle):
    """The interim large-M path: dequantized slabs of the weight through ``gemm``."""
    N, K = qw.shape
    slab = N if N * qw.K_padded <= DEQUANT_SLAB_ELEMENTS else max(
        128, DEQUANT_SLAB_ELEMENTS // qw.K_padded // 128 * 128)
    for n0 in range(0, N, slab):
        rows = min(slab, N - n0)
        w = dequantize_rows(qw, tx, n0, rows, tx.dtype, handle)
        if qw.K_padded != K:
            w = w[:, :K]
        whole = rows == N
        gemm(x, w.T, bias=bias if whole or bias is None else bias[n0:n0 + rows],
             activation=activation, out=out if whole else out[:, n0:n0 + rows],
             out_dtype=out_dtype, stream=stream)


_QUANT_GEMM_CALLS = OpCalls("quant_gemm")


def quant_gemm(x: ArrayLike, qw: QuantizedWeight, *, bias: ArrayLike | None = None,
               activation: str | None = None, out: ArrayLike | None = None,
               out_dtype: DTypeLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """``out = activation(x @ qw.dequantize().T + bias)``, (M, N).

    Args:
        x: (M, K) fp16 / bf16, last dimension contiguous; K must be qw's K.
        qw: a ``QuantizedWeight`` (``quantize_weight``, ``QuantizedWeight.from_gguf`` /
            ``from_gptq``) whose arrays live where x does.
        bias: optional (N,) fp16 / bf16 / fp32, contiguous.
        activation: None, "relu", "gelu" (tanh form) or "silu".
        out: optional (M, N), any non-negative strides.
        out_dtype: fp16, bf16 or fp32; default: out's dtype when given, else x's.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns ``out`` (allocated in x's kind when not given). Arithmetic: products summed in fp32
    (M <= 16: the weight exact in fp32; larger M: the weight rounded to x's dtype, then gemm's
    Tensor Cores), the epilogue in fp32, one rounding to ``out_dtype``.

    Raises:
        TypeError: qw not a QuantizedWeight, a non-array, x not fp16 / bf16, bias / out /
            out_dtype of an unsupported dtype.
        ValueError: x not 2-D or its K not qw's, a non-contiguous last dimension, bias or out of
            the wrong shape, an unknown activation.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw: expected a QuantizedWeight (quantize_weight, "
                        f"QuantizedWeight.from_gguf / from_gptq), got {type(qw).__name__}")
    result = _QUANT_GEMM_CALLS.replay((x, qw.qweight, qw.scales, qw.aux, bias, out),
                                      (qw.key, activation, out_dtype), stream)
    if result is MISS:
        result = _QUANT_GEMM_CALLS.record(_quant_gemm_checked, x, qw, bias, activation, out,
                                          out_dtype, stream)
    return result


def _quant_gemm_checked(x, qw, bias, activation, out, out_dtype, stream):
    """The checked path of ``quant_gemm`` (validation, planning, launch)."""
    tx = tensor(x, "x", ndim=2)
    N, K = qw.shape
    shape("x", tx, (None, K), "to match qw's K (qw.shape = " + str(qw.shape) + ")")
    if tx.dtype not in X_DTYPES:
        raise TypeError(f"x: expected dtype in {X_DTYPES}, got {tx.dtype}")
    last_dim_contiguous("x", tx)
    M = tx.shape[0]
    tbias = bias_vector(bias, N, OUT_DTYPES, "(qw's N,)")
    choice("activation", activation, ACTIVATIONS)
    out_dtype = result_dtype(out_dtype, out, tx.dtype, OUT_DTYPES)
    to = output("out", out, (M, N), out_dtype, tx)
    if to is None:
        out = empty(tx, (M, N), out_dtype)
        to = tensor(out, "out")
    if M == 0:
        return out
    handle = stream_handle(stream, (tx,))
    if M <= TUNING.decode_max_m:
        _decode(tx, qw, tbias, to, out_dtype, activation, handle)
    else:
        _dequant_gemm(x, tx, qw, bias, activation, out, out_dtype, stream, handle)
    return out


# ---- compile-only checks (sm_90a SASS): the decode kernels of the shapes ------------

def _register():
    variants = {
        # name: (bits, m_block, mode, zero point, scale dtype, x dtype, out dtype, partial)
        "quant_decode_int4_g128_bf16_m1": (4, 1, "const", 8, "bfloat16", "bfloat16", "bfloat16",
                                           False),
        "quant_decode_int4_g128_f16_m16_splitk": (4, 16, "const", 8, "float16", "float16",
                                                  "float16", True),
        "quant_decode_int4_awq_bf16_m4": (4, 4, "zeros", None, "bfloat16", "bfloat16",
                                          "bfloat16", False),
        "quant_decode_q4_1_f16_m1": (4, 1, "affine", None, "float16", "float16", "float16",
                                     False),
        "quant_decode_int8_bf16_m8": (8, 8, "const", 128, "bfloat16", "bfloat16", "float32",
                                      True),
    }
    for name, (bits, mb, mode, zp, sd, xd, od, partial) in variants.items():
        def build(bits=bits, mb=mb, mode=mode, zp=zp, sd=sd, xd=xd, od=od, partial=partial):
            if partial:
                od = "float32"
            fn = qk.decode_kernel_fn(bits, mb, BLOCK_N, mode, zp, sd, xd, od, None, None,
                                     partial)
            return fn, qk.decode_signature(mode, sd, xd, od, None), qk.decode_options(BLOCK_N,
                                                                                      mb)

        compile_check.register(name, build, sass_must_have=("LDG.E.128", "LDS.128"))
    compile_check.register(
        "quant_dequant_int4_bf16",
        lambda: (qk.dequant_kernel_fn(4, "const", 8, "bfloat16", "bfloat16"),
                 qk.dequant_signature("const", "bfloat16", "bfloat16")),
        sass_must_have=("LDG.E.128", "STG.E.128"))


_register()
