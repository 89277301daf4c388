"""Device pieces shared by the attention kernels (FlashAttention forward, paged decode).

Mask convention (FlashAttention 2, bottom-right aligned): with ``offset = seqlen_k - seqlen_q``,
query row ``i`` attends key ``j < seqlen_k`` iff
``j >= i + offset - window_left`` (skipped when ``window_left < 0``) and
``j <= i + offset + window_right`` (skipped when ``window_right < 0``); causal is
``window_right = 0``. ``llmspeed_numba.reference.attention`` is the float64 statement of it.

Online softmax convention (FlashAttention forward): scores ``s`` are kept unscaled; a row keeps
its running maximum ``m`` (unscaled) and its running sum ``l`` of
``exp2(s * scale_log2 - m * scale_log2)``, where ``scale_log2 = softmax_scale * log2(e)``, so each
probability is one FMA and one ``ex2``. A row with no attended key so far has ``m = -inf``;
``scaled_max`` maps it to 0 so that every ``exp2`` sees ``-inf`` (giving 0), never
``-inf - -inf`` (NaN).

Paged decode keeps its state in log2 units instead: scores are multiplied by ``scale_log2`` as
soon as they are made, a row's maximum is of those scaled scores, and ``exp2_base`` plays the part
of ``scaled_max`` (``softmax_step``, ``merge_state``, ``row_lse2``).

Every helper is an ``inline="always"`` device function (compiles offline, and runs as plain
Python under the simulator).
"""

import math

import numpy as np

from .. import ptx
from .._env import SIMULATOR, cuda

NEG_INF = np.float32(-np.inf)
LOG2E = math.log2(math.e)

_device = cuda.jit(device=True, inline="always")

if SIMULATOR:
    fmax = max
else:
    from numba.cuda import libdevice

    #: float32 maximum as one FMNMX (Python's ``max`` compiles to a compare and a select).
    fmax = libdevice.fmaxf


@_device
def attends(row, col, offset, window_left, window_right):
    """True when query ``row`` attends key ``col`` (the ``col < seqlen_k`` bound is separate)."""
    diagonal = row + offset
    return (window_left < 0 or col >= diagonal - window_left) and (
        window_right < 0 or col <= diagonal + window_right)


@_device
def key_bounds(row_lo, row_hi, offset, seqlen_k, window_left, window_right):
    """Keys ``[lo, hi)`` that any query row in ``[row_lo, row_hi)`` may attend (``hi <= lo``:
    none). Blocks of keys outside it are skipped."""
    lo = 0
    hi = seqlen_k
    if window_left >= 0:
        lo = max(0, row_lo + offset - window_left)
    if window_right >= 0:
        hi = min(seqlen_k, row_hi - 1 + offset + window_right + 1)
    return lo, hi


@_device
def row_key_range(row, offset, seqlen_k, window_left, window_right):
    """Inclusive range ``[first, last]`` of the keys query ``row`` attends (``last < first``:
    none): a mask test per element is then two compares."""
    diagonal = row + offset
    first = 0
    last = seqlen_k - 1
    if window_left >= 0:
        first = max(first, diagonal - window_left)
    if window_right >= 0:
        last = min(last, diagonal + window_right)
    return first, last


@_device
def block_is_full(row_lo, row_hi, col_lo, col_hi, offset, seqlen_k, window_left, window_right):
    """True when every query row in ``[row_lo, row_hi)`` attends every key in
    ``[col_lo, col_hi)``: such a block needs no mask."""
    if col_hi > seqlen_k:
        return False
    if window_right >= 0 and col_hi - 1 > row_lo + offset + window_right:
        return False
    if window_left >= 0 and col_lo < row_hi - 1 + offset - window_left:
        return False
    return True


@_device
def clamped_range(cu_seqlens, batch, total):
    """``(start, length)`` of sequence ``batch``'s rows ``cu_seqlens[batch]:cu_seqlens[batch +
    1]``, clamped to ``[0, total]`` (an empty range where the offsets decrease): a kernel reading
    packed rows through offsets it never validated stays in bounds whatever they hold. In int32
    throughout: a min / max with an int64 literal widens the offsets, and the 64-bit values held
    over the kernel's loop cost registers."""
    total = np.int32(total)
    start = min(max(np.int32(cu_seqlens[batch]), np.int32(0)), total)
    end = min(max(np.int32(cu_seqlens[batch + 1]), start), total)
    return start, end - start


