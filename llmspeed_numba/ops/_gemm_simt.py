"""The SIMT GEMM kernel: shared-memory tiles, register blocking, double buffering.

One thread block computes a ``BLOCK_M x BLOCK_N`` tile over the K range of its split; each thread
owns a ``THREAD_M x THREAD_N`` register tile of fp32 accumulators, fed per k by ``THREAD_M`` values
of A and ``THREAD_N`` of B read from shared memory (``THREAD_M * THREAD_N`` FMAs per
``(THREAD_M + THREAD_N) / 4`` 16-byte shared loads when both are multiples of 4).

Shared memory holds two buffers of A as ``[BLOCK_K][BLOCK_M + 4]`` and B as ``[BLOCK_K][BLOCK_N +
4]`` in fp32 (inputs are converted on the way in, so fp16 / bf16 inputs work too): a thread's
operands for one k are contiguous. The +4 padding spreads the transposing stores of a
K-contiguous operand over the banks and keeps rows 16-byte aligned.

Double buffering: the next K tile is loaded from global memory into registers while the current
one is computed, then stored to the other buffer; one ``__syncthreads`` per K tile. Global loads
walk the operand's contiguous dimension across consecutive threads (coalesced for either layout)
and are predicated at every edge; an interior block runs a separate K loop whose loads use
offsets computed once plus a per-tile step (no predicates or index math), with the k loop
written out so its shared-memory offsets are immediates. The epilogue is the shared fused one (``_epilogue``); in split-K
mode it stores raw fp32 partial sums like the Tensor Core kernel.
"""

import numpy as np

from .. import ptx
from .._env import cuda
from ._epilogue import epilogue, grouped_tile, loader

_PAD = 4


