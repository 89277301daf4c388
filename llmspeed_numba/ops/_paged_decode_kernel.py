"""The paged-decode attention kernel (``paged_decode.py`` is the op: its math, layout, checks).

One block per (batch, kv head, split, row tile), ``warps`` warps:

- Rows. The ``group * q_len`` query rows that share a KV head are the M rows of one m16n8k16
  ``mma`` tile (8 rows when they fit, else 16), so every K/V page is read once, and a GQA group
  costs no more memory traffic than one head. More than 16 rows (e.g. group 8 x q_len 4) take
  several row tiles, each of which reads the pages again (mostly from L2: they run together).
- Keys. The block's key range (its split of the sequence, clipped to the causal window) is cut
  into 16-key tiles; warp ``w`` takes tiles ``w, w + warps, ...`` and streams them through its own
  ``stages``-deep ring of shared-memory buffers with 16-byte ``cp.async`` (L2 only, with an L2
  prefetch-size hint), so ``stages - 1`` tiles (8 KB each at headdim 128) per warp are in flight
  while it computes. At headdim 64 and 128 the ring's rows are unpadded and XOR-swizzled (see
  ``SWIZZLE_DIMS``), so that every 128-byte line of K/V is asked of the L2 once. Page ids are
  read 32 tiles at a time, one per lane, a batch ahead, and handed out by a warp shuffle, so no
  dependent page-table load stands between a tile's copies and the next tile's.
- Prologue (paid again at each wave of blocks): ``seq_len`` is loaded first; the query fragments
  (all at once, before any is used; the shared-memory Q tile of D 256, 16 loads a thread at a
  time) and, without splits or a window, the first page ids are loaded beside it. Index
  arithmetic divides in 32 bits (``_udiv``).
- Math (per tile, FlashAttention-2 style): ``S = Q K^T`` with K read by ``ldmatrix.x4`` (K rows are
  columns of K^T); masking only on tiles that cross a window edge or the sequence end; online
  softmax in registers, in log2 units (``_attention_common.softmax_step``: running max and sum
  per row, two ``shfl.bfly`` per row); ``O += P V`` with P's C fragments reused as A fragments
  and V read by ``ldmatrix.x4.trans``.
- End. The warps' partial (max, sum, O) are merged through shared memory. With one split the
  block writes ``out`` (and ``lse``) directly; with several, each block writes its normalised fp32
  partial output and log2-sum-exp to a workspace, then fences them and draws a ticket
  (``atomicAdd`` on its (batch, KV head, row tile) counter); the block drawing the last ticket
  merges all the splits' partials (a lane per 16 bytes of a row and group of splits,
  ``MERGE_UNROLL`` loads in flight, a shuffle butterfly across the groups), writes ``out`` /
  ``lse`` and sets the counter back to 0, so the workspace is zeroed only when made and a CUDA
  graph replays the kernel as it is.

Compile-time configuration (closure constants of ``_decode_kernel``): ``(head_dim, m16, page8,
is_bf16, warps, stages, q_smem, l2_prefetch)``; ``_paged_decode_plan.launch_plan`` chooses it.
The measurements behind the constants below are in benchmarks/NOTES.md ("Paged decode").
"""

import functools
import math

import numpy as np
from numba import types

from .. import ptx
from .._env import cuda
from .._launch import Kernel, array1d, jit
from ._attention_common import NEG_INF, merge_state, row_lse2, softmax_step

#: Keys per tile: the n of two m16n8k16 score tiles and the k of one P V step.
TILE = 16

#: L2 prefetch-size hint of the K/V copies (bytes, ``ptx.cp_async_16_l2``; 0: none). 128 was
#: faster than none in every comparison on the H200; 256 was erratic.
L2_PREFETCH = 128

#: Head dimensions from which Q's A fragments are read from shared memory (``ldmatrix``) for every
#: tile instead of being kept in registers: at 256 the registers would spill.
Q_IN_SHARED_FROM = 256

#: Splits a lane of the folded merge loads before using any (16 bytes of partial output each).
MERGE_UNROLL = 8

LN2 = math.log(2.0)

