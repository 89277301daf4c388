"""The paged-decode attention kernel (``paged_decode.py`` is the op: its math, layout, checks).

One block per (batch, kv head, split, row tile), ``warps`` warps. This module is the block's
plan of work and its pipeline; the pieces it runs are in the modules named below.

- Rows. The ``group * q_len`` query rows that share a KV head are the M rows of one m16n8k16
  ``mma`` tile (8 rows when they fit, else 16), so every K/V page is read once, and a GQA group
  costs no more memory traffic than one head. More than 16 rows (e.g. group 8 x q_len 4) take
  several row tiles, each of which reads the pages again (mostly from L2: they run together).
- Keys. The block's key range (its split of the sequence, clipped to the causal window) is cut
  into 16-key tiles; warp ``w`` takes tiles ``w, w + warps, ...`` and streams them through its own
  ``stages``-deep ring of shared-memory buffers (``_paged_decode_layout``; at headdim 64 and 128
  unpadded and swizzled) with 16-byte ``cp.async`` (``_paged_decode_copy``), so ``stages - 1``
  tiles (8 KB each at headdim 128) per warp are in flight while it computes. Page ids are read
  32 tiles at a time, one per lane, a batch ahead, and handed out by a warp shuffle.
- Prologue (paid again at each wave of blocks): ``seq_len`` is loaded first; the query fragments
  (all at once, before any is used; the shared-memory Q tile of D 256, 16 loads a thread at a
  time) and, without splits or a window, the first page ids are loaded beside it. Index
  arithmetic divides in 32 bits (``_index32``).
- Math (per tile, ``_paged_decode_tile``): ``S = Q K^T``, the mask where a tile crosses a window
  edge or the sequence end, online softmax in registers in log2 units, ``O += P V``.
- End (``_paged_decode_merge``). The warps' partial (max, sum, O) are merged through shared
  memory. With one split the block writes ``out`` (and ``lse``) directly; with several, each
  block writes its normalised fp32 partial output and log2-sum-exp to a workspace, and the
  block of each (batch, KV head, row tile) that finishes last (``_last_block``: a ticket from an
  int32 counter, set back to 0 by that block, so the counters are zeroed only when made and a
  CUDA graph replays the kernel as it is) merges all the splits' partials into ``out`` /
  ``lse``.

Compile-time configuration (closure constants of ``_decode_kernel``): ``(head_dim, m16, page8,
is_bf16, warps, stages, q_smem, l2_prefetch)``; ``_paged_decode_plan.launch_plan`` chooses it.
Run-time parameters: ``PARAMS``, one list of names and types for the kernel, its signature and
its launch (``DecodeArgs``). The measurements behind the constants are in benchmarks/NOTES.md
("Paged decode").
"""

import collections
import functools
import inspect

import numpy as np
from numba import types

from .. import ptx
from .._env import cuda
from .._launch import Kernel, array1d, jit
from ._attention_common import NEG_INF
from ._index32 import udiv
from ._last_block import last_block
from ._paged_decode_copy import page_reader, tile_copier
from ._paged_decode_layout import TILE, rows, stage_elems, warp_elems
from ._paged_decode_merge import split_merge, warp_merge
from ._paged_decode_tile import (fragment_lanes, q_registers, q_registers_count, q_shared,
                                 tile_attention)

_U16, _I32, _F32 = array1d(np.uint16), array1d(np.int32), array1d(np.float32)
_I64, _S32 = types.int64, types.int32

#: The kernel's parameters in order, and their types: the kernel's Python signature must list
#: these names (checked when it is built), its numba signature is their types, and the
#: launcher fills ``DecodeArgs`` by name. Strides are in elements; ``s<array><dim>``.
PARAMS = (
    # arrays: q, the caches, block table, lengths; out, lse; the split partials and tickets
    ("q", _U16), ("kc", _U16), ("vc", _U16), ("bt", _I32), ("sl", _I32), ("out", _U16),
    ("lse", _F32), ("part_o", _F32), ("part_lse", _F32), ("tickets", _I32),
    # strides: q (batch, token, head, dim), k / v caches (page, slot, head), block table,
    # seq_lens, out (batch, token, head, dim), lse (batch, head, token)
    ("sqb", _I64), ("sqt", _I64), ("sqh", _I64), ("sqd", _I64),
    ("skb", _I64), ("skt", _I64), ("skh", _I64), ("svb", _I64), ("svt", _I64), ("svh", _I64),
    ("sbtb", _I64), ("sbts", _I64), ("ssl", _I64),
    ("sob", _I64), ("sot", _I64), ("soh", _I64), ("sod", _I64),
    ("slb", _I64), ("slh", _I64), ("slt", _I64),
    # shapes and options
    ("q_len", _S32), ("nheads", _S32), ("nheads_k", _S32), ("group", _S32),
    ("rows_total", _S32), ("row_tiles", _S32), ("max_slots", _S32), ("num_blocks", _S32),
    ("bs_shift", _S32), ("window_left", _S32), ("num_splits", _S32),
    ("scale_log2", types.float32), ("want_lse", _S32),
)
#: A launch's arguments, by name (a tuple in parameter order).
DecodeArgs = collections.namedtuple("DecodeArgs", [name for name, _ in PARAMS])
SIGNATURE = tuple(ty for _, ty in PARAMS)


