"""The end of a paged-decode block: its warps' partial results merged, then (split sequences)
the splits' partials merged by the block that finishes last.

Warps. Each warp holds (max, sum, O) of its own key tiles for the tile's query rows, in log2
units (``_attention_common``). They meet in shared memory (each warp's ring, reused as float32
words) and one pass over the tile's rows x ``head_dim`` combines them: with one split into
``out`` (and ``lse``), with several into the split's normalised fp32 partial output and
log2-sum-exp in the workspace.

Splits. The block that draws the last ticket of its (batch, KV head, row tile)
(``_last_block``) merges every split's partials: a lane per 16 bytes of a row and group of
splits, ``MERGE_UNROLL`` loads in flight, a shuffle butterfly across the groups.
"""

import functools
import math

import numpy as np

from .. import ptx
from .._env import cuda
from ._attention_common import NEG_INF, merge_state, row_lse2
from ._index32 import udiv
from ._paged_decode_layout import rows, warp_elems

#: Splits a lane of the split merge loads before using any (16 bytes of partial output each).
MERGE_UNROLL = 8

_LN2 = np.float32(math.log(2.0))
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


def _to_half(is_bf16):
    return ptx.f32_to_bf16 if is_bf16 else ptx.f32_to_f16


@functools.lru_cache(maxsize=None)
def warp_merge(head_dim, m16, is_bf16, warps, stages):
    """Device function ``merge_warps(smem_f, o, m_0, l_0, m_1, l_1, tid, warp, g, t4, row_first,
    rows_total, b, kvh, group, q_len, nheads, split, num_splits, out, lse, part_o, part_lse, so,
    sl, want_lse)``: the warps' states (lane ``(g, t4)``'s accumulators ``o`` and rows ``g``,
    ``g + 8``'s (max, partial sum)) merged and written; ``so`` / ``sl``: out's (batch, token,
    head, dim) and lse's (batch, head, token) strides. Every thread of the block calls it."""
    D = head_dim
    NT = D // 8                # n8 tiles of O
    ROWS = rows(m16)
    THREADS = 32 * warps
    WARP_F = warp_elems(D, stages) // 2   # a warp's ring in float32 words
    OPITCH = D + 8             # a partial O row: 2-way bank conflicts, not 8
    to_half = _to_half(is_bf16)

    @cuda.jit(device=True, inline="always")
    def merge_warps(smem_f, o, m_0, l_0, m_1, l_1, tid, warp, g, t4, row_first, rows_total, b,
                    kvh, group, q_len, nheads, split, num_splits, out, lse, part_o, part_lse, so,
                    sl, want_lse):
        sob, sot, soh, sod = so
        slb, slh, slt = sl
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
                acc = _F0
                total = _F0
                if big != NEG_INF:
                    for w in range(warps):
                        f = ptx.ex2_approx(smem_f[w * WARP_F + ROWS * OPITCH + r] - big)
                        total += smem_f[w * WARP_F + ROWS * OPITCH + ROWS + r] * f
                        acc += smem_f[w * WARP_F + r * OPITCH + d] * f
                if total > _F0:  # >= 1 (the row max's own term): no denormal reciprocal
                    acc *= ptx.rcp_approx(total)
                tq = udiv(gr, group)
                head = kvh * group + gr - tq * group
                if num_splits == 1:
                    out[b * sob + tq * sot + head * soh + d * sod] = to_half(acc)
                    if want_lse != 0 and d == 0:
                        lse[b * slb + head * slh + tq * slt] = row_lse2(big, total) * _LN2
                else:
                    row_id = (b * q_len + tq) * nheads + head
                    part_o[(row_id * num_splits + split) * D + d] = acc
                    if d == 0:
                        part_lse[row_id * num_splits + split] = row_lse2(big, total)

    return merge_warps


@functools.lru_cache(maxsize=None)
def split_merge(head_dim, is_bf16, warps):
    """Device function ``merge_splits(part_o, part_lse, out, lse, tid, row_first, row_last, b,
    kvh, group, q_len, nheads, num_splits, so, sl, want_lse)``: every split's partials of rows
    ``row_first..row_last`` merged into ``out`` (and ``lse``), by the block that drew the last
    ticket (every thread of it calls it)."""
    D = head_dim
    COLS4 = D // 4             # 16-byte columns of a row
    THREADS = 32 * warps
    to_half = _to_half(is_bf16)

    @cuda.jit(device=True, inline="always")
    def merge_splits(part_o, part_lse, out, lse, tid, row_first, row_last, b, kvh, group, q_len,
                     nheads, num_splits, so, sl, want_lse):
        sob, sot, soh, sod = so
        slb, slh, slt = sl
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
            col = udiv(item, parts)
            part = item - col * parts
            m = NEG_INF
            l = _F0
            a0 = _F0
            a1 = _F0
            a2 = _F0
            a3 = _F0
            r = col // COLS4
            d = (col - r * COLS4) * 4
            gr = row_first + r
            tq = udiv(gr, group)
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
                        m, l, a0, a1, a2, a3 = merge_state(m, l, a0, a1, a2, a3, ws[u], _F1,
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
                inv = _F0
                if l > _F0:
                    inv = _F1 / l
                o_at = b * sob + tq * sot + head * soh + d * sod
                out[o_at] = to_half(a0 * inv)
                out[o_at + sod] = to_half(a1 * inv)
                out[o_at + 2 * sod] = to_half(a2 * inv)
                out[o_at + 3 * sod] = to_half(a3 * inv)
                if want_lse != 0 and d == 0:
                    lse[b * slb + head * slh + tq * slt] = row_lse2(m, l) * _LN2

    return merge_splits
