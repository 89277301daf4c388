"""The Hopper GEMM kernel: cp.async pipeline -> 128-byte-swizzled shared tiles -> wgmma.

One thread block of ``block_m / 64`` warpgroups computes a ``block_m x block_n`` tile of
``a @ b`` over the K range of its split (``blockIdx.y``); warpgroup g owns rows ``64 g .. 64 g +
63`` and all ``block_n`` columns, as ``block_n / 2`` fp32 accumulators per thread that
``wgmma.mma_async.m64n{block_n}k16`` reads both operands for straight from shared memory (no
ldmatrix, no fragments in registers: the warps only issue copies and MMAs).

Shared memory (dynamic, one ``uint16`` buffer, realigned to 1024 bytes because the hardware
swizzle follows address bits 7-9): ``stages`` A tiles, then ``stages`` B tiles, each stored in
the orientation of the operand in global memory (``tile_loader`` with ``panels``): 64-element
panels of 128-byte rows whose 16-byte chunks are XOR-ed with ``row % 8``. That is wgmma's
128-byte-swizzle canonical layout in both orientations, so K-major operands (A row-major, B
column-major) and M- / N-major ones (A column-major, B row-major) differ only in the
descriptor and the instruction's transpose bit:
- K-major: 128-byte rows along K, 8-row groups 1024 bytes apart (SBO); a k16 step moves the
  start address 32 bytes.
- M- / N-major: rows along K, panels of 64 M / N elements ``rows * 128`` bytes apart (LBO), 8
  K rows 1024 bytes apart (SBO); a k16 step moves 16 rows.

Pipeline: ``stages - 2`` K tiles are loaded ahead of the one being multiplied, and one group of
wgmma stays in flight while the next is issued (``wgmma_wait(1)``). A stage is refilled only
after every warpgroup has waited for the MMAs that read it: the barrier at the top of K tile kt
follows each warpgroup's wait for tile kt - 2, whose stage the copies of tile kt + stages - 2
then reuse. The first K tile is issued before the loop, its first k16 step with scale-d = 0:
ptxas serialises every wgmma (warning C7515) if any other instruction defines the accumulator
on a path into the final wait. Edges as in ``_gemm_tensor_core``: rows / columns past M, N and
K elements past the split's end are zero-filled by cp.async's ``src_bytes``; interior blocks
run a K loop with unpredicated copies. Both operands must allow 16-byte copies (aligned
pointers and leading strides): the caller runs ``_gemm_tensor_core`` otherwise. The
warp-specialised form (``producer``: a copying warpgroup before the MMA warpgroups, stages
handed over through mbarriers) replaces the loop with ``producer_mainloop``.

Epilogue: as ``_gemm_tensor_core``, through an fp32 tile in shared memory (``tile_epilogue``);
a gated activation pairs each thread's gate and up accumulators while staging it
(``_staged_epilogue``).
"""

import numpy as np

from .. import ptx
from .._env import cuda
from ._activations_device import GATED_ACTIVATIONS
from ._epilogue import (block_work, epilogue_tile_ld, gated_fragment, gated_tile_store,
                        staged_store, tile_epilogue)
from ._gemm_tensor_core import either_loader, stage_loader
from ._stage_ring import init_stage_barriers

BLOCK_K = 64          # one 128-byte swizzle row of b16 per tile row along K
PRODUCER_THREADS = 128   # the copying warpgroup of the warp-specialised form
#: warpgroup g's 64 rows of A: 64 rows of 64 (K-major) or panel g (M-major), 4096 elements
A_GROUP = 64 * 64
_ALIGN_BYTES = 1024   # the 128-byte swizzle repeats every 8 rows of 128 bytes


