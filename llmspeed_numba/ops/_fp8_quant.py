"""FP8 E4M3 quantization for the W8A8 path of ``quant_gemm``: weights once at load (host NumPy
or torch where the tensor lives, the same bits), activations per token on every call (one
row-wise kernel).

Both use one scale per row (a weight's output channel, an activation's token):

    s = max|v| / 448 (float32),   q = e4m3(v / s)  (float32 division, round to nearest even,
                                                    saturating: ``cvt.rn.satfinite``)

an all-zero row has s = 0 and zero codes; the row stands for ``decode(q) * s``
(``_fp8_codec``). Codes are stored row-major, one byte an element (K-major: what 8-bit wgmma
reads), K a multiple of ``K_MULTIPLE``.

Activation kernel (``row_kernel``): ``_rowwise.row_plan``'s layout, ``threads_per_row`` threads
a row, each owning chunks of 8 elements (one 16-byte load) when x's rows are 16-byte aligned,
else chunks of 2 (scalar loads); rows short enough stay in registers between the max reduction and the
conversion (one read of x), longer ones are read again. Codes go out two at a time
(``ptx.pack_e4m3x2``, one uint16), so the code buffer is passed as its uint16 view.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from .._launch import Kernel, array1d, jit
from . import _rowwise as rw

#: K must be a multiple of this: a row of codes is whole 16-byte copies for the GEMM's loader.
K_MULTIPLE = 16
E4M3_MAX = np.float32(448.0)
#: Elements of one chunk of the activation kernel with 16-byte loads of fp16 / bf16.
_VEC = 8


def check_k(k, name):
    if k % K_MULTIPLE:
        raise ValueError(f"{name}: fp8_e4m3 needs K to be a multiple of {K_MULTIPLE} (whole "
                         f"16-byte rows of codes), got K={k}")


def quantize_weight_host(w32):
    """NumPy: (codes (N, K) uint8, scales (1, N) float32) of an (N, K) float32 weight."""
    from .._fp8_codec import quantize_rows

    codes, s = quantize_rows(w32)
    return codes, s[None, :]


def quantize_weight_torch(w):
    """torch, where ``w`` lives: the same bits as ``quantize_weight_host`` (float32 divisions;
    torch's float8_e4m3fn conversion rounds to nearest even but overflows to NaN, so values
    are clamped to +-448 first, which is what saturation gives)."""
    import torch

    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=1)
    # a tensor divisor: CUDA divides by a Python / NumPy scalar through its reciprocal, which
    # can differ from the host's division in the last bit
    s = amax / torch.full_like(amax, float(E4M3_MAX))
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = (w32 / safe[:, None]).clamp(-float(E4M3_MAX), float(E4M3_MAX))
    return q.to(torch.float8_e4m3fn).view(torch.uint8), s[None, :]


# ---- activations: the per-row kernel -----------------------------------------------------------

@functools.cache
def row_kernel(x_dtype, vec, threads_per_row, rows_per_block, chunks_per_thread):
    """``row_kernel_fn``'s kernel, compiled for x's dtype."""
    return Kernel(jit(row_kernel_fn(x_dtype, vec, threads_per_row, rows_per_block,
                                    chunks_per_thread)),
                  row_signature(x_dtype), "fp8_quantize_rows")


def row_kernel_fn(x_dtype, vec, threads_per_row, rows_per_block, chunks_per_thread):
    """Kernel function ``(x, codes16, scales, M, K, x_stride)``: row r of x (``x[r * x_stride +
    k]``) -> ``codes16`` (the uint16 view of (M, K) uint8 codes) and ``scales[r]``. ``vec`` 1:
    chunks of 8 elements, one 16-byte load; 0: chunks of 2, scalar loads. ``chunks_per_thread``
    0: the row streams (read twice)."""
    kind = rw.kind(x_dtype)
    width = 8 if vec else 2
    load_vec = rw.chunk_loader(kind, 8)
    up = rw.to_f32(kind)
    reduce = rw.row_reducer(threads_per_row, rw.max_f32)
    slots = rw.scratch_slots(threads_per_row, rows_per_block)
    held = max(1, chunks_per_thread) * width

    @cuda.jit(device=True, inline="always")
    def load(x, offset, dst, d0):
        if vec:
            load_vec(x, offset, dst, d0)
        else:
            for e in range(width):
                dst[d0 + e] = up(x[offset + e])

    @cuda.jit(device=True, inline="always")
    def chunk_max(vals, d0, amax):
        for e in range(width):
            amax = rw.max_f32(amax, abs(vals[d0 + e]))
        return amax

    @cuda.jit(device=True, inline="always")
    def store(codes16, base, vals, d0, safe):
        for p in range(width // 2):
            lo = vals[d0 + 2 * p] / safe
            hi = vals[d0 + 2 * p + 1] / safe
            codes16[base + p] = ptx.pack_e4m3x2(lo, hi)

    def fp8_rows_kernel(x, codes16, scales, M, K, x_stride):
        scratch = cuda.shared.array(slots, np.float32)
        vals = cuda.local.array(held, np.float32)
        tid = cuda.threadIdx.x
        t = tid % threads_per_row
        row = cuda.blockIdx.x * rows_per_block + tid // threads_per_row
        valid = row < M
        chunks = K // width
        x_row = row * x_stride
        amax = np.float32(0.0)
        if chunks_per_thread:
            for i in range(chunks_per_thread):
                c = t + i * threads_per_row
                if valid and c < chunks:
                    load(x, x_row + c * width, vals, i * width)
                    amax = chunk_max(vals, i * width, amax)
        else:
            c = t
            while valid and c < chunks:
                load(x, x_row + c * width, vals, 0)
                amax = chunk_max(vals, 0, amax)
                c += threads_per_row
        amax = reduce(amax, scratch)
        s = amax / E4M3_MAX
        safe = s if s != 0 else np.float32(1.0)
        out_row = row * (K // 2)
        if chunks_per_thread:
            for i in range(chunks_per_thread):
                c = t + i * threads_per_row
                if valid and c < chunks:
                    store(codes16, out_row + c * (width // 2), vals, i * width, safe)
        else:
            c = t
            while valid and c < chunks:
                load(x, x_row + c * width, vals, 0)
                store(codes16, out_row + c * (width // 2), vals, 0, safe)
                c += threads_per_row
        if valid and t == 0:
            scales[row] = s

    return fp8_rows_kernel


def row_signature(x_dtype):
    from numba import types

    return (array1d(rw.storage_dtype(x_dtype)), array1d(np.uint16), array1d(np.float32),
            types.int32, types.int32, types.int64)


def row_launch_plan(K, vec):
    """(threads_per_row, rows_per_block, chunks_per_thread) of ``row_kernel`` for rows of K."""
    return rw.row_plan(K // (8 if vec else 2))


def quantize_rows(x_buf, x_dtype, M, K, x_stride, vec, codes16, scales, stream):
    """Launch ``row_kernel`` on M rows of K."""
    tpr, rpb, cpt = row_launch_plan(K, vec)
    kernel = row_kernel(x_dtype, vec, tpr, rpb, cpt)
    kernel((-(-M // rpb),), tpr * rpb, (x_buf, codes16, scales, M, K, x_stride), stream)
