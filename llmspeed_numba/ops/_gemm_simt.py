"""The SIMT GEMM kernel: shared-memory tiles, register blocking, double buffering.

One thread block computes a ``BLOCK_M x BLOCK_N`` tile over the K range of its split; each thread
owns a ``THREAD_M x THREAD_N`` register tile of fp32 accumulators, fed per k by ``THREAD_M`` values
of A and ``THREAD_N`` of B read from shared memory (an outer product: ``THREAD_M * THREAD_N`` FMAs
per ``(THREAD_M + THREAD_N) / 4`` 16-byte shared loads when both are multiples of 4).

Shared memory holds two buffers of A as ``[BLOCK_K][BLOCK_M + 4]`` and B as ``[BLOCK_K][BLOCK_N +
4]`` in fp32 (inputs are converted on the way in, so fp16 / bf16 inputs work too): a thread's
operands for one k are contiguous, so both fragments are 16-byte loads (LDS.128). A thread's
THREAD_M rows are groups of 4 consecutive rows, BLOCK_M / (THREAD_M / 4) apart (same for
columns), and a warp is a 4 x 8 patch of the thread grid: its A loads touch 4 consecutive 16-byte
chunks and its B loads 8, each load one conflict-free shared-memory wavefront.

Global -> shared: the next K tile is loaded into registers while the current one is computed,
then stored to the other buffer; one ``__syncthreads`` per K tile. Every full K tile, in every
block, is loaded without predicates from offsets computed once (advanced by a constant per
tile): rows past M (columns past N) are clamped to the last one, as they only feed outputs the
epilogue drops. With a 16-byte aligned fp32 operand (``a_vec`` / ``b_vec``) those are 16-byte
loads of 4 elements along the operand's contiguous dimension (LDG.128): a K-contiguous operand
is transposed on the way into shared memory by 4 scalar stores (two threads share a row's
32-byte sector and a warp covers 16 rows, so the stores hit 32 different banks), the other is
one 16-byte store. Only a partial last K tile takes predicated scalar loads (K past the end
reads zeros), outside the loop, so their addresses never hold registers beside the fragments:
the fp32 kernel fits 128 registers, two 256-thread blocks per SM. The k loop is written out so
its shared-memory offsets are immediates. The epilogue is the shared fused one (``_epilogue``);
in split-K mode it stores raw fp32 partial sums like the Tensor Core kernel.

``min_blocks`` (launch bounds: blocks per SM the registers must allow) only enters the closure,
so that numba's disk cache, which keys on the closure but not on launch bounds, keeps variants
apart.
"""

import numpy as np

from .. import ptx
from .._env import cuda
from ._epilogue import block_work, epilogue, loader

_PAD = 4