def make_kernel(block_m, block_n, stages, group_m, a_k_inner, b_k_inner, is_bf16, out_dtype,
                c_dtype, bias_dtype, act, split_finish=False, producer=False, tma=False):
    """The kernel function (not yet jitted) for one configuration; the parameters and launch of
    ``_gemm_tensor_core.make_kernel`` plus the tensor maps of a and b (``tma_mainloop``; other
    forms ignore them), with ``threads_for(block_m, producer)`` threads and
    ``shared_bytes(...)`` of dynamic shared memory. ``producer``: the warp-specialised pipeline
    (``producer_mainloop``); ``tma``: its copies by the Tensor Memory Accelerator (both
    operands K-major)."""
    threads = threads_for(block_m, producer)
    regs = block_n // 2
    work = block_work(block_m, block_n, BLOCK_K, group_m)
    is_bf16 = int(is_bf16)     # the intrinsic takes compile-time integers
    trans_a = 0 if a_k_inner else 1
    trans_b = 0 if b_k_inner else 1

    @cuda.jit(device=True, inline="always")
    def mma(acc, da, db, scale_d):
        ptx.wgmma_m64k16(acc, da, db, scale_d, block_n, is_bf16, trans_a, trans_b)

    if tma:
        if not (a_k_inner and b_k_inner):
            raise ValueError("tma: both operands must be K-major")
        run = tma_mainloop(block_m, block_n, stages, mma)
    else:
        run = (producer_mainloop if producer else mainloop)(block_m, block_n, stages,
                                                            a_k_inner, b_k_inner, mma)
    n_bars = 2 * stages if producer else 1
    first_consumer = PRODUCER_THREADS if producer else 0
    stage_acc, store_tile = staged_store(
        split_finish, lambda *dtypes: _staged_epilogue(block_m, block_n, threads, *dtypes),
        block_m, block_n, threads, out_dtype, c_dtype, bias_dtype, act)

    def gemm_wgmma_kernel(a, b, out, c, bias, M, N, K, lda, ldb, so_m, so_n, out_z, sc_m, sc_n,
                          alpha, beta, k_split, tiles_m, tiles_n, out_vec, ws, counters, a_map,
                          b_map):
        tiles = aligned_tiles(cuda.shared.array(0, np.uint16))
        tid = np.int32(cuda.threadIdx.x)
        m0, n0, z, k_begin, k_end, k_tiles = work(tiles_m, tiles_n, K, k_split)
        acc = cuda.local.array(regs, np.float32)
        bars = cuda.shared.array(n_bars, np.uint64)
        run(tiles, bars, a, b, m0, n0, M, N, lda, ldb, k_begin, k_end, k_tiles, tid, acc, a_map,
            b_map)

        # epilogue through shared memory (the pipeline's buffers, once every group is done);
        # the accumulators are the consumers', the stores every thread's
        tile = cuda.shared.array(0, np.float32)
        if tid >= first_consumer:
            stage_acc(tile, acc, tid - first_consumer, n0, N, bias, alpha)
        cuda.syncthreads()
        store_tile(tile, tid, m0, n0, M, N, out, z * out_z, so_m, so_n, c, sc_m, sc_n, bias,
                   alpha, beta, out_vec, ws, counters)

    return gemm_wgmma_kernel


@cuda.jit(device=True, inline="always")
def aligned_tiles(smem):
    """The dynamic shared ``uint16`` buffer from its first 1024-byte-aligned element on (the
    hardware swizzle follows address bits 7-9)."""
    pad = ((_ALIGN_BYTES - (ptx.shared_address(smem, 0) & (_ALIGN_BYTES - 1)))
           & (_ALIGN_BYTES - 1)) >> 1
    return smem[pad:]


