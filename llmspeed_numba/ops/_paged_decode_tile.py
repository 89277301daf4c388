"""The paged-decode kernel's math on one key tile: Q's A fragments, ``S = Q K^T``, the mask, the
online softmax and ``O += P V`` (FlashAttention-2 style, on m16n8k16 ``mma``).

A block's query rows (8 or 16, ``_paged_decode_layout.rows``) are the M rows of the mma; lane
``(g, t4) = (lane // 4, lane % 4)`` holds rows ``g`` and ``g + 8`` of each fragment. Q's A
fragments live in registers (``q_registers``: loaded first, packed once the page ids are in
flight), or from ``Q_IN_SHARED_FROM`` in a shared-memory Q tile re-read by ``ldmatrix`` for each
key tile (``q_shared``). K is read by ``ldmatrix.x4`` (K rows are columns of K^T), V by
``ldmatrix.x4.trans``; P's C fragments are reused as the A fragments of the P V step. Scores are
masked only on tiles that cross a window edge or the sequence end; the online softmax runs in
registers in log2 units (``_attention_common.softmax_step``).
"""

import functools

import numpy as np

from .. import ptx
from .._env import cuda
from ._attention_common import NEG_INF, softmax_step
from ._index32 import udiv
from ._paged_decode_layout import TILE, pitch, ring_offset, ring_pitch, rows, warp_elems

_ZERO_U32 = np.uint32(0)
_F0 = np.float32(0.0)


@cuda.jit(device=True, inline="always")
def _mask_row(c0, lo, hi, a0, a1, b0, b1):
    """A row's four scores of this lane (keys ``c0``, ``c0 + 1``, ``c0 + 8``, ``c0 + 9``),
    -inf outside the row's keys ``[lo, hi]``."""
    if c0 < lo or c0 > hi:
        a0 = NEG_INF
    if c0 + 1 < lo or c0 + 1 > hi:
        a1 = NEG_INF
    if c0 + 8 < lo or c0 + 8 > hi:
        b0 = NEG_INF
    if c0 + 9 < lo or c0 + 9 > hi:
        b1 = NEG_INF
    return a0, a1, b0, b1


