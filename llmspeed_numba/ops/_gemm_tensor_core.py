"""The Tensor Core GEMM kernel: cp.async pipeline -> swizzled shared tiles -> ldmatrix -> mma.sync.

One thread block computes a ``BLOCK_M x BLOCK_N`` tile of ``a @ b`` over the K range of its split
(``blockIdx.y``); its warps form a ``WARPS_M x WARPS_N`` grid, each owning a ``WM x WN`` warp tile
of ``m16n8k16`` fragments whose fp32 accumulators live in registers.

Shared memory (dynamic, one ``uint16`` buffer): ``STAGES`` A tiles then ``STAGES`` B tiles. A tile
is stored in the orientation of the operand in global memory, so each 16-byte ``cp.async`` chunk is
8 contiguous elements of the source:
- A row-major (K contiguous): ``BLOCK_M`` rows of ``BLOCK_K``, read with ``ldmatrix.x4``;
  A column-major (M contiguous): ``BLOCK_K`` rows of ``BLOCK_M``, read with ``ldmatrix.x4.trans``.
- B column-major (K contiguous): ``BLOCK_N`` rows of ``BLOCK_K``, ``ldmatrix.x4``;
  B row-major (N contiguous): ``BLOCK_K`` rows of ``BLOCK_N``, ``ldmatrix.x4.trans``.
Within a row the 16-byte chunk index is XOR-swizzled with the row number (``_swizzle_params``),
so the 8 row addresses of one ``ldmatrix`` matrix hit 8 different bank groups: conflict-free
reads.

Pipeline: ``STAGES - 1`` K tiles are in flight while one is computed; one ``__syncthreads`` per K
tile, placed before the tile's last k16 step so the next tile's first fragments are loaded while
that step's mma run. Fragments are double-buffered: ldmatrix of step ks + 1 precedes the mma of
step ks, within a tile and across tiles. Edges: rows / columns past M, N and K elements past the split's end are zero-filled
(``src_bytes`` < 16, from an in-bounds address) or, when the operand is not 16-byte aligned
(``a_vec`` / ``b_vec`` False), copied with predicated scalar loads. Nothing is read or written
out of bounds.

Blocks are rasterised in groups of ``GROUP_M`` tile rows (``blockIdx.x`` walks down a group's
columns first), so the A rows and B columns a wave of blocks shares stay in L2.

Epilogue: the accumulators are staged through shared memory as an fp32 block tile (reusing the
pipeline's buffers), then each thread takes 16 bytes of output at a time: ``alpha``, ``beta * c``,
bias and the activation (``_epilogue``), one 16-byte store when the output rows allow it.
Unrolled per accumulator in registers instead, the epilogue spills. A gated activation
(``gemm(..., activation="silu_and_mul")``) pairs each thread's gate and up accumulators while
staging (``_staged_epilogue``), so the tile holds ``block_n / 2`` output columns. In split-K
mode the caller asks for an fp32 output without ``c`` / bias / activation, ``out_z`` elements
apart per split: raw partial sums in a workspace, which the reduce kernel adds up.

Hot-loop notes: all fragment loops have compile-time trip counts and are unrolled (the k16
steps explicitly, see ``tile_step``), so the accumulators stay in registers (``compile_check``
asserts no local memory); a lane's ldmatrix offsets (swizzle included) are computed once
(``lane_offsets``); index math is int32 where it is known to fit; interior blocks run a separate
copy of the K loop whose copies are unpredicated (``full`` loader), so the edge code is neither
executed nor holding registers there.
"""

import numpy as np

from .. import ptx
from .._env import cuda
from ._activations_device import GATED_ACTIVATIONS
from ._epilogue import (block_work, epilogue_tile_ld, gated_fragment, gated_tile_store,
                        staged_store, tile_epilogue)


