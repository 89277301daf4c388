"""The Hopper warpgroup MMA ops (``wgmma_m64k16``, ``wgmma_m64k16_rs``, ``smem_desc``,
``smem_desc_advance``, fences, commit / wait) against NumPy: one warpgroup computes
C (64 x n) = A (64 x K) @ B (K x n) through 128-byte-swizzled shared tiles, for every operand
orientation (K-major or M- / N-major), and with A from registers (``_rs``: mma.sync's A fragment
layout, B K- or N-major).

Under the simulator the twins run (each thread decodes the descriptors and reads the swizzled
tiles itself); on the H200 the same kernel runs the real instructions, which ties the twin's
layout model (descriptor fields, swizzle, accumulator fragment) to the hardware's.
"""

import functools

import ml_dtypes
import numpy as np
import pytest

from llmspeed_numba import ptx
from llmspeed_numba._env import SIMULATOR, cuda

BF16 = ml_dtypes.bfloat16
SLAB = 64          # K elements per shared tile (one 128-byte row of b16)
PANEL_BYTES = 8192  # one 64 x 64 b16 panel: the LBO between MN panels of an MN-major tile


@cuda.jit(device=True, inline="always")
def store_accumulator(c, acc, tid, n):
    """The warpgroup's 64 x n accumulator (wgmma's fragment) into row-major ``c``."""
    warp = tid // 32
    lane = tid % 32
    for jb in range(n // 8):
        for q in range(4):
            row = 16 * warp + lane // 4 + 8 * (q // 2)
            col = 8 * jb + 2 * (lane % 4) + q % 2
            c[row * n + col] = acc[jb * 4 + q]


@functools.cache
def _tile_kernel(n, is_bf16, a_mn_major, b_mn_major):
    """C[64, n] = A @ B over K in 64-wide slabs. A is given as (64, K) row-major when K-major,
    else as A^T (K, 64) row-major; B as B^T (n, K) row-major when K-major, else (K, n)."""
    regs = n // 2
    a_rows, a_inner = (SLAB, 64) if a_mn_major else (64, SLAB)
    b_rows, b_inner = (SLAB, n) if b_mn_major else (n, SLAB)
    b_off = 64 * SLAB

    def store_swizzled(smem, base, rows, inner, r, i, value):
        # 64-wide panels of rows x 128 bytes; the 16-byte chunk index XOR row % 8
        smem[base + (i // 64) * rows * 64 + r * 64 + ((((i % 64) // 8) ^ (r % 8)) * 8)
             + i % 8] = value

    store_swizzled = cuda.jit(device=True, inline="always")(store_swizzled)

    def kernel(a, b, c, k_total):
        smem = cuda.shared.array(0, np.uint16)
        tid = cuda.threadIdx.x
        # the swizzle pattern follows address bits 7-9: tiles start 1024-byte aligned
        base = ((1024 - (ptx.shared_address(smem, 0) & 1023)) & 1023) // 2
        acc = cuda.local.array(regs, np.float32)
        for i in range(regs):
            acc[i] = 0.0
        for k0 in range(0, k_total, SLAB):
            for e in range(tid, a_rows * a_inner, 128):
                r = e // a_inner
                i = e % a_inner
                src = (k0 + r) * 64 + i if a_mn_major else r * k_total + k0 + i
                store_swizzled(smem, base, a_rows, a_inner, r, i, a[src])
            for e in range(tid, b_rows * b_inner, 128):
                r = e // b_inner
                i = e % b_inner
                src = (k0 + r) * n + i if b_mn_major else r * k_total + k0 + i
                store_swizzled(smem, base + b_off, b_rows, b_inner, r, i, b[src])
            ptx.fence_proxy_async()
            cuda.syncthreads()
            ptx.wgmma_fence()
            for j in range(SLAB // 16):
                # k16 step j: K-major tiles move 32 bytes along the row, MN-major 16 rows
                if a_mn_major:
                    da = ptx.smem_desc(smem, base + j * 16 * 64, PANEL_BYTES, 1024, 1)
                else:
                    da = ptx.smem_desc(smem, base + j * 16, 16, 1024, 1)
                if b_mn_major:
                    db = ptx.smem_desc(smem, base + b_off + j * 16 * 64, PANEL_BYTES, 1024, 1)
                else:
                    db = ptx.smem_desc(smem, base + b_off + j * 16, 16, 1024, 1)
                ptx.wgmma_m64k16(acc, da, db, 1, n, is_bf16, a_mn_major, b_mn_major)
            ptx.wgmma_commit()
            ptx.wgmma_wait(acc, regs, 0)
            cuda.syncthreads()  # the tiles are overwritten by the next slab
        store_accumulator(c, acc, tid, n)

    return cuda.jit(kernel)


CASES = [  # (n, dtype, A M-major, B N-major)
    (64, np.float16, False, False),
    (64, BF16, False, True),
    (128, np.float16, True, False),
    (128, BF16, True, True),
    (256, BF16, False, True),
    (256, np.float16, True, True),
]
if SIMULATOR:  # the n = 256 cases add nothing but time under the simulator
    CASES = CASES[:4]


@pytest.mark.parametrize("n,dtype,a_mn,b_mn", CASES,
                         ids=[f"n{c[0]}-{np.dtype(c[1]).name}-{'KM'[c[2]]}{'KN'[c[3]]}"
                              for c in CASES])
def test_wgmma_tile(n, dtype, a_mn, b_mn, rng):
    k = 128
    a = rng.standard_normal((64, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    a_given = np.ascontiguousarray(a.T if a_mn else a).view(np.uint16).ravel()
    b_given = np.ascontiguousarray(b if b_mn else b.T).view(np.uint16).ravel()
    c = np.full(64 * n, np.nan, np.float32)
    shared = 2 * (64 * SLAB + n * SLAB) + 1024
    _tile_kernel(n, int(dtype == BF16), int(a_mn), int(b_mn))[1, 128, 0, shared](
        a_given, b_given, c, np.int32(k))
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    ref = a64 @ b64
    # products of b16 values are exact in f32; what remains is f32 accumulation over K terms
    bound = k * 2.0 ** -23 * (np.abs(a64) @ np.abs(b64))
    err = np.abs(c.reshape(64, n) - ref)
    assert np.all(err <= bound), (
        f"max error {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}, "
        f"bound there {bound.ravel()[err.argmax()]:.3g}")


@functools.cache
def _register_a_kernel(n, is_bf16, b_mn_major):
    """C[64, n] = A @ B with A (64, K) row-major read straight into each warp's A fragments
    (rows 16 w .. 16 w + 15 of warp w) and B staged in shared memory as ``_tile_kernel`` does."""
    regs = n // 2
    b_rows, b_inner = (SLAB, n) if b_mn_major else (n, SLAB)
    b_lbo = b_rows * 128 if b_mn_major else 16

    @cuda.jit(device=True, inline="always")
    def pair(a, i):
        return np.uint32(a[i]) | (np.uint32(a[i + 1]) << np.uint32(16))

    def kernel(a, b, c, k_total):
        smem = cuda.shared.array(0, np.uint16)
        tid = cuda.threadIdx.x
        base = ((1024 - (ptx.shared_address(smem, 0) & 1023)) & 1023) // 2
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        acc = cuda.local.array(regs, np.float32)
        for i in range(regs):
            acc[i] = np.float32(np.nan)     # overwritten: the first step has scale-d = 0
        for k0 in range(0, k_total, SLAB):
            for e in range(tid, b_rows * b_inner, 128):
                r = e // b_inner
                i = e % b_inner
                src = (k0 + r) * n + i if b_mn_major else r * k_total + k0 + i
                smem[base + (i // 64) * b_rows * 64 + r * 64 + ((((i % 64) // 8) ^ (r % 8)) * 8)
                     + i % 8] = b[src]
            ptx.fence_proxy_async()
            cuda.syncthreads()
            ptx.wgmma_fence()
            for j in range(SLAB // 16):
                row = (16 * warp + g) * k_total + k0 + 16 * j + 2 * t
                a0 = pair(a, row)
                a1 = pair(a, row + 8 * k_total)
                a2 = pair(a, row + 8)
                a3 = pair(a, row + 8 * k_total + 8)
                # built once, moved to each k16 step (the attention kernel's way)
                step = j * 16 * 64 if b_mn_major else j * 16
                db = ptx.smem_desc_advance(ptx.smem_desc(smem, base, b_lbo, 1024, 1), 2 * step)
                ptx.wgmma_m64k16_rs(acc, a0, a1, a2, a3, db, 0 if k0 == 0 and j == 0 else 1,
                                    n, is_bf16, b_mn_major)
            ptx.wgmma_commit()
            ptx.wgmma_wait(acc, regs, 0)
            cuda.syncthreads()
        store_accumulator(c, acc, tid, n)

    return cuda.jit(kernel)


RS_CASES = [  # (n, dtype, B N-major)
    (64, np.float16, False),
    (128, BF16, True),
    (64, BF16, False),
    (256, np.float16, True),
]
if SIMULATOR:
    RS_CASES = RS_CASES[:2]


@pytest.mark.parametrize("n,dtype,b_mn", RS_CASES,
                         ids=[f"n{c[0]}-{np.dtype(c[1]).name}-{'KN'[c[2]]}" for c in RS_CASES])
def test_wgmma_register_a(n, dtype, b_mn, rng):
    k = 128
    a = rng.standard_normal((64, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    b_given = np.ascontiguousarray(b if b_mn else b.T).view(np.uint16).ravel()
    c = np.full(64 * n, np.nan, np.float32)
    shared = 2 * n * SLAB + 1024
    _register_a_kernel(n, int(dtype == BF16), int(b_mn))[1, 128, 0, shared](
        a.view(np.uint16).ravel(), b_given, c, np.int32(k))
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    bound = k * 2.0 ** -23 * (np.abs(a64) @ np.abs(b64))
    err = np.abs(c.reshape(64, n) - a64 @ b64)
    assert np.all(err <= bound), (
        f"max error {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}, "
        f"bound there {bound.ravel()[err.argmax()]:.3g}")


@functools.cache
def _e4m3_tile_kernel(n):
    """C[64, n] = A @ B^T over K for e4m3 codes: A (64, K) and B (n, K) row-major bytes, both
    K-major (8-bit wgmma reads no other layout), handed over as their uint16 views: a 64-unit
    tile row is 128 bytes = 128 codes, and one k32 step moves 32 bytes, as a k16 step of b16."""
    regs = n // 2
    b_off = 64 * SLAB

    def kernel(a16, b16, c, k_units):
        smem = cuda.shared.array(0, np.uint16)
        tid = cuda.threadIdx.x
        base = ((1024 - (ptx.shared_address(smem, 0) & 1023)) & 1023) // 2
        acc = cuda.local.array(regs, np.float32)
        for i in range(regs):
            acc[i] = np.float32(np.nan)     # overwritten: the first step has scale-d = 0
        for k0 in range(0, k_units, SLAB):
            for e in range(tid, (64 + n) * SLAB, 128):
                r = e // SLAB
                i = e % SLAB
                v = a16[r * k_units + k0 + i] if r < 64 else b16[(r - 64) * k_units + k0 + i]
                smem[base + r * 64 + (((i // 8) ^ (r % 8)) * 8) + i % 8] = v
            ptx.fence_proxy_async()
            cuda.syncthreads()
            ptx.wgmma_fence()
            for j in range(SLAB // 16):
                da = ptx.smem_desc(smem, base + j * 16, 16, 1024, 1)
                db = ptx.smem_desc(smem, base + b_off + j * 16, 16, 1024, 1)
                ptx.wgmma_m64k32_e4m3(acc, da, db, 0 if k0 == 0 and j == 0 else 1, n)
            ptx.wgmma_commit()
            ptx.wgmma_wait(acc, regs, 0)
            cuda.syncthreads()
        store_accumulator(c, acc, tid, n)

    return cuda.jit(kernel)


@pytest.mark.parametrize("n", [16, 64] if SIMULATOR else [64, 256])
def test_wgmma_e4m3_tile(n, rng):
    """``wgmma_m64k32_e4m3`` on one warpgroup: every code but NaN, K = 256 (two tiles of 128)."""
    from llmspeed_numba._fp8_codec import E4M3_VALUES

    k = 256
    finite = np.nonzero(np.isfinite(E4M3_VALUES))[0].astype(np.uint8)
    a = rng.choice(finite, (64, k))
    b = rng.choice(finite, (n, k))
    c = np.full(64 * n, np.nan, np.float32)
    shared = 2 * (64 + n) * SLAB + 1024
    _e4m3_tile_kernel(n)[1, 128, 0, shared](a.view(np.uint16).ravel(),
                                            b.view(np.uint16).ravel(), c, np.int32(k // 2))
    a64 = E4M3_VALUES[a].astype(np.float64)
    b64 = E4M3_VALUES[b].astype(np.float64)
    # products of e4m3 values are exact; the sums: fp32 steps (twins), or the FP8 MMA's
    # narrower accumulator on the GPU (tests/test_quant_fp8.py: 2^-13 a k32 step)
    rel = 2.0 ** -20 if SIMULATOR else 2.0 ** -13 * (k // 32)
    bound = rel * (np.abs(a64) @ np.abs(b64).T) + 1e-30
    err = np.abs(c.reshape(64, n) - a64 @ b64.T)
    assert np.all(err <= bound), (
        f"max error {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}, "
        f"bound there {bound.ravel()[err.argmax()]:.3g}")