def q_registers_count(head_dim, m16, q_smem):
    """32-bit Q registers a lane keeps (1, unused, with the Q tile in shared memory)."""
    return 1 if q_smem else (4 if m16 else 2) * (head_dim // 16)


@functools.lru_cache(maxsize=None)
def q_registers(head_dim, m16):
    """Device functions ``(load_q, pack_q)`` of Q's A fragments in registers.

    ``load_q(q, raw, b, kvh, r0, r1, rows_total, group, sq, t4)``: every 16-bit element of this
    lane's fragments of query rows ``r0`` and ``r1`` (``r0 + 8``) into ``raw`` (KSTEPS, 2, 2, 2),
    all loads issued at once, none behind a branch: a row past ``rows_total`` reads the last
    valid row (zeroed when packed). ``sq``: q's (batch, token, head, dim) strides.

    ``pack_q(raw, qa, live0, live1)``: the A fragments into ``qa``, the rows not ``live``
    zero."""
    KSTEPS = head_dim // 16    # k16 steps of Q K^T
    QR = 4 if m16 else 2       # Q registers a lane keeps per k16 step

    @cuda.jit(device=True, inline="always")
    def load_q(q, raw, b, kvh, r0, r1, rows_total, group, sq, t4):
        sqb, sqt, sqh, sqd = sq
        r0c = min(r0, rows_total - 1)
        tq = udiv(r0c, group)
        q0 = b * sqb + tq * sqt + (kvh * group + r0c - tq * group) * sqh
        r1c = min(r1, rows_total - 1)
        tq = udiv(r1c, group)
        q1 = b * sqb + tq * sqt + (kvh * group + r1c - tq * group) * sqh
        for ks in range(KSTEPS):
            for half in range(2):
                d = (16 * ks + 8 * half + 2 * t4) * sqd
                raw[ks, half, 0, 0] = q[q0 + d]
                raw[ks, half, 0, 1] = q[q0 + d + sqd]
                if m16:
                    raw[ks, half, 1, 0] = q[q1 + d]
                    raw[ks, half, 1, 1] = q[q1 + d + sqd]

    @cuda.jit(device=True, inline="always")
    def pack_q(raw, qa, live0, live1):
        for ks in range(KSTEPS):
            for half in range(2):
                v0 = np.uint32(raw[ks, half, 0, 0]) | (
                    np.uint32(raw[ks, half, 0, 1]) << np.uint32(16))
                if not live0:
                    v0 = _ZERO_U32
                if m16:
                    v1 = np.uint32(raw[ks, half, 1, 0]) | (
                        np.uint32(raw[ks, half, 1, 1]) << np.uint32(16))
                    if not live1:
                        v1 = _ZERO_U32
                    qa[QR * ks + 2 * half] = v0
                    qa[QR * ks + 2 * half + 1] = v1
                else:
                    qa[QR * ks + half] = v0

    return load_q, pack_q


@functools.lru_cache(maxsize=None)
def q_shared(head_dim, m16, warps, stages):
    """Device function ``load_q_tile(smem, q, tid, b, kvh, row_first, rows_total, group, sq)``:
    the block's Q tile into shared memory after the warps' rings (rows past ``rows_total``
    zero), ``Q_GROUP`` loads in flight a thread (clamped to a valid row, zeroed when stored)
    before any is stored. Every thread of the block calls it (it synchronises the block)."""
    D = head_dim
    ROWS = rows(m16)
    THREADS = 32 * warps
    PITCH = pitch(D)
    Q_BASE = warps * warp_elems(D, stages)
    Q_PER_THREAD = -(-ROWS * D // THREADS)   # Q tile elements a thread loads
    Q_GROUP = min(16, Q_PER_THREAD)

    @cuda.jit(device=True, inline="always")
    def load_q_tile(smem, q, tid, b, kvh, row_first, rows_total, group, sq):
        sqb, sqt, sqh, sqd = sq
        for e0 in range(0, Q_PER_THREAD, Q_GROUP):
            vals = cuda.local.array(Q_GROUP, np.uint16)
            for u in range(Q_GROUP):
                e = min(tid + (e0 + u) * THREADS, ROWS * D - 1)
                r = e // D
                gr = min(row_first + r, rows_total - 1)
                tq = udiv(gr, group)
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

    return load_q_tile


@functools.lru_cache(maxsize=None)
def fragment_lanes(head_dim, m16, warps, stages):
    """Device functions ``(k_at, v_at, q_at)`` of this lane's ``ldmatrix`` row offsets, computed
    once. ``k_at(lane, j)`` / ``v_at(lane, j)``: in a K / V tile of the ring (K: x4 over key
    rows 0-15 in two column halves; V: .trans over key rows 0-15), of the row's 16-byte chunk
    read at k16 steps ``j, j + 4, ...`` (a row's chunk ``c + 8a`` sits 8a chunks after chunk
    ``c``: the swizzle only permutes a row's chunks within each aligned group of 8, so
    ``j < 4`` cover every step). ``q_at(lane)``: in the shared Q tile (x4: rows 0-15; x2: rows
    0-7). The kernel keeps them in registers: filled by its own loop, not by a device
    function's, which left the tile loop's fragment loads rolled."""
    ROWS = rows(m16)
    PITCH = pitch(head_dim)
    Q_BASE = warps * warp_elems(head_dim, stages)
    ring_at = ring_offset(head_dim)

    @cuda.jit(device=True, inline="always")
    def k_at(lane, j):
        return ring_at(((lane >> 4) << 3) + (lane & 7), ((lane >> 3) & 1) + 2 * j)

    @cuda.jit(device=True, inline="always")
    def v_at(lane, j):
        return ring_at((((lane >> 3) & 1) << 3) + (lane & 7), (lane >> 4) + 2 * j)

    @cuda.jit(device=True, inline="always")
    def q_at(lane):
        return Q_BASE + (lane % ROWS) * PITCH + ((lane // ROWS) % 2) * 8

    return k_at, v_at, q_at


@functools.lru_cache(maxsize=None)
def tile_attention(head_dim, m16, is_bf16, q_smem):
    """Device function ``attend_tile(smem, kbase, qa, q_ld, k_sw, v_sw, o, m_0, l_0, m_1, l_1,
    pos, full_lo, full_hi, lo_0, hi_0, lo_1, hi_1, scale_log2, t4) -> (m_0, l_0, m_1, l_1)``:
    the key tile at position ``pos``, its K at ``kbase`` of the ring (V after it), folded into
    this lane's accumulators ``o`` (NT, OC) and the online-softmax states (max, partial sum) of
    rows ``g`` and ``g + 8``. Row ``g`` attends keys ``[lo_0, hi_0]`` (``g + 8``:
    ``[lo_1, hi_1]``); a tile within ``[full_lo, full_hi]`` is not masked. Every lane of the
    warp calls it (mma, shuffles)."""
    KSTEPS = head_dim // 16    # k16 steps of Q K^T; also pairs of n8 tiles of P V
    TILE_ELEMS = TILE * ring_pitch(head_dim)
    Q_SMEM = q_smem
    mma = ptx.mma_bf16 if is_bf16 else ptx.mma_f16
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2

    @cuda.jit(device=True, inline="always")
    def attend_tile(smem, kbase, qa, q_ld, k_sw, v_sw, o, m_0, l_0, m_1, l_1, pos, full_lo,
                    full_hi, lo_0, hi_0, lo_1, hi_1, scale_log2, t4):
        vbase = kbase + TILE_ELEMS
        sa0 = _F0
        sa1 = _F0
        sa2 = _F0
        sa3 = _F0
        sb0 = _F0
        sb1 = _F0
        sb2 = _F0
        sb3 = _F0
        for ks in range(KSTEPS):
            b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, kbase + k_sw[ks % 4] + (ks // 4) * 64)
            if Q_SMEM:
                if m16:
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, q_ld + 16 * ks)
                else:
                    a0, a2 = ptx.ldmatrix_x2(smem, q_ld + 16 * ks)
                    a1 = _ZERO_U32
                    a3 = _ZERO_U32
            elif m16:
                a0 = qa[4 * ks]
                a1 = qa[4 * ks + 1]
                a2 = qa[4 * ks + 2]
                a3 = qa[4 * ks + 3]
            else:
                a0 = qa[2 * ks]
                a1 = _ZERO_U32
                a2 = qa[2 * ks + 1]
                a3 = _ZERO_U32
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
        if pos < full_lo or pos + TILE - 1 > full_hi:
            c0 = pos + 2 * t4
            sa0, sa1, sb0, sb1 = _mask_row(c0, lo_0, hi_0, sa0, sa1, sb0, sb1)
            if m16:
                sa2, sa3, sb2, sb3 = _mask_row(c0, lo_1, hi_1, sa2, sa3, sb2, sb3)
        # online softmax, row g (and g + 8)
        m_0, l_0, alpha_0, sa0, sa1, sb0, sb1 = softmax_step(m_0, l_0, sa0, sa1, sb0, sb1)
        alpha_1 = _F0
        if m16:
            m_1, l_1, alpha_1, sa2, sa3, sb2, sb3 = softmax_step(m_1, l_1, sa2, sa3, sb2, sb3)
        # P's C fragments are the A fragment of the P V step
        p0 = pack(sa0, sa1)
        p2 = pack(sb0, sb1)
        p1 = _ZERO_U32
        p3 = _ZERO_U32
        if m16:
            p1 = pack(sa2, sa3)
            p3 = pack(sb2, sb3)
        for pair in range(KSTEPS):
            b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(smem, vbase + v_sw[pair % 4] + (pair // 4) * 64)
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
                    _F0, _F0)
                o[n1, 0], o[n1, 1], _, _ = mma(
                    p0, p1, p2, p3, b2, b3, o[n1, 0] * alpha_0, o[n1, 1] * alpha_0,
                    _F0, _F0)
        return m_0, l_0, m_1, l_1

    return attend_tile
