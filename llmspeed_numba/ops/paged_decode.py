"""Decode attention over a paged KV cache (flash-decoding with split-K), on Tensor Cores.

    out[b, t, h, :] = sum_j P[b, h, t, j] v(b, j, h // group)
    P[b, h, t, j]   = exp(scale * q[b, t, h] . k(b, j, h // group) - lse[b, h, t])   (attended j)
    k(b, j, hk)     = k_cache[block_table[b, j // block_size], j % block_size, hk, :]   (v alike)

Layout: ``k_cache``, ``v_cache`` (num_blocks, block_size, nheads_k, headdim); ``block_table`` int32
(batch, max_blocks_per_seq); ``seq_lens`` int32 (batch,); q (batch, nheads, headdim) or
(batch, q_len, nheads, headdim); ``group = nheads // nheads_k`` (GQA / MQA).

Mask: ``seq_lens[b]`` *includes* the ``q_len`` new tokens (already appended, as in vLLM and
FlashInfer). Query ``t`` (0-based among the new ones) sits at position ``p = seq_len - q_len + t``
and attends cache positions ``j`` with ``p - window_left <= j <= p`` (bottom-right causal; no
lower bound when ``window_left == -1``), i.e. FlashAttention 2's ``causal=True`` with
``seqlen_k = seq_len``. A query with nothing to attend (``seq_len == 0``) gets 0 and lse ``-inf``.

Kernel (one block per (batch, kv head, split, row tile), ``WARPS`` warps):

- Rows. The ``group * q_len`` query rows that share a KV head are the M rows of one m16n8k16
  ``mma`` tile (8 rows when they fit, else 16), so every K/V page is read once, and a GQA group
  costs no more memory traffic than one head. More than 16 rows (e.g. group 8 x q_len 4) take
  several row tiles, each of which reads the pages again (mostly from L2: they run together).
- Keys. The block's key range (its split of the sequence, clipped to the causal window) is cut
  into 16-key tiles; warp ``w`` takes tiles ``w, w + WARPS, ...`` and streams them through its own
  ``STAGES``-deep ring of shared-memory buffers with 16-byte ``cp.async`` (L2 only, with an L2
  prefetch-size hint), so ``STAGES - 1`` tiles (8 KB each at headdim 128) per warp are in flight
  while it computes. At headdim 64 and 128 the ring's rows are unpadded and XOR-swizzled (see
  ``SWIZZLE_DIMS``), so that every 128-byte line of K/V is asked of the L2 once. Page ids are
  read 32 tiles at a time, one per lane, a batch ahead, and handed out by a warp shuffle, so no
  dependent page-table load stands between a tile's copies and the next tile's.
- Prologue (about 2 us a block, paid again at each wave): ``seq_len`` is loaded first; the query
  fragments (all at once, before any is used; the shared-memory Q tile of D 256, 16 loads a
  thread at a time) and, without splits or a window, the first page ids are loaded beside it.
  Index arithmetic divides in 32 bits (``_udiv``): numba's 64-bit division is a subroutine
  call, and a dozen of them, chained, had cost about 0.9 us here and 0.45 us in the end merge.
- Math (per tile, FlashAttention-2 style): ``S = Q K^T`` with K read by ``ldmatrix.x4`` (K rows are
  columns of K^T); masking only on tiles that cross a window edge or the sequence end; online
  softmax in registers (running max and sum per row, two ``shfl.bfly`` per row); ``O += P V`` with
  P's C fragments reused as A fragments and V read by ``ldmatrix.x4.trans``.
- End. The warps' partial (max, sum, O) are merged through shared memory. With one split the
  block writes ``out`` (and ``lse``) directly; with several, each block writes its normalised fp32
  partial output and log2-sum-exp to a workspace, then fences them and draws a ticket
  (``atomicAdd`` on its (batch, KV head, row tile) counter); the block drawing the last ticket
  merges all the splits' partials (a lane per 16 bytes of a row and group of splits,
  ``MERGE_UNROLL`` loads in flight, a shuffle butterfly across the groups), writes ``out`` /
  ``lse`` and sets the counter back to 0, so the workspace is zeroed only when made and a CUDA
  graph replays the kernel as it is. The workspace is kept per (device, stream) and reused;
  repeated call signatures launch through a recorded fast path (see "the launch fast path"
  below).

Configuration: ``CONFIGS`` (warps, stages) by head dimension, or ``BATCH_CONFIGS`` (two smaller
blocks an SM) when batch x kv heads x row tiles fill every SM without splitting, or
``SHORT_JOB_CONFIGS`` (2-warp blocks, half the waves) for 3-8 waves of those of up to 512 keys.

Split count (``num_splits=None``): from batch, kv heads, row tiles and the longest possible
sequence (``max_blocks_per_seq * block_size``: no device-to-host read), the count with the lowest
modelled time, waves of resident blocks (SMs x blocks an SM holds) x keys a split, plus fixed
costs (``choose_num_splits``): at D 128 (one 8-warp block an SM) batch 1 x 8 KV heads at 32K keys
gets 16 splits (128 blocks, one wave), batch 32 x 8 KV heads at 8K keys none. Each sequence is
then divided evenly among the splits by its own length (tile-aligned), so shorter sequences get
shorter splits. Pass a trimmed block_table (``PagedKVCache.tables`` does) so that its width
tracks the real lengths.

Bounds (``check_bounds``): the kernel is memory-safe for any block_table / seq_lens contents
(lengths are clamped to ``[0, max_blocks_per_seq * block_size]``, page ids to
``[0, num_blocks)``), but invalid contents give meaningless results. ``check_bounds=True`` reads
block_table and seq_lens back to the host (a device synchronisation) and raises ``ValueError`` for
a length outside ``[0, max_blocks_per_seq * block_size]`` or a used page id outside
``[0, num_blocks)``. Default (``None``): checked when the arrays are host memory (the CUDA
simulator), unchecked on the GPU.

Tests and benchmark sweeps force a configuration through ``TUNING`` (scope ``paged_decode`` of
``_overrides.overrides``): ``tuning``, ``(warps, stages, q_smem[, l2_prefetch])``.
"""