#: Head dimensions whose K/V rings' rows are unpadded and swizzled (16-byte chunk ``c`` of row
#: ``r`` stored at chunk ``c ^ (r % 8)``): each 128-byte line of a key row lands in one 128-byte
#: line of shared memory, so a warp's cp.async asks the L2 for whole lines once. With the
#: 16-byte pad the lines straddle shared-memory lines and the L2 serves 1.5x the sectors, its
#: throughput the limit. Rows under 128 bytes (D < 64) have no whole line to keep; at D 256 the
#: 16 copy rounds' swizzled offsets, hoisted out of the tile loop, push the 2-warp kernel past
#: 255 registers (spills), so it keeps the pad.
SWIZZLE_DIMS = (64, 128)


def _pitch(head_dim):
    """Row length (elements) of the Q tile and, outside ``SWIZZLE_DIMS``, of the K/V rings: the
    16-byte pad spreads the 8 rows one ldmatrix phase reads over 8 bank groups."""
    return head_dim + 8


def _ring_pitch(head_dim):
    """Row length (elements) of the K/V rings: unpadded when swizzled."""
    return head_dim if head_dim in SWIZZLE_DIMS else _pitch(head_dim)


def shared_bytes(head_dim, warps, stages, q_smem):
    """Dynamic shared memory of a block: the warps' K/V rings (and the Q tile)."""
    q_tile = 16 * _pitch(head_dim) if q_smem else 0
    return (warps * stages * 2 * TILE * _ring_pitch(head_dim) + q_tile) * 2


# ---- device helpers -------------------------------------------------------------------------

_device = cuda.jit(device=True, inline="always")