def _check_params(kernel):
    names = tuple(inspect.signature(kernel).parameters)
    if names != DecodeArgs._fields:
        raise TypeError(f"{kernel.__name__}: parameters {names} differ from PARAMS "
                        f"{DecodeArgs._fields}")
    return kernel


def _decode_kernel_fn(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch,
                      trigger=False):
    """The decode kernel for one compile-time configuration.

    ``m16``: 16 query rows a tile (else 8, and the mma's rows 8..15 are zero); ``page8``: block
    size 8, so a 16-key tile spans two pages; ``q_smem``: Q's A fragments are re-read from a
    shared-memory Q tile for every key tile instead of living in registers; ``l2_prefetch``:
    the cp.async L2 prefetch-size hint in bytes (0: none); ``trigger``: each block first releases
    the next programmatic kernel's launch (the output projection's streaming kernel, which
    then fetches weights while this kernel runs)."""
    if stages < 2:
        # the warps' partial O and (max, sum) of the end merge reuse each warp's ring; one
        # stage of unpadded rows is too small for them
        raise ValueError(f"stages: expected at least 2, got {stages}")
    D = head_dim
    KSTEPS = D // 16           # k16 steps of Q K^T
    NT = D // 8                # n8 tiles of O
    STAGE_ELEMS = stage_elems(D)
    WARP_ELEMS = warp_elems(D, stages)
    ROWS = rows(m16)
    OC = 4 if m16 else 2       # accumulator values a lane keeps per n8 tile
    Q_SMEM = q_smem
    Q_REGS = q_registers_count(D, m16, q_smem)
    WAIT = stages - 1
    zero_f = np.float32(0.0)
    page_ids = page_reader(page8)
    copy_lanes, issue_tile = tile_copier(D, page8, l2_prefetch)
    load_q, pack_q = q_registers(D, m16)
    load_q_tile = q_shared(D, m16, warps, stages)
    k_at, v_at, q_at = fragment_lanes(D, m16, warps, stages)
    attend_tile = tile_attention(D, m16, is_bf16, q_smem)
    merge_warps = warp_merge(D, m16, is_bf16, warps, stages)
    merge_splits = split_merge(D, is_bf16, warps)

    def paged_decode_kernel(q, kc, vc, bt, sl, out, lse, part_o, part_lse, tickets,
                            sqb, sqt, sqh, sqd, skb, skt, skh, svb, svt, svh, sbtb, sbts, ssl,
                            sob, sot, soh, sod, slb, slh, slt,
                            q_len, nheads, nheads_k, group, rows_total, row_tiles, max_slots,
                            num_blocks, bs_shift, window_left, num_splits, scale_log2, want_lse):
        if trigger:
            ptx.griddep_launch_dependents()
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
        b = udiv(bid, per_b)
        seq_raw = sl[b * ssl]
        rest = bid - b * per_b
        head_tile = udiv(rest, num_splits)   # (remainders by subtraction)
        split = rest - head_tile * num_splits
        rt = udiv(head_tile, nheads_k)
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
        cur_a, cur_b = page_ids(bt, bt_row, sbts, warp * TILE + lane * tile_step, max_slots,
                                bs_shift, early_pages)
        nxt_a, nxt_b = page_ids(bt, bt_row, sbts, warp * TILE + (lane + 32) * tile_step,
                                max_slots, bs_shift, early_pages)

        # Q rows g and g + 8 of the tile: every load issued now
        r0 = row_first + g
        r1 = r0 + 8
        raw = cuda.local.array((KSTEPS, 2, 2, 2), np.uint16)   # (ks, half, row, pair)
        if not Q_SMEM:
            load_q(q, raw, b, kvh, r0, r1, rows_total, group, (sqb, sqt, sqh, sqd), t4)

        # ---- this block's rows and key range --------------------------------------------
        capacity = max_slots << bs_shift
        seq_len = min(max(np.int64(seq_raw), 0), capacity)
        base_pos = seq_len - q_len           # position of query 0
        row_last = min(row_first + ROWS, rows_total) - 1
        tq_first = udiv(row_first, group)
        tq_last = udiv(row_last, group)
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
        per_split = udiv(n_tiles + num_splits - 1, num_splits)
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
            hi_0 = base_pos + udiv(r0, group)
            if window_left >= 0:
                lo_0 = hi_0 - window_left
        lo_1 = 0
        hi_1 = -1
        if m16 and r1 < rows_total:
            hi_1 = base_pos + udiv(r1, group)
            if window_left >= 0:
                lo_1 = hi_1 - window_left

        qa = cuda.local.array(Q_REGS, np.uint32)
        if Q_SMEM:
            load_q_tile(smem, q, tid, b, kvh, row_first, rows_total, group, (sqb, sqt, sqh, sqd))

        # ---- per-lane constants of the copies and the fragment loads ----------------------
        cp_tok, cp_chunk, k_head, v_head, step_k, step_v = copy_lanes(lane, kvh, skh, svh, skt,
                                                                      svt)
        k_sw = cuda.local.array(4, np.int32)
        v_sw = cuda.local.array(4, np.int32)
        for j in range(4):
            k_sw[j] = k_at(lane, j)
            v_sw[j] = v_at(lane, j)
        q_ld = q_at(lane)
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
            cur_a, cur_b = page_ids(bt, bt_row, sbts, issue_pos + lane * tile_step, max_slots,
                                    bs_shift, lane < my_count)
            nxt_a, nxt_b = page_ids(bt, bt_row, sbts, issue_pos + (lane + 32) * tile_step,
                                    max_slots, bs_shift, lane + 32 < my_count)
        if not Q_SMEM:  # Q's A fragments, from the loads issued first
            pack_q(raw, qa, r0 < rows_total, m16 and r1 < rows_total)
        compute_pos = issue_pos
        issue_stage = 0
        compute_stage = 0

        # ---- the pipeline: tile i's copies issued while tile i - stages + 1 is computed ----
        for i in range(my_count + stages - 1):
            # every lane is done with the buffer the next copies overwrite
            ptx.syncwarp()
            if i < my_count:
                il = i % 32
                if il == 0 and i > 0:  # the next batch of page ids, and the one after it
                    cur_a = nxt_a
                    cur_b = nxt_b
                    nxt_a, nxt_b = page_ids(bt, bt_row, sbts, issue_pos + (32 + lane) * tile_step,
                                            max_slots, bs_shift, i + 32 + lane < my_count)
                issue_tile(smem, kc, vc, wbase + issue_stage * STAGE_ELEMS, cur_a, cur_b, il,
                           issue_pos, end, page_mask, num_blocks, skb, skt, svb, svt, cp_tok,
                           cp_chunk, k_head, v_head, step_k, step_v)
                issue_pos += tile_step
                issue_stage += 1
                if issue_stage == stages:
                    issue_stage = 0
            ptx.cp_async_commit()
            if i >= stages - 1:
                ptx.cp_async_wait(WAIT)
                ptx.syncwarp()
                m_0, l_0, m_1, l_1 = attend_tile(
                    smem, wbase + compute_stage * STAGE_ELEMS, qa, q_ld, k_sw, v_sw, o, m_0, l_0,
                    m_1, l_1, compute_pos, full_lo, full_hi, lo_0, hi_0, lo_1, hi_1, scale_log2,
                    t4)
                compute_pos += tile_step
                compute_stage += 1
                if compute_stage == stages:
                    compute_stage = 0

        # ---- the warps' results merged: out (one split) or this split's partials ----------
        merge_warps(smem_f, o, m_0, l_0, m_1, l_1, tid, warp, g, t4, row_first, rows_total, b,
                    kvh, group, q_len, nheads, split, num_splits, out, lse, part_o, part_lse,
                    (sob, sot, soh, sod), (slb, slh, slt), want_lse)
        if num_splits == 1:
            return
        # ---- the block that finishes its rows' splits last merges them ---------------------
        if last_block(tickets, bid, num_splits, num_splits) == 0:  # counter: (b, kv head, tile)
            return
        merge_splits(part_o, part_lse, out, lse, tid, row_first, row_last, b, kvh, group, q_len,
                     nheads, num_splits, (sob, sot, soh, sod), (slb, slh, slt), want_lse)

    return _check_params(paged_decode_kernel)


@functools.lru_cache(maxsize=None)
def _decode_kernel(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch,
                   trigger=False):
    return Kernel(jit(_decode_kernel_fn(head_dim, m16, page8, is_bf16, warps, stages, q_smem,
                                        l2_prefetch, trigger)),
                  SIGNATURE, "paged_decode_kernel")