import functools
import math

import numpy as np
from numba import types

from .. import _checks, _recording, compile_check, ptx
from .._arrays import (Buffer, empty, host_ints, kernel_buffer, stream_handle,
                      torch_current_stream, torch_signature)
from .._checks import boolean, output, same_dtype, shape, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, PreparedLaunch, array1d, collecting, jit, sm_count
from .._overrides import Knobs
from .._typing import ArrayLike, StreamLike
from ._attention_common import LOG2E, NEG_INF

HALF_DTYPES = ("float16", "bfloat16")
HEADDIMS = (16, 32, 64, 128, 256)
BLOCK_SIZES = tuple(1 << s for s in range(3, 9))  # 8 .. 256

#: Keys per tile: the n of two m16n8k16 score tiles and the k of one P V step.
TILE = 16

#: ``(warps, stages)`` by head dimension. A stage of a warp is K + V of 16 keys, 16 x D (D + 8
#: outside SWIZZLE_DIMS) x 2 x 2 B (8 KB at D 128); 8 warps x 3 stages is 192 KB a block at D 128
#: (x 2 stages: 128 KB) and, at 172-224
#: registers a thread, one block (8 warps, 16-24 tiles = 128-192 KB in flight) per SM, the same
#: warps per SM as 2 blocks of 4 but half the blocks' prologues and merges; on the H200 it was
#: the faster of the two on all four target shapes (first sweep). D 256 takes 2 warps (107 KB
#: with its Q tile) to keep 2 blocks, and 2 x 2 x 2 tiles in flight, per SM. D 128 runs 2
#: stages: same speed at batch 32 (90.1% vs 89.4% of copy with 8 KV heads), faster at batch 1
#: x 32K keys (59.1% vs 58.3% with 8 KV heads, 86.0% vs 75-84% with 32) on the H200.
CONFIGS = {16: (4, 3), 32: (4, 3), 64: (4, 3), 128: (8, 2), 256: (2, 3)}
#: ``(warps, stages)`` by head dimension when batch x KV heads x row tiles fill every SM without
#: splitting: two 4-warp blocks an SM instead of one of 8 (the same warps, a wave of 264 blocks
#: instead of two of 132). On the H200 with swizzled rings: B32 S8192 Hk8 255.2 vs 262.5 us,
#: Hk32 977.7 vs 984.3; at batch 1 (split) the 8-warp block stays faster (46.4-47.3 vs 49.0).
BATCH_CONFIGS = {128: (4, 2)}
#: ``(warps, stages)`` by head dimension for many short jobs: when ``BATCH_CONFIGS``' blocks of
#: at most ``SHORT_JOB_MAX_KEYS`` keys would run in ``SHORT_JOB_WAVES`` (min, max) waves, 2-warp
#: blocks, twice as many resident, run them in half the waves, each wave's chain of prologue and
#: end merge paid half as often. On the H200 (unsplit, us): B128 S512 Hk8 74.7 vs 78.8, B32 S512
#: Hk32 70.7 vs 73.1 (3.9 waves); slower at one wave (B32 S512 Hk8 25.4 vs 23.6), at 15.5 waves
#: (B128 S512 Hk32 250.4 vs 248.5) and with 4096 keys (B32 Hk32 493.3 vs 487.8; B128 Hk8 495.9
#: vs 492.6). The bounds lie between those points; only 3.9 waves at 512 keys is measured inside.
SHORT_JOB_CONFIGS = {128: (2, 3)}
SHORT_JOB_MAX_KEYS = 512
SHORT_JOB_WAVES = (3, 8)

#: L2 prefetch-size hint of the K/V copies (bytes, ``ptx.cp_async_16_l2``; 0: none). 128 was
#: 0.3-2.5% faster than none in every comparison on the H200 (B32 S8192 Hk8 246.0 vs 247.7 us,
#: B1 S32768 Hk8 42.6 vs 43.0); 256 was erratic (up to 9% slower).
L2_PREFETCH = 128

#: Head dimensions from which Q's A fragments are read from shared memory (``ldmatrix``) for every
#: tile instead of being kept in registers: at 256 the registers would spill.
Q_IN_SHARED_FROM = 256

#: Simulator configuration: two warps (so the cross-warp merge runs) and two stages.
SIMULATOR_CONFIG = (2, 2)

