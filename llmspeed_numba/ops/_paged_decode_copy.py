"""K/V streaming of the paged-decode kernel: page ids, and a key tile's copies into a warp's ring.

Each warp streams its key tiles through its own ring of ``stages`` shared-memory buffers
(``_paged_decode_layout``) with 16-byte ``cp.async`` copies (L2 only, with an L2 prefetch-size
hint): a round of copies covers ``32 // (head_dim // 8)`` key rows, a tile's K and V take
``TILE`` rows of each. A tile's keys lie in one page, or with 8-key pages in two. Page ids come
from the block table through ``page_ids``; the kernel reads those of 32 tiles at a time, one a
lane, a batch ahead, and ``issue_tile`` takes a tile's from its lane by a shuffle, so no
page-table load stands between two tiles' copies.
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from ._paged_decode_layout import TILE, ring_offset, ring_pitch

#: L2 prefetch-size hint of the K/V copies (bytes, ``ptx.cp_async_16_l2``; 0: none). 128 was
#: faster than none in every comparison on the H200; 256 was erratic (benchmarks/NOTES.md).
L2_PREFETCH = 128


@functools.lru_cache(maxsize=None)
def page_reader(page8):
    """Device function ``page_ids(bt, bt_row, sbts, pos, max_slots, bs_shift, live) ->
    (page, second)``: the page ids of the tile at key ``pos`` (and, with 8-key pages, of its
    second page); 0 when not ``live`` or past the block table's row."""

    @cuda.jit(device=True, inline="always")
    def page_ids(bt, bt_row, sbts, pos, max_slots, bs_shift, live):
        a = np.int32(0)
        second = np.int32(0)
        if live:
            slot = pos >> bs_shift
            if slot < max_slots:
                a = bt[bt_row + slot * sbts]
            if page8 and slot + 1 < max_slots:
                second = bt[bt_row + (slot + 1) * sbts]
        return a, second

    return page_ids


@functools.lru_cache(maxsize=None)
def tile_copier(head_dim, page8, l2_prefetch):
    """Device functions ``(copy_lanes, issue_tile)``.

    ``copy_lanes(lane, kvh, skh, svh, skt, svt) -> (cp_tok, cp_chunk, k_head, v_head, step_k,
    step_v)``: this lane's part of every copy round (its first key row and 16-byte chunk, the
    offsets of its chunk of the KV head's row, a round's step in K and V), computed once.

    ``issue_tile(smem, kc, vc, sk, cur_a, cur_b, il, pos, end, page_mask, num_blocks, skb, skt,
    svb, svt, cp_tok, cp_chunk, k_head, v_head, step_k, step_v)``: the copies of the tile at key
    ``pos`` into the ring buffer at element ``sk`` (K, then V), its page ids those lane ``il``
    holds in ``cur_a`` / ``cur_b`` (clamped to ``[0, num_blocks)``); keys from ``end`` on are
    zero-filled, not read. Every lane of the warp calls it (shuffles)."""
    CPR = head_dim // 8        # 16-byte chunks a row
    TPJ = 32 // CPR            # rows one warp-wide round of cp.async covers
    ROUNDS = TILE // TPJ       # rounds a tile (K and V each)
    TILE_ELEMS = TILE * ring_pitch(head_dim)
    LANE_PAGE = TPJ > 8        # 8-key pages and one copy round: the page depends on the lane
    SWITCH_ROUND = 8 // TPJ if TPJ <= 8 else -1   # else: the round that starts the second page
    L2_HINT = l2_prefetch
    ring_at = ring_offset(head_dim)

    @cuda.jit(device=True, inline="always")
    def copy_lanes(lane, kvh, skh, svh, skt, svt):
        cp_tok = lane // CPR                 # row of this lane's first chunk in a copy round
        cp_col = (lane % CPR) * 8            # column of its chunks
        cp_chunk = lane % CPR
        k_head = kvh * skh + cp_col
        v_head = kvh * svh + cp_col
        step_k = TPJ * skt
        step_v = TPJ * svt
        return cp_tok, cp_chunk, k_head, v_head, step_k, step_v

    @cuda.jit(device=True, inline="always")
    def issue_tile(smem, kc, vc, sk, cur_a, cur_b, il, pos, end, page_mask, num_blocks, skb, skt,
                   svb, svt, cp_tok, cp_chunk, k_head, v_head, step_k, step_v):
        pg_a = np.int64(min(max(ptx.shfl_idx_i32(cur_a, il), 0), num_blocks - 1))
        pg_b = pg_a
        if page8:
            pg_b = np.int64(min(max(ptx.shfl_idx_i32(cur_b, il), 0), num_blocks - 1))
        in_page = pos & page_mask   # 0 with 8-key pages (tiles start on one)
        src_k = pg_a * skb + (in_page + cp_tok) * skt + k_head
        src_v = pg_a * svb + (in_page + cp_tok) * svt + v_head
        if page8 and LANE_PAGE and cp_tok >= 8:
            src_k = pg_b * skb + (cp_tok - 8) * skt + k_head
            src_v = pg_b * svb + (cp_tok - 8) * svt + v_head
        rows_left = end - pos - cp_tok   # round j is in range iff j * TPJ < it
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
            dst = sk + ring_at(cp_tok + j * TPJ, cp_chunk)
            ptx.cp_async_16_l2(smem, dst, kc, ck, nbytes, L2_HINT)
            ptx.cp_async_16_l2(smem, dst + TILE_ELEMS, vc, cv, nbytes, L2_HINT)
            src_k += step_k
            src_v += step_v

    return copy_lanes, issue_tile