def _swizzle_params(inner):
    """(divisor, modulus) of the row -> chunk XOR for rows of ``inner`` b16 elements.

    Rows of ``inner // 8`` 16-byte chunks: 8 consecutive rows read at the same logical chunk must
    land in 8 different bank groups (128-byte lines hold 8 chunks), so rows sharing a line get
    different XOR masks."""
    chunks = inner // 8
    return max(1, 8 // chunks), min(chunks, 8)


def tile_loader(rows, inner, threads, vec, full, panels=False):
    """Device function copying one ``rows x inner`` tile (global -> shared, swizzled).

    ``(smem, s_base, src, g_base, ld, rows_left, inner_left, tid)``: the tile's element (r, i) is
    ``src[g_base + r * ld + i]``, present when ``r < rows_left`` and ``i < inner_left``; absent
    elements become zeros. ``full``: the caller guarantees the whole tile is present, so the
    copies are unpredicated (the hot path: every K tile of an interior block but the last).

    Thread ``tid`` copies chunk column ``tid % chunks_per_row`` of rows ``tid // chunks_per_row +
    it * row_step``: its column, and hence its edge predicate along the row, is the same for
    every chunk it copies.

    ``panels``: the tile is stored as ``inner // 64`` panels of ``rows x 64`` elements (rows of
    128 bytes, 128-byte swizzle), the layout wgmma reads; the same as the plain layout when
    ``inner == 64``."""
    chunks_per_row = inner // 8
    row_step = threads // chunks_per_row
    per_thread = (rows + row_step - 1) // row_step
    exact = rows % row_step == 0
    sw_div, sw_mod = _swizzle_params(inner)
    same_swizzle = row_step % (sw_div * sw_mod) == 0   # every row the thread copies: one XOR

    @cuda.jit(device=True, inline="always")
    def load(smem, s_base, src, g_base, ld, rows_left, inner_left, tid):
        # int32 index math (numba widens to int64; the casts let LLVM keep 32-bit ops)
        r0 = np.int32(tid // chunks_per_row)
        cc = np.int32(tid % chunks_per_row)
        g_row0 = g_base + r0 * ld + cc * 8
        if not full:
            rows_left = np.int32(rows_left)
            avail = np.int32(inner_left - cc * 8)
            nbytes_full = np.int32(16 if avail >= 8 else (2 * avail if avail > 0 else 0))
        for it in range(per_thread):
            r = np.int32(r0 + it * row_step)
            if exact or r < rows:
                sw = (r0 // sw_div) % sw_mod if same_swizzle else (r // sw_div) % sw_mod
                if panels:
                    s_off = np.int32(s_base + (cc // 8) * (rows * 64) + r * 64
                                     + ((cc ^ sw) % 8) * 8)
                else:
                    s_off = np.int32(s_base + r * inner + ((cc ^ sw) * 8))
                if full:
                    ptx.cp_async_16(smem, s_off, src, g_row0 + it * row_step * ld, 16)
                elif vec:
                    nbytes = nbytes_full if r < rows_left else np.int32(0)
                    g_off = g_row0 + it * row_step * ld if nbytes > 0 else g_base * 0
                    ptx.cp_async_16(smem, s_off, src, g_off, nbytes)
                else:
                    g_off = g_row0 + it * row_step * ld
                    row_ok = r < rows_left
                    for e in range(8):
                        v = np.uint16(0)
                        if row_ok and e < avail:
                            v = src[g_off + e]
                        smem[s_off + e] = v

    return load


def stage_loader(block_m, block_n, block_k, stages, threads, a_k_inner, b_k_inner, a_vec,
                 b_vec, full, panels=False):
    """Device function ``(smem, stage, k0, k_end, a, b, m0, n0, M, N, lda, ldb, tid)`` copying
    pipeline stage ``stage``: A's ``block_m x block_k`` and B's ``block_k x block_n`` tile at K
    offset ``k0`` (``tile_loader`` each, in the orientation of the operand in global memory).
    Shared layout: ``stages`` A tiles, then ``stages`` B tiles."""
    a_rows, a_inner = (block_m, block_k) if a_k_inner else (block_k, block_m)
    b_rows, b_inner = (block_n, block_k) if b_k_inner else (block_k, block_n)
    a_stage = block_m * block_k
    b_stage = block_n * block_k
    b_base = stages * a_stage
    load_a = tile_loader(a_rows, a_inner, threads, a_vec, full, panels)
    load_b = tile_loader(b_rows, b_inner, threads, b_vec, full, panels)

    @cuda.jit(device=True, inline="always")
    def load_stage(smem, stage, k0, k_end, a, b, m0, n0, M, N, lda, ldb, tid):
        if a_k_inner:
            load_a(smem, stage * a_stage, a, m0 * lda + k0, lda, M - m0, k_end - k0, tid)
        else:
            load_a(smem, stage * a_stage, a, k0 * lda + m0, lda, k_end - k0, M - m0, tid)
        if b_k_inner:
            load_b(smem, b_base + stage * b_stage, b, n0 * ldb + k0, ldb, N - n0, k_end - k0,
                   tid)
        else:
            load_b(smem, b_base + stage * b_stage, b, k0 * ldb + n0, ldb, k_end - k0, N - n0,
                   tid)

    return load_stage


def either_loader(block_k, load_full, load_edge):
    """Device function ``(smem, stage, kt, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb,
    tid)`` loading K tile ``kt`` of the split into ``stage``: unpredicated copies for the
    block's first ``k_full`` tiles (whole tiles of an interior block), predicated ones after."""
    @cuda.jit(device=True, inline="always")
    def load(smem, stage, kt, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb, tid):
        if kt < k_full:
            load_full(smem, stage, k_begin + kt * block_k, k_end, a, b, m0, n0, M, N, lda, ldb,
                      tid)
        else:
            load_edge(smem, stage, k_begin + kt * block_k, k_end, a, b, m0, n0, M, N, lda, ldb,
                      tid)

    return load


def make_kernel(block_m, block_n, block_k, warps_m, warps_n, stages, group_m,
                a_k_inner, b_k_inner, a_vec, b_vec, is_bf16,
                out_dtype, c_dtype, bias_dtype, act, min_blocks=0, split_finish=False):
    """The kernel function (not yet jitted) for one configuration.

    ``a_k_inner``: A is row-major (K contiguous); ``b_k_inner``: B is column-major (K contiguous).
    ``a_vec`` / ``b_vec``: the operand allows 16-byte cp.async (aligned pointer and stride).
    Parameters: ``(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, out_z, sc_m, sc_n, alpha,
    beta, k_split, tiles_m, tiles_n, out_vec)`` (``out_vec``: nonzero when ``out`` takes 16-byte
    stores: unit column stride, rows and split offsets 16-byte aligned); launch with
    ``tiles_m * tiles_n`` x ``splits`` blocks of
    ``32 * warps_m * warps_n`` threads and ``shared_bytes(...)`` of dynamic shared memory.
    ``min_blocks``: the launch bounds the caller compiles with; it only enters the closure, so
    that numba's disk cache (keyed on the closure, not on launch bounds) keeps variants apart.
    """
    threads = 32 * warps_m * warps_n
    work = block_work(block_m, block_n, block_k, group_m)
    wm = block_m // warps_m
    wn = block_n // warps_n
    mf = wm // 16             # 16-row A fragments per warp
    nf = wn // 8              # 8-column B fragments per warp
    n_pairs = nf // 2         # one ldmatrix.x4 loads two B fragments
    k_steps = block_k // 16
    a_stage = block_m * block_k
    b_stage = block_n * block_k
    b_base = stages * a_stage
    wait_pending = stages - 2
    stage_acc, store_tile = staged_store(
        split_finish,
        lambda *dtypes: _staged_epilogue(block_m, block_n, wm, wn, threads, *dtypes),
        block_m, block_n, threads, out_dtype, c_dtype, bias_dtype, act)

    a_inner = block_k if a_k_inner else block_m
    b_inner = block_k if b_k_inner else block_n
    a_div, a_mod = _swizzle_params(a_inner)
    b_div, b_mod = _swizzle_params(b_inner)
    fast_path = a_vec and b_vec

    load_stage_edge = stage_loader(block_m, block_n, block_k, stages, threads, a_k_inner,
                                   b_k_inner, a_vec, b_vec, False)
    load_stage_full = stage_loader(block_m, block_n, block_k, stages, threads, a_k_inner,
                                   b_k_inner, a_vec, b_vec, True)
    load_stage_any = either_loader(block_k, load_stage_full, load_stage_edge)

    # ldmatrix addressing. The XOR swizzle of a row depends only on row % 8 (divisor * modulus
    # = 8), which is lane % 8 for every fragment, so a lane's offsets are precomputed once: one
    # per k16 step where the step moves along the swizzled (chunk) axis, one per fragment where
    # the fragment does; the other index adds a compile-time constant (an LDSM immediate).
    a_var = k_steps if a_k_inner else mf
    b_var = k_steps if b_k_inner else n_pairs
    a_imm = 16 * a_inner     # elements between fragments (k-inner) or k16 steps (m-inner)
    b_imm = 16 * b_inner

    @cuda.jit(device=True, inline="always")
    def lane_offsets(lane, wm0, wn0, a_off, b_off):
        for x in range(a_var):
            if a_k_inner:   # x = ks; rows m, chunks along k
                r = np.int32(wm0 + lane % 16)
                ch = np.int32(x * 2 + lane // 16)
            else:           # x = i; rows k, chunks along m
                r = np.int32(lane % 8 + 8 * (lane // 16))
                ch = np.int32((wm0 + x * 16) // 8 + (lane // 8) % 2)
            a_off[x] = np.int32(r * a_inner + ((ch ^ ((r // a_div) % a_mod)) * 8))
        for x in range(b_var):
            if b_k_inner:   # x = ks; rows n, chunks along k
                r = np.int32(wn0 + lane % 8 + 8 * (lane // 16))
                ch = np.int32(x * 2 + (lane // 8) % 2)
            else:           # x = j; rows k, chunks along n
                r = np.int32(lane % 8 + 8 * ((lane // 8) % 2))
                ch = np.int32((wn0 + x * 16) // 8 + lane // 16)
            b_off[x] = np.int32(r * b_inner + ((ch ^ ((r // b_div) % b_mod)) * 8))

    @cuda.jit(device=True, inline="always")
    def load_frags(smem, a_s, b_s, ks, a_off, b_off, a_frag, b_frag, buf):
        """ldmatrix the A and B fragments of k16 step ``ks`` of stage (a_s, b_s) into fragment
        buffer ``buf``."""
        for i in range(mf):
            if a_k_inner:
                f0, f1, f2, f3 = ptx.ldmatrix_x4(smem, np.int32(a_s + a_off[ks] + i * a_imm))
            else:
                f0, f1, f2, f3 = ptx.ldmatrix_x4_trans(smem,
                                                       np.int32(a_s + a_off[i] + ks * a_imm))
            a_frag[buf, i, 0] = f0
            a_frag[buf, i, 1] = f1
            a_frag[buf, i, 2] = f2
            a_frag[buf, i, 3] = f3
        for j in range(n_pairs):
            if b_k_inner:
                f0, f1, f2, f3 = ptx.ldmatrix_x4(smem, np.int32(b_s + b_off[ks] + j * b_imm))
            else:
                f0, f1, f2, f3 = ptx.ldmatrix_x4_trans(smem,
                                                       np.int32(b_s + b_off[j] + ks * b_imm))
            b_frag[buf, 2 * j, 0] = f0
            b_frag[buf, 2 * j, 1] = f1
            b_frag[buf, 2 * j + 1, 0] = f2
            b_frag[buf, 2 * j + 1, 1] = f3

    @cuda.jit(device=True, inline="always")
    def mma_frags(acc, a_frag, b_frag, buf):
        """``mf x nf`` mma of fragment buffer ``buf`` into ``acc``."""
        for i in range(mf):
            for j in range(nf):
                if is_bf16:  # (an @intrinsic in a closure would defeat numba's disk cache)
                    d0, d1, d2, d3 = ptx.mma_bf16(a_frag[buf, i, 0], a_frag[buf, i, 1],
                                                  a_frag[buf, i, 2], a_frag[buf, i, 3],
                                                  b_frag[buf, j, 0], b_frag[buf, j, 1],
                                                  acc[i, j, 0], acc[i, j, 1], acc[i, j, 2],
                                                  acc[i, j, 3])
                else:
                    d0, d1, d2, d3 = ptx.mma_f16(a_frag[buf, i, 0], a_frag[buf, i, 1],
                                                 a_frag[buf, i, 2], a_frag[buf, i, 3],
                                                 b_frag[buf, j, 0], b_frag[buf, j, 1],
                                                 acc[i, j, 0], acc[i, j, 1], acc[i, j, 2],
                                                 acc[i, j, 3])
                acc[i, j, 0] = d0
                acc[i, j, 1] = d1
                acc[i, j, 2] = d2
                acc[i, j, 3] = d3

    @cuda.jit(device=True, inline="always")
    def inner_step(smem, a_s, b_s, ks, a_off, b_off, a_frag, b_frag, acc):
        """k16 step ``ks`` (not the tile's last): ldmatrix step ks + 1 into the other buffer,
        then mma step ks, so the shared loads overlap the Tensor Core work."""
        load_frags(smem, a_s, b_s, ks + 1, a_off, b_off, a_frag, b_frag, (ks + 1) % 2)
        mma_frags(acc, a_frag, b_frag, ks % 2)

    def tile_step(full):
        """One K tile ``kt`` of the main loop; returns the next (read_stage, write_stage).
        ``full``: the tile it prefetches (kt + stages - 1) is a full interior tile (unpredicated
        copies); two copies of the loop keep the edge code out of the hot one."""
        load_stage = load_stage_full if full else load_stage_edge

        @cuda.jit(device=True, inline="always")
        def step(smem, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                 k_begin, k_end, tid, a_off, b_off, a_frag, b_frag, acc):
            a_s = np.int32(read_stage * a_stage)
            b_s = np.int32(b_base + read_stage * b_stage)
            if full and k_steps > 1:
                load_frags(smem, a_s, b_s, 1, a_off, b_off, a_frag, b_frag, 1)
            # tile kt + stages - 1 into the stage tile kt - 1 used (freed by the last barrier)
            nxt = kt + stages - 1
            if full or nxt < k_tiles:
                load_stage(smem, write_stage, k_begin + nxt * block_k, k_end, a, b, m0, n0, M,
                           N, lda, ldb, tid)
            ptx.cp_async_commit()
            # (edge tiles: ldmatrix after the predicated copies, whose address and predicate
            # registers would otherwise coexist with both fragment buffers and spill)
            if not full and k_steps > 1:
                load_frags(smem, a_s, b_s, 1, a_off, b_off, a_frag, b_frag, 1)
            if k_steps > 1:
                mma_frags(acc, a_frag, b_frag, 0)
            # (k16 steps written out: numba has no unroll pragma)
            if k_steps > 2:
                inner_step(smem, a_s, b_s, 1, a_off, b_off, a_frag, b_frag, acc)
            if k_steps > 3:
                inner_step(smem, a_s, b_s, 2, a_off, b_off, a_frag, b_frag, acc)
            # last step: tile kt + 1 landed and every warp is done reading stage kt
            ptx.cp_async_wait(wait_pending)
            cuda.syncthreads()
            read_stage = read_stage + 1 if read_stage < stages - 1 else 0
            a_s = np.int32(read_stage * a_stage)
            b_s = np.int32(b_base + read_stage * b_stage)
            if k_steps % 2 == 0:  # the last step used buffer 1
                load_frags(smem, a_s, b_s, 0, a_off, b_off, a_frag, b_frag, 0)
                mma_frags(acc, a_frag, b_frag, 1)
            else:                 # k_steps == 1: one step per tile, buffer 0 each time
                load_frags(smem, a_s, b_s, 0, a_off, b_off, a_frag, b_frag, 1)
                mma_frags(acc, a_frag, b_frag, 0)
                for i in range(mf):
                    for q in range(4):
                        a_frag[0, i, q] = a_frag[1, i, q]
                for j in range(nf):
                    for q in range(2):
                        b_frag[0, j, q] = b_frag[1, j, q]
            return read_stage, write_stage + 1 if write_stage < stages - 1 else 0

        return step

    tile_full = tile_step(True)
    tile_edge = tile_step(False)

    def gemm_tensor_core_kernel(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, out_z,
                                sc_m, sc_n, alpha, beta, k_split, tiles_m, tiles_n, out_vec, ws,
                                counters):
        min_blocks  # noqa: B018  (cache key only, see the factory)
        smem = cuda.shared.array(0, np.uint16)
        # int32 thread / warp indices: int64 values live across the main loop cost registers
        tid = np.int32(cuda.threadIdx.x)
        lane = np.int32(tid & 31)
        warp = np.int32(tid >> 5)
        wm0 = np.int32((warp // warps_n) * wm)
        wn0 = np.int32((warp % warps_n) * wn)

        m0, n0, z, k_begin, k_end, k_tiles = work(tiles_m, tiles_n, K, k_split)

        acc = cuda.local.array((mf, nf, 4), np.float32)
        for i in range(mf):
            for j in range(nf):
                for q in range(4):
                    acc[i, j, q] = np.float32(0.0)
        a_frag = cuda.local.array((2, mf, 4), np.uint32)   # two buffers: steps ks, ks + 1
        b_frag = cuda.local.array((2, nf, 2), np.uint32)
        a_off = cuda.local.array(a_var, np.int32)
        b_off = cuda.local.array(b_var, np.int32)
        lane_offsets(lane, wm0, wn0, a_off, b_off)

        # K tiles that need no predicate in a block that needs none along M and N
        interior = m0 + block_m <= M and n0 + block_n <= N
        k_full = (k_end - k_begin) // block_k if fast_path and interior else 0

        for s in range(stages - 1):
            if s < k_tiles:
                load_stage_any(smem, s, s, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb,
                               tid)
            ptx.cp_async_commit()

        # Fragments are double-buffered across k16 steps and across K tiles: the ldmatrix of
        # step ks + 1 (of the next tile's step 0, after the barrier) is issued before the mma of
        # step ks. One barrier per K tile, before the last step's mma: it publishes tile kt + 1
        # and tells every warp that stage kt (now only in registers) may be refilled.
        ptx.cp_async_wait(wait_pending)
        cuda.syncthreads()
        load_frags(smem, np.int32(0), np.int32(b_base), 0, a_off, b_off, a_frag, b_frag, 0)
        read_stage = 0
        write_stage = stages - 1
        kt = 0
        main_tiles = min(k_tiles, k_full - (stages - 1))  # tiles prefetching a full tile
        while kt < main_tiles:
            read_stage, write_stage = tile_full(
                smem, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                k_begin, k_end, tid, a_off, b_off, a_frag, b_frag, acc)
            kt += 1
        while kt < k_tiles:
            read_stage, write_stage = tile_edge(
                smem, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                k_begin, k_end, tid, a_off, b_off, a_frag, b_frag, acc)
            kt += 1

        # Epilogue through shared memory: the accumulators go to an fp32 block tile, then every
        # thread walks it row by row. Stores and c loads become coalesced, and the epilogue is
        # one small loop instead of one unrolled copy per accumulator (which spills).
        ptx.cp_async_wait(0)
        cuda.syncthreads()  # every warp is done with the pipeline's buffers
        tile = cuda.shared.array(0, np.float32)
        stage_acc(tile, acc, lane, wm0, wn0, n0, N, bias, alpha)
        cuda.syncthreads()
        store_tile(tile, tid, m0, n0, M, N, out, z * out_z, so_m, so_n, c, sc_m, sc_n, bias,
                   alpha, beta, out_vec, ws, counters)

    return gemm_tensor_core_kernel


def _staged_epilogue(block_m, block_n, wm, wn, threads, out_dtype, c_dtype, bias_dtype, act):
    """``(stage_acc, store_tile)``: ``stage_acc(tile, acc, lane, wm0, wn0, n0, N, bias, alpha)``
    writes a warp's accumulators into the fp32 block tile in shared memory, ``store_tile`` (as
    ``tile_epilogue``'s) stores that tile through the epilogue.

    Plain: the tile is the ``block_m x block_n`` accumulator block, the whole epilogue runs in
    ``store_tile``. Gated (``act`` in ``GATED_ACTIVATIONS``): n8 fragments ``2 jj`` (gate) and
    ``2 jj + 1`` (up) of a warp tile are one interleaved block of b (``_epilogue.GATE_BLOCK``),
    so each thread pairs its own accumulators, ``combine(acc[i, 2 jj, q], acc[i, 2 jj + 1, q])``
    (bias added before the activation), and stages the ``block_m x block_n / 2`` output tile,
    which ``store_tile`` only rounds and stores. (Chosen here, in Python, so the kernel holds
    only the variant it runs.)"""
    mf = wm // 16
    nf = wn // 8
    if act not in GATED_ACTIVATIONS:
        tile_ld = epilogue_tile_ld(block_n)

        @cuda.jit(device=True, inline="always")
        def stage_acc(tile, acc, lane, wm0, wn0, n0, N, bias, alpha):
            g = np.int32(lane >> 2)
            t2 = np.int32(2 * (lane & 3))
            for i in range(mf):
                for j in range(nf):
                    idx = np.int32((wm0 + i * 16 + g) * tile_ld + wn0 + j * 8 + t2)
                    tile[idx] = acc[i, j, 0]
                    tile[idx + 1] = acc[i, j, 1]
                    tile[idx + 8 * tile_ld] = acc[i, j, 2]
                    tile[idx + 8 * tile_ld + 1] = acc[i, j, 3]

        return stage_acc, tile_epilogue(block_m, block_n, tile_ld, threads, out_dtype, c_dtype,
                                        bias_dtype, act)

    tile_ld = epilogue_tile_ld(block_n // 2)
    store_fragment = gated_fragment(bias_dtype, act, out_dtype, tile_ld)
    pairs = nf // 2

    @cuda.jit(device=True, inline="always")
    def stage_frag(tile, acc, i, jj, t, n, N, bias, alpha):
        """Gate fragment (i, 2 jj) times up fragment (i, 2 jj + 1): 4 outputs at tile[t ..]."""
        store_fragment(tile, t, acc[i, 2 * jj, 0], acc[i, 2 * jj, 1], acc[i, 2 * jj, 2],
                       acc[i, 2 * jj, 3], acc[i, 2 * jj + 1, 0], acc[i, 2 * jj + 1, 1],
                       acc[i, 2 * jj + 1, 2], acc[i, 2 * jj + 1, 3], n, N, bias, alpha)

    @cuda.jit(device=True, inline="always")
    def stage_column(tile, acc, jj, lane, wm0, wn0, n0, N, bias, alpha):
        """Fragment pair column jj of the warp tile, every row (``mf`` written out when <= 4)."""
        t2 = np.int32(2 * (lane & 3))
        n = n0 + wn0 + jj * 16 + t2   # b's gate column of acc[:, 2 jj, 0] (and 2)
        t = np.int32((wm0 + (lane >> 2)) * tile_ld + (wn0 >> 1) + jj * 8 + t2)
        if mf > 4:
            for i in range(mf):
                stage_frag(tile, acc, i, jj, t + i * 16 * tile_ld, n, N, bias, alpha)
        else:
            stage_frag(tile, acc, 0, jj, t, n, N, bias, alpha)
            if mf > 1:
                stage_frag(tile, acc, 1, jj, t + 16 * tile_ld, n, N, bias, alpha)
            if mf > 2:
                stage_frag(tile, acc, 2, jj, t + 32 * tile_ld, n, N, bias, alpha)
            if mf > 3:
                stage_frag(tile, acc, 3, jj, t + 48 * tile_ld, n, N, bias, alpha)

    @cuda.jit(device=True, inline="always")
    def stage_gated(tile, acc, lane, wm0, wn0, n0, N, bias, alpha):
        # written out (numba has no unroll pragma): as loops, LLVM left them rolled with GELU
        # and a bias (at 128 x 256, 64 x 64 warp tiles), and the accumulator, indexed by the
        # loop counters, went to local memory (512 B stack). Warp tiles wider or taller than
        # 64 (none in CONFIGS) take the loops.
        if pairs > 4:
            for jj in range(pairs):
                stage_column(tile, acc, jj, lane, wm0, wn0, n0, N, bias, alpha)
        else:
            stage_column(tile, acc, 0, lane, wm0, wn0, n0, N, bias, alpha)
            if pairs > 1:
                stage_column(tile, acc, 1, lane, wm0, wn0, n0, N, bias, alpha)
            if pairs > 2:
                stage_column(tile, acc, 2, lane, wm0, wn0, n0, N, bias, alpha)
            if pairs > 3:
                stage_column(tile, acc, 3, lane, wm0, wn0, n0, N, bias, alpha)

    return stage_gated, gated_tile_store(block_m, block_n, tile_ld, threads, out_dtype)


def shared_bytes(block_m, block_n, block_k, stages):
    """Dynamic shared memory of one block: the pipeline's ``stages`` A and B tiles of b16, or
    the fp32 epilogue tile if larger (they reuse the same memory)."""
    return max(2 * stages * (block_m + block_n) * block_k,
               4 * block_m * epilogue_tile_ld(block_n))