def mainloop(block_m, block_n, stages, a_k_inner, b_k_inner, mma):
    """Device function ``(tiles, bars, a, b, m0, n0, M, N, lda, ldb, k_begin, k_end, k_tiles,
    tid, acc, a_map, b_map)`` (``bars`` and the tensor maps unused): the pipeline of the
    module note over K tiles ``k_begin .. k_end`` of the block tile at (m0, n0), leaving the
    block tile in ``acc`` (``block_n / 2`` fp32 a thread), every wgmma group retired, every
    copy landed and the block past a barrier, so ``tiles`` may be reused. Operands and
    ``tiles`` are ``uint16`` arrays and K, lda, ldb count 16-bit units (``BLOCK_K`` a tile).
    ``mma(acc, desc_a, desc_b, scale_d)`` issues one wgmma of 32 bytes along K (k16 of b16, k32
    of 8-bit data) from the two descriptors."""
    threads = threads_for(block_m)
    regs = block_n // 2
    lead = stages - 2          # K tiles in flight ahead of the one multiplied
    tile_pending = lead - 1    # cp.async groups that may still run when a tile is needed
    load_full, load_edge, load_any = _loaders(block_m, block_n, stages, threads, a_k_inner,
                                              b_k_inner)
    mma_tile = tile_mma(block_m, block_n, stages, a_k_inner, b_k_inner, mma)

    def tile_step(full):
        load = load_full if full else load_edge

        @cuda.jit(device=True, inline="always")
        def step(tiles, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                 k_begin, k_end, tid, a_row0, acc):
            ptx.cp_async_wait(tile_pending)   # tile kt landed (this thread's copies)
            ptx.fence_proxy_async()       # ... and is visible to wgmma's async proxy
            cuda.syncthreads()            # everyone's copies; every group waited for kt - 2
            mma_tile(tiles, read_stage, a_row0, acc, False)
            nxt = kt + lead
            if full or nxt < k_tiles:
                load(tiles, write_stage, k_begin + nxt * BLOCK_K, k_end, a, b, m0, n0, M, N,
                     lda, ldb, tid)
            ptx.cp_async_commit()
            ptx.wgmma_wait(acc, regs, 1)  # tile kt - 1's group is done: its stage is free
            return (read_stage + 1 if read_stage < stages - 1 else 0,
                    write_stage + 1 if write_stage < stages - 1 else 0)

        return step

    step_full = tile_step(True)
    step_edge = tile_step(False)

    @cuda.jit(device=True, inline="always")
    def run(tiles, bars, a, b, m0, n0, M, N, lda, ldb, k_begin, k_end, k_tiles, tid, acc, a_map,
            b_map):
        a_row0 = np.int32((tid >> 7) * A_GROUP)
        interior = m0 + block_m <= M and n0 + block_n <= N
        k_full = (k_end - k_begin) // BLOCK_K if interior else 0

        for s in range(lead):
            if s < k_tiles:
                load_any(tiles, s, s, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb, tid)
            ptx.cp_async_commit()

        # K tile 0, peeled (see the module note), then its prefetch of tile ``lead``
        ptx.cp_async_wait(tile_pending)
        ptx.fence_proxy_async()
        cuda.syncthreads()
        mma_tile(tiles, 0, a_row0, acc, True)
        if lead < k_tiles:
            load_any(tiles, lead, lead, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb,
                     tid)
        ptx.cp_async_commit()

        read_stage = 1
        write_stage = lead + 1 if lead + 1 < stages else 0
        kt = 1
        main_tiles = min(k_tiles, k_full - lead)   # tiles whose prefetch is a full tile
        while kt < main_tiles:
            read_stage, write_stage = step_full(
                tiles, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                k_begin, k_end, tid, a_row0, acc)
            kt += 1
        while kt < k_tiles:
            read_stage, write_stage = step_edge(
                tiles, kt, k_tiles, read_stage, write_stage, a, b, m0, n0, M, N, lda, ldb,
                k_begin, k_end, tid, a_row0, acc)
            kt += 1
        ptx.wgmma_wait(acc, regs, 0)
        ptx.cp_async_wait(0)
        cuda.syncthreads()

    return run


def _loaders(block_m, block_n, stages, threads, a_k_inner, b_k_inner):
    """``(load_full, load_edge, load_any)``: ``threads`` threads' copies of a K tile into a
    stage (``_gemm_tensor_core.stage_loader`` into 128-byte-swizzled panels: unpredicated for
    whole tiles of an interior block, predicated at edges, and the one choosing by tile)."""
    load_edge = stage_loader(block_m, block_n, BLOCK_K, stages, threads, a_k_inner, b_k_inner,
                             True, True, False, panels=True)
    load_full = stage_loader(block_m, block_n, BLOCK_K, stages, threads, a_k_inner, b_k_inner,
                             True, True, True, panels=True)
    return load_full, load_edge, either_loader(BLOCK_K, load_full, load_edge)