@_device
def varlen_sequence(cu_seqlens_q, cu_seqlens_k, batch, total_q, total_k):
    """``(q_start, seqlen_q, k_start, seqlen_k)`` of packed sequence ``batch``, its query rows
    clamped to ``[0, total_q]``. A sequence whose key offsets are not ``0 <= start <= end <=
    total_k`` gets no query rows, so its blocks return before reading K or V. The keys are
    checked rather than clamped: a clamped key length made the Tensor Core kernel's loop 12%
    slower on the H200 (the query clamp costs nothing)."""
    q_start, seqlen_q = clamped_range(cu_seqlens_q, batch, total_q)
    k_start = np.int32(cu_seqlens_k[batch])
    k_end = np.int32(cu_seqlens_k[batch + 1])
    if k_start < 0 or k_end < k_start or k_end > np.int32(total_k):
        seqlen_q = np.int32(0)
    return q_start, seqlen_q, k_start, k_end - k_start


@_device
def scaled_max(row_max, scale_log2):
    """``row_max * scale_log2``, or 0 for a row with nothing attended yet (``-inf``)."""
    if row_max == NEG_INF:
        return np.float32(0.0)
    return row_max * scale_log2


@_device
def rescale_factor(old_max, new_max_scaled, scale_log2):
    """Factor ``exp2(old_max * scale_log2 - new_max_scaled)`` that moves a row's sum and output
    from its old maximum to the new one (0 when the old maximum is ``-inf``)."""
    return ptx.ex2_approx(cuda.fma(old_max, scale_log2, -new_max_scaled))


@_device
def finish_row(row_max, row_sum, softmax_scale):
    """``(1 / row_sum, lse)`` of a finished row; ``(0, -inf)`` for a row that attended nothing."""
    if row_sum > np.float32(0.0):
        return (np.float32(1.0) / row_sum,
                row_max * softmax_scale + np.float32(math.log(row_sum)))
    return np.float32(0.0), NEG_INF


# ---- online softmax in log2 units (paged decode) --------------------------------------------

@_device
def exp2_base(m):
    """What scores are measured from: the row's max ``m``, or 0 while nothing is attended
    (``m = -inf``), so that ``exp2`` sees ``-inf`` (giving 0), never ``-inf - -inf`` (NaN)."""
    if m == NEG_INF:
        return np.float32(0.0)
    return m


@_device
def softmax_step(m, l, x0, x1, x2, x3):
    """One key tile of a row's online softmax: the row's four scores in this lane (log2 units),
    its running max ``m`` and sum ``l`` across the lane's quad -> ``(m, l, alpha, p0..p3)``,
    ``alpha`` rescaling the row's earlier output and ``p`` the tile's probabilities."""
    mx = max(max(x0, x1), max(x2, x3))
    mx = max(mx, ptx.shfl_xor_f32(mx, 1))
    mx = max(mx, ptx.shfl_xor_f32(mx, 2))
    m_new = max(m, mx)
    base = exp2_base(m_new)
    alpha = ptx.ex2_approx(m - base)
    p0 = ptx.ex2_approx(x0 - base)
    p1 = ptx.ex2_approx(x1 - base)
    p2 = ptx.ex2_approx(x2 - base)
    p3 = ptx.ex2_approx(x3 - base)
    return m_new, l * alpha + ((p0 + p1) + (p2 + p3)), alpha, p0, p1, p2, p3


@_device
def row_lse2(big, total):
    """A row's log2-sum-exp from its max (log2 units) and the sum of 2^(x - max)."""
    if total > np.float32(0.0):
        return big + math.log2(total)
    return NEG_INF


@_device
def merge_state(m, l, a0, a1, a2, a3, m2, l2, b0, b1, b2, b3):
    """Two partial softmax states of one row (log2 max, sum, four unnormalised outputs) as one;
    a state with ``m = -inf`` (nothing attended) adds nothing."""
    big = max(m, m2)
    base = exp2_base(big)
    f = ptx.ex2_approx(m - base)
    f2 = ptx.ex2_approx(m2 - base)
    return (big, l * f + l2 * f2, a0 * f + b0 * f2, a1 * f + b1 * f2, a2 * f + b2 * f2,
            a3 * f + b3 * f2)
