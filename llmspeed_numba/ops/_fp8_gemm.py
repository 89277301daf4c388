"""W8A8 FP8 GEMM on Hopper: ``quant_gemm(x, qw)`` for an ``"fp8_e4m3"`` weight.

    out[m, n] = act((sum_k e4m3(xq[m, k]) * e4m3(wq[n, k])) * sx[m] * sw[n] + bias[n])

Two launches: ``_fp8_quant.row_kernel`` quantizes x per token (codes ``xq`` (M, K) and the row
scales ``sx``), then the kernel here: ``_gemm_wgmma``'s pipeline (``mainloop``: cp.async into
128-byte-swizzled tiles, ``wgmma`` straight from shared memory, fp32 accumulators) with
``wgmma.mma_async.m64n{block_n}k32.f32.e4m3.e4m3``. Both operands are K-major, as 8-bit wgmma
requires: x's codes (M, K) row-major and the weight's (N, K) row-major, the layout
``quantize_weight`` stores. The pipeline moves 16-bit units, so the codes are handed to it as
their ``uint16`` view with K halved: a tile row of ``BLOCK_K`` units is 128 bytes = 128 e4m3
values, and the 32-byte K step of each descriptor is one k32 MMA. Everything about the shared
layout, edges (rows past M / N and K past the end zero-filled by cp.async) and the pipeline is
``_gemm_wgmma``'s.

Epilogue: each accumulator times its row's and column's scale (``acc * sx[m] * sw[n]``, fp32)
as it is staged in shared memory, then gemm's tile epilogue (bias, activation, one rounding to
out's dtype, 16-byte stores).

Precision: products of e4m3 values are exact; the Tensor Cores sum them in fp32 (Hopper's FP8
MMA keeps fewer accumulator bits than a full fp32 add: the tests allow for it on the GPU).
"""

import functools

import numpy as np

from .. import compile_check, ptx
from .._arrays import Buffer, empty, kernel_buffer
from .._checks import tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit
from .._overrides import Knobs
from .._workspace import workspace
from . import _fp8_quant, _gemm_wgmma
from ._epilogue import block_work, epilogue_tile_ld, tile_epilogue, vector_width
from ._gemm_wgmma import BLOCK_K, _acc_position, aligned_tiles, mainloop
from ._rowwise import vector_aligned
from .gemm import _address
from .gemm_configs import wgmma_supported

#: (block_m, block_n, stages, group_m): two warpgroups of 64 x 256 (128 fp32 accumulators a
#: thread, as bf16's fastest wgmma tile), 4 stages of 128 K (48 KiB each); untuned.
TILE = (128, 256, 4, 8)
#: The simulator's tile: one warpgroup, 16 columns.
SIM_TILE = (64, 16, 3, 8)
TUNING = Knobs("fp8_gemm", tile=SIM_TILE if SIMULATOR else TILE)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


