"""One-warp Tensor Core tile product: the smallest kernel that uses the whole PTX op layer.

``warp_tile_matmul(a, b)`` computes ``out = a @ b`` in fp32 for ``a`` (16, K) and ``b`` (K, 8),
fp16 or bf16, both row-major, K a multiple of 8. One warp streams K in steps of 16:
``cp.async`` (16-byte chunks, zero-filled past K) -> ``ldmatrix.x4`` (A) / ``ldmatrix.x2.trans``
(B) -> ``mma.sync.m16n8k16``. It is the self-test that ties the simulator twins' fragment layouts
to the hardware's (same kernel, both targets), and the first entry of the compile-only check.
"""

import functools

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import empty, kernel_buffer, stream_handle
from .._checks import contiguous, output, same_dtype, shape, tensor
from .._env import cuda
from .._launch import Kernel, array1d, jit
from .._replay import MISS, OpCalls
from .._typing import ArrayLike, StreamLike

TILE_M, TILE_N, TILE_K = 16, 8, 16
_A_TILE = TILE_M * TILE_K          # uint16 elements of the A tile in shared memory
_B_TILE = TILE_K * TILE_N
SHARED_BYTES = 2 * (_A_TILE + _B_TILE)


def _warp_tile_kernel_fn(is_bf16):
    mma = ptx.mma_bf16 if is_bf16 else ptx.mma_f16

    def warp_tile_kernel(a, b, out, k_total):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(0, np.uint16)
        c0 = np.float32(0.0)
        c1 = np.float32(0.0)
        c2 = np.float32(0.0)
        c3 = np.float32(0.0)
        for k0 in range(0, k_total, TILE_K):
            # A tile: 16 rows x 2 chunks of 8; lane -> (row lane // 2, chunk lane % 2)
            row = lane // 2
            col = k0 + (lane % 2) * 8
            left = k_total - col
            nbytes = 16 if left >= 8 else (2 * left if left > 0 else 0)
            src = row * k_total + col if nbytes > 0 else 0
            ptx.cp_async_16(smem, row * TILE_K + (lane % 2) * 8, a, src, nbytes)
            # B tile: 16 rows of 8; lanes 0..15
            if lane < TILE_K:
                k = k0 + lane
                nbytes_b = 16 if k < k_total else 0
                ptx.cp_async_16(smem, _A_TILE + lane * TILE_N, b,
                                k * TILE_N if k < k_total else 0, nbytes_b)
            ptx.cp_async_commit()
            ptx.cp_async_wait(0)
            ptx.syncwarp()
            a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, (lane % 16) * TILE_K + (lane // 16) * 8)
            b0, b1 = ptx.ldmatrix_x2_trans(smem, _A_TILE + (lane % 16) * TILE_N)
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            ptx.syncwarp()  # the next step's copies overwrite the tiles just read
        g = lane // 4
        t = lane % 4
        out[g * TILE_N + 2 * t] = c0
        out[g * TILE_N + 2 * t + 1] = c1
        out[(g + 8) * TILE_N + 2 * t] = c2
        out[(g + 8) * TILE_N + 2 * t + 1] = c3

    return warp_tile_kernel


_SIGNATURE = (array1d(np.uint16), array1d(np.uint16), array1d(np.float32), types.int32)


@functools.lru_cache(maxsize=None)
def _warp_tile_kernel(is_bf16):
    return Kernel(jit(_warp_tile_kernel_fn(is_bf16)), _SIGNATURE, "warp_tile_kernel")


_WARP_TILE_CALLS = OpCalls("warp_tile_matmul")


def warp_tile_matmul(a: ArrayLike, b: ArrayLike, *, out: ArrayLike | None = None,
                     stream: StreamLike = None) -> ArrayLike:
    """``out = a @ b`` (fp32) for ``a`` (16, K), ``b`` (K, 8): fp16 or bf16, row-major, contiguous,
    K >= 8 a multiple of 8. Returns ``out`` (16, 8) float32 in the kind of ``a``."""
    result = _WARP_TILE_CALLS.replay((a, b, out), (), stream)
    if result is MISS:
        result = _WARP_TILE_CALLS.record(_warp_tile_matmul_checked, a, b, out, stream)
    return result


def _warp_tile_matmul_checked(a, b, out, stream):
    """The checked path of ``warp_tile_matmul`` (validation, launch)."""
    ta = tensor(a, "a", ndim=2, dtypes=("float16", "bfloat16"))
    tb = tensor(b, "b", ndim=2, dtypes=("float16", "bfloat16"))
    shape("a", ta, (TILE_M, None))
    k_total = ta.shape[1]
    shape("b", tb, (k_total, TILE_N), "to match a's K")
    same_dtype("a", ta, b=tb)
    contiguous("a", ta)
    contiguous("b", tb)
    if k_total % 8 or k_total == 0:
        raise ValueError(f"a: expected K a positive multiple of 8, got {k_total}")
    for name, t in (("a", ta), ("b", tb)):
        if t.ptr % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer (cp.async), got "
                             f"address {t.ptr:#x}")
    to = output("out", out, (TILE_M, TILE_N), "float32", ta)
    if to is None:
        out = empty(ta, (TILE_M, TILE_N), "float32")
        to = tensor(out, "out")
    contiguous("out", to)
    kernel = _warp_tile_kernel(ta.dtype == "bfloat16")
    args = (kernel_buffer(ta), kernel_buffer(tb), kernel_buffer(to), k_total)
    kernel(1, 32, args, stream_handle(stream, (ta, tb)), SHARED_BYTES)
    return out


def _compile_target(is_bf16):
    return lambda: (_warp_tile_kernel_fn(is_bf16), _SIGNATURE)


for _bf16 in (False, True):
    compile_check.register(
        f"warp_tile_{'bf16' if _bf16 else 'f16'}", _compile_target(_bf16),
        ptx_must_have=("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4",
                       "ldmatrix.sync.aligned.m8n8.x2.trans", "cp.async.cg.shared.global"),
        sass_must_have=("HMMA", "LDSM", "LDGSTS"))