def tile_mma(block_m, block_n, stages, a_k_inner, b_k_inner, mma):
    """Device function ``mma_tile(tiles, stage, a_row0, acc, first)``: the four 32-byte K steps
    of the K tile in ``stage`` as one wgmma group of the calling warpgroup (rows from element
    ``a_row0`` of the A tile). ``first``: the very first tile, whose first step overwrites the
    accumulator (scale-d = 0)."""
    a_stage = block_m * BLOCK_K
    b_stage = block_n * BLOCK_K
    b_base = stages * a_stage
    # descriptors: LBO (unused by K-major swizzled tiles: 16), SBO, and the 32-byte K step
    a_lbo = 16 if a_k_inner else BLOCK_K * 128
    b_lbo = 16 if b_k_inner else BLOCK_K * 128
    a_step = 16 if a_k_inner else 16 * 64
    b_step = 16 if b_k_inner else 16 * 64

    @cuda.jit(device=True, inline="always")
    def mma_tile(tiles, stage, a_row0, acc, first):
        a_s = np.int32(stage * a_stage + a_row0)
        b_s = np.int32(b_base + stage * b_stage)
        ptx.wgmma_fence()
        for j in range(BLOCK_K // 16):
            da = ptx.smem_desc(tiles, a_s + j * a_step, a_lbo, 1024, 1)
            db = ptx.smem_desc(tiles, b_s + j * b_step, b_lbo, 1024, 1)
            mma(acc, da, db, 0 if first and j == 0 else 1)
        ptx.wgmma_commit()

    return mma_tile


def producer_mainloop(block_m, block_n, stages, a_k_inner, b_k_inner, mma):
    """``mainloop``'s device function, warp-specialised: warpgroup 0 (``PRODUCER_THREADS``)
    only copies, the consumer warpgroups after it only multiply, handing the ``stages`` ring
    over through mbarriers in ``bars`` (``full[s] = bars[s]``, ``empty[s] = bars[stages + s]``),
    so each side runs at its own pace instead of meeting at a block barrier every K tile.

    The producer copies K tile kt into stage ``kt % stages`` once the consumers released it
    (``empty``; a fresh barrier passes the first round) and announces it on ``full`` with
    ``cp.async.mbarrier.arrive.noinc``: the hardware arrives when the thread's copies land, so
    the producer never waits for its own copies and keeps up to ``stages - 1`` tiles in flight
    (the plain loop: ``stages - 2``). The consumers wait for ``full``, fence the async proxy
    (the copies are generic-proxy writes, wgmma reads through the async proxy), issue the
    tile's wgmma group, wait for the previous group and release its stage."""
    consumer_threads = threads_for(block_m)
    regs = block_n // 2
    _, _, load_any = _loaders(block_m, block_n, stages, PRODUCER_THREADS, a_k_inner, b_k_inner)
    mma_tile = tile_mma(block_m, block_n, stages, a_k_inner, b_k_inner, mma)

    @cuda.jit(device=True, inline="always")
    def run(tiles, bars, a, b, m0, n0, M, N, lda, ldb, k_begin, k_end, k_tiles, tid, acc, a_map,
            b_map):
        init_stage_barriers(bars, stages, PRODUCER_THREADS, consumer_threads, tid)
        if tid < PRODUCER_THREADS:
            interior = m0 + block_m <= M and n0 + block_n <= N
            k_full = (k_end - k_begin) // BLOCK_K if interior else 0
            for kt in range(k_tiles):
                s = kt % stages
                ptx.mbarrier_wait_parity(bars, stages + s, ((kt // stages) & 1) ^ 1)
                load_any(tiles, s, kt, k_full, k_begin, k_end, a, b, m0, n0, M, N, lda, ldb,
                         tid)
                ptx.cp_async_mbarrier_arrive_noinc(bars, s)
            ptx.cp_async_commit()
            ptx.cp_async_wait(0)   # every copy landed before the tiles are reused
        else:
            a_row0 = np.int32(((tid - PRODUCER_THREADS) >> 7) * A_GROUP)
            ptx.mbarrier_wait_parity(bars, 0, 0)
            ptx.fence_proxy_async()
            mma_tile(tiles, 0, a_row0, acc, True)
            for kt in range(1, k_tiles):
                s = kt % stages
                ptx.mbarrier_wait_parity(bars, s, (kt // stages) & 1)
                ptx.fence_proxy_async()
                mma_tile(tiles, s, a_row0, acc, False)
                ptx.wgmma_wait(acc, regs, 1)   # tile kt - 1's group is done: release it
                ptx.mbarrier_arrive(bars, stages + (kt - 1) % stages)
            ptx.wgmma_wait(acc, regs, 0)
        cuda.syncthreads()

    return run


def tma_mainloop(block_m, block_n, stages, mma):
    """``producer_mainloop`` with the copies made by the Tensor Memory Accelerator (both
    operands K-major): per K tile one elected producer thread announces the tile's bytes on
    ``full`` and issues one box of A (``block_m`` rows of x from the map ``a_map``) and one of B
    (``block_n`` rows of b's K-major storage from ``b_map``), each 64 K elements of 128 bytes a
    row in the 128-byte swizzle the descriptors read; rows and K past the operands' ends arrive
    as zeros (a K split's range is whole tiles, so only the last split's last tile crosses K).
    The copies are async-proxy writes that complete on ``full``: the consumers need no proxy
    fence. The operand arrays and M, N, lda, ldb, k_end are the maps' business here."""
    consumer_threads = threads_for(block_m)
    regs = block_n // 2
    a_stage = block_m * BLOCK_K
    b_stage = block_n * BLOCK_K
    b_base = stages * a_stage
    tile_bytes = 2 * (a_stage + b_stage)
    mma_tile = tile_mma(block_m, block_n, stages, True, True, mma)

    @cuda.jit(device=True, inline="always")
    def run(tiles, bars, a, b, m0, n0, M, N, lda, ldb, k_begin, k_end, k_tiles, tid, acc, a_map,
            b_map):
        init_stage_barriers(bars, stages, 1, consumer_threads, tid)
        if tid < PRODUCER_THREADS:
            if tid < 32 and ptx.elect_sync():
                for kt in range(k_tiles):
                    s = kt % stages
                    ptx.mbarrier_wait_parity(bars, stages + s, ((kt // stages) & 1) ^ 1)
                    ptx.mbarrier_arrive_expect_tx(bars, s, tile_bytes)
                    k = k_begin + kt * BLOCK_K
                    ptx.cp_async_bulk_tensor_2d_g2s(tiles, s * a_stage, a_map, k, m0, bars, s)
                    ptx.cp_async_bulk_tensor_2d_g2s(tiles, b_base + s * b_stage, b_map, k, n0,
                                                    bars, s)
        else:
            a_row0 = np.int32(((tid - PRODUCER_THREADS) >> 7) * A_GROUP)
            ptx.mbarrier_wait_parity(bars, 0, 0)
            mma_tile(tiles, 0, a_row0, acc, True)
            for kt in range(1, k_tiles):
                s = kt % stages
                ptx.mbarrier_wait_parity(bars, s, (kt // stages) & 1)
                mma_tile(tiles, s, a_row0, acc, False)
                ptx.wgmma_wait(acc, regs, 1)   # tile kt - 1's group is done: release it
                ptx.mbarrier_arrive(bars, stages + (kt - 1) % stages)
            ptx.wgmma_wait(acc, regs, 0)
        cuda.syncthreads()

    return run


@cuda.jit(device=True, inline="always")
def _acc_position(tid):
    """(block row, column in an 8-column block) of a thread's first accumulator."""
    lane = tid & 31
    return np.int32((tid >> 5) * 16 + (lane >> 2)), np.int32(2 * (lane & 3))


def _staged_epilogue(block_m, block_n, threads, out_dtype, c_dtype, bias_dtype, act):
    """``(stage_acc, store_tile)`` as ``_gemm_tensor_core._staged_epilogue``, for the wgmma
    accumulator: ``stage_acc(tile, acc, tid, n0, N, bias, alpha)``. A thread of warp w holds
    rows ``16 w + lane / 4`` and ``+ 8`` of every 8-column block ``jb`` of the block tile,
    columns ``8 jb + 2 (lane % 4)`` and ``+ 1``, in ``acc[4 jb .. 4 jb + 3]``; gated, blocks
    ``2 jj`` (gate) and ``2 jj + 1`` (up) pair up in the thread's own registers."""
    if act not in GATED_ACTIVATIONS:
        tile_ld = epilogue_tile_ld(block_n)

        @cuda.jit(device=True, inline="always")
        def stage_acc(tile, acc, tid, n0, N, bias, alpha):
            row, col = _acc_position(tid)
            for jb in range(block_n // 8):
                for q in range(4):
                    tile[(row + 8 * (q // 2)) * tile_ld + 8 * jb + col + q % 2] = acc[jb * 4 + q]

        return stage_acc, tile_epilogue(block_m, block_n, tile_ld, threads, out_dtype, c_dtype,
                                        bias_dtype, act)

    tile_ld = epilogue_tile_ld(block_n // 2)
    store_fragment = gated_fragment(bias_dtype, act, out_dtype, tile_ld)
    pairs = block_n // 16

    @cuda.jit(device=True, inline="always")
    def stage_pair(tile, acc, jj, row, col, n0, N, bias, alpha):
        """Gate block 2 jj (``acc[8 jj ..]``) times up block 2 jj + 1 (``acc[8 jj + 4 ..]``)."""
        g = 8 * jj
        store_fragment(tile, np.int32(row * tile_ld + 8 * jj + col), acc[g], acc[g + 1],
                       acc[g + 2], acc[g + 3], acc[g + 4], acc[g + 5], acc[g + 6], acc[g + 7],
                       n0 + 16 * jj + col, N, bias, alpha)

    @cuda.jit(device=True, inline="always")
    def stage_four(tile, acc, jj, row, col, n0, N, bias, alpha):
        stage_pair(tile, acc, jj, row, col, n0, N, bias, alpha)
        if jj + 1 < pairs:
            stage_pair(tile, acc, jj + 1, row, col, n0, N, bias, alpha)
        if jj + 2 < pairs:
            stage_pair(tile, acc, jj + 2, row, col, n0, N, bias, alpha)
        if jj + 3 < pairs:
            stage_pair(tile, acc, jj + 3, row, col, n0, N, bias, alpha)

    @cuda.jit(device=True, inline="always")
    def stage_gated(tile, acc, tid, n0, N, bias, alpha):
        # the pairs written out (numba has no unroll pragma): as a loop, LLVM left it rolled
        # with GELU and a bias (four activations a trip), and the accumulator, indexed by the
        # loop counter, went to local memory (512 B stack at 128 x 256)
        row, col = _acc_position(tid)
        stage_four(tile, acc, 0, row, col, n0, N, bias, alpha)
        if pairs > 4:
            stage_four(tile, acc, 4, row, col, n0, N, bias, alpha)
        if pairs > 8:
            stage_four(tile, acc, 8, row, col, n0, N, bias, alpha)
        if pairs > 12:
            stage_four(tile, acc, 12, row, col, n0, N, bias, alpha)

    return stage_gated, gated_tile_store(block_m, block_n, tile_ld, threads, out_dtype)


def threads_for(block_m, producer=False):
    """Threads of a block: one warpgroup (128) per 64 rows, after the producer warpgroup of the
    warp-specialised form."""
    return 2 * block_m + (PRODUCER_THREADS if producer else 0)


def shared_bytes(block_m, block_n, stages):
    """Dynamic shared memory of one block: the pipeline's tiles plus the realignment slack, or
    the fp32 epilogue tile if larger (they reuse the same memory)."""
    return max(2 * stages * (block_m + block_n) * BLOCK_K + _ALIGN_BYTES,
               4 * block_m * epilogue_tile_ld(block_n))