def make_kernel(block_m, block_n, stages, group_m, out_dtype, bias_dtype, act):
    """The kernel function (not yet jitted): ``(a16, b16, out, bias, row_scale, col_scale, M,
    N, K2, ld, so_m, so_n, tiles_m, tiles_n, out_vec)``, a16 / b16 the uint16 views of the
    (M, K) and (N, K) codes, K2 = ld = K / 2; ``threads_for(block_m)`` threads, grid
    ``tiles_m * tiles_n`` blocks, ``shared_bytes`` of dynamic shared memory."""
    threads = _gemm_wgmma.threads_for(block_m)
    regs = block_n // 2
    work = block_work(block_m, block_n, BLOCK_K, group_m)

    @cuda.jit(device=True, inline="always")
    def mma(acc, da, db, scale_d):
        ptx.wgmma_m64k32_e4m3(acc, da, db, scale_d, block_n)

    run = mainloop(block_m, block_n, stages, True, True, mma)
    tile_ld = epilogue_tile_ld(block_n)
    store_tile = tile_epilogue(block_m, block_n, tile_ld, threads, out_dtype, None, bias_dtype,
                               act)

    @cuda.jit(device=True, inline="always")
    def stage_scaled(tile, acc, tid, m0, n0, M, N, row_scale, col_scale):
        """The fp32 block tile in shared memory, each accumulator times its row's and column's
        scale (wgmma's fragment: rows ``row``, ``row + 8``; columns ``8 jb + col``, ``+ 1``;
        zero past M / N: never stored). Scaled while staged, so each accumulator register is
        free once written (scaled in place first, ptxas spilled the column scales)."""
        row, col = _acc_position(tid)
        m = m0 + row
        r0 = row_scale[m] if m < M else _ZERO
        r1 = row_scale[m + 8] if m + 8 < M else _ZERO
        t0 = row * tile_ld + col
        for jb in range(block_n // 8):
            n = n0 + 8 * jb + col
            c0 = col_scale[n] if n < N else _ZERO
            c1 = col_scale[n + 1] if n + 1 < N else _ZERO
            t = t0 + 8 * jb
            tile[t] = acc[4 * jb] * r0 * c0
            tile[t + 1] = acc[4 * jb + 1] * r0 * c1
            tile[t + 8 * tile_ld] = acc[4 * jb + 2] * r1 * c0
            tile[t + 8 * tile_ld + 1] = acc[4 * jb + 3] * r1 * c1

    def fp8_gemm_kernel(a16, b16, out, bias, row_scale, col_scale, M, N, K2, ld, so_m, so_n,
                        tiles_m, tiles_n, out_vec):
        tiles = aligned_tiles(cuda.shared.array(0, np.uint16))
        tid = np.int32(cuda.threadIdx.x)
        m0, n0, _, k_begin, k_end, k_tiles = work(tiles_m, tiles_n, K2, K2)
        acc = cuda.local.array(regs, np.float32)
        run(tiles, None, a16, b16, m0, n0, M, N, ld, ld, k_begin, k_end, k_tiles, tid, acc,
            None, None)
        tile = cuda.shared.array(0, np.float32)
        stage_scaled(tile, acc, tid, m0, n0, M, N, row_scale, col_scale)
        cuda.syncthreads()
        store_tile(tile, tid, m0, n0, M, N, out, 0, so_m, so_n, out, 0, 0, bias, _ONE, _ZERO,
                   out_vec)

    return fp8_gemm_kernel


def signature(out_dtype, bias_dtype):
    from numba import types

    from .._arrays import STORAGE

    i32, i64 = types.int32, types.int64
    u16, f32 = array1d(np.uint16), array1d(np.float32)
    return (u16, u16, array1d(STORAGE[out_dtype]), array1d(STORAGE[bias_dtype or out_dtype]),
            f32, f32, i32, i32, i32, i64, i64, i64, i32, i32, i32)


@functools.cache
def gemm_kernel(tile, out_dtype, bias_dtype, act):
    block_m, block_n, stages, group_m = tile
    return Kernel(jit(make_kernel(block_m, block_n, stages, group_m, out_dtype, bias_dtype,
                                  act)),
                  signature(out_dtype, bias_dtype), "fp8_gemm_wgmma")


def _u16(buf):
    """The uint16 view of a kernel buffer of bytes (even length)."""
    if SIMULATOR:
        return buf.view(np.uint16)
    return Buffer(buf.ptr, buf.size // 2, np.dtype(np.uint16), buf.owner)


def _scratch(tx, stream, name, n, dtype):
    """A per-call buffer of ``n`` ``dtype`` elements: torch's caching allocator for torch x
    (stream-ordered, private to a captured graph), else the stream's workspace."""
    if tx.kind == "torch":
        return kernel_buffer(tensor(empty(tx, (n,), dtype), name))
    return workspace(tx, stream, name, n, np.dtype(dtype))


def require_fp8_support():
    """NotImplementedError unless this GPU runs the fp8 GEMM (Hopper, or the simulator)."""
    if not wgmma_supported():
        cc = "".join(map(str, cuda.get_current_device().compute_capability))
        raise NotImplementedError(
            f"fp8_e4m3 weights need a Hopper GPU (sm_90: wgmma with e4m3 operands), this one "
            f"is sm_{cc}; use 'int8' or 'int4' weights")


def fp8_gemm(tx, qw, tbias, to, out_dtype, activation, stream):
    """``quant_gemm`` of a checked call with an fp8_e4m3 weight (M, N, K >= 1)."""
    require_fp8_support()
    codes16, row_scale = quantize_activations(tx, stream)
    gemm_quantized(codes16, row_scale, tx.shape[0], qw, tbias, to, out_dtype, activation,
                   stream)


def quantize_activations(tx, stream):
    """x's e4m3 codes (the uint16 view of (M, K) bytes) and row scales (M,), fresh buffers."""
    M, K = tx.shape
    x_stride = tx.strides[0]
    codes16 = _u16(_scratch(tx, stream, "fp8_x_codes", M * K, "uint8"))
    row_scale = _scratch(tx, stream, "fp8_x_scales", M, "float32")
    _fp8_quant.quantize_rows(kernel_buffer(tx), tx.dtype, M, K, x_stride,
                             int(vector_aligned(tx, x_stride, 8)), codes16, row_scale, stream)
    return codes16, row_scale


def gemm_quantized(codes16, row_scale, M, qw, tbias, to, out_dtype, activation, stream):
    """The GEMM launch on x already quantized (``quantize_activations``)."""
    N, K = qw.shape
    tile = TUNING.tile
    block_m, block_n, stages, _ = tile
    bias_dtype = tbias.dtype if tbias is not None else None
    kernel = gemm_kernel(tile, out_dtype, bias_dtype, activation)
    out_buf = kernel_buffer(to)
    bias_buf = kernel_buffer(tbias) if tbias is not None else out_buf
    so_m, so_n = to.strides
    out_vec = int(so_n == 1 and so_m % vector_width(out_dtype) == 0
                  and _address(out_buf) % 16 == 0)
    tiles_m, tiles_n = -(-M // block_m), -(-N // block_n)
    kernel((tiles_m * tiles_n, 1), _gemm_wgmma.threads_for(block_m),
           (codes16, _u16(kernel_buffer(tensor(qw.qweight, "qw.qweight"))), out_buf, bias_buf,
            row_scale, kernel_buffer(tensor(qw.scales, "qw.scales")), M, N, K // 2, K // 2,
            so_m, so_n, tiles_m, tiles_n, out_vec),
           stream, _gemm_wgmma.shared_bytes(block_m, block_n, stages))


# ---- compile-only checks (sm_90a SASS) -------------------------------------------------------

def _register():
    for name, out_dtype, bias_dtype, act in (
            ("fp8_gemm_wgmma_bf16", "bfloat16", None, None),
            ("fp8_gemm_wgmma_f16_bias_silu", "float16", "float32", "silu")):
        compile_check.register(
            name, lambda o=out_dtype, b=bias_dtype, a=act: (
                make_kernel(*TILE, o, b, a), signature(o, b)),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3",
                           "cp.async.cg.shared"),
            sass_must_have=("QGMMA", "LDGSTS"))
    for name, x_dtype, vec in (("fp8_quantize_rows_bf16", "bfloat16", 1),
                               ("fp8_quantize_rows_f16_scalar", "float16", 0)):
        compile_check.register(
            name, lambda d=x_dtype, v=vec: (
                _fp8_quant.row_kernel_fn(d, v, *_fp8_quant.row_launch_plan(4096, v)),
                _fp8_quant.row_signature(d)),
            ptx_must_have=("cvt.rn.satfinite.e4m3x2.f32",), sass_must_have=("F2FP",))


_register()