def make_kernel(block_m, block_n, block_k, thread_m, thread_n, group_m, a_k_inner, b_k_inner,
                in_dtype, out_dtype, c_dtype, bias_dtype, act):
    """The kernel function (not yet jitted); same parameters and grid as the Tensor Core kernel
    (``_gemm_tensor_core.make_kernel``; ``out_vec`` is ignored), ``threads(...)`` threads per
    block."""
    threads_n = block_n // thread_n
    threads = threads_n * (block_m // thread_m)
    a_per_thread = block_m * block_k // threads
    b_per_thread = block_k * block_n // threads
    a_row = block_m + _PAD
    b_row = block_n + _PAD
    a_buf = block_k * a_row
    b_buf = block_k * b_row
    b_start = 2 * a_buf        # one shared array: two A buffers, then two B buffers
    smem_elems = 2 * (a_buf + b_buf)
    load_in = loader(in_dtype)
    # A thread's THREAD_M rows are groups of 4 consecutive rows, STRIDE_M apart (two groups at
    # 0 and BLOCK_M / 2 for THREAD_M = 8): one LDS.128 per group, and the 16 threads of a row of
    # the thread grid read 16 different 16-byte chunks (no bank conflict). Same for columns.
    vec = thread_m % 4 == 0 and thread_n % 4 == 0
    stride_m = block_m // (thread_m // 4) if vec else 0
    stride_n = block_n // (thread_n // 4) if vec else 0
    apply_epilogue = epilogue(out_dtype, c_dtype, bias_dtype, act)

    def make_fetch(full):
        @cuda.jit(device=True, inline="always")
        def fetch(regs_a, regs_b, a, b, k0, k_end, m0, n0, M, N, lda, ldb, tid):
            """Global -> registers for one K tile; consecutive threads walk the contiguous
            dim. ``full``: the caller guarantees the whole tile is in bounds (no predicates)."""
            for i in range(a_per_thread):
                e = np.int32(tid + i * threads)
                if a_k_inner:
                    m = np.int32(e // block_k)
                    k = np.int32(e % block_k)
                else:
                    m = np.int32(e % block_m)
                    k = np.int32(e // block_m)
                v = np.float32(0.0)
                if full or (m0 + m < M and k0 + k < k_end):
                    if a_k_inner:
                        v = load_in(a, (m0 + m) * lda + k0 + k)
                    else:
                        v = load_in(a, (k0 + k) * lda + m0 + m)
                regs_a[i] = v
            for i in range(b_per_thread):
                e = np.int32(tid + i * threads)
                if b_k_inner:
                    n = np.int32(e // block_k)
                    k = np.int32(e % block_k)
                else:
                    n = np.int32(e % block_n)
                    k = np.int32(e // block_n)
                v = np.float32(0.0)
                if full or (n0 + n < N and k0 + k < k_end):
                    if b_k_inner:
                        v = load_in(b, (n0 + n) * ldb + k0 + k)
                    else:
                        v = load_in(b, (k0 + k) * ldb + n0 + n)
                regs_b[i] = v

        return fetch

    fetch_edge = make_fetch(False)

    @cuda.jit(device=True, inline="always")
    def tile_offsets(a_g, b_g, k0, m0, n0, lda, ldb, tid):
        """Element offsets of a thread's loads for the K tile at ``k0`` (later tiles of an
        interior block add a constant step: no index math or predicates in the loop)."""
        for i in range(a_per_thread):
            e = np.int32(tid + i * threads)
            if a_k_inner:
                a_g[i] = (m0 + np.int32(e // block_k)) * lda + k0 + np.int32(e % block_k)
            else:
                a_g[i] = (k0 + np.int32(e // block_m)) * lda + m0 + np.int32(e % block_m)
        for i in range(b_per_thread):
            e = np.int32(tid + i * threads)
            if b_k_inner:
                b_g[i] = (n0 + np.int32(e // block_k)) * ldb + k0 + np.int32(e % block_k)
            else:
                b_g[i] = (k0 + np.int32(e // block_n)) * ldb + n0 + np.int32(e % block_n)

    @cuda.jit(device=True, inline="always")
    def fetch_fast(regs_a, regs_b, a, b, a_g, b_g, a_shift, b_shift):
        for i in range(a_per_thread):
            # (unsigned index: numba's negative-index wraparound costs 3 instructions a load)
            regs_a[i] = load_in(a, np.uint64(a_g[i] + a_shift))
        for i in range(b_per_thread):
            regs_b[i] = load_in(b, np.uint64(b_g[i] + b_shift))

    @cuda.jit(device=True, inline="always")
    def k_row(smem, a_base, b_base, kk, frag_a, frag_b, acc):
        """One k of the register tile: THREAD_M + THREAD_N shared loads, THREAD_M * THREAD_N
        FMAs (``kk`` a literal: the offsets are immediates)."""
        if vec:  # 16-byte shared loads (LDS.128), groups of 4 rows / columns
            for q in range(thread_m // 4):
                w0, w1, w2, w3 = ptx.load_u32x4(smem, a_base + (kk * a_row + q * stride_m))
                frag_a[4 * q] = ptx.f32_from_bits(w0)
                frag_a[4 * q + 1] = ptx.f32_from_bits(w1)
                frag_a[4 * q + 2] = ptx.f32_from_bits(w2)
                frag_a[4 * q + 3] = ptx.f32_from_bits(w3)
            for q in range(thread_n // 4):
                w0, w1, w2, w3 = ptx.load_u32x4(smem, b_base + (kk * b_row + q * stride_n))
                frag_b[4 * q] = ptx.f32_from_bits(w0)
                frag_b[4 * q + 1] = ptx.f32_from_bits(w1)
                frag_b[4 * q + 2] = ptx.f32_from_bits(w2)
                frag_b[4 * q + 3] = ptx.f32_from_bits(w3)
        else:
            for i in range(thread_m):
                frag_a[i] = smem[a_base + (kk * a_row + i)]
            for j in range(thread_n):
                frag_b[j] = smem[b_base + (kk * b_row + j)]
        for i in range(thread_m):
            for j in range(thread_n):
                acc[i, j] += frag_a[i] * frag_b[j]

    @cuda.jit(device=True, inline="always")
    def stash(regs_a, regs_b, smem, buf, tid):
        """Registers -> shared buffer ``buf``, as [k][m] and [k][n]."""
        for i in range(a_per_thread):
            e = np.int32(tid + i * threads)
            if a_k_inner:
                m = np.int32(e // block_k)
                k = np.int32(e % block_k)
            else:
                m = np.int32(e % block_m)
                k = np.int32(e // block_m)
            smem[np.uint32(buf * a_buf + k * a_row + m)] = regs_a[i]
        for i in range(b_per_thread):
            e = np.int32(tid + i * threads)
            if b_k_inner:
                n = np.int32(e // block_k)
                k = np.int32(e % block_k)
            else:
                n = np.int32(e % block_n)
                k = np.int32(e // block_n)
            smem[np.uint32(b_start + buf * b_buf + k * b_row + n)] = regs_b[i]

    @cuda.jit(device=True, inline="always")
    def compute_tile(smem, a_base, b_base, frag_a, frag_b, acc):
        """The K tile in shared memory at (a_base, b_base) into ``acc``; the k loop written
        out (numba has no unroll pragma and LLVM leaves it rolled)."""
        a_base = np.int32(a_base)
        b_base = np.int32(b_base)
        k_row(smem, a_base, b_base, 0, frag_a, frag_b, acc)
        if block_k > 1:
            k_row(smem, a_base, b_base, 1, frag_a, frag_b, acc)
        if block_k > 2:
            k_row(smem, a_base, b_base, 2, frag_a, frag_b, acc)
        if block_k > 3:
            k_row(smem, a_base, b_base, 3, frag_a, frag_b, acc)
        if block_k > 4:
            k_row(smem, a_base, b_base, 4, frag_a, frag_b, acc)
        if block_k > 5:
            k_row(smem, a_base, b_base, 5, frag_a, frag_b, acc)
        if block_k > 6:
            k_row(smem, a_base, b_base, 6, frag_a, frag_b, acc)
        if block_k > 7:
            k_row(smem, a_base, b_base, 7, frag_a, frag_b, acc)
        for kk in range(8, block_k):
            k_row(smem, a_base, b_base, kk, frag_a, frag_b, acc)

    def gemm_simt_kernel(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, out_z, sc_m, sc_n,
                         alpha, beta, k_split, tiles_m, tiles_n, out_vec):
        smem = cuda.shared.array(smem_elems, np.float32, alignment=16)
        tid = np.int32(cuda.threadIdx.x)
        ty = np.int32(tid // threads_n)
        tx = np.int32(tid % threads_n)
        pid_m, pid_n = grouped_tile(cuda.blockIdx.x, tiles_m, tiles_n, group_m)
        m0 = pid_m * block_m
        n0 = pid_n * block_n
        z = cuda.blockIdx.y
        k_begin = z * k_split
        k_end = min(K, k_begin + k_split)
        k_tiles = (k_end - k_begin + block_k - 1) // block_k

        acc = cuda.local.array((thread_m, thread_n), np.float32)
        for i in range(thread_m):
            for j in range(thread_n):
                acc[i, j] = np.float32(0.0)
        regs_a = cuda.local.array(a_per_thread, np.float32)
        regs_b = cuda.local.array(b_per_thread, np.float32)
        frag_a = cuda.local.array(thread_m, np.float32)
        frag_b = cuda.local.array(thread_n, np.float32)

        # K tiles that need no predicate: all of them but a partial last one, in a block that
        # needs none along M and N
        interior = m0 + block_m <= M and n0 + block_n <= N
        k_full = (k_end - k_begin) // block_k if interior else 0
        if k_tiles > 0:
            fetch_edge(regs_a, regs_b, a, b, k_begin, k_end, m0, n0, M, N, lda, ldb, tid)
            stash(regs_a, regs_b, smem, 0, tid)
        cuda.syncthreads()
        buf = 0
        a_lane = np.int32(ty * (4 if vec else thread_m))
        b_lane = np.int32(b_start + tx * (4 if vec else thread_n))
        a_g = cuda.local.array(a_per_thread, np.int64)
        b_g = cuda.local.array(b_per_thread, np.int64)
        tile_offsets(a_g, b_g, k_begin, m0, n0, lda, ldb, tid)
        a_step = block_k if a_k_inner else block_k * lda   # offset change per K tile
        b_step = block_k if b_k_inner else block_k * ldb
        kt = 0
        while kt + 1 < k_full:  # hot loop: the next tile is full, unpredicated loads
            fetch_fast(regs_a, regs_b, a, b, a_g, b_g, (kt + 1) * a_step, (kt + 1) * b_step)
            compute_tile(smem, a_lane + buf * a_buf, b_lane + buf * b_buf, frag_a, frag_b, acc)
            stash(regs_a, regs_b, smem, 1 - buf, tid)
            cuda.syncthreads()
            buf = 1 - buf
            kt += 1
        while kt < k_tiles:
            more = kt + 1 < k_tiles
            if more:
                fetch_edge(regs_a, regs_b, a, b, k_begin + (kt + 1) * block_k, k_end, m0, n0,
                           M, N, lda, ldb, tid)
            compute_tile(smem, a_lane + buf * a_buf, b_lane + buf * b_buf, frag_a, frag_b, acc)
            if more:
                stash(regs_a, regs_b, smem, 1 - buf, tid)
            cuda.syncthreads()
            buf = 1 - buf
            kt += 1

        out_base = z * out_z
        for i in range(thread_m):
            if vec:
                m = m0 + (i // 4) * stride_m + ty * 4 + i % 4
            else:
                m = m0 + ty * thread_m + i
            if m < M:
                for j in range(thread_n):
                    if vec:
                        n = n0 + (j // 4) * stride_n + tx * 4 + j % 4
                    else:
                        n = n0 + tx * thread_n + j
                    if n < N:
                        apply_epilogue(acc[i, j], n, out, out_base + m * so_m + n * so_n,
                                       c, m * sc_m + n * sc_n, bias, alpha, beta)

    return gemm_simt_kernel


def threads(block_m, block_n, thread_m, thread_n):
    return (block_m // thread_m) * (block_n // thread_n)