@_device
def _udiv(n, d):
    """``n // d`` for ``0 <= n < 2**32`` and ``0 < d < 2**32``, as a 32-bit unsigned division
    (``div.u32``: a short inline sequence). Numba types ``int // int`` as a 64-bit signed
    division, a subroutine call (``__cuda_sm20_div_s64``), and a dozen of them, chained,
    lengthen the prologue and the end merge measurably."""
    return np.int64(np.uint32(n) // np.uint32(d))


# ---- kernels ------------------------------------------------------------------------------

def _decode_kernel_fn(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch):
    """The decode kernel for one compile-time configuration.

    ``m16``: 16 query rows a tile (else 8, and the mma's rows 8..15 are zero); ``page8``: block
    size 8, so a 16-key tile spans two pages; ``q_smem``: Q's A fragments are re-read from a
    shared-memory Q tile for every key tile instead of living in registers; ``l2_prefetch``:
    the cp.async L2 prefetch-size hint in bytes (0: none)."""
    if stages < 2:
        # the warps' partial O and (max, sum) of the end merge reuse each warp's ring; one
        # stage of unpadded rows is too small for them
        raise ValueError(f"stages: expected at least 2, got {stages}")
    D = head_dim
    KSTEPS = D // 16           # k16 steps of Q K^T; also pairs of n8 tiles of P V
    NT = D // 8                # n8 tiles of O
    CPR = D // 8               # 16-byte chunks a row
    TPJ = 32 // CPR            # rows one warp-wide round of cp.async covers
    ROUNDS = TILE // TPJ       # rounds a tile (K and V each)
    PITCH = _pitch(D)          # Q tile
    RING_PITCH = _ring_pitch(D)
    SWIZZLE = D in SWIZZLE_DIMS
    TILE_ELEMS = TILE * RING_PITCH
    STAGE_ELEMS = 2 * TILE_ELEMS
    WARP_ELEMS = stages * STAGE_ELEMS
    WARP_F = WARP_ELEMS // 2   # the same region in float32 words (merge)
    ROWS = 16 if m16 else 8
    OC = 4 if m16 else 2       # accumulator values a lane keeps per n8 tile
    QR = 4 if m16 else 2       # Q registers a lane keeps per k16 step
    Q_SMEM = q_smem
    Q_REGS = 1 if Q_SMEM else QR * KSTEPS
    Q_BASE = warps * WARP_ELEMS  # the Q tile (Q_SMEM), after the rings
    Q_PER_THREAD = -(-ROWS * D // (32 * warps))   # Q tile elements a thread loads (Q_SMEM)
    Q_GROUP = min(16, Q_PER_THREAD)
    THREADS = 32 * warps
    WAIT = stages - 1
    LANE_PAGE = TPJ > 8        # 8-key pages and one copy round: the page depends on the lane
    SWITCH_ROUND = 8 // TPJ if TPJ <= 8 else -1   # else: the round that starts the second page
    mma = ptx.mma_bf16 if is_bf16 else ptx.mma_f16
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2
    to_half = ptx.f32_to_bf16 if is_bf16 else ptx.f32_to_f16
    zero_u32 = np.uint32(0)
    zero_f = np.float32(0.0)
    one_f = np.float32(1.0)
    ln2 = np.float32(LN2)
    COLS4 = D // 4             # 16-byte columns of a row (folded merge)
    L2_HINT = l2_prefetch
    OPITCH = D + 8             # a warp's partial O row in the merge: 2-way bank conflicts, not 8

    @_device
    def _page_ids(bt, bt_row, sbts, pos, max_slots, bs_shift, live):
        """Page ids of the tile at key ``pos`` (and, with 8-key pages, of its second page);
        0 when not ``live`` or past the block table's row."""
        a = np.int32(0)
        second = np.int32(0)
        if live:
            slot = pos >> bs_shift
            if slot < max_slots:
                a = bt[bt_row + slot * sbts]
            if page8 and slot + 1 < max_slots:
                second = bt[bt_row + (slot + 1) * sbts]
        return a, second

    @_device
    def _ring_at(row, chunk):
        """Element offset of 16-byte chunk ``chunk`` of row ``row`` in a K or V ring tile."""
        if SWIZZLE:
            return row * RING_PITCH + ((chunk ^ (row & 7)) << 3)
        return row * RING_PITCH + (chunk << 3)

    def paged_decode_kernel(q, kc, vc, bt, sl, out, lse, part_o, part_lse, tickets,
                            sqb, sqt, sqh, sqd, skb, skt, skh, svb, svt, svh, sbtb, sbts, ssl,
                            sob, sot, soh, sod, slb, slh, slt,
                            q_len, nheads, nheads_k, group, rows_total, row_tiles, max_slots,
                            num_blocks, bs_shift, window_left, num_splits, scale_log2, want_lse):
        smem = cuda.shared.array(0, np.uint16)
        smem_f = cuda.shared.array(0, np.float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t4 = lane % 4

        # The prologue is a chain of round trips before the first key arrives (seq_len, then
        # page ids, then K/V), paid again at every wave of blocks. So seq_len is loaded first,
        # and Q and (when they do not depend on seq_len) the first page ids are loaded beside
        # it; Q is packed once the page ids are in flight.
        bid = cuda.blockIdx.x
        per_b = num_splits * nheads_k * row_tiles
        b = _udiv(bid, per_b)
        seq_raw = sl[b * ssl]
        rest = bid - b * per_b
        head_tile = _udiv(rest, num_splits)   # (remainders by subtraction)
        split = rest - head_tile * num_splits
        rt = _udiv(head_tile, nheads_k)
        kvh = head_tile - rt * nheads_k
        row_first = rt * ROWS
        bt_row = b * sbtb
        tile_step = warps * TILE

        # page ids: lane l holds those of the warp's tile 32 c + l of the current batch c (and,
        # loaded a whole batch ahead, of batch c + 1); tile i takes them by a warp shuffle, so
        # no page-table load sits between two tiles' copies. Clamped where used. Without
        # splits or a window the warp's first tile is known before seq_len: loaded now (slots
        # past the sequence are read but never used).
        early_pages = num_splits == 1 and window_left < 0
        cur_a, cur_b = _page_ids(bt, bt_row, sbts, warp * TILE + lane * tile_step, max_slots,
                                 bs_shift, early_pages)
        nxt_a, nxt_b = _page_ids(bt, bt_row, sbts, warp * TILE + (lane + 32) * tile_step,
                                 max_slots, bs_shift, early_pages)

        # ---- Q rows g and g + 8 of the tile: every load issued now, none behind a branch
        # (rows past rows_total read the last valid row and are zeroed when packed) ----------
        r0 = row_first + g
        r1 = r0 + 8
        raw = cuda.local.array((KSTEPS, 2, 2, 2), np.uint16)   # (ks, half, row, pair)
        if not Q_SMEM:
            r0c = min(r0, rows_total - 1)
            tq = _udiv(r0c, group)
            q0 = b * sqb + tq * sqt + (kvh * group + r0c - tq * group) * sqh
            r1c = min(r1, rows_total - 1)
            tq = _udiv(r1c, group)
            q1 = b * sqb + tq * sqt + (kvh * group + r1c - tq * group) * sqh
            for ks in range(KSTEPS):
                for half in range(2):
                    d = (16 * ks + 8 * half + 2 * t4) * sqd
                    raw[ks, half, 0, 0] = q[q0 + d]
                    raw[ks, half, 0, 1] = q[q0 + d + sqd]
                    if m16:
                        raw[ks, half, 1, 0] = q[q1 + d]
                        raw[ks, half, 1, 1] = q[q1 + d + sqd]

        # ---- this block's rows and key range --------------------------------------------
        capacity = max_slots << bs_shift
        seq_len = min(max(np.int64(seq_raw), 0), capacity)
        base_pos = seq_len - q_len           # position of query 0
        row_last = min(row_first + ROWS, rows_total) - 1
        tq_first = _udiv(row_first, group)
        tq_last = _udiv(row_last, group)
        hi = min(base_pos + tq_last + 1, seq_len)      # keys [lo, hi) may be attended
        full_hi = base_pos + tq_first                  # keys <= full_hi: attended by all rows
        lo = 0
        full_lo = 0                                    # keys >= full_lo: attended by all rows
        if window_left >= 0:
            lo = max(base_pos + tq_first - window_left, 0)
            full_lo = base_pos + tq_last - window_left
        lo16 = lo - lo % TILE
        n_tiles = 0
        if hi > lo16:
            n_tiles = (hi - lo16 + TILE - 1) // TILE
        per_split = _udiv(n_tiles + num_splits - 1, num_splits)
        tile_begin = split * per_split
        tile_end = min(tile_begin + per_split, n_tiles)
        end = min(lo16 + tile_end * TILE, hi)
        my_count = 0
        if tile_end - tile_begin > warp:
            my_count = (tile_end - tile_begin - warp + warps - 1) // warps

        # ---- query rows g and g + 8 of the tile: bounds --------------------------------
        lo_0 = 0
        hi_0 = -1
        if r0 < rows_total:
            hi_0 = base_pos + _udiv(r0, group)
            if window_left >= 0:
                lo_0 = hi_0 - window_left
        lo_1 = 0
        hi_1 = -1
        if m16 and r1 < rows_total:
            hi_1 = base_pos + _udiv(r1, group)
            if window_left >= 0:
                lo_1 = hi_1 - window_left

        qa = cuda.local.array(Q_REGS, np.uint32)
        if Q_SMEM:
            # the block's Q tile, zero rows past rows_total; Q_GROUP loads in flight a thread
            # (clamped to a valid row, zeroed when stored) before any is stored
            for e0 in range(0, Q_PER_THREAD, Q_GROUP):
                vals = cuda.local.array(Q_GROUP, np.uint16)
                for u in range(Q_GROUP):
                    e = min(tid + (e0 + u) * THREADS, ROWS * D - 1)
                    r = e // D
                    gr = min(row_first + r, rows_total - 1)
                    tq = _udiv(gr, group)
                    vals[u] = q[b * sqb + tq * sqt + (kvh * group + gr - tq * group) * sqh
                                + (e - r * D) * sqd]
                for u in range(Q_GROUP):
                    e = tid + (e0 + u) * THREADS
                    if e < ROWS * D:
                        r = e // D
                        value = vals[u]
                        if row_first + r >= rows_total:
                            value = np.uint16(0)
                        smem[Q_BASE + r * PITCH + e - r * D] = value
            cuda.syncthreads()
        # ldmatrix row address of this lane in the Q tile (x4: rows 0-15; x2: rows 0-7)
        q_ld = Q_BASE + (lane % ROWS) * PITCH + ((lane // ROWS) % 2) * 8

        # ---- per-lane constants of the copies and the fragment loads ----------------------
        cp_tok = lane // CPR                 # row of this lane's first chunk in a copy round
        cp_col = (lane % CPR) * 8            # column of its chunks
        cp_chunk = lane % CPR
        k_head = kvh * skh + cp_col
        v_head = kvh * svh + cp_col
        step_k = TPJ * skt
        step_v = TPJ * svt
        # ldmatrix rows of this lane (K: x4 over key rows 0-15 in two column halves; V: .trans
        # over key rows 0-15), their first 16-byte chunk, and the row's swizzle
        # (chunk c + 8a of a row sits 8a chunks after chunk c: the swizzle only permutes a row's
        # chunks within each aligned group of 8, so 4 offsets a lane cover every k16 step)
        k_row = ((lane >> 4) << 3) + (lane & 7)
        v_row = (((lane >> 3) & 1) << 3) + (lane & 7)
        k_sw = cuda.local.array(4, np.int32)
        v_sw = cuda.local.array(4, np.int32)
        for j in range(4):
            k_sw[j] = _ring_at(k_row, ((lane >> 3) & 1) + 2 * j)
            v_sw[j] = _ring_at(v_row, (lane >> 4) + 2 * j)
        wbase = warp * WARP_ELEMS
        page_mask = (1 << bs_shift) - 1

        o = cuda.local.array((NT, OC), np.float32)
        for nt in range(NT):
            for c in range(OC):
                o[nt, c] = zero_f
        m_0 = NEG_INF
        l_0 = zero_f
        m_1 = NEG_INF
        l_1 = zero_f

        issue_pos = lo16 + (tile_begin + warp) * TILE
        if not early_pages:
            cur_a, cur_b = _page_ids(bt, bt_row, sbts, issue_pos + lane * tile_step, max_slots,
                                     bs_shift, lane < my_count)
            nxt_a, nxt_b = _page_ids(bt, bt_row, sbts, issue_pos + (lane + 32) * tile_step,
                                     max_slots, bs_shift, lane + 32 < my_count)
        if not Q_SMEM:  # Q's A fragments, from the loads issued first
            live0 = r0 < rows_total
            live1 = m16 and r1 < rows_total
            for ks in range(KSTEPS):
                for half in range(2):
                    v0 = np.uint32(raw[ks, half, 0, 0]) | (
                        np.uint32(raw[ks, half, 0, 1]) << np.uint32(16))
                    if not live0:
                        v0 = zero_u32
                    if m16:
                        v1 = np.uint32(raw[ks, half, 1, 0]) | (
                            np.uint32(raw[ks, half, 1, 1]) << np.uint32(16))
                        if not live1:
                            v1 = zero_u32
                        qa[QR * ks + 2 * half] = v0
                        qa[QR * ks + 2 * half + 1] = v1
                    else:
                        qa[QR * ks + half] = v0
        compute_pos = issue_pos
        issue_stage = 0
        compute_stage = 0

        for i in range(my_count + stages - 1):
            # every lane is done with the buffer the next copies overwrite
            ptx.syncwarp()
            if i < my_count:
                # ---- issue the copies of tile i (keys issue_pos ..) ------------------------
                il = i % 32
                if il == 0 and i > 0:  # the next batch of page ids, and the one after it
                    cur_a = nxt_a
                    cur_b = nxt_b
                    nxt_a, nxt_b = _page_ids(bt, bt_row, sbts, issue_pos + (32 + lane) * tile_step,
                                             max_slots, bs_shift, i + 32 + lane < my_count)
                pg_a = np.int64(min(max(ptx.shfl_idx_i32(cur_a, il), 0), num_blocks - 1))
                pg_b = pg_a
                if page8:
                    pg_b = np.int64(min(max(ptx.shfl_idx_i32(cur_b, il), 0), num_blocks - 1))
                sk = wbase + issue_stage * STAGE_ELEMS
                in_page = issue_pos & page_mask   # 0 with 8-key pages (tiles start on one)
                src_k = pg_a * skb + (in_page + cp_tok) * skt + k_head
                src_v = pg_a * svb + (in_page + cp_tok) * svt + v_head
                if page8 and LANE_PAGE and cp_tok >= 8:
                    src_k = pg_b * skb + (cp_tok - 8) * skt + k_head
                    src_v = pg_b * svb + (cp_tok - 8) * svt + v_head
                rows_left = end - issue_pos - cp_tok   # round j is in range iff j * TPJ < it
                for j in range(ROUNDS):
                    if page8 and j == SWITCH_ROUND:     # keys 8..15: the tile's second page
                        src_k = pg_b * skb + cp_tok * skt + k_head
                        src_v = pg_b * svb + cp_tok * svt + v_head
                    nbytes = 16
                    ck = src_k
                    cv = src_v
                    if j * TPJ >= rows_left:
                        nbytes = 0
                        ck = 0
                        cv = 0
                    dst = sk + _ring_at(cp_tok + j * TPJ, cp_chunk)
                    ptx.cp_async_16_l2(smem, dst, kc, ck, nbytes, L2_HINT)
                    ptx.cp_async_16_l2(smem, dst + TILE_ELEMS, vc, cv, nbytes, L2_HINT)
                    src_k += step_k
                    src_v += step_v
                issue_pos += tile_step
                issue_stage += 1
                if issue_stage == stages:
                    issue_stage = 0
            ptx.cp_async_commit()
            if i >= stages - 1:
                ptx.cp_async_wait(WAIT)
                ptx.syncwarp()
                # ---- compute the tile at compute_pos ---------------------------------------
                kbase = wbase + compute_stage * STAGE_ELEMS
                vbase = kbase + TILE_ELEMS
                sa0 = zero_f
                sa1 = zero_f
                sa2 = zero_f
                sa3 = zero_f
                sb0 = zero_f
                sb1 = zero_f
                sb2 = zero_f
                sb3 = zero_f
                for ks in range(KSTEPS):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, kbase + k_sw[ks % 4] + (ks // 4) * 64)
                    if Q_SMEM:
                        if m16:
                            a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, q_ld + 16 * ks)
                        else:
                            a0, a2 = ptx.ldmatrix_x2(smem, q_ld + 16 * ks)
                            a1 = zero_u32
                            a3 = zero_u32
                    elif m16:
                        a0 = qa[4 * ks]
                        a1 = qa[4 * ks + 1]
                        a2 = qa[4 * ks + 2]
                        a3 = qa[4 * ks + 3]
                    else:
                        a0 = qa[2 * ks]
                        a1 = zero_u32
                        a2 = qa[2 * ks + 1]
                        a3 = zero_u32
                    sa0, sa1, sa2, sa3 = mma(a0, a1, a2, a3, b0, b1, sa0, sa1, sa2, sa3)
                    sb0, sb1, sb2, sb3 = mma(a0, a1, a2, a3, b2, b3, sb0, sb1, sb2, sb3)
                sa0 *= scale_log2
                sa1 *= scale_log2
                sb0 *= scale_log2
                sb1 *= scale_log2
                if m16:
                    sa2 *= scale_log2
                    sa3 *= scale_log2
                    sb2 *= scale_log2
                    sb3 *= scale_log2
                if compute_pos < full_lo or compute_pos + TILE - 1 > full_hi:
                    c0 = compute_pos + 2 * t4
                    if c0 < lo_0 or c0 > hi_0:
                        sa0 = NEG_INF
                    if c0 + 1 < lo_0 or c0 + 1 > hi_0:
                        sa1 = NEG_INF
                    if c0 + 8 < lo_0 or c0 + 8 > hi_0:
                        sb0 = NEG_INF
                    if c0 + 9 < lo_0 or c0 + 9 > hi_0:
                        sb1 = NEG_INF
                    if m16:
                        if c0 < lo_1 or c0 > hi_1:
                            sa2 = NEG_INF
                        if c0 + 1 < lo_1 or c0 + 1 > hi_1:
                            sa3 = NEG_INF
                        if c0 + 8 < lo_1 or c0 + 8 > hi_1:
                            sb2 = NEG_INF
                        if c0 + 9 < lo_1 or c0 + 9 > hi_1:
                            sb3 = NEG_INF
                # online softmax, row g (and g + 8)
                m_0, l_0, alpha_0, sa0, sa1, sb0, sb1 = softmax_step(m_0, l_0, sa0, sa1,
                                                                      sb0, sb1)
                alpha_1 = zero_f
                if m16:
                    m_1, l_1, alpha_1, sa2, sa3, sb2, sb3 = softmax_step(m_1, l_1, sa2, sa3,
                                                                          sb2, sb3)
                # P's C fragments are the A fragment of the P V step
                p0 = pack(sa0, sa1)
                p2 = pack(sb0, sb1)
                p1 = zero_u32
                p3 = zero_u32
                if m16:
                    p1 = pack(sa2, sa3)
                    p3 = pack(sb2, sb3)
                for pair in range(KSTEPS):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(
                        smem, vbase + v_sw[pair % 4] + (pair // 4) * 64)
                    n0 = 2 * pair
                    n1 = n0 + 1
                    if m16:
                        o[n0, 0], o[n0, 1], o[n0, 2], o[n0, 3] = mma(
                            p0, p1, p2, p3, b0, b1, o[n0, 0] * alpha_0, o[n0, 1] * alpha_0,
                            o[n0, 2] * alpha_1, o[n0, 3] * alpha_1)
                        o[n1, 0], o[n1, 1], o[n1, 2], o[n1, 3] = mma(
                            p0, p1, p2, p3, b2, b3, o[n1, 0] * alpha_0, o[n1, 1] * alpha_0,
                            o[n1, 2] * alpha_1, o[n1, 3] * alpha_1)
                    else:
                        o[n0, 0], o[n0, 1], _, _ = mma(
                            p0, p1, p2, p3, b0, b1, o[n0, 0] * alpha_0, o[n0, 1] * alpha_0,
                            zero_f, zero_f)
                        o[n1, 0], o[n1, 1], _, _ = mma(
                            p0, p1, p2, p3, b2, b3, o[n1, 0] * alpha_0, o[n1, 1] * alpha_0,
                            zero_f, zero_f)
                compute_pos += tile_step
                compute_stage += 1
                if compute_stage == stages:
                    compute_stage = 0

        # ---- merge the warps' partial results through shared memory ----------------------
        l_0 += ptx.shfl_xor_f32(l_0, 1)
        l_0 += ptx.shfl_xor_f32(l_0, 2)
        if m16:
            l_1 += ptx.shfl_xor_f32(l_1, 1)
            l_1 += ptx.shfl_xor_f32(l_1, 2)
        ptx.syncwarp()  # the warp's last fragment loads are done: its region is free
        fb = warp * WARP_F
        for nt in range(NT):
            d = nt * 8 + 2 * t4
            smem_f[fb + g * OPITCH + d] = o[nt, 0]
            smem_f[fb + g * OPITCH + d + 1] = o[nt, 1]
            if m16:
                smem_f[fb + (g + 8) * OPITCH + d] = o[nt, 2]
                smem_f[fb + (g + 8) * OPITCH + d + 1] = o[nt, 3]
        if t4 == 0:
            smem_f[fb + ROWS * OPITCH + g] = m_0
            smem_f[fb + ROWS * OPITCH + ROWS + g] = l_0
            if m16:
                smem_f[fb + ROWS * OPITCH + g + 8] = m_1
                smem_f[fb + ROWS * OPITCH + ROWS + g + 8] = l_1
        cuda.syncthreads()

        for e in range(tid, ROWS * D, THREADS):
            r = e // D
            d = e - r * D
            gr = row_first + r
            if gr < rows_total:
                big = NEG_INF
                for w in range(warps):
                    big = max(big, smem_f[w * WARP_F + ROWS * OPITCH + r])
                acc = zero_f
                total = zero_f
                if big != NEG_INF:
                    for w in range(warps):
                        f = ptx.ex2_approx(smem_f[w * WARP_F + ROWS * OPITCH + r] - big)
                        total += smem_f[w * WARP_F + ROWS * OPITCH + ROWS + r] * f
                        acc += smem_f[w * WARP_F + r * OPITCH + d] * f
                if total > zero_f:  # >= 1 (the row max's own term): no denormal reciprocal
                    acc *= ptx.rcp_approx(total)
                tq = _udiv(gr, group)
                head = kvh * group + gr - tq * group
                if num_splits == 1:
                    out[b * sob + tq * sot + head * soh + d * sod] = to_half(acc)
                    if want_lse != 0 and d == 0:
                        lse[b * slb + head * slh + tq * slt] = row_lse2(big, total) * ln2
                else:
                    row_id = (b * q_len + tq) * nheads + head
                    part_o[(row_id * num_splits + split) * D + d] = acc
                    if d == 0:
                        part_lse[row_id * num_splits + split] = row_lse2(big, total)

        if num_splits == 1:
            return
        # ---- folded reduction: the block that finishes its rows' splits last merges them ----
        # Release: this thread's partials are visible GPU-wide before the block's ticket.
        cuda.threadfence()
        cuda.syncthreads()
        last = 0
        if tid == 0:
            ticket_id = _udiv(bid, num_splits)
            if cuda.atomic.add(tickets, ticket_id, np.int32(1)) == num_splits - 1:
                last = 1
                tickets[ticket_id] = 0  # every split has drawn: zero for the next launch
            cuda.threadfence()  # acquire: the other splits' partials, fenced before their tickets
        if cuda.syncthreads_or(last) == 0:
            return
        # Items (column of 4 outputs of a row, part): a column's ``parts`` items are adjacent
        # lanes, each merging every parts-th split (UNROLL loads in flight), then a butterfly
        # of shuffles merges the parts and lane part 0 writes.
        cols = (row_last - row_first + 1) * COLS4
        parts = 1
        while parts < 32 and 2 * parts * cols <= THREADS and parts < num_splits:
            parts *= 2
        stride = parts * MERGE_UNROLL
        for first in range(0, cols * parts, THREADS):  # the same trip count in every lane
            item = first + tid
            col = _udiv(item, parts)
            part = item - col * parts
            m = NEG_INF
            l = zero_f
            a0 = zero_f
            a1 = zero_f
            a2 = zero_f
            a3 = zero_f
            r = col // COLS4
            d = (col - r * COLS4) * 4
            gr = row_first + r
            tq = _udiv(gr, group)
            head = kvh * group + gr - tq * group
            src = ((b * q_len + tq) * nheads + head) * num_splits
            if col < cols:
                for s0 in range(part, num_splits, stride):
                    ws = cuda.local.array(MERGE_UNROLL, np.float32)
                    vs = cuda.local.array((MERGE_UNROLL, 4), np.float32)
                    for u in range(MERGE_UNROLL):  # loads first: their latencies overlap
                        s = min(s0 + u * parts, num_splits - 1)
                        ws[u] = part_lse[src + s]
                        if s0 + u * parts >= num_splits:
                            ws[u] = NEG_INF  # past the end: weight 0
                        v0, v1, v2, v3 = ptx.load_u32x4(part_o, (src + s) * D + d)
                        vs[u, 0] = ptx.f32_from_bits(v0)
                        vs[u, 1] = ptx.f32_from_bits(v1)
                        vs[u, 2] = ptx.f32_from_bits(v2)
                        vs[u, 3] = ptx.f32_from_bits(v3)
                    for u in range(MERGE_UNROLL):
                        m, l, a0, a1, a2, a3 = merge_state(m, l, a0, a1, a2, a3, ws[u], one_f,
                                                            vs[u, 0], vs[u, 1], vs[u, 2],
                                                            vs[u, 3])
            mask = 1
            while mask < parts:
                m, l, a0, a1, a2, a3 = merge_state(
                    m, l, a0, a1, a2, a3, ptx.shfl_xor_f32(m, mask), ptx.shfl_xor_f32(l, mask),
                    ptx.shfl_xor_f32(a0, mask), ptx.shfl_xor_f32(a1, mask),
                    ptx.shfl_xor_f32(a2, mask), ptx.shfl_xor_f32(a3, mask))
                mask *= 2
            if col < cols and part == 0:
                inv = zero_f
                if l > zero_f:
                    inv = one_f / l
                o_at = b * sob + tq * sot + head * soh + d * sod
                out[o_at] = to_half(a0 * inv)
                out[o_at + sod] = to_half(a1 * inv)
                out[o_at + 2 * sod] = to_half(a2 * inv)
                out[o_at + 3 * sod] = to_half(a3 * inv)
                if want_lse != 0 and d == 0:
                    lse[b * slb + head * slh + tq * slt] = row_lse2(m, l) * ln2

    return paged_decode_kernel


_DECODE_SIGNATURE = (
    (array1d(np.uint16),) * 3 + (array1d(np.int32),) * 2
    + (array1d(np.uint16),) + (array1d(np.float32),) * 3 + (array1d(np.int32),)
    + (types.int64,) * 20
    + (types.int32,) * 11 + (types.float32, types.int32)
)


@functools.lru_cache(maxsize=None)
def _decode_kernel(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch):
    return Kernel(jit(_decode_kernel_fn(head_dim, m16, page8, is_bf16, warps, stages, q_smem,
                                        l2_prefetch)),
                  _DECODE_SIGNATURE, "paged_decode_kernel")
