"""FlashAttention forward on Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a).

A block of ``GROUPS`` consumer warpgroups owns ``BLOCK_M = 64 * GROUPS`` query rows of one
(batch, head); warpgroup ``wg`` owns rows ``64 wg .. 64 wg + 63`` and computes, per key block
of ``BLOCK_N`` keys:

1. ``S = Q K^T`` (fp32, ``BLOCK_N / 2`` registers a thread): ``DIM / 16`` wgmma m64n{BLOCK_N}k16,
   Q (A, K-major) and K (B, K-major: a key row is a column of K^T) both read from shared memory
   through descriptors. The first step overwrites S (scale-d = 0).
2. Mask (only blocks that cross an edge: causal diagonal, window, ``seqlen_k``) and online
   softmax on the accumulator fragment: thread (warp w, lane l) holds rows ``16 w + l / 4`` and
   ``+ 8`` of its warpgroup, columns ``8 j + 2 (l % 4)`` and ``+ 1`` in registers ``4 j ..
   4 j + 3`` (``_intrinsics/wgmma.py``), so each row's max and sum live in the 4 lanes of a quad
   (two ``shfl.bfly``), as in the mma.sync kernel (``_flash_attn_tc``).
3. ``O += P V``: P packed to fp16 / bf16 pairs in registers is the A operand of ``BLOCK_N / 16``
   wgmma m64n{DIM}k16 (``wgmma_m64k16_rs``; the S fragment of columns ``16 kk ..`` *is* the A
   fragment of k16 step kk); V (B, N-major: keys along K, the head dimension contiguous) from
   shared memory with the transpose bit.
4. At the end O is divided by the row sum once, staged through the warpgroup's own rows of the
   Q tile and written with 16-byte stores; ``lse = max * scale + log(sum)``.

Key blocks are visited from the last to the first (the masked ones first); blocks wholly outside
the causal mask / window are never visited. Mask and softmax conventions: ``_attention_common``.

Shared memory (one ``uint16`` buffer realigned to 1024 bytes: the hardware swizzle follows
address bits 7-9): the Q tile, then ``STAGES`` (K tile, V tile) pairs. Every tile is stored as
``DIM / 64`` panels of ``rows x 64`` elements (128-byte rows, 16-byte chunks XOR-ed with
``row % 8``: wgmma's 128-byte-swizzle layout, ``_gemm_tensor_core.tile_loader``), so one loader
fills Q, K and V and only the descriptors differ: K-major (Q, K) steps 32 bytes along a panel
row per k16 step and 8-row groups are 1024 bytes apart; N-major V steps 16 rows (2048 bytes) per
k16 step, its 64-column panels ``BLOCK_N * 128`` bytes apart.

Loads, two forms: the ring (every thread copies with cp.async into ``STAGES`` (K, V) buffers,
``STAGES - 1`` key blocks ahead; a block barrier per key block hands a stage from the copies
to the MMAs, ``fence.proxy.async`` making the copies visible to wgmma's async proxy, and back),
and the warp-specialised one (``producer_kernel``: a producer warpgroup fills the stages, with
cp.async or, for whole key blocks, the Tensor Memory Accelerator, and hands them over through
mbarriers). wgmma descriptors are built once per tile and stage; each k16 step's is the tile's
moved a constant number of bytes (``ptx.smem_desc_advance``).
Edges: rows past ``seqlen_q`` / ``seqlen_k`` and columns past ``head_dim`` are zero-filled by
cp.async's ``src_bytes``. Q, K, V and out must allow 16-byte copies (pointers and strides
multiples of 8 elements): the caller runs another kernel otherwise.

Every wgmma group is waited for (``wgmma_wait(0)``) before any other instruction touches its
accumulator: ptxas serialises all wgmma of a kernel (warning C7515) when a non-wgmma
instruction defines an accumulator while a group that uses it may be in flight.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from .._launch import Kernel, jit
from ._attention_common import (NEG_INF, block_is_full, clamped_range, finish_row, fmax,
                                key_bounds, rescale_factor, row_key_range, scaled_max,
                                varlen_sequence)
from ._gemm_tensor_core import tile_loader
from ._last_block import draw_ticket
from ._stage_ring import init_stage_barriers

PANEL = 64            # b16 elements in one 128-byte swizzle row
MAX, SUM, SCALED, ALPHA = 0, 1, 2, 3   # rows of a thread's row state (``softmax``)
_ALIGN_BYTES = 1024   # the 128-byte swizzle repeats every 8 rows of 128 bytes
#: ``lazy`` kernels: a row's maximum moves only when a block raises it by more than this (scaled
#: scores, log2 units), so P stays at most 2 ** 8 = 256: exact in fp16 / bf16, and far from
#: overflowing the fp32 sums and O.
LAZY_RESCALE_LOG2 = np.float32(8.0)
_ONE = np.float32(1.0)

#: setmaxnreg count of the producer warpgroup by padded head dimension: its copy loops keep every
#: chunk's address offsets live across the key-block loop (LLVM hoists them), so it spills below
#: these (offline sm_90a: d64 36 B at 120, d128 4 B at 64, varlen d128 8 B at 80); the
#: consumers get the rest (``maxnreg_split``: 176 at d64, 200 at d128, two consumer groups;
#: 232 with the TMA producer).
PRODUCER_REGS = {64: 144, 128: 96, 192: 96, 256: 96}
#: ... and of the TMA producer (``tma_producer``: one thread's issue loop, no copy addresses)
TMA_PRODUCER_REGS = 40

_device = cuda.jit(device=True, inline="always")


def padded_dim(headdim):
    """Head dimension the kernel computes with: the next multiple of 64 (whole panels)."""
    return -(-headdim // PANEL) * PANEL


def threads_for(groups, producer):
    """Threads of a block: ``groups`` consumer warpgroups, after the producer warpgroup."""
    return 128 * (groups + (1 if producer else 0))


def maxnreg_split(groups, dim, tma=False, min_blocks=1):
    """``setmaxnreg`` counts (producer, consumer) of the warp-specialised kernel. The block
    starts with ``65536 / (threads * min_blocks)`` registers a thread (rounded down to 8: the
    launch bounds);
    ``setmaxnreg.inc`` takes only what ``.dec`` gave back to the block's pool, so the producer
    warpgroup keeps ``PRODUCER_REGS[dim]`` (``TMA_PRODUCER_REGS`` with ``tma``; at most what it
    starts with) and the consumers share the rest of the block's allocation (a larger ``inc``
    would wait forever)."""
    threads = threads_for(groups, True)
    at_launch = 65536 // (threads * max(1, min_blocks)) // 8 * 8
    producer = min(TMA_PRODUCER_REGS if tma else PRODUCER_REGS[dim], at_launch)
    consumer = min(256, (threads * at_launch - 128 * producer) // (128 * groups) // 8 * 8)
    return producer, consumer


def shared_bytes(dim, groups, block_n, stages):
    """Dynamic shared memory of one block: Q tile, ``stages`` K and V tiles, realignment."""
    return 2 * dim * (64 * groups + 2 * stages * block_n) + _ALIGN_BYTES


def _wgmma_kernel_fn(head_dim, dim, groups, block_n, stages, is_bf16, is_varlen, min_blocks=0,
                     producer=False, pingpong=False, tma=False, lazy=False, overlap=False,
                     persistent=False):
    """The kernel for a padded head dimension ``dim`` (multiple of 64) holding ``head_dim``;
    parameters as ``_flash_attn_tc._tc_kernel_fn`` (the block table and its numbers unused).
    ``min_blocks`` (launch bounds) only enters the closure, for numba's disk cache key.
    ``producer``: the warp-specialised form (``producer_kernel``), else every thread copies
    (``ring_kernel``); ``pingpong`` (warp-specialised, two or more consumer groups): the
    groups take turns issuing their MMAs, so one group's softmax runs while another's MMAs
    do (FlashAttention 3's ping-pong schedule); ``tma`` (warp-specialised, ``head_dim`` a
    multiple of 64): the producer copies whole key blocks with the Tensor Memory Accelerator
    from the tensor maps ``k_map`` / ``v_map`` (``tma_producer``; the kernels of other forms
    take the two arguments and ignore them); ``lazy``: a row's running maximum moves only when
    a block raises it by more than ``LAZY_RESCALE_LOG2`` (scaled, log2 units), so most blocks
    leave the factors at 1 and a warp whose rows all kept theirs skips rescaling O (P is then
    at most ``2 ** LAZY_RESCALE_LOG2``; the result is the same softmax); ``overlap``
    (warp-specialised): the softmax of key block j + 1 runs under block j's P V (see
    ``producer_kernel``'s loop); ``persistent`` (TMA producer, no ping-pong, ``dim`` up to
    128): a block an SM slot works through tiles drawn from a counter (``persistent_kernel``).
    Not at 256: its epilogue spills O, and inside the tile loop ptxas then serialises every
    wgmma (C7519, offline sm_90a)."""
    assert not pingpong or (producer and groups >= 2)
    assert not persistent or (tma and not pingpong and dim <= 128)
    assert not overlap or producer
    assert not tma or (producer and head_dim == dim)
    assert dim % PANEL == 0 and head_dim <= dim <= 256
    assert block_n % 16 == 0 and 16 <= block_n <= 256 and stages >= 2
    block_m = 64 * groups
    s_regs = block_n // 2            # S accumulator registers a thread
    # O as one accumulator up to 128 columns, as two of 128 at 256 (one m64n256 accumulator of
    # 128 registers stays in local memory: offline sm_90a, a 544-byte stack even with 255
    # registers free); the second, ``acc_o2``, a one-element placeholder when unused
    o_parts = 2 if dim > 128 else 1
    o_n = dim // o_parts             # columns of one O accumulator
    o_regs = o_n // 2                # registers of one O accumulator a thread
    n_tiles = block_n // 8           # n8 column tiles of S
    k_steps = dim // 16              # k16 steps of Q K^T
    p_steps = block_n // 16          # k16 steps of P V
    p_regs = 4 * p_steps             # P as packed b16 pairs: the A fragments of P V
    q_panel = block_m * PANEL        # elements of one panel of the Q tile
    kv_panel = block_n * PANEL       # ... of a K or V tile
    kv_elems = block_n * dim
    s_kv = block_m * dim             # first K tile; stage s: K at s_kv + 2 s kv_elems, V after
    v_lbo = block_n * 128            # bytes between the 64-column panels of V (N-major)
    out_chunks = 64 * dim // 8 // 128    # 16-byte output chunks a thread
    chunks_per_row = dim // 8
    is_bf16 = int(is_bf16)
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2
    from_f32 = ptx.f32_to_bf16 if is_bf16 else ptx.f32_to_f16
    copy_threads = 128 if producer else 128 * groups     # threads that copy K and V
    consumer_threads = 128 * groups
    n_bars = 2 * stages              # producer kernel: full[s], then empty[s]
    two_in_flight = stages >= 3      # ... the producer's copies of two blocks run at once
    sched0 = 2 + groups              # ... ping-pong: named barrier of group g's turn: sched0 + g
    stage_bytes = 2 * kv_elems * 2   # producer kernel with tma: K and V tiles of a stage
    lead = stages - 1                # ring kernel: key blocks loaded ahead of the one computed
    pending = stages - 2             # ... cp.async groups that may run when a block is needed
    producer_regs, consumer_regs = maxnreg_split(groups, dim, tma, min_blocks)
    load_q = tile_loader(block_m, dim, 128 * groups, True, False, panels=True)
    load_edge = tile_loader(block_n, dim, copy_threads, True, False, panels=True)
    load_full = tile_loader(block_n, dim, copy_threads, True, True, panels=True)

    @_device
    def load_kv(tiles, stage, k, v, k_base, v_base, k_sn, v_sn, col, seqlen_k, tid):
        """Copy key block ``col .. col + block_n`` of K and V into ring stage ``stage``."""
        s_k = s_kv + stage * 2 * kv_elems
        if head_dim == dim and col + block_n <= seqlen_k:
            load_full(tiles, s_k, k, k_base + col * k_sn, k_sn, block_n, dim, tid)
            load_full(tiles, s_k + kv_elems, v, v_base + col * v_sn, v_sn, block_n, dim, tid)
        else:
            load_edge(tiles, s_k, k, k_base + col * k_sn, k_sn, seqlen_k - col, head_dim, tid)
            load_edge(tiles, s_k + kv_elems, v, v_base + col * v_sn, v_sn, seqlen_k - col,
                      head_dim, tid)

    @_device
    def tma_boxes(tiles, bars, k_map, v_map, s, k_col0, v_col0, k_row, v_row):
        """Key block rows ``k_row`` / ``v_row`` of K and V into stage ``s`` by TMA (one thread):
        the stage's bytes announced on its ``full`` barrier (an arrival), then the boxes."""
        ptx.mbarrier_arrive_expect_tx(bars, s, stage_bytes)
        s_k = s_kv + s * 2 * kv_elems
        for p in range(dim // PANEL):
            ptx.cp_async_bulk_tensor_2d_g2s(tiles, s_k + p * kv_panel, k_map,
                                            k_col0 + p * PANEL, k_row, bars, s)
            ptx.cp_async_bulk_tensor_2d_g2s(tiles, s_k + kv_elems + p * kv_panel, v_map,
                                            v_col0 + p * PANEL, v_row, bars, s)

    @_device
    def tma_block(tiles, bars, k_map, v_map, s, k_col0, v_col0, k_row, v_row, tid):
        """``tma_boxes`` by thread 0; the other producer threads arrive."""
        if tid == 0:
            tma_boxes(tiles, bars, k_map, v_map, s, k_col0, v_col0, k_row, v_row)
        else:
            ptx.mbarrier_arrive(bars, s)

    @_device
    def tma_producer(tiles, bars, k_map, v_map, batch, k_start, head_k, k_sb, k_sn, k_sh, v_sb,
                     v_sn, v_sh, n_end, n_blocks, tid):
        """The producer warpgroup with the Tensor Memory Accelerator: a key block is ``DIM / 64``
        boxes of K and of V (``block_n`` rows of 128 bytes, the 128-byte swizzle the descriptors
        read) from the maps of K and V seen as 2-D (token rows of the packed batch, ``k_sb /
        k_sn`` rows a sequence; head ``h`` at column ``h * k_sh``), issued by one thread that
        announces the stage's bytes; the other 127 arrive at once, so ``full`` keeps its count
        of 128 and completes when the bytes have landed. Rows past the tensor arrive as zeros;
        rows past the sequence but inside the tensor (the next sequence's) do not: the consumers
        zero those rows of V (``zero_v_tail``) and mask those of K."""
        k_row0 = np.int32(batch * (k_sb // k_sn) + k_start)   # K's row of key 0
        v_row0 = np.int32(batch * (v_sb // v_sn) + k_start)
        k_col0 = np.int32(head_k * k_sh)
        v_col0 = np.int32(head_k * v_sh)
        s = np.int32(0)
        phase = np.int32(1)          # the first pass waits on already completed phases
        for b in range(n_blocks):
            ptx.mbarrier_wait_parity(bars, stages + s, phase)
            col = np.int32((n_end - 1 - b) * block_n)
            tma_block(tiles, bars, k_map, v_map, s, k_col0, v_col0, k_row0 + col, v_row0 + col,
                      tid)
            s += 1
            if s == stages:
                s = 0
                phase ^= 1

    @_device
    def zero_v_tail(tiles, stage, first, ctid):
        """Zero rows ``first ..`` of ring stage ``stage``'s V tile (the tile's first key block
        visited, the only one that can end past ``seqlen_k``), so that P's zeros there meet
        zeros and not another sequence's values (0 * inf would be NaN); then make the writes
        visible to wgmma and wait for every consumer's."""
        chunks = (block_n - first) * (dim // PANEL) * 8      # 16-byte chunks to zero
        v_tile = s_kv + stage * 2 * kv_elems + kv_elems
        for i in range(ctid, chunks, consumer_threads):
            row = first + i // (8 * (dim // PANEL))
            rest = i % (8 * (dim // PANEL))
            ptx.store_u32x4(tiles, v_tile + (rest // 8) * kv_panel + row * PANEL
                            + (rest % 8) * 8, np.uint32(0), np.uint32(0), np.uint32(0),
                            np.uint32(0))
        ptx.fence_proxy_async()
        ptx.named_barrier_sync(1, consumer_threads)

    @_device
    def swizzled(row, col, rows):
        """Element offset of (row, col) in a panelled tile of ``rows`` rows."""
        return ((col // PANEL) * rows * PANEL + row * PANEL
                + ((((col % PANEL) // 8) ^ (row % 8)) * 8) + col % 8)

    @_device
    def init_state(acc_o, acc_o2, rows):
        """O = 0; the rows' maxima -inf and sums 0."""
        # not a literal 0: LLVM would make the zero fill a memset over local memory
        zero = ptx.ex2_approx(NEG_INF)
        for i in range(o_regs):     # a loop an accumulator: each one fully unrolled
            acc_o[i] = zero
        if o_parts == 2:
            for i in range(o_regs):
                acc_o2[i] = zero
        for h in range(2):
            rows[MAX, h] = NEG_INF
            rows[SUM, h] = zero
            if lazy:    # read only behind the -inf test, set for clarity
                rows[SCALED, h] = zero

    @_device
    def stage_descs(tiles, stage):
        """wgmma descriptors of the K and V tiles of ring stage ``stage`` (their first k16
        step; the others are constant byte offsets on, ``issue_s`` / ``issue_pv``)."""
        dk = ptx.smem_desc(tiles, s_kv + stage * 2 * kv_elems, 16, 1024, 1)
        dv = ptx.smem_desc(tiles, s_kv + stage * 2 * kv_elems + kv_elems, v_lbo, 1024, 1)
        return dk, dv

    @_device
    def issue_s(dq, dk, acc_s):
        """Issue S = Q K^T as one wgmma group (S overwritten); ``dq``: this warpgroup's Q rows,
        ``dk``: the stage's K tile."""
        for j in range(k_steps):
            step = 2 * ((j // 4) * q_panel + (j % 4) * 16)       # bytes into the Q tile
            kstep = 2 * ((j // 4) * kv_panel + (j % 4) * 16)     # ... into the K tile
            ptx.wgmma_m64k16(acc_s, ptx.smem_desc_advance(dq, step),
                             ptx.smem_desc_advance(dk, kstep), 0 if j == 0 else 1, block_n,
                             is_bf16, 0, 0)
        ptx.wgmma_commit()

    @_device
    def issue_pv(dv, p_frag, acc_o, acc_o2):
        """Issue O += P V of the stage's V tile ``dv`` as one wgmma group (the second O
        accumulator: V's columns from ``o_n`` on, ``o_n / 64`` panels further)."""
        for kk in range(p_steps):
            ptx.wgmma_m64k16_rs(acc_o, p_frag[4 * kk], p_frag[4 * kk + 1], p_frag[4 * kk + 2],
                                p_frag[4 * kk + 3], ptx.smem_desc_advance(dv, kk * 32 * PANEL),
                                1, o_n, is_bf16, 1)
            if o_parts == 2:
                dv2 = ptx.smem_desc_advance(dv, 2 * ((o_n // PANEL) * kv_panel + kk * 16 * PANEL))
                ptx.wgmma_m64k16_rs(acc_o2, p_frag[4 * kk], p_frag[4 * kk + 1],
                                    p_frag[4 * kk + 2], p_frag[4 * kk + 3], dv2, 1, o_n,
                                    is_bf16, 1)
        ptx.wgmma_commit()

    @_device
    def wait_o(acc_o, acc_o2):
        """Wait for every wgmma group (P V's last): O readable."""
        ptx.wgmma_wait(acc_o, o_regs, 0)
        if o_parts == 2:
            ptx.wgmma_wait(acc_o2, o_regs, 0)

    @_device
    def turn_begin(wg):
        """Ping-pong: wait for this group's turn to issue MMAs (the previous group's arrive,
        and this group's own 128 threads)."""
        if pingpong:
            ptx.named_barrier_sync(sched0 + wg, 256)

    @_device
    def turn_end(wg, last):
        """Ping-pong: hand the turn to the next group; the last group's last turn hands over
        nothing (its first was given by its initial arrive), so every barrier ends balanced."""
        if pingpong and not (last and wg == groups - 1):
            ptx.named_barrier_arrive(sched0 + (wg + 1) % groups, 256)

    @_device
    def softmax(acc_s, rows, warp_row0, g, t, col0, offset, seqlen_k, window_left,
                window_right, scale_log2):
        """Mask S (blocks crossing an edge only), then the online-softmax step on the state of
        the thread's two rows ``rows[MAX | SUM | SCALED | ALPHA, h]`` (maximum, this lane's
        part of the sum, the maximum times scale_log2, the factor O must be rescaled by): new
        maxima (quad reduction), sums rescaled and increased, S replaced by P (unnormalised)."""
        if not block_is_full(warp_row0, warp_row0 + 16, col0, col0 + block_n, offset,
                             seqlen_k, window_left, window_right):
            for h in range(2):
                first, last = row_key_range(warp_row0 + g + 8 * h, offset, seqlen_k,
                                            window_left, window_right)
                lane_col = col0 + 2 * t
                first_rel = np.int32(first - lane_col)
                last_rel = np.int32(last - lane_col)
                for nt in range(n_tiles):
                    for e in range(2):
                        j = np.int32(nt * 8 + e)
                        if j < first_rel or j > last_rel:
                            acc_s[4 * nt + 2 * h + e] = NEG_INF
        for h in range(2):
            new_max = rows[MAX, h]
            for nt in range(n_tiles):
                new_max = fmax(new_max, fmax(acc_s[4 * nt + 2 * h], acc_s[4 * nt + 2 * h + 1]))
            new_max = fmax(new_max, ptx.shfl_xor_f32(new_max, 1))
            new_max = fmax(new_max, ptx.shfl_xor_f32(new_max, 2))
            scaled = scaled_max(new_max, scale_log2)
            alpha = rescale_factor(rows[MAX, h], scaled, scale_log2)
            if lazy and not (rows[MAX, h] == NEG_INF
                             or scaled > rows[SCALED, h] + LAZY_RESCALE_LOG2):
                alpha = _ONE            # keep the old maximum (exactly 1: O is left alone)
            else:
                rows[SCALED, h] = scaled
                rows[MAX, h] = new_max
            rows[SUM, h] *= alpha
            rows[ALPHA, h] = alpha
        for i in range(s_regs):
            p = ptx.ex2_approx(cuda.fma(acc_s[i], scale_log2, -rows[SCALED, (i // 2) % 2]))
            acc_s[i] = p
            rows[SUM, (i // 2) % 2] += p

    @_device
    def rescale_o(acc_o, acc_o2, rows):
        """O *= the rows' factors (the last softmax step's); with ``lazy``, only in warps where
        a row's factor is not 1."""
        if lazy and not ptx.vote_any(rows[ALPHA, 0] != _ONE or rows[ALPHA, 1] != _ONE):
            return
        for i in range(o_regs):
            acc_o[i] *= rows[ALPHA, (i // 2) % 2]
        if o_parts == 2:
            for i in range(o_regs):
                acc_o2[i] *= rows[ALPHA, (i // 2) % 2]

    @_device
    def pack_p(acc_s, p_frag):
        """P packed to b16 pairs (the A fragments of P V)."""
        for i in range(p_regs):
            p_frag[i] = pack(acc_s[2 * i], acc_s[2 * i + 1])

    @_device
    def rescale_and_pack(acc_o, acc_o2, acc_s, p_frag, rows):
        """O *= the rows' factors; P packed to b16 pairs (the A fragments of P V)."""
        rescale_o(acc_o, acc_o2, rows)
        pack_p(acc_s, p_frag)

    @_device
    def stage_row(tiles, o_tile, acc_o, acc_o2, rows, lse, wg, warp, g, t, row0, q_start,
                  seqlen_q, batch, head, lse_sb, lse_sh, softmax_scale, h):
        """Row ``g + 8 h`` of the warp, normalised, into its row of the staging tile at
        ``o_tile`` (laid out as the Q tile); its lse."""
        total = rows[SUM, h]
        total += ptx.shfl_xor_f32(total, 1)
        total += ptx.shfl_xor_f32(total, 2)
        inv_sum, row_lse = finish_row(rows[MAX, h], total, softmax_scale)
        r = wg * 64 + warp * 16 + g + 8 * h
        for jb in range(o_regs // 4):
            base = o_tile + swizzled(r, 8 * jb + 2 * t, block_m)
            tiles[base] = from_f32(acc_o[4 * jb + 2 * h] * inv_sum)
            tiles[base + 1] = from_f32(acc_o[4 * jb + 2 * h + 1] * inv_sum)
        if o_parts == 2:
            for jb in range(o_regs // 4):
                base = o_tile + swizzled(r, o_n + 8 * jb + 2 * t, block_m)
                tiles[base] = from_f32(acc_o2[4 * jb + 2 * h] * inv_sum)
                tiles[base + 1] = from_f32(acc_o2[4 * jb + 2 * h + 1] * inv_sum)
        if t == 0 and row0 + r < seqlen_q:
            lse[batch * lse_sb + head * lse_sh + q_start + row0 + r] = row_lse

    @_device
    def finish(tiles, o_tile, acc_o, acc_o2, rows, out, lse, wg, warp, g, t, wtid, row0,
               q_start, seqlen_q, batch, head, o_sb, o_sn, o_sh, lse_sb, lse_sh, softmax_scale,
               barrier):
        """Normalise once, stage the warpgroup's rows in its own rows of the tile at ``o_tile``
        (the Q tile, 0, or a ring stage's K and V; no other warpgroup reads them), write
        16-byte chunks; ``barrier``: the warpgroup's named barrier."""
        ptx.fence_proxy_async()   # wgmma's reads of the tile (async proxy) before these writes
        if o_parts == 2:
            # each of the thread's two rows by a call of its own: with ``h`` a constant every
            # accumulator index is one (at d256 a loop over h stays rolled, leaving O in local
            # memory; up to d128 it is unrolled, and kept for the same code as before)
            stage_row(tiles, o_tile, acc_o, acc_o2, rows, lse, wg, warp, g, t, row0, q_start,
                      seqlen_q, batch, head, lse_sb, lse_sh, softmax_scale, 0)
            stage_row(tiles, o_tile, acc_o, acc_o2, rows, lse, wg, warp, g, t, row0, q_start,
                      seqlen_q, batch, head, lse_sb, lse_sh, softmax_scale, 1)
        else:
            for h in range(2):
                stage_row(tiles, o_tile, acc_o, acc_o2, rows, lse, wg, warp, g, t, row0,
                          q_start, seqlen_q, batch, head, lse_sb, lse_sh, softmax_scale, h)
        ptx.named_barrier_sync(barrier, 128)   # the warpgroup's rows are staged
        o_base = batch * o_sb + (q_start + row0) * o_sn + head * o_sh
        for c in range(out_chunks):
            i = wtid + 128 * c
            r = wg * 64 + i // chunks_per_row
            col = (i % chunks_per_row) * 8
            if row0 + r < seqlen_q and col < head_dim:
                w0, w1, w2, w3 = ptx.load_u32x4(tiles, o_tile + swizzled(r, col, block_m))
                ptx.store_u32x4(out, o_base + r * o_sn + col, w0, w1, w2, w3)

    def ring_kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, seqlen_q_arg,
                    seqlen_k_arg, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, o_sb,
                    o_sn, o_sh, lse_sb, lse_sh, bt_sb, bt_ss, group, softmax_scale, scale_log2,
                    window_left, window_right, num_pages, bs_shift, k_map, v_map):
        """Every thread copies and computes: ``stages - 1`` key blocks are loaded ahead by
        cp.async into the ring, and a block barrier per key block hands a stage from the
        copies to the MMAs and back. Each warpgroup runs S, softmax and P V of a block in
        turn."""
        min_blocks  # noqa: B018  (cache key only, see the factory)
        tiles = _tiles(cuda.shared.array(0, np.uint16))
        tid = np.int32(cuda.threadIdx.x)
        wg = tid // 128
        warp = (tid % 128) // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x   # longest causal rows first
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        q_start, seqlen_q, k_start, seqlen_k = _sequence(
            cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg, is_varlen)
        row0 = m_block * block_m
        if row0 >= seqlen_q:
            return
        offset = seqlen_k - seqlen_q
        head_k = head // group
        warp_row0 = row0 + wg * 64 + warp * 16     # this warp's 16 query rows

        acc_s = cuda.local.array(s_regs, np.float32)
        acc_o = cuda.local.array(o_regs, np.float32)
        acc_o2 = cuda.local.array(o_regs if o_parts == 2 else 1, np.float32)
        p_frag = cuda.local.array(p_regs, np.uint32)
        rows = cuda.local.array((4, 2), np.float32)
        init_state(acc_o, acc_o2, rows)

        q_base = batch * q_sb + (q_start + row0) * q_sn + head * q_sh
        load_q(tiles, 0, q, q_base, q_sn, seqlen_q - row0, head_dim, tid)
        ptx.cp_async_commit()
        k_base = batch * k_sb + k_start * k_sn + head_k * k_sh
        v_base = batch * v_sb + k_start * v_sn + head_k * v_sh

        lo, hi = key_bounds(row0, min(row0 + block_m, seqlen_q), offset, seqlen_k,
                            window_left, window_right)
        n_end = (hi + block_n - 1) // block_n
        n_blocks = n_end - lo // block_n if hi > lo else 0
        for s in range(lead):
            if s < n_blocks:
                load_kv(tiles, s, k, v, k_base, v_base, k_sn, v_sn, (n_end - 1 - s) * block_n,
                        seqlen_k, tid)
            ptx.cp_async_commit()

        dq = ptx.smem_desc(tiles, wg * 64 * PANEL, 16, 1024, 1)   # this warpgroup's rows of Q
        stage = 0
        for it in range(n_blocks):
            col0 = (n_end - 1 - it) * block_n
            ptx.cp_async_wait(pending)       # this thread's copies of the block landed
            ptx.fence_proxy_async()          # ... visible to wgmma's async proxy
            cuda.syncthreads()               # everyone's; every warpgroup is done with it - 1
            nxt = it + lead
            if nxt < n_blocks:
                load_kv(tiles, (stage + lead) % stages, k, v, k_base, v_base, k_sn, v_sn,
                        (n_end - 1 - nxt) * block_n, seqlen_k, tid)
            ptx.cp_async_commit()
            dk, dv = stage_descs(tiles, stage)
            ptx.wgmma_fence()
            issue_s(dq, dk, acc_s)
            ptx.wgmma_wait(acc_s, s_regs, 0)
            softmax(acc_s, rows, warp_row0, g, t, col0, offset, seqlen_k, window_left,
                    window_right, scale_log2)
            rescale_and_pack(acc_o, acc_o2, acc_s, p_frag, rows)
            ptx.wgmma_fence()
            issue_pv(dv, p_frag, acc_o, acc_o2)
            wait_o(acc_o, acc_o2)
            stage = stage + 1 if stage < stages - 1 else 0

        ptx.cp_async_wait(0)
        if is_varlen:                # read again rather than kept in registers over the loop
            q_start, seqlen_q = clamped_range(cu_seqlens_q, batch, seqlen_q_arg)
        finish(tiles, 0, acc_o, acc_o2, rows, out, lse, wg, warp, g, t, tid % 128, row0,
               q_start, seqlen_q, batch, head, o_sb, o_sn, o_sh, lse_sb, lse_sh,
               softmax_scale, 1 + wg)

    def producer_kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
                        seqlen_q_arg, seqlen_k_arg, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb,
                        v_sn, v_sh, o_sb, o_sn, o_sh, lse_sb, lse_sh, bt_sb, bt_ss, group,
                        softmax_scale, scale_log2, window_left, window_right, num_pages,
                        bs_shift, k_map, v_map):
        """Warp-specialised: warpgroup 0 copies K / V blocks (cp.async, or TMA with ``tma``)
        into the ring and hands each stage over through mbarriers; the consumer warpgroups only
        compute, each at its own pace: S = Q K^T of block j + 1 is issued, O rescaled under it,
        then block j's P V, and the softmax of j + 1 follows S's wait. ptxas moves the P V wait
        to the top of the softmax's basic block, so the softmax waits for P V; with
        ``overlap`` a never-taken branch ends that block after the softmax, which then runs
        under the P V (FlashAttention 3's order; offline SASS: the exponentials between the two
        waits, same registers). A branch with 8 stores in it ran 13% slower (NOTES, session
        28); this one holds a return only."""
        min_blocks  # noqa: B018  (cache key only, see the factory)
        tiles = _tiles(cuda.shared.array(0, np.uint16))
        bars = cuda.shared.array(n_bars, np.uint64)   # full[s] = bars[s], empty: + stages
        tid = np.int32(cuda.threadIdx.x)
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x   # longest causal rows first
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        q_start, seqlen_q, k_start, seqlen_k = _sequence(
            cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg, is_varlen)
        row0 = m_block * block_m
        if row0 >= seqlen_q:
            return
        init_stage_barriers(bars, stages, 128, consumer_threads, tid)
        offset = seqlen_k - seqlen_q
        head_k = head // group
        lo, hi = key_bounds(row0, min(row0 + block_m, seqlen_q), offset, seqlen_k,
                            window_left, window_right)
        n_end = (hi + block_n - 1) // block_n
        n_blocks = n_end - lo // block_n if hi > lo else 0

        if tid < 128:
            # producer: block b goes to stage b % stages once the consumers released it; with 3+
            # stages its copies are announced (wait, proxy fence, release-arrive) after the
            # next block's are issued, so two blocks are in flight. Not with 2: the consumers
            # hold block j until they have block j + 1, so announcing j + 1 must not wait for
            # a stage that only j's release frees (a deadlock).
            ptx.setmaxnreg_dec(producer_regs)
            if tma:
                tma_producer(tiles, bars, k_map, v_map, batch, k_start, head_k, k_sb, k_sn,
                             k_sh, v_sb, v_sn, v_sh, n_end, n_blocks, tid)
                return
            k_base = batch * k_sb + k_start * k_sn + head_k * k_sh
            v_base = batch * v_sb + k_start * v_sn + head_k * v_sh
            for b in range(n_blocks):
                s = b % stages
                ptx.mbarrier_wait_parity(bars, stages + s, ((b // stages) & 1) ^ 1)
                load_kv(tiles, s, k, v, k_base, v_base, k_sn, v_sn, (n_end - 1 - b) * block_n,
                        seqlen_k, tid)
                ptx.cp_async_commit()
                if not two_in_flight:
                    ptx.cp_async_wait(0)
                    ptx.fence_proxy_async()
                    ptx.mbarrier_arrive(bars, s)
                elif b > 0:
                    ptx.cp_async_wait(1)
                    ptx.fence_proxy_async()
                    ptx.mbarrier_arrive(bars, (b - 1) % stages)
            if two_in_flight and n_blocks > 0:
                ptx.cp_async_wait(0)
                ptx.fence_proxy_async()
                ptx.mbarrier_arrive(bars, (n_blocks - 1) % stages)
            return

        ptx.setmaxnreg_inc(consumer_regs)
        ctid = tid - 128
        # lane 0's value: ptxas then knows it is warp-uniform and keeps the descriptors built
        # from it in uniform registers (offline sm_90a: no R2UR a wgmma)
        wg = ptx.shfl_idx_i32(ctid // 128, 0)
        warp = (ctid % 128) // 32
        lane = ctid % 32
        g = lane // 4
        t = lane % 4
        warp_row0 = row0 + wg * 64 + warp * 16     # this warp's 16 query rows
        acc_s = cuda.local.array(s_regs, np.float32)
        acc_o = cuda.local.array(o_regs, np.float32)
        acc_o2 = cuda.local.array(o_regs if o_parts == 2 else 1, np.float32)
        p_frag = cuda.local.array(p_regs, np.uint32)
        rows = cuda.local.array((4, 2), np.float32)
        init_state(acc_o, acc_o2, rows)

        q_base = batch * q_sb + (q_start + row0) * q_sn + head * q_sh
        load_q(tiles, 0, q, q_base, q_sn, seqlen_q - row0, head_dim, ctid)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        ptx.fence_proxy_async()
        ptx.named_barrier_sync(1, consumer_threads)    # the whole Q tile landed
        dq = ptx.smem_desc(tiles, wg * 64 * PANEL, 16, 1024, 1)   # this warpgroup's rows of Q

        if n_blocks > 0:
            if pingpong and wg == groups - 1:
                ptx.named_barrier_arrive(sched0, 256)   # group 0 goes first
            ptx.mbarrier_wait_parity(bars, 0, 0)
            if tma and n_end * block_n > seqlen_k:
                zero_v_tail(tiles, 0, seqlen_k - (n_end - 1) * block_n, ctid)
            dk, dv = stage_descs(tiles, 0)
            turn_begin(wg)
            ptx.wgmma_fence()
            issue_s(dq, dk, acc_s)
            turn_end(wg, False)
            ptx.wgmma_wait(acc_s, s_regs, 0)
            softmax(acc_s, rows, warp_row0, g, t, (n_end - 1) * block_n, offset, seqlen_k,
                    window_left, window_right, scale_log2)
            rescale_and_pack(acc_o, acc_o2, acc_s, p_frag, rows)
        # block j (in stage s): S of j + 1 (in stage s_next) and P V of j in flight together,
        # then the softmax of j + 1
        s = np.int32(0)
        phase = np.int32(0)                    # parity of the ring's current pass
        for j in range(n_blocks - 1):
            s_next = s + 1 if s < stages - 1 else 0
            if s_next == 0:
                phase ^= 1
            ptx.mbarrier_wait_parity(bars, s_next, phase)
            dk_next, dv_next = stage_descs(tiles, s_next)
            turn_begin(wg)
            ptx.wgmma_fence()
            issue_s(dq, dk_next, acc_s)
            rescale_o(acc_o, acc_o2, rows)         # under S's MMAs (FlashAttention 3's order)
            ptx.wgmma_fence()
            issue_pv(dv, p_frag, acc_o, acc_o2)
            turn_end(wg, False)
            ptx.wgmma_wait(acc_s, s_regs, 1)       # S of j + 1 is done, P V of j may run
            softmax(acc_s, rows, warp_row0, g, t, (n_end - 2 - j) * block_n, offset, seqlen_k,
                    window_left, window_right, scale_log2)
            if overlap and seqlen_k < 0:
                return   # never: a block with keys to visit has seqlen_k > 0 (see docstring)
            wait_o(acc_o, acc_o2)
            ptx.mbarrier_arrive(bars, stages + s)  # K and V of block j are no longer read
            pack_p(acc_s, p_frag)
            s = s_next
            dv = dv_next
        if n_blocks > 0:
            turn_begin(wg)
            rescale_o(acc_o, acc_o2, rows)
            ptx.wgmma_fence()
            issue_pv(dv, p_frag, acc_o, acc_o2)
            turn_end(wg, True)
            wait_o(acc_o, acc_o2)
            ptx.mbarrier_arrive(bars, stages + s)

        if is_varlen:                # read again rather than kept in registers over the loop
            q_start, seqlen_q = clamped_range(cu_seqlens_q, batch, seqlen_q_arg)
        finish(tiles, 0, acc_o, acc_o2, rows, out, lse, wg, warp, g, t, ctid % 128, row0,
               q_start, seqlen_q, batch, head, o_sb, o_sn, o_sh, lse_sb, lse_sh,
               softmax_scale, 2 + wg)

    # ---- the persistent form ----------------------------------------------------------------
    # barriers past the ring's: Q's full / empty, then the tile hand-over's full / empty pairs
    q_full = 2 * stages
    q_empty = q_full + 1
    tile_full = q_full + 2       # + slot (two slots)
    tile_empty = q_full + 4      # + slot
    n_persistent_bars = q_full + 6
    q_bytes = block_m * dim * 2
    # O staged in the last key block's stage when its K and V tiles hold it (else stored from
    # registers): Q's buffer is the next tile's by then
    stage_out = 2 * block_n >= block_m

    @_device
    def tile_work(tile, m_blocks, nheads, cu_seqlens_q, cu_seqlens_k, seqlen_q_arg,
                  seqlen_k_arg, window_left, window_right):
        """Tile ``tile``'s ``(batch, head, row0, q_start, seqlen_q, k_start, seqlen_k, n_end,
        n_blocks)``. Tiles go head by head, each head's query blocks longest-first, so tiles
        drawn together share their K and V in L2 and a causal head's long tiles start first;
        ``row0 >= seqlen_q``: a tile past its sequence's rows, with nothing to do."""
        m_block = m_blocks - 1 - tile % m_blocks
        rest = tile // m_blocks
        batch = rest // nheads
        head = rest % nheads
        q_start, seqlen_q, k_start, seqlen_k = _sequence(
            cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg, is_varlen)
        row0 = m_block * block_m
        lo, hi = key_bounds(row0, min(row0 + block_m, seqlen_q), seqlen_k - seqlen_q, seqlen_k,
                            window_left, window_right)
        n_end = (hi + block_n - 1) // block_n
        n_blocks = n_end - lo // block_n if hi > lo else 0
        return batch, head, row0, q_start, seqlen_q, k_start, seqlen_k, n_end, n_blocks

    @_device
    def persistent_producer(tiles, bars, slots, counter, q_map, k_map, v_map, cu_seqlens_q,
                            cu_seqlens_k, seqlen_q_arg, seqlen_k_arg, q_sb, q_sn, q_sh, k_sb,
                            k_sn, k_sh, v_sb, v_sn, v_sh, group, window_left, window_right,
                            m_blocks, nheads, n_tiles):
        """One thread: draws tiles from ``counter[0]`` (an atomic add: whoever is free first
        takes the next tile) and hands each to the consumers through two slots, then loads the
        tile's Q (once the consumers have released the last one) and its key blocks into the
        ring, whose stage and phase run on across tiles, so the next tile's loads overlap this
        one's last blocks and its output. After the first tile past the end, the block's ticket
        on ``counter[1]``; the last block's sets both back to 0 for the next launch."""
        s = np.int32(0)
        phase = np.int32(1)          # the ring's first pass waits on already completed phases
        loaded = np.int32(0)         # Q tiles loaded
        drawn = np.int32(0)
        while True:
            tile = cuda.atomic.add(counter, 0, 1)
            slot = drawn % 2
            ptx.mbarrier_wait_parity(bars, tile_empty + slot, ((drawn // 2) & 1) ^ 1)
            slots[slot] = tile
            ptx.mbarrier_arrive(bars, tile_full + slot)
            drawn += 1
            if tile >= n_tiles:
                break
            batch, head, row0, q_start, seqlen_q, k_start, seqlen_k, n_end, n_blocks = \
                tile_work(tile, m_blocks, nheads, cu_seqlens_q, cu_seqlens_k, seqlen_q_arg,
                          seqlen_k_arg, window_left, window_right)
            if row0 >= seqlen_q:
                continue
            ptx.mbarrier_wait_parity(bars, q_empty, (loaded & 1) ^ 1)
            ptx.mbarrier_arrive_expect_tx(bars, q_full, q_bytes)
            q_row = np.int32(batch * (q_sb // q_sn) + q_start + row0)
            for p in range(dim // PANEL):
                ptx.cp_async_bulk_tensor_2d_g2s(tiles, p * q_panel, q_map,
                                                np.int32(head * q_sh + p * PANEL), q_row, bars,
                                                q_full)
            loaded += 1
            head_k = head // group
            k_row0 = np.int32(batch * (k_sb // k_sn) + k_start)
            v_row0 = np.int32(batch * (v_sb // v_sn) + k_start)
            k_col0 = np.int32(head_k * k_sh)
            v_col0 = np.int32(head_k * v_sh)
            for b in range(n_blocks):
                ptx.mbarrier_wait_parity(bars, stages + s, phase)
                col = np.int32((n_end - 1 - b) * block_n)
                tma_boxes(tiles, bars, k_map, v_map, s, k_col0, v_col0, k_row0 + col,
                          v_row0 + col)
                s += 1
                if s == stages:
                    s = 0
                    phase ^= 1
        cuda.threadfence()   # release: this block's draws on counter[0] before its ticket
        if draw_ticket(counter, 1, np.int32(cuda.gridDim.x - 1)):
            cuda.threadfence()   # acquire: every block's draws before the reset
            counter[0] = 0

    @_device
    def store_row(acc_o, rows, out, lse, wg, warp, g, t, row0, q_start, seqlen_q, batch, head,
                  o_sb, o_sn, o_sh, lse_sb, lse_sh, softmax_scale, h):
        """Row ``g + 8 h`` of the warp normalised and written straight from registers (two b16
        a store), and its lse: the persistent kernel's output where no ring stage holds O's
        staging tile (``stage_out``)."""
        total = rows[SUM, h]
        total += ptx.shfl_xor_f32(total, 1)
        total += ptx.shfl_xor_f32(total, 2)
        inv_sum, row_lse = finish_row(rows[MAX, h], total, softmax_scale)
        r = wg * 64 + warp * 16 + g + 8 * h
        if row0 + r < seqlen_q:
            base = batch * o_sb + (q_start + row0 + r) * o_sn + head * o_sh + 2 * t
            for jb in range(o_regs // 4):
                out[base + 8 * jb] = from_f32(acc_o[4 * jb + 2 * h] * inv_sum)
                out[base + 8 * jb + 1] = from_f32(acc_o[4 * jb + 2 * h + 1] * inv_sum)
            if t == 0:
                lse[batch * lse_sb + head * lse_sh + q_start + row0 + r] = row_lse

    @_device
    def store_empty_rows(out, lse, wg, warp, g, t, row0, q_start, seqlen_q, batch, head, o_sb,
                         o_sn, o_sh, lse_sb, lse_sh):
        """The thread's rows of a tile that attends no key: O 0 and lse -inf (``finish_row``'s
        values), without reading the accumulators (a second path reading them made the
        persistent kernel spill, offline sm_90a)."""
        zero = from_f32(np.float32(0.0))
        for h in range(2):
            r = wg * 64 + warp * 16 + g + 8 * h
            if row0 + r < seqlen_q:
                base = batch * o_sb + (q_start + row0 + r) * o_sn + head * o_sh + 2 * t
                for jb in range(o_regs // 4):
                    out[base + 8 * jb] = zero
                    out[base + 8 * jb + 1] = zero
                if t == 0:
                    lse[batch * lse_sb + head * lse_sh + q_start + row0 + r] = NEG_INF

    def persistent_kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
                          seqlen_q_arg, seqlen_k_arg, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb,
                          v_sn, v_sh, o_sb, o_sn, o_sh, lse_sb, lse_sh, bt_sb, bt_ss, group,
                          softmax_scale, scale_log2, window_left, window_right, num_pages,
                          bs_shift, k_map, v_map, q_map, counter, m_blocks, nheads, batches):
        """Persistent and warp-specialised: a block per SM slot works through tiles (``BLOCK_M``
        query rows of one head) drawn by its producer thread (``persistent_producer``); the
        consumers take each tile's number from the hand-over slots and compute it as
        ``producer_kernel`` does, releasing Q after its last S, then write O staged through the
        last key block's stage (or from registers, ``store_row``) and go on to the next tile,
        whose Q and first key blocks are already on their way."""
        min_blocks  # noqa: B018  (cache key only, see the factory)
        tiles = _tiles(cuda.shared.array(0, np.uint16))
        bars = cuda.shared.array(n_persistent_bars, np.uint64)
        slots = cuda.shared.array(2, np.int32)
        tid = np.int32(cuda.threadIdx.x)
        n_tiles = m_blocks * nheads * batches
        if tid == 0:
            for st in range(stages):
                ptx.mbarrier_init(bars, st, 1)
                ptx.mbarrier_init(bars, stages + st, consumer_threads)
            ptx.mbarrier_init(bars, q_full, 1)
            ptx.mbarrier_init(bars, q_empty, consumer_threads)
            for slot in range(2):
                ptx.mbarrier_init(bars, tile_full + slot, 1)
                ptx.mbarrier_init(bars, tile_empty + slot, consumer_threads)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        if tid < 128:
            ptx.setmaxnreg_dec(producer_regs)
            if tid == 0:
                persistent_producer(tiles, bars, slots, counter, q_map, k_map, v_map,
                                    cu_seqlens_q, cu_seqlens_k, seqlen_q_arg, seqlen_k_arg, q_sb,
                                    q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, group,
                                    window_left, window_right, m_blocks, nheads, n_tiles)
            return

        ptx.setmaxnreg_inc(consumer_regs)
        ctid = tid - 128
        wg = ptx.shfl_idx_i32(ctid // 128, 0)   # warp-uniform, as in ``producer_kernel``
        warp = (ctid % 128) // 32
        lane = ctid % 32
        g = lane // 4
        t = lane % 4
        acc_s = cuda.local.array(s_regs, np.float32)
        acc_o = cuda.local.array(o_regs, np.float32)
        acc_o2 = cuda.local.array(o_regs if o_parts == 2 else 1, np.float32)
        p_frag = cuda.local.array(p_regs, np.uint32)
        rows = cuda.local.array((4, 2), np.float32)
        dq = ptx.smem_desc(tiles, wg * 64 * PANEL, 16, 1024, 1)   # this warpgroup's rows of Q
        s = np.int32(0)
        phase = np.int32(0)          # parity of the ring's current pass
        loaded = np.int32(0)         # Q tiles used
        taken = np.int32(0)          # tiles taken from the slots
        while True:
            slot = taken % 2
            ptx.mbarrier_wait_parity(bars, tile_full + slot, (taken // 2) & 1)
            tile = slots[slot]
            ptx.mbarrier_arrive(bars, tile_empty + slot)
            taken += 1
            if tile >= n_tiles:
                break
            batch, head, row0, q_start, seqlen_q, k_start, seqlen_k, n_end, n_blocks = \
                tile_work(tile, m_blocks, nheads, cu_seqlens_q, cu_seqlens_k, seqlen_q_arg,
                          seqlen_k_arg, window_left, window_right)
            if row0 >= seqlen_q:
                continue
            offset = seqlen_k - seqlen_q
            warp_row0 = row0 + wg * 64 + warp * 16     # this warp's 16 query rows
            init_state(acc_o, acc_o2, rows)
            ptx.mbarrier_wait_parity(bars, q_full, loaded & 1)
            loaded += 1
            if n_blocks > 0:
                ptx.mbarrier_wait_parity(bars, s, phase)
                if n_end * block_n > seqlen_k:
                    zero_v_tail(tiles, s, seqlen_k - (n_end - 1) * block_n, ctid)
                dk, dv = stage_descs(tiles, s)
                ptx.wgmma_fence()
                issue_s(dq, dk, acc_s)
                ptx.wgmma_wait(acc_s, s_regs, 0)
                if n_blocks == 1:
                    ptx.mbarrier_arrive(bars, q_empty)     # Q read for the last time
                softmax(acc_s, rows, warp_row0, g, t, (n_end - 1) * block_n, offset, seqlen_k,
                        window_left, window_right, scale_log2)
                rescale_and_pack(acc_o, acc_o2, acc_s, p_frag, rows)
            else:
                ptx.mbarrier_arrive(bars, q_empty)
            for j in range(n_blocks - 1):
                s_next = s + 1 if s < stages - 1 else 0
                if s_next == 0:
                    phase ^= 1
                ptx.mbarrier_wait_parity(bars, s_next, phase)
                dk_next, dv_next = stage_descs(tiles, s_next)
                ptx.wgmma_fence()
                issue_s(dq, dk_next, acc_s)
                rescale_o(acc_o, acc_o2, rows)
                ptx.wgmma_fence()
                issue_pv(dv, p_frag, acc_o, acc_o2)
                ptx.wgmma_wait(acc_s, s_regs, 1)       # S of j + 1 is done, P V of j may run
                if j == n_blocks - 2:
                    ptx.mbarrier_arrive(bars, q_empty)  # that S was Q's last use
                softmax(acc_s, rows, warp_row0, g, t, (n_end - 2 - j) * block_n, offset,
                        seqlen_k, window_left, window_right, scale_log2)
                if overlap and seqlen_k < 0:
                    return   # never (see ``producer_kernel``)
                wait_o(acc_o, acc_o2)
                ptx.mbarrier_arrive(bars, stages + s)  # K and V of block j are no longer read
                pack_p(acc_s, p_frag)
                s = s_next
                dv = dv_next
            if n_blocks > 0:
                rescale_o(acc_o, acc_o2, rows)
                ptx.wgmma_fence()
                issue_pv(dv, p_frag, acc_o, acc_o2)
                wait_o(acc_o, acc_o2)
                if stage_out:
                    # O staged in the last block's K and V (still held: the producer may not
                    # refill them yet), stored by 16-byte chunks, then the stage released. The
                    # thread's place comes through a shuffle (an identity, but opaque): LLVM
                    # then cannot hoist the staging offsets out of the tile loop, where holding
                    # them spilled ~280 B (offline sm_90a)
                    me = ptx.shfl_idx_i32(ctid, lane)
                    # every consumer warp's P V has read the stage's V (a warp's wgmma wait
                    # says nothing of the other warps' parts) before any warp writes over it
                    ptx.named_barrier_sync(1, consumer_threads)
                    finish(tiles, s_kv + s * 2 * kv_elems, acc_o, acc_o2, rows, out, lse, wg,
                           (me % 128) // 32, (me % 32) // 4, me % 4, me % 128, row0, q_start,
                           seqlen_q, batch, head, o_sb, o_sn, o_sh, lse_sb, lse_sh,
                           softmax_scale, 2 + wg)
                    ptx.fence_proxy_async()   # these reads and writes before the next TMA's
                ptx.mbarrier_arrive(bars, stages + s)
                s = s + 1 if s < stages - 1 else 0    # the next tile's first stage
                if s == 0:
                    phase ^= 1
            if not stage_out:
                for h in range(2):
                    store_row(acc_o, rows, out, lse, wg, warp, g, t, row0, q_start, seqlen_q,
                              batch, head, o_sb, o_sn, o_sh, lse_sb, lse_sh, softmax_scale, h)
            elif n_blocks == 0:
                store_empty_rows(out, lse, wg, warp, g, t, row0, q_start, seqlen_q, batch, head,
                                 o_sb, o_sn, o_sh, lse_sb, lse_sh)

    if persistent:
        kernel = persistent_kernel
    else:
        kernel = producer_kernel if producer else ring_kernel
    kernel.__name__ = "flash_attn_wgmma_kernel"
    return kernel


@_device
def _sequence(cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg, is_varlen):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of sequence ``batch`` (varlen: the packed
    totals in ``seqlen_q_arg`` / ``seqlen_k_arg`` bound the offsets)."""
    if is_varlen:
        return varlen_sequence(cu_seqlens_q, cu_seqlens_k, batch, seqlen_q_arg, seqlen_k_arg)
    return 0, seqlen_q_arg, 0, seqlen_k_arg


@_device
def _tiles(smem):
    """The dynamic shared buffer from its first 1024-byte-aligned element on (the 128-byte
    swizzle follows address bits 7-9)."""
    pad = ((_ALIGN_BYTES - (ptx.shared_address(smem, 0) & (_ALIGN_BYTES - 1)))
           & (_ALIGN_BYTES - 1)) >> 1
    return smem[pad:]


def launch_options(groups, min_blocks, producer):
    """``cuda.jit`` options: launch bounds (both bounds: setmaxnreg needs them)."""
    if not min_blocks:
        return {}
    return {"launch_bounds": (threads_for(groups, producer), min_blocks)}


@functools.lru_cache(maxsize=None)
def wgmma_kernel(signature, head_dim, dim, groups, block_n, stages, min_blocks, producer,
                 pingpong, is_bf16, is_varlen, tma=False, lazy=False, overlap=False,
                 persistent=False):
    """The wgmma kernel for one configuration; ``min_blocks`` 0 leaves registers to ptxas."""
    return Kernel(jit(_wgmma_kernel_fn(head_dim, dim, groups, block_n, stages, is_bf16,
                                       is_varlen, min_blocks, producer, pingpong, tma, lazy,
                                       overlap, persistent),
                      **launch_options(groups, min_blocks, producer)),
                  signature, "flash_attn_wgmma_kernel")