def _operand(rows, block_k, k_inner, vec, threads, load_in):
    """Device functions moving one operand's K tile global -> registers -> shared memory.

    The tile has ``rows`` (BLOCK_M of A, BLOCK_N of B) by ``block_k``; shared memory holds it
    k-major, element (r, k) at ``base + k * (rows + PAD) + r``. In global memory element (r, k)
    of the tile at (r0, k0) is ``src[(r0 + r) * ld + k0 + k]`` when ``k_inner`` (K contiguous),
    else ``src[(k0 + k) * ld + r0 + r]``. Returns ``(fast_regs, n_fast, fetch_fast,
    stash_fast, offsets, fetch_edge, stash_edge)``: the unpredicated path (``n_fast`` loads a
    thread into ``fast_regs`` registers; 16-byte loads when ``vec``) and the predicated scalar
    path (``rows * block_k / threads`` elements a thread)."""
    row = rows + _PAD
    per_thread = rows * block_k // threads
    chunks = rows * block_k // 4
    n_fast = -(-chunks // threads) if vec else per_thread
    fast_regs = 4 * n_fast if vec else per_thread
    vec_exact = chunks % threads == 0
    row_chunks = rows // 4

    @cuda.jit(device=True, inline="always")
    def scalar_rk(e):
        """(r, k) of element ``e``: consecutive threads walk the contiguous dimension."""
        if k_inner:
            return np.int32(e // block_k), np.int32(e % block_k)
        return np.int32(e % rows), np.int32(e // rows)

    @cuda.jit(device=True, inline="always")
    def chunk_rk(c):
        """(r, k) of the first element of 16-byte chunk ``c``. K contiguous: thread pairs read
        a row's 8 consecutive k (one 32-byte sector), 16 pairs cover 16 consecutive rows."""
        if k_inner:
            rest = np.int32(c // 2)
            return np.int32(rest % rows), np.int32(((rest // rows) * 2 + c % 2) * 4)
        return np.int32((c % row_chunks) * 4), np.int32(c // row_chunks)

    @cuda.jit(device=True, inline="always")
    def active(c):
        return vec_exact or c < chunks

    @cuda.jit(device=True, inline="always")
    def offsets(g_off, s_off, r0, k0, r_end, ld, tid):
        """Global element offsets (tile at ``k0``) and shared offsets (buffer 0) of a thread's
        fast-path loads; idle chunk slots get offset 0 (never loaded). Rows past ``r_end`` read
        the last row (the last aligned chunk for 16-byte loads along the rows, which needs
        ``r_end % 4 == 0``): they only feed output rows / columns the epilogue drops."""
        for i in range(n_fast):
            c = np.int32(tid + i * threads)
            if vec:
                r, k = chunk_rk(c)
            else:
                r, k = scalar_rk(c)
            rg = min(r0 + r, r_end - (4 if vec and not k_inner else 1))
            if not vec or active(c):
                if k_inner:
                    g_off[i] = rg * ld + k0 + k
                else:
                    g_off[i] = (k0 + k) * ld + rg
            else:
                g_off[i] = 0
            s_off[i] = np.int32(k * row + r)

    @cuda.jit(device=True, inline="always")
    def fetch_fast(regs, src, g_off, step, tid, i0, i1):
        """Loads ``i0 <= i < i1`` of the tile at ``g_off``, then advance their ``g_off`` by
        ``step`` (the next tile)."""
        for i in range(i0, i1):
            # (unsigned index: numba's negative-index wraparound costs 3 instructions a load)
            if vec:
                if active(np.int32(tid + i * threads)):
                    w0, w1, w2, w3 = ptx.load_u32x4(src, np.uint64(g_off[i]))
                    regs[4 * i] = ptx.f32_from_bits(w0)
                    regs[4 * i + 1] = ptx.f32_from_bits(w1)
                    regs[4 * i + 2] = ptx.f32_from_bits(w2)
                    regs[4 * i + 3] = ptx.f32_from_bits(w3)
            else:
                regs[i] = load_in(src, np.uint64(g_off[i]))
            g_off[i] += step

    @cuda.jit(device=True, inline="always")
    def stash_fast(regs, smem, s_off, base, tid, i0, i1):
        for i in range(i0, i1):
            s = np.uint32(base + s_off[i])
            if vec:
                if active(np.int32(tid + i * threads)):
                    if k_inner:  # transpose: 4 k of one row
                        smem[s] = regs[4 * i]
                        smem[s + row] = regs[4 * i + 1]
                        smem[s + 2 * row] = regs[4 * i + 2]
                        smem[s + 3 * row] = regs[4 * i + 3]
                    else:
                        ptx.store_u32x4(smem, s, ptx.f32_bits(regs[4 * i]),
                                        ptx.f32_bits(regs[4 * i + 1]),
                                        ptx.f32_bits(regs[4 * i + 2]),
                                        ptx.f32_bits(regs[4 * i + 3]))
            else:
                smem[s] = regs[i]

    @cuda.jit(device=True, inline="always")
    def fetch_edge(regs, src, r0, k0, k_end, r_end, ld, tid):
        """Predicated: rows past ``r_end`` and k past ``k_end`` read as zeros."""
        for i in range(per_thread):
            r, k = scalar_rk(np.int32(tid + i * threads))
            v = np.float32(0.0)
            if r0 + r < r_end and k0 + k < k_end:
                if k_inner:
                    v = load_in(src, (r0 + r) * ld + k0 + k)
                else:
                    v = load_in(src, (k0 + k) * ld + r0 + r)
            regs[i] = v

    @cuda.jit(device=True, inline="always")
    def stash_edge(regs, smem, base, tid):
        for i in range(per_thread):
            r, k = scalar_rk(np.int32(tid + i * threads))
            smem[np.uint32(base + k * row + r)] = regs[i]

    return fast_regs, n_fast, fetch_fast, stash_fast, offsets, fetch_edge, stash_edge


def make_kernel(block_m, block_n, block_k, thread_m, thread_n, group_m, a_k_inner, b_k_inner,
                a_vec, b_vec, in_dtype, out_dtype, c_dtype, bias_dtype, act, min_blocks=0):
    """The kernel function (not yet jitted); same parameters and grid as the Tensor Core kernel
    (``_gemm_tensor_core.make_kernel``; ``out_vec`` is ignored), ``threads(...)`` threads per
    block. ``a_vec`` / ``b_vec``: the operand allows 16-byte loads (aligned pointer, leading
    dimension a multiple of 4); used for fp32 inputs."""
    threads_m = block_m // thread_m
    threads_n = block_n // thread_n
    n_threads = threads_m * threads_n
    work = block_work(block_m, block_n, block_k, group_m)
    a_row = block_m + _PAD
    b_row = block_n + _PAD
    a_buf = block_k * a_row
    b_buf = block_k * b_row
    b_start = 2 * a_buf        # one shared array: two A buffers, then two B buffers
    smem_elems = 2 * (a_buf + b_buf)
    load_in = loader(in_dtype)
    fp32 = in_dtype == "float32"
    a_vec = bool(a_vec) and fp32 and (block_k % 8 == 0 if a_k_inner else block_m % 4 == 0)
    b_vec = bool(b_vec) and fp32 and (block_k % 8 == 0 if b_k_inner else block_n % 4 == 0)
    a_regs, a_fast, fetch_fast_a, stash_fast_a, offsets_a, fetch_edge_a, stash_edge_a = \
        _operand(block_m, block_k, a_k_inner, a_vec, n_threads, load_in)
    b_regs, b_fast, fetch_fast_b, stash_fast_b, offsets_b, fetch_edge_b, stash_edge_b = \
        _operand(block_n, block_k, b_k_inner, b_vec, n_threads, load_in)
    a_edge = block_m * block_k // n_threads
    b_edge = block_n * block_k // n_threads
    vec = thread_m % 4 == 0 and thread_n % 4 == 0   # 16-byte fragment loads
    stride_m = block_m // (thread_m // 4) if vec else 0
    stride_n = block_n // (thread_n // 4) if vec else 0
    # warps as 4 x 8 patches of the thread grid (fewest distinct fragment addresses per warp)
    warp_grid = n_threads % 32 == 0 and threads_m % 4 == 0 and threads_n % 8 == 0
    warps_n = threads_n // 8
    apply_epilogue = epilogue(out_dtype, c_dtype, bias_dtype, act)

    # numba inlines an ``inline="always"`` function into the caller's IR before typing it,
    # every branch included, even those a closure constant decides: the variants below are
    # chosen here, in Python, so each call site copies only the code it runs (with the
    # branches in the IR the kernel took ~6x longer to compile, 150 s instead of 25).
    @cuda.jit(device=True, inline="always")
    def k_row_vec(smem, a_base, b_base, kk, frag_a, frag_b, acc):
        """One k of the register tile: THREAD_M + THREAD_N shared loads (16 bytes each),
        THREAD_M * THREAD_N FMAs (``kk`` a constant after inlining: the offsets are immediates)."""
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
        for i in range(thread_m):
            for j in range(thread_n):
                acc[i, j] += frag_a[i] * frag_b[j]

    @cuda.jit(device=True, inline="always")
    def k_row_scalar(smem, a_base, b_base, kk, frag_a, frag_b, acc):
        """``k_row_vec`` with scalar shared loads (THREAD_M or THREAD_N not a multiple of 4)."""
        for i in range(thread_m):
            frag_a[i] = smem[a_base + (kk * a_row + i)]
        for j in range(thread_n):
            frag_b[j] = smem[b_base + (kk * b_row + j)]
        for i in range(thread_m):
            for j in range(thread_n):
                acc[i, j] += frag_a[i] * frag_b[j]

    k_row = k_row_vec if vec else k_row_scalar

    @cuda.jit(device=True, inline="always")
    def k_rows8(smem, a_base, b_base, k0, frag_a, frag_b, acc):
        """k = k0 .. k0 + 7 (those below BLOCK_K), written out: numba has no unroll pragma
        and LLVM leaves the loop rolled."""
        k_row(smem, a_base, b_base, k0, frag_a, frag_b, acc)
        if k0 + 1 < block_k:
            k_row(smem, a_base, b_base, k0 + 1, frag_a, frag_b, acc)
        if k0 + 2 < block_k:
            k_row(smem, a_base, b_base, k0 + 2, frag_a, frag_b, acc)
        if k0 + 3 < block_k:
            k_row(smem, a_base, b_base, k0 + 3, frag_a, frag_b, acc)
        if k0 + 4 < block_k:
            k_row(smem, a_base, b_base, k0 + 4, frag_a, frag_b, acc)
        if k0 + 5 < block_k:
            k_row(smem, a_base, b_base, k0 + 5, frag_a, frag_b, acc)
        if k0 + 6 < block_k:
            k_row(smem, a_base, b_base, k0 + 6, frag_a, frag_b, acc)
        if k0 + 7 < block_k:
            k_row(smem, a_base, b_base, k0 + 7, frag_a, frag_b, acc)

    if block_k == 8:
        @cuda.jit(device=True, inline="always")
        def compute_tile(smem, a_base, b_base, frag_a, frag_b, acc):
            """The K tile in shared memory at (a_base, b_base) into ``acc``."""
            k_rows8(smem, np.int32(a_base), np.int32(b_base), 0, frag_a, frag_b, acc)
    elif block_k == 16:
        @cuda.jit(device=True, inline="always")
        def compute_tile(smem, a_base, b_base, frag_a, frag_b, acc):
            a_base = np.int32(a_base)
            b_base = np.int32(b_base)
            k_rows8(smem, a_base, b_base, 0, frag_a, frag_b, acc)
            k_rows8(smem, a_base, b_base, 8, frag_a, frag_b, acc)
    else:
        @cuda.jit(device=True, inline="always")
        def compute_tile(smem, a_base, b_base, frag_a, frag_b, acc):
            a_base = np.int32(a_base)
            b_base = np.int32(b_base)
            for k0 in range(0, block_k, 8):
                k_rows8(smem, a_base, b_base, k0, frag_a, frag_b, acc)

    # The hot loop takes a tile in slices of 8 k: the next tile's loads for slice p are issued
    # before slice p is computed and stored (to the free buffer) right after it, so only one
    # slice's loads hold registers (BLOCK_K = 16 then fits 128 registers too).
    parts = block_k // 8
    if block_k % 8 or a_fast % max(parts, 1) or b_fast % max(parts, 1):
        parts = 1
    a_part = a_fast // parts
    b_part = b_fast // parts

    if parts == 1:
        @cuda.jit(device=True, inline="always")
        def hot_tile(smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b, a_cur,
                     b_cur, a_next, b_next, tid, frag_a, frag_b, acc):
            """One hot-loop tile: the next tile's loads, this tile's FMAs, the next tile's
            stores to the free buffer."""
            fetch_fast_a(regs_a, a, a_g, a_step, tid, 0, a_fast)
            fetch_fast_b(regs_b, b, b_g, b_step, tid, 0, b_fast)
            compute_tile(smem, a_cur, b_cur, frag_a, frag_b, acc)
            stash_fast_a(regs_a, smem, a_s, a_next, tid, 0, a_fast)
            stash_fast_b(regs_b, smem, b_s, b_next, tid, 0, b_fast)
    else:
        @cuda.jit(device=True, inline="always")
        def hot_slice(p, smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b,
                      a_cur, b_cur, a_next, b_next, tid, frag_a, frag_b, acc):
            """Slice ``p`` of a hot-loop tile (``p`` a constant after inlining)."""
            fetch_fast_a(regs_a, a, a_g, a_step, tid, p * a_part, (p + 1) * a_part)
            fetch_fast_b(regs_b, b, b_g, b_step, tid, p * b_part, (p + 1) * b_part)
            k_rows8(smem, np.int32(a_cur), np.int32(b_cur), p * 8, frag_a, frag_b, acc)
            stash_fast_a(regs_a, smem, a_s, a_next, tid, p * a_part, (p + 1) * a_part)
            stash_fast_b(regs_b, smem, b_s, b_next, tid, p * b_part, (p + 1) * b_part)

        @cuda.jit(device=True, inline="always")
        def hot_tile(smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b, a_cur,
                     b_cur, a_next, b_next, tid, frag_a, frag_b, acc):
            hot_slice(0, smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b, a_cur,
                      b_cur, a_next, b_next, tid, frag_a, frag_b, acc)
            for p in range(1, parts):  # (parts is 2 in CONFIGS: written out by LLVM)
                hot_slice(p, smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b,
                          a_cur, b_cur, a_next, b_next, tid, frag_a, frag_b, acc)

    def gemm_simt_kernel(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, out_z, sc_m, sc_n,
                         alpha, beta, k_split, tiles_m, tiles_n, out_vec):
        min_blocks  # noqa: B018  (cache key only, see the module docstring)
        smem = cuda.shared.array(smem_elems, np.float32, alignment=16)
        tid = np.int32(cuda.threadIdx.x)
        if warp_grid:
            warp = np.int32(tid // 32)
            lane = np.int32(tid % 32)
            ty = np.int32((warp // warps_n) * 4 + lane // 8)
            tx = np.int32((warp % warps_n) * 8 + lane % 8)
        else:
            ty = np.int32(tid // threads_n)
            tx = np.int32(tid % threads_n)
        m0, n0, z, k_begin, k_end, k_tiles = work(tiles_m, tiles_n, K, k_split)

        acc = cuda.local.array((thread_m, thread_n), np.float32)
        for i in range(thread_m):
            for j in range(thread_n):
                acc[i, j] = np.float32(0.0)
        frag_a = cuda.local.array(thread_m, np.float32)
        frag_b = cuda.local.array(thread_n, np.float32)

        # Every full K tile takes the unpredicated path, edge blocks too (rows past M / N are
        # clamped, see ``offsets``); only a partial last K tile is loaded with predicates (K
        # elements past the end must read as zeros), outside any loop, so the predicated
        # loads' addresses never live beside the fragments.
        k_full = np.int32((k_end - k_begin) // block_k)
        a_lane = np.int32(ty * (4 if vec else thread_m))
        b_lane = np.int32(b_start + tx * (4 if vec else thread_n))
        regs_a = cuda.local.array(a_regs, np.float32)
        regs_b = cuda.local.array(b_regs, np.float32)
        edge_a = cuda.local.array(a_edge, np.float32)
        edge_b = cuda.local.array(b_edge, np.float32)
        a_g = cuda.local.array(a_fast, np.int64)
        b_g = cuda.local.array(b_fast, np.int64)
        a_s = cuda.local.array(a_fast, np.int32)
        b_s = cuda.local.array(b_fast, np.int32)
        offsets_a(a_g, a_s, m0, k_begin, M, lda, tid)
        offsets_b(b_g, b_s, n0, k_begin, N, ldb, tid)
        a_step = block_k if a_k_inner else block_k * lda   # offset change per K tile
        b_step = block_k if b_k_inner else block_k * ldb
        if k_full > 0:
            fetch_fast_a(regs_a, a, a_g, a_step, tid, 0, a_fast)
            fetch_fast_b(regs_b, b, b_g, b_step, tid, 0, b_fast)
            stash_fast_a(regs_a, smem, a_s, 0, tid, 0, a_fast)
            stash_fast_b(regs_b, smem, b_s, b_start, tid, 0, b_fast)
        elif k_tiles > 0:
            fetch_edge_a(edge_a, a, m0, k_begin, k_end, M, lda, tid)
            fetch_edge_b(edge_b, b, n0, k_begin, k_end, N, ldb, tid)
            stash_edge_a(edge_a, smem, 0, tid)
            stash_edge_b(edge_b, smem, b_start, tid)
        cuda.syncthreads()
        buf = np.int32(0)
        kt = np.int32(0)
        while kt + 1 < k_full:  # hot loop: tile kt + 1 is full
            a_cur = a_lane + buf * a_buf
            b_cur = b_lane + buf * b_buf
            a_next = (1 - buf) * a_buf
            b_next = b_start + (1 - buf) * b_buf
            hot_tile(smem, a, b, a_g, b_g, a_step, b_step, a_s, b_s, regs_a, regs_b, a_cur, b_cur,
                     a_next, b_next, tid, frag_a, frag_b, acc)
            cuda.syncthreads()
            buf = np.int32(1 - buf)
            kt = np.int32(kt + 1)
        if 0 < k_full < k_tiles:  # the partial tile, stored beside the last full one
            k0 = k_begin + k_full * block_k
            fetch_edge_a(edge_a, a, m0, k0, k_end, M, lda, tid)
            fetch_edge_b(edge_b, b, n0, k0, k_end, N, ldb, tid)
            stash_edge_a(edge_a, smem, (1 - buf) * a_buf, tid)
            stash_edge_b(edge_b, smem, b_start + (1 - buf) * b_buf, tid)
            compute_tile(smem, a_lane + buf * a_buf, b_lane + buf * b_buf, frag_a, frag_b, acc)
            cuda.syncthreads()
            buf = 1 - buf
        if k_tiles > 0:
            compute_tile(smem, a_lane + buf * a_buf, b_lane + buf * b_buf, frag_a, frag_b, acc)

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