#: ``tuning``: ``(warps, stages, q_smem[, l2_prefetch])`` forced (None: planned).
TUNING = Knobs("paged_decode", tuning=None)

#: Split-count heuristic: a split shorter than this many tiles per warp is not worth its share of
#: the merge; at most this many splits (the merges loop over them).
MIN_TILES_PER_WARP = 2
MAX_SPLITS = 128
#: Fixed cost of a block (Q load, merge, partial write), in keys. The split merge costs the
#: last block a fixed part (the partial writes' fence, the ticket atomic, a round of L2 loads:
#: about 3 us, some 200-300 keys of a block's stream) and a part per split (its partials, 2 KB
#: a split at group 4, read by one SM).
#: Fitted to a sweep of 1-16 splits on the H200 (``probe_decode.py``, S 512 / 4096, batch 1 / 8
#: / 32): with a merge of 32 keys the model split 512-key sequences at batch 1 and 8 in two,
#: 0.6-2 us slower than one split (B8 S512 Hk8 15.2 vs 13.2 us); 256 keeps them whole and
#: changes no other benchmarked shape's count.
BLOCK_OVERHEAD_KEYS = 128
FOLDED_MERGE_KEYS = 256
FOLDED_MERGE_KEYS_PER_SPLIT = 1

#: Splits a lane of the folded merge loads before using any (16 bytes of partial output each).
MERGE_UNROLL = 8

LN2 = math.log(2.0)
_SM_REGISTERS = 65536
_SM_SHARED = 233472      # bytes per SM on sm_90 (228 KB)
_SM_THREADS = 2048
_SM_BLOCKS = 32


#: Head dimensions whose K/V rings' rows are unpadded and swizzled (16-byte chunk ``c`` of row
#: ``r`` stored at chunk ``c ^ (r % 8)``): each 128-byte line of a key row lands in one 128-byte
#: line of shared memory, so a warp's cp.async asks the L2 for whole lines once. With the
#: 16-byte pad the lines straddle shared-memory lines and the L2 served 1.5x the sectors (45% of
#: them twice), its throughput the limit (B32 S8192 Hk8 on the H200: 50.4 M sectors for 33.6 M
#: from DRAM, L2 at 90% of peak, DRAM at 81%). Rows under 128 bytes (D < 64) have no whole line
#: to keep; at D 256 the 16 copy rounds' swizzled offsets, hoisted out of the tile loop, push the
#: 2-warp kernel past 255 registers (12-16 bytes of spills), so it keeps the pad.
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
    division, a subroutine call (``__cuda_sm20_div_s64``): with a dozen of them, chained, the
    prologue took 2.9 us a block instead of 2.0, and the end merge 0.45 us more
    (per-block timestamps, B32 S8192 Hk8: benchmarks/NOTES.md, session 6)."""
    return np.int64(np.uint32(n) // np.uint32(d))


@_device
def _exp2_base(m):
    """What scores are measured from: the row's max ``m``, or 0 while nothing is attended
    (``m = -inf``), so that ``exp2`` sees ``-inf`` (giving 0), never ``-inf - -inf`` (NaN)."""
    if m == NEG_INF:
        return np.float32(0.0)
    return m


@_device
def _softmax_step(m, l, x0, x1, x2, x3):
    """One key tile of a row's online softmax: the row's four scores in this lane (log2 units),
    its running max ``m`` and sum ``l`` across the lane's quad -> ``(m, l, alpha, p0..p3)``,
    ``alpha`` rescaling the row's earlier output and ``p`` the tile's probabilities."""
    mx = max(max(x0, x1), max(x2, x3))
    mx = max(mx, ptx.shfl_xor_f32(mx, 1))
    mx = max(mx, ptx.shfl_xor_f32(mx, 2))
    m_new = max(m, mx)
    base = _exp2_base(m_new)
    alpha = ptx.ex2_approx(m - base)
    p0 = ptx.ex2_approx(x0 - base)
    p1 = ptx.ex2_approx(x1 - base)
    p2 = ptx.ex2_approx(x2 - base)
    p3 = ptx.ex2_approx(x3 - base)
    return m_new, l * alpha + ((p0 + p1) + (p2 + p3)), alpha, p0, p1, p2, p3


@_device
def _row_lse2(big, total):
    """A row's log2-sum-exp from its max (log2 units) and the sum of 2^(x - max)."""
    if total > np.float32(0.0):
        return big + math.log2(total)
    return NEG_INF


@_device
def _merge_state(m, l, a0, a1, a2, a3, m2, l2, b0, b1, b2, b3):
    """Two partial softmax states of one row (log2 max, sum, four unnormalised outputs) as one;
    a state with ``m = -inf`` (nothing attended) adds nothing."""
    big = max(m, m2)
    base = _exp2_base(big)
    f = ptx.ex2_approx(m - base)
    f2 = ptx.ex2_approx(m2 - base)
    return (big, l * f + l2 * f2, a0 * f + b0 * f2, a1 * f + b1 * f2, a2 * f + b2 * f2,
            a3 * f + b3 * f2)


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
                m_0, l_0, alpha_0, sa0, sa1, sb0, sb1 = _softmax_step(m_0, l_0, sa0, sa1,
                                                                      sb0, sb1)
                alpha_1 = zero_f
                if m16:
                    m_1, l_1, alpha_1, sa2, sa3, sb2, sb3 = _softmax_step(m_1, l_1, sa2, sa3,
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
                        lse[b * slb + head * slh + tq * slt] = _row_lse2(big, total) * ln2
                else:
                    row_id = (b * q_len + tq) * nheads + head
                    part_o[(row_id * num_splits + split) * D + d] = acc
                    if d == 0:
                        part_lse[row_id * num_splits + split] = _row_lse2(big, total)

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
                        m, l, a0, a1, a2, a3 = _merge_state(m, l, a0, a1, a2, a3, ws[u], one_f,
                                                            vs[u, 0], vs[u, 1], vs[u, 2],
                                                            vs[u, 3])
            mask = 1
            while mask < parts:
                m, l, a0, a1, a2, a3 = _merge_state(
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
                    lse[b * slb + head * slh + tq * slt] = _row_lse2(m, l) * ln2

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


# ---- split count ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def resident_blocks_per_sm(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch):
    """Blocks of the decode kernel one SM holds at once (registers, shared memory, threads)."""
    if SIMULATOR:
        return 1
    kernel = _decode_kernel(head_dim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch)
    regs = max(kernel.resources()["registers"], 1)
    warp_regs = -(-regs * 32 // 256) * 256
    by_regs = _SM_REGISTERS // (warp_regs * warps)
    by_smem = _SM_SHARED // (shared_bytes(head_dim, warps, stages, q_smem) + 1024)
    by_threads = _SM_THREADS // (32 * warps)
    return max(1, min(by_regs, by_smem, by_threads, _SM_BLOCKS))


@functools.lru_cache(maxsize=4096)
def choose_num_splits(blocks, max_len, warps, slots):
    """Split count for ``blocks`` (batch x kv heads x row tiles) blocks of at most ``max_len``
    keys on ``slots`` resident blocks (SMs x blocks per SM).

    Models the time as waves x (keys a split + a block's fixed cost), plus the merge (in the
    last block) when splitting, and takes the cheapest count (the smallest among equals); a
    split keeps at least ``MIN_TILES_PER_WARP`` tiles per warp."""
    tiles = -(-max(max_len, 1) // TILE)
    limit = max(1, min(MAX_SPLITS, tiles // (MIN_TILES_PER_WARP * warps)))
    best, best_cost = 1, None
    for splits in range(1, limit + 1):
        waves = -(-blocks * splits // slots)
        keys = -(-tiles // splits) * TILE
        cost = waves * (keys + BLOCK_OVERHEAD_KEYS)
        if splits > 1:
            cost += FOLDED_MERGE_KEYS + FOLDED_MERGE_KEYS_PER_SPLIT * splits
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


# ---- launcher -------------------------------------------------------------------------------

def _check_options(softmax_scale, window_size, headdim, num_splits):
    scale = _checks.softmax_scale(softmax_scale, headdim)
    left, right = _checks.window_size(window_size)
    if right > 0:
        raise NotImplementedError(
            f"window_size[1]: decode attention is causal among the new tokens (bottom-right "
            f"aligned); expected -1 or 0, got {right}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
            raise TypeError(f"num_splits: expected an int or None, got "
                            f"{type(num_splits).__name__}")
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits: expected 1 <= num_splits <= {MAX_SPLITS}, got "
                             f"{num_splits}")
    return scale, int(left)


def _check_cache_layout(name, t):
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    if t.strides[3] != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), got "
                         f"strides {t.strides}")
    if t.ptr % 16 or any(s % 8 for n, s in zip(t.shape[:3], t.strides[:3], strict=True) if n > 1):
        raise ValueError(f"{name}: expected a 16-byte aligned pointer and strides that are "
                         f"multiples of 8 elements (16-byte rows for cp.async), got strides "
                         f"{t.strides}")


def check_tables(block_table, seq_lens, num_blocks, block_size, q_len=None):
    """Host check of block_table / seq_lens contents (both host int arrays); ``ValueError``."""
    capacity = block_table.shape[1] * block_size
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > capacity))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"seq_lens: expected lengths in [0, {capacity}] (max_blocks_per_seq "
                         f"{block_table.shape[1]} x block_size {block_size}), got "
                         f"seq_lens[{b}] = {int(seq_lens[b])}")
    for b, n in enumerate(seq_lens):
        used = block_table[b, :-(-int(n) // block_size)]
        wrong = np.flatnonzero((used < 0) | (used >= num_blocks))
        if wrong.size:
            j = int(wrong[0])
            raise ValueError(f"block_table: expected page ids in [0, {num_blocks}) for the "
                             f"{used.size} pages sequence {b} uses, got block_table[{b}, {j}] = "
                             f"{int(used[j])}")


_DUMMIES = {}


def _dummy(dtype):
    """A one-element buffer for a kernel parameter the launch does not use."""
    if dtype not in _DUMMIES:
        if SIMULATOR:
            _DUMMIES[dtype] = np.zeros(1, dtype)
        else:
            _DUMMIES[dtype] = Buffer(0, 1, np.dtype(dtype))
    return _DUMMIES[dtype]


def _validate(q, k_cache, v_cache, block_table, seq_lens):
    tq = tensor(q, "q", ndim=(3, 4), dtypes=HALF_DTYPES)
    tk = tensor(k_cache, "k_cache", ndim=4)
    tv = tensor(v_cache, "v_cache", ndim=4)
    tbt = tensor(block_table, "block_table", ndim=2)
    tsl = tensor(seq_lens, "seq_lens", ndim=1)
    batch = tq.shape[0]
    nheads, headdim = tq.shape[-2], tq.shape[-1]
    num_blocks, block_size, nheads_k, _ = tk.shape
    shape("k_cache", tk, (None, None, None, headdim), "to match q's headdim")
    shape("v_cache", tv, tk.shape, "to match k_cache")
    shape("block_table", tbt, (batch, None), "to match q's batch")
    shape("seq_lens", tsl, (batch,), "to match q's batch")
    same_dtype("q", tq, k_cache=tk, v_cache=tv)
    for name, t in (("block_table", tbt), ("seq_lens", tsl)):
        if t.dtype != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if tq.ndim == 4 and tq.shape[1] == 0:
        raise ValueError(f"q: expected at least one query token, got shape {tq.shape}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"k_cache: expected nheads_k dividing q's nheads {nheads}, got "
                         f"{nheads_k}")
    if num_blocks == 0 or tbt.shape[1] == 0:
        raise ValueError(f"k_cache / block_table: expected at least one page, got "
                         f"{num_blocks} pages and {tbt.shape[1]} slots a sequence")
    for name, t in (("q", tq), ("block_table", tbt), ("seq_lens", tsl)):
        if any(s < 0 for s in t.strides):
            raise ValueError(f"{name}: negative strides are unsupported, got {t.strides}")
    _check_cache_layout("k_cache", tk)
    _check_cache_layout("v_cache", tv)
    if headdim not in HEADDIMS:
        raise NotImplementedError(f"q: headdim {headdim} is not supported; expected one of "
                                  f"{HEADDIMS}")
    if block_size not in BLOCK_SIZES:
        raise NotImplementedError(f"k_cache: block_size {block_size} is not supported; "
                                  f"expected a power of two in [8, 256]")
    return tq, tk, tv, tbt, tsl


def short_jobs_take_small_blocks(blocks, max_len, slots):
    """Whether ``blocks`` unsplit jobs of at most ``max_len`` keys, on ``slots`` resident blocks
    of the ``BATCH_CONFIGS`` configuration, run in ``SHORT_JOB_CONFIGS`` blocks instead."""
    low, high = SHORT_JOB_WAVES
    return max_len <= SHORT_JOB_MAX_KEYS and low * slots <= blocks <= high * slots


@functools.lru_cache(maxsize=4096)
def launch_plan(batch, q_len, nheads, nheads_k, headdim, block_size, max_blocks_per_seq,
                dtype, num_splits=None, tuning=None):
    """How ``paged_decode_attention`` runs these shapes: the kernel configuration
    ``(headdim, m16, page8, is_bf16, warps, stages, q_smem, l2_prefetch)``, the split count,
    the query rows a KV head has (``group * q_len``) and their row tiles, and the blocks a split.
    ``tuning``: ``(warps, stages, q_smem[, l2_prefetch])`` forced (``TUNING.tuning``)."""
    group = nheads // nheads_k
    rows_total = group * q_len
    m16 = rows_total > 8
    row_tiles = -(-rows_total // (16 if m16 else 8))
    blocks = batch * nheads_k * row_tiles
    q_smem = headdim >= Q_IN_SHARED_FROM
    l2_prefetch = L2_PREFETCH
    max_len = max_blocks_per_seq * block_size

    def config_of(warps, stages):
        return (headdim, m16, block_size == 8, dtype == "bfloat16", warps, stages, q_smem,
                l2_prefetch)

    if SIMULATOR:
        warps, stages = SIMULATOR_CONFIG
    elif headdim in BATCH_CONFIGS and blocks >= sm_count():
        warps, stages = BATCH_CONFIGS[headdim]
        if headdim in SHORT_JOB_CONFIGS:
            slots = sm_count() * resident_blocks_per_sm(*config_of(warps, stages))
            if short_jobs_take_small_blocks(blocks, max_len, slots):
                warps, stages = SHORT_JOB_CONFIGS[headdim]
    else:
        warps, stages = CONFIGS[headdim]
    if tuning is not None:
        warps, stages, q_smem = tuning[:3]
        if len(tuning) > 3:
            l2_prefetch = tuning[3]
    config = config_of(warps, stages)
    if num_splits is None:
        slots = sm_count() * resident_blocks_per_sm(*config)
        num_splits = choose_num_splits(blocks, max_len, warps, slots)
    return {"config": config, "num_splits": int(num_splits), "group": group,
            "rows_total": rows_total, "row_tiles": row_tiles, "blocks": blocks}


def paged_decode_attention(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                           block_table: ArrayLike, seq_lens: ArrayLike, *,
                           softmax_scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                           out: ArrayLike | None = None, stream: StreamLike = None,
                           num_splits: int | None = None, check_bounds: bool | None = None
                           ) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """Attention of the newest tokens of each sequence over its paged KV cache.

    q: (batch, nheads, headdim), or (batch, q_len, nheads, headdim) for ``q_len`` new tokens
    (speculative decoding), fp16 or bf16. k_cache, v_cache: (num_blocks, block_size, nheads_k,
    headdim), q's dtype, ``nheads_k`` dividing ``nheads``, ``block_size`` a power of two in
    [8, 256], ``headdim`` in (16, 32, 64, 128, 256), rows contiguous and 16-byte aligned.
    block_table: int32 (batch, max_blocks_per_seq), page ids of each sequence in order.
    seq_lens: int32 (batch,), each sequence's length *including* the q_len new tokens, which
    must already be in the cache (``paged_kv_append``).

    Query ``t`` sits at position ``seq_len - q_len + t`` and attends the positions up to it
    (bottom-right causal), and no further back than ``window_size[0]`` positions (-1: no limit);
    ``window_size[1]`` must be -1 or 0 (both: causal). ``softmax_scale`` defaults to
    ``1 / sqrt(headdim)``.

    Returns ``out`` shaped like q (q's dtype, in q's array kind), and with ``return_lse`` also
    ``lse`` float32 (batch, nheads) for 3-D q or (batch, nheads, q_len) for 4-D q (natural log;
    ``-inf`` for a query with nothing to attend). ``num_splits``: split-K count (None: chosen
    from the shapes, see the module docstring). ``check_bounds``: see the module docstring.

    Errors: ``TypeError`` (not an array, dtype, options of the wrong type), ``ValueError``
    (shapes, strides, alignment, option values; with checks on, seq_lens / block_table
    contents), ``NotImplementedError`` (headdim, block_size, window_size[1] > 0).
    """
    key = _fast_key(q, k_cache, v_cache, block_table, seq_lens, out, softmax_scale, window_size,
                    return_lse, stream, num_splits, check_bounds)
    if key is not None:
        fast = _FAST.get(key)
        if fast is not None:
            result = fast(q, k_cache, v_cache, block_table, seq_lens, out, stream)
            if result is not None:
                return result
    tq, tk, tv, tbt, tsl = _validate(q, k_cache, v_cache, block_table, seq_lens)
    batch = tq.shape[0]
    nheads, headdim = tq.shape[-2], tq.shape[-1]
    num_blocks, block_size, nheads_k, _ = tk.shape
    q_len = tq.shape[1] if tq.ndim == 4 else 1
    scale, left = _check_options(softmax_scale, window_size, headdim, num_splits)
    boolean("return_lse", return_lse)
    if check_bounds is not None:
        boolean("check_bounds", check_bounds)
    lse_shape = (batch, nheads, q_len) if tq.ndim == 4 else (batch, nheads)
    out_given = out is not None
    to = output("out", out, tq.shape, tq.dtype, tq)
    if to is None:
        out = empty(tq, tq.shape, tq.dtype)
        to = tensor(out, "out")
    lse = None
    if return_lse:
        lse = empty(tq, lse_shape, "float32")
        tl = tensor(lse, "lse")
    if check_bounds is None:
        check_bounds = SIMULATOR or tbt.kind == "numpy"
    if check_bounds:
        check_tables(host_ints(tbt), host_ints(tsl), num_blocks, block_size)
    if batch == 0 or nheads == 0:
        return (out, lse) if return_lse else out

    tuning = TUNING.tuning
    plan = launch_plan(batch, q_len, nheads, nheads_k, headdim, block_size, tbt.shape[1],
                       tq.dtype, None if num_splits is None else int(num_splits),
                       None if tuning is None else tuple(tuning))
    config, num_splits = plan["config"], plan["num_splits"]
    warps, stages, q_smem = config[4:7]
    group, rows_total, row_tiles = plan["group"], plan["rows_total"], plan["row_tiles"]
    blocks, max_slots = plan["blocks"], tbt.shape[1]

    # strides, with q (and out, lse) seen as 4-D / 3-D
    if tq.ndim == 4:
        sqb, sqt, sqh, sqd = tq.strides
        sob, sot, soh, sod = to.strides
    else:
        (sqb, sqh, sqd), sqt = tq.strides, 0
        (sob, soh, sod), sot = to.strides, 0
    slb = slh = slt = 0
    if return_lse:
        if tq.ndim == 4:
            slb, slh, slt = tl.strides
        else:
            slb, slh = tl.strides
    handle = stream_handle(stream, (tq, tk))
    split = num_splits > 1
    rows = batch * q_len * nheads
    work = (rows * num_splits * headdim, rows * num_splits, blocks)
    if split:
        po, pl, tickets = _workspace(tq, handle, *work)
    else:
        po = pl = _dummy(np.float32)
        tickets = _dummy(np.int32)
    lse_buf = kernel_buffer(tl) if return_lse else _dummy(np.float32)
    kernel = _decode_kernel(*config)
    main = (blocks * num_splits, 32 * warps,
            (kernel_buffer(tq), kernel_buffer(tk), kernel_buffer(tv), kernel_buffer(tbt),
             kernel_buffer(tsl), kernel_buffer(to), lse_buf, po, pl, tickets,
             sqb, sqt, sqh, sqd, *tk.strides[:3], *tv.strides[:3], *tbt.strides,
             tsl.strides[0], sob, sot, soh, sod, slb, slh, slt,
             q_len, nheads, nheads_k, group, rows_total, row_tiles, max_slots, num_blocks,
             block_size.bit_length() - 1, left, num_splits, scale * LOG2E, int(return_lse)),
            shared_bytes(headdim, warps, stages, q_smem))
    kernel(main[0], main[1], main[2], handle, main[3])
    if key is not None and not check_bounds and len(_FAST) < _FAST_MAX and not collecting():
        _FAST[key] = _FastCall(_decode_kernel(*config), main, out_given, tq,
                               lse_shape if return_lse else None, work if split else None)
    return (out, lse) if return_lse else out


# ---- the launch fast path --------------------------------------------------------------------
#
# A decode step is a few tens of microseconds of GPU time, as long as the generic launcher's
# Python work (reading six arrays, validating, planning, packing ~40 parameters). So the first
# call with torch tensors of a given signature (shapes, strides, dtypes, device, options)
# records its launches with every parameter packed; later calls of the same signature only read
# the buffers' pointers, patch them in and launch. Validation results depend only on the
# signature, except for the caches' 16-byte alignment, which is checked on every call.

#: Signatures kept (first come, first kept).
_FAST_MAX = 256
_FAST = {}
# forgotten with every op's recorded plans (``_overrides`` changed the kernel choice); the plans
# read the SM count, which ``_overrides`` may change too
_recording.on_clear(_FAST.clear)
_recording.on_clear(launch_plan.cache_clear)
#: (device, stream) -> _Workspace: split partials and folded-merge tickets of eager calls, kept
#: and grown, never shrunk (kernels on one stream run in order, so one stream's launches can
#: share it; the folded merge leaves every ticket 0 again). Calls captured into a CUDA graph
#: never use these (``_torch_workspace``).
_WORKSPACES = {}
#: Workspaces of captured calls: each captured call's own, alive as long as the process (the
#: graph replays into them).
_CAPTURED = []


def _sig(x):
    return (type(x),) + torch_signature(x)


def _fast_key(q, k_cache, v_cache, block_table, seq_lens, out, softmax_scale, window_size,
              return_lse, stream, num_splits, check_bounds):
    """The fast-path signature of a call with torch CUDA tensors, else None."""
    if SIMULATOR or type(q).__module__ != "torch":
        return None
    try:
        key = (_sig(q), _sig(k_cache), _sig(v_cache), _sig(block_table), _sig(seq_lens),
               None if out is None else _sig(out), softmax_scale, type(softmax_scale),
               tuple(window_size), tuple(map(type, window_size)), return_lse,
               type(return_lse), stream is None, num_splits, type(num_splits), check_bounds)
        hash(key)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return key


class _Workspace:
    """Split partials (float32 part_o, part_lse, made uninitialised) and tickets (int32, made
    zero) of one (device, stream) of eager calls; ``context``: the numba context the arrays
    belong to (a closed context's arrays are not reused)."""

    __slots__ = ("context", "pl", "po", "tickets")

    def __init__(self, context=None):
        self.po = self.pl = self.tickets = None
        self.context = context


def _grown(old, n, make):
    """``old`` when it holds ``n`` elements, else ``make(max(n, 2 x old size))``. The old one is
    dropped: only calls on this workspace's stream used it, and they run before anything that
    reuses its memory (torch's allocator orders by stream; numba frees synchronously)."""
    size = 0 if old is None else old.shape[0]
    if size >= max(n, 1):
        return old
    return make(max(n, 2 * size, 1))


_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


def _torch_buffer(t, dtype):
    """The ``Buffer`` of a 1-D torch workspace tensor, read directly (this runs on the fast
    path, where ``kernel_buffer(tensor(...))`` would cost about a microsecond an array)."""
    return Buffer(t.data_ptr(), t.numel(), dtype, t)


def _workspace(tq, stream, n_o, n_lse, n_tickets):
    """Kernel buffers (part_o, part_lse, tickets) of at least n_o / n_lse float32 and n_tickets
    zero int32 for split partials on ``stream``."""
    if tq.kind == "torch":
        return _torch_workspace(tq.obj.device, stream, n_o, n_lse, n_tickets)
    if SIMULATOR:
        device, context = 0, None

        def zeros(n, dtype):
            return np.zeros(n, dtype)
    else:
        context = cuda.current_context()
        device = context.device.id

        def zeros(n, dtype):
            array = cuda.to_device(np.zeros(n, dtype))
            cuda.synchronize()  # zero before any stream's kernel reads it (made rarely)
            return array
    ws = _WORKSPACES.get((device, stream))
    if ws is None or ws.context is not context:
        ws = _WORKSPACES[(device, stream)] = _Workspace(context)
    ws.po = _grown(ws.po, n_o, lambda n: zeros(n, np.float32))
    ws.pl = _grown(ws.pl, n_lse, lambda n: zeros(n, np.float32))
    ws.tickets = _grown(ws.tickets, n_tickets, lambda n: zeros(n, np.int32))
    return tuple(kernel_buffer(tensor(a, "workspace")) for a in (ws.po, ws.pl, ws.tickets))


def _torch_workspace(device, stream, n_o, n_lse, n_tickets):
    """As ``_workspace``, for torch tensors. Under CUDA-graph capture each captured call gets a
    workspace of its own, its tickets zeroed by a memset captured before the kernel: a graph
    then starts every replay from zero tickets whatever ran before, and never shares partials
    or tickets with another graph (replayed concurrently, or captured after it) or with eager
    calls. Eager calls share one workspace per (device, stream), its tickets zeroed on that
    stream when made."""
    import torch

    current = torch_current_stream(device.index)
    if stream == current:
        capturing = torch.cuda.is_current_stream_capturing()
        launch_stream = None
    else:
        launch_stream = torch.cuda.ExternalStream(stream, device=device)
        with torch.cuda.stream(launch_stream):
            capturing = torch.cuda.is_current_stream_capturing()

    def alloc(n, dtype, make=torch.empty):
        # on the launch stream, so torch's allocator orders the memory's reuse after our kernels
        if launch_stream is None:
            return make(n, dtype=dtype, device=device)
        with torch.cuda.stream(launch_stream):
            return make(n, dtype=dtype, device=device)

    if capturing:
        po = alloc(max(n_o, 1), torch.float32)
        pl = alloc(max(n_lse, 1), torch.float32)
        tickets = alloc(max(n_tickets, 1), torch.int32, torch.zeros)
        _CAPTURED.append((po, pl, tickets))
    else:
        ws = _WORKSPACES.get((device, stream))
        if ws is None:
            ws = _WORKSPACES[(device, stream)] = _Workspace()
        ws.po = _grown(ws.po, n_o, lambda n: alloc(n, torch.float32))
        ws.pl = _grown(ws.pl, n_lse, lambda n: alloc(n, torch.float32))
        ws.tickets = _grown(ws.tickets, n_tickets, lambda n: alloc(n, torch.int32, torch.zeros))
        po, pl, tickets = ws.po, ws.pl, ws.tickets
    return _torch_buffer(po, _F32), _torch_buffer(pl, _F32), _torch_buffer(tickets, _I32)


class _FastCall:
    """The recorded launches of one call signature (see above)."""

    def __init__(self, kernel, main, out_given, tq, lse_shape, work):
        self.main = PreparedLaunch(kernel, *main)
        self.out_given = out_given
        self.shape, self.dtype, self.device = tuple(tq.shape), tq.obj.dtype, tq.obj.device
        self.lse_shape = lse_shape
        self.work = work

    def __call__(self, q, k_cache, v_cache, block_table, seq_lens, out, stream):
        import torch

        kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
        if (kp | vp) & 15:
            return None  # the generic path raises
        if not self.out_given:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        lse = None
        lp = 0
        if self.lse_shape is not None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            lp = lse.data_ptr()
        handle = torch_current_stream() if stream is None else stream_handle(stream, ())
        op = out.data_ptr()
        wo = wl = wt = 0
        if self.work is not None:
            po, pl, tickets = _torch_workspace(self.device, handle, *self.work)
            wo, wl, wt = po.ptr, pl.ptr, tickets.ptr
        self.main((q.data_ptr(), kp, vp, block_table.data_ptr(), seq_lens.data_ptr(), op, lp,
                   wo, wl, wt), handle)
        return (out, lse) if self.lse_shape is not None else out


# ---- compile-only check -------------------------------------------------------------------

def _compile_target(*config):
    return lambda: (_decode_kernel_fn(*config), _DECODE_SIGNATURE)


# D 128 m8 bf16 is the benchmarked batch-1 / batch-32 decode (GQA 4 and MHA alike); "batch":
# the configuration taken when the blocks fill the GPU unsplit, "short": many short jobs
_TABLES = {"": CONFIGS, "batch": BATCH_CONFIGS, "short": SHORT_JOB_CONFIGS}
for _dim, _m16, _page8, _bf16, _table in ((128, False, False, True, ""),
                                          (128, False, False, True, "batch"),
                                          (128, False, False, True, "short"),
                                          (128, True, False, True, ""),
                                          (128, False, True, False, ""),
                                          (64, False, False, True, ""),
                                          (256, False, False, False, ""),
                                          (256, True, False, True, "")):
    _warps, _stages = _TABLES[_table][_dim]
    compile_check.register(
        f"paged_decode_d{_dim}_{'m16' if _m16 else 'm8'}{'_page8' if _page8 else ''}_"
        f"{'bf16' if _bf16 else 'f16'}{'_' + _table if _table else ''}",
        _compile_target(_dim, _m16, _page8, _bf16, _warps, _stages,
                        _dim >= Q_IN_SHARED_FROM, L2_PREFETCH),
        ptx_must_have=("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned.m8n8.x4.shared",
                       "ldmatrix.sync.aligned.m8n8.x4.trans",
                       f"cp.async.cg.shared.global.L2::{L2_PREFETCH}B" if L2_PREFETCH
                       else "cp.async.cg.shared.global"),
        sass_must_have=("HMMA", "LDSM", "LDGSTS"))
