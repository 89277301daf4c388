"""The few-row kernel of ``quant_gemm`` for 4-bit weights: codes streamed by 1-D bulk copies
through an mbarrier ring, dequantized in registers and summed by ``mma.sync`` (sm_90).

At M <= 16 (decode) every code is read once and used M times: the kernel must keep HBM busy and
spend few instructions a code. Bulk copies keep a block's next stages in flight without a
register or an instruction a byte (the producer is one thread); the Tensor Cores do the products,
so a code costs about a tenth of an instruction of a lane (a LOP3 and half a packed subtraction
per pair of codes, a share of one LDS.32 and of an HMMA), against about six in the SIMT decode
kernel (``_quant_kernels``).

Block: ``warps`` consumer warps and one producer warp (the last). The block owns the ``16 *
warps`` output columns ``n0 ..`` (weight rows) and a range of ``kspan`` chunks of K (split over
``gridDim.y``; a chunk is 32 k, one 16-byte word quad of a row in ``quant_weight``'s chunk-major
layout).

- Producer (one thread): ring stage ``j % stages`` holds ``STAGE_CHUNKS`` chunks of the block's
  rows (one bulk copy a chunk: a chunk's rows are contiguous) and the scales (zero points,
  minimums) of the stage's scale units (one copy an array and unit: a group's row of ``(groups,
  N)``); the stage's ``full`` barrier counts the bytes. The first ``stages`` stages are issued
  before x is staged, so the copies and x's loads overlap.
- x: every thread stages x[0:m_block, the block's K] once, as fp16 / bf16 bits in shared
  memory, zeros past M and K, each run of 8 k stored in the order [0, 4, 1, 5, 2, 6, 3, 7]
  (below), and (affine weights) the sums of x over each scale unit.
- Consumer warp w: rows n0 + 16w .. + 16 are the A operand of m16n8k16, x the B operand (8
  tokens a fragment). Lane (g, t) reads word t of rows g and g + 8 of each chunk (two
  conflict-free LDS.32: 8 codes each, k = 8t .. 8t + 7 of the chunk). A code OR-ed into the
  mantissa of the half 1024 (fp16) or 128 (bf16) is that half plus the code, exactly; one packed
  subtraction of (magic + zero point) leaves ``q - z`` in both lanes of a pair, exactly. The
  pairs a mask yields are nibbles (i, i + 4): the MMA's k slots are a permutation of the chunk's
  k, the same for every lane of a given t, and x is stored in that permutation, so its B
  fragment is one LDS.128 (16 bytes of token g's run of 8 k at 8t: the pairs (0, 4), (1, 5) for
  the first k16 step and (2, 6), (3, 7) for the second).
- Scales: the MMAs of one scale unit (``min(group, stage)`` chunks, a whole stage for one group
  a row) sum exact ``(q - z) x`` products in fp32; the unit's sum is then scaled per row in fp32
  (``acc += s * sum``; affine: ``+ m * sum(x over the unit)``), so no weight is rounded.
- Split K: fp32 partial sums (splits, M, N) and the last block of a column range sums them and
  applies the epilogue (one launch, ``_last_block``). Without a split, lanes store their
  outputs directly (bias, activation, rounding: ``_epilogue``).
- Gated activations (``silu_and_mul``, ``gelu_and_mul``; the weight's rows gate and up
  interleaved in blocks of 8, ``ops/gemm_gated.py``): a warp's 16 rows are 8 gate rows and
  their 8 up rows, so a lane holds each gate sum beside its up sum (rows g and g + 8) and
  stores ``act(gate) * up`` at output column ``(n0 + 16 warp) / 2 + g``: (M, N / 2).

Accepted weights: 4-bit codes with N a multiple of 16 (every bulk copy of a row range of the
scales, zero points and codes is then whole 16-byte units); other weights take
``_quant_kernels``.
"""

import functools
import math

import numpy as np
from numba import types

from .. import ptx
from .._arrays import STORAGE
from .._env import cuda
from .._launch import Kernel, array1d, jit
from ._activations_device import GATED_ACTIVATIONS
from ._epilogue import (GATE_BLOCK, accumulating_epilogue, epilogue, gate_column,
                        gated_epilogue, loader, storer)
from ._index32 import udiv
from ._last_block import last_block
from ._quant_kernels import fused_norm_tail, norm_types, operand_types, sum_splits
from ._stage_ring import init_stage_barriers

#: Chunks (32 k each) of a ring stage: 16 bytes a row each (8 KB of codes at 64 rows).
STAGE_CHUNKS = 8
#: k of a chunk (16 bytes of 4-bit codes).
CHUNK_K = 32
#: x's staged rows are padded by 64 bytes, so the 8 tokens of a warp's LDS.128 hit distinct banks.
X_ROW_PAD_WORDS = 16
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NIBBLE_BYTES = np.uint32(0x0F0F0F0F)
#: PRMT selectors: bytes 0 and 2 (1 and 3) of the first source, each below byte 5 / 7 of the
#: second (the magic's exponent bytes): two codes as the low bytes of two halves.
_BYTES_0_2 = np.uint32(0x7250)
_BYTES_1_3 = np.uint32(0x7351)
_U4, _U16 = np.uint32(4), np.uint32(16)
_HALF = np.uint32(0xFFFF)
#: PRMT selectors joining two words' low (high) halves: x's run of 8 k into the MMA's k order.
_LOW_HALVES = np.uint32(0x5410)
_HIGH_HALVES = np.uint32(0x7632)
#: x runs (16 bytes) a thread has in flight while staging x.
X_RUNS_IN_FLIGHT = 4


def _magic(x_dtype):
    """Both halves of a uint32 set to the half whose mantissa's low bits hold a code exactly."""
    return np.uint32(0x43004300 if x_dtype == "bfloat16" else 0x64006400)


def scale_unit(group_chunks):
    """Chunks summed before one scaling: a whole group when it fits a stage, else a stage
    (``group_chunks`` 0: one group a row)."""
    if group_chunks == 0 or group_chunks >= STAGE_CHUNKS:
        return STAGE_CHUNKS
    return group_chunks


def _itemsize(dtype):
    return np.dtype(STORAGE[dtype]).itemsize


def _aux_itemsize(mode, scale_dtype):
    if mode == "zeros":
        return 1
    return _itemsize(scale_dtype) if mode == "affine" else 0


def stage_words(block_n, group_chunks, mode, scale_dtype):
    """uint32 words of one ring stage: codes, then each unit's scales, then its aux values."""
    units = STAGE_CHUNKS // scale_unit(group_chunks)
    per_unit = block_n * (_itemsize(scale_dtype) + _aux_itemsize(mode, scale_dtype))
    return (STAGE_CHUNKS * block_n * 16 + units * per_unit) // 4


def x_row_words(kspan):
    return kspan * CHUNK_K // 2 + X_ROW_PAD_WORDS


def shared_bytes(warps, stages, m_block, kspan, group_chunks, mode, scale_dtype):
    """Dynamic shared memory of a block: the ring, x, and (affine) x's sums per scale unit."""
    block_n = 16 * warps
    words = stages * stage_words(block_n, group_chunks, mode, scale_dtype)
    words += m_block * x_row_words(kspan)
    if mode == "affine":
        words += m_block * (kspan // scale_unit(group_chunks))
    return 4 * words


def _half_loader(dtype):
    """Device function ``(word, index) -> float32``: element ``index`` (0 / 1) of a uint32
    holding two ``dtype`` halves, or the word itself as fp32 bits."""
    if dtype == "float32":
        @cuda.jit(device=True, inline="always")
        def load(word, index):
            return ptx.f32_from_bits(word)
    elif dtype == "bfloat16":
        @cuda.jit(device=True, inline="always")
        def load(word, index):
            return ptx.f32_from_bits(((word >> np.uint32(16 * index)) & _HALF) << _U16)
    else:
        @cuda.jit(device=True, inline="always")
        def load(word, index):
            return ptx.f16_to_f32(np.uint16((word >> np.uint32(16 * index)) & _HALF))
    return load


def kernel_fn(warps, stages, m_block, group_chunks, mode, zero_point, scale_dtype, x_dtype,
              out_dtype, bias_dtype, act, partial, programmatic=False, norm_dtype=None,
              x_norm_dtype=None, accumulate=False):
    """Kernel ``(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan, so_m,
    so_n, x_vec)``, grid (column blocks, splits), ``32 * (warps + 1)`` threads, ``shared_bytes``
    of dynamic shared memory (module docstring). ``kspan``: chunks a split, a multiple of
    ``STAGE_CHUNKS``. ``group_chunks``: chunks a group (1, 2, 4), 0 for one group a row.
    ``partial``: K split; ``work`` (fp32, splits * M * N) and ``counters`` (int32, a column
    block each, zero before the launch and left zero) are used only then. ``x_vec``: x is read
    in 16-byte runs (its address, row stride and K allow it), else element by element.
    ``programmatic``: launched as a programmatic dependent (``_launch.programmatic_launch``):
    a block first releases the next programmatic kernel's launch, the producer issues the first
    stages of the weight, which no kernel writes, and then every thread waits for the previous
    kernel (``griddep_wait``); x, the outputs and the split-K buffers are touched only after.
    ``norm_dtype`` (the norm weight's dtype; ``out_dtype`` then x's, no gated activation): the
    kernel takes seven more parameters (``_quant_kernels.norm_types``) and ends with vLLM's
    fused add + RMSNorm of its result (``_quant_kernels.add_rms_norm_rows``): once every column
    block has stored its outputs (a ticket on ``counters[gridDim.x]``, so ``counters`` holds
    one more), the last block adds them into ``residual`` and writes ``normed``.
    ``x_norm_dtype`` (a norm weight's dtype): the kernel takes two more parameters, the norm
    weight (K,) and eps, and multiplies ``rms_norm(x, norm weight, eps)`` instead of x: each
    block sums the squares of x's rows over the whole K (as ``ops/rms_norm.py`` computes them,
    summed in another order) and stages ``x * inv * w``, rounded to x's dtype.
    ``accumulate`` (no activation, out x's dtype): each output is added into ``out`` (the
    residual stream): ``out = round(round(acc + bias) + out)``, the projection rounded before the
    add as when it is stored and then added (``rms_norm``'s ``residual``)."""
    assert norm_dtype is None or (out_dtype == x_dtype and act not in GATED_ACTIVATIONS)
    assert not accumulate or (act is None and out_dtype == x_dtype and norm_dtype is None)
    assert x_norm_dtype is None or norm_dtype is None
    block_n = 16 * warps
    m_frags = -(-m_block // 8)
    S = STAGE_CHUNKS
    unit = scale_unit(group_chunks)
    units = S // unit
    ss = _itemsize(scale_dtype)
    aux_size = _aux_itemsize(mode, scale_dtype)
    words_per_stage = stage_words(block_n, group_chunks, mode, scale_dtype)
    codes_words = S * block_n * 4
    scale_words = units * block_n * ss // 4
    affine = mode == "affine"
    per_group_zero = mode == "zeros"
    has_aux = aux_size > 0
    threads = 32 * (warps + 1)
    producer_tid = 32 * warps
    magic = _magic(x_dtype)
    bf16 = x_dtype == "bfloat16"
    mma = ptx.mma_bf16 if bf16 else ptx.mma_f16
    sub = ptx.sub_bf16x2 if bf16 else ptx.sub_f16x2
    # (magic + zero point) in both halves; the magic's mantissa is zero, so OR adds the code
    const_offset = np.uint32(magic | (((zero_point or 0) << 16) | (zero_point or 0)))
    load_scale = _half_loader(scale_dtype)
    gated = act in GATED_ACTIVATIONS
    # every epilogue function bound (a closure cell left empty has no cache key); the kernel
    # calls the gated ones or the plain one
    bias_pair, combine = gated_epilogue(bias_dtype, act if gated else "silu_and_mul", out_dtype)
    store_value = storer(out_dtype)
    store_out = (accumulating_epilogue(out_dtype, bias_dtype) if accumulate
                 else epilogue(out_dtype, None, bias_dtype, None if gated else act))
    x_norm = x_norm_dtype is not None
    load_norm_w = loader(x_norm_dtype or "float32")
    unpack2 = ptx.unpack_bf16x2 if x_dtype == "bfloat16" else ptx.unpack_f16x2
    pack2 = ptx.pack_bf16x2 if x_dtype == "bfloat16" else ptx.pack_f16x2
    load_x_element = loader(x_dtype)
    n_acc = 4 * m_frags
    barriers = 2 * stages
    warp_slots = warps + 1
    norm_partials = warp_slots * m_block

    @cuda.jit(device=True, inline="always")
    def group_of(chunk):
        if group_chunks == 0:
            return 0
        return chunk // group_chunks

    @cuda.jit(device=True, inline="always")
    def issue_stage(ring, bars, qw, scales, aux, j, s, chunk_begin, chunk_end, n0, rows, N):
        c0 = chunk_begin + j * S
        chunks = min(S, chunk_end - c0)
        stage_units = (chunks + unit - 1) // unit
        nbytes = rows * (16 * chunks + stage_units * (ss + aux_size))
        ptx.mbarrier_arrive_expect_tx(bars, s, nbytes)
        base = s * words_per_stage
        for c in range(S):
            if c < chunks:
                ptx.cp_async_bulk_g2s(ring, base + c * block_n * 4, qw, ((c0 + c) * N + n0) * 4,
                                      rows * 16, bars, s)
        for u in range(units):
            if u < stage_units:
                row0 = group_of(c0 + u * unit) * N + n0
                ptx.cp_async_bulk_g2s(ring, base + codes_words + u * (block_n * ss // 4),
                                      scales, row0, rows * ss, bars, s)
                if has_aux:
                    ptx.cp_async_bulk_g2s(
                        ring, base + codes_words + scale_words + u * (block_n * aux_size // 4),
                        aux, row0, rows * aux_size, bars, s)

    @cuda.jit(device=True, inline="always")
    def normed_word(word, inv, norm_weight, k, K):
        """x's elements k, k + 1 (a word of two halves) times ``inv`` and the norm weight,
        rounded (``x_norm``); past K (zeros) the weight is not read."""
        a, b = unpack2(word)
        wa = load_norm_w(norm_weight, k) if k < K else _F0
        wb = load_norm_w(norm_weight, k + 1) if k + 1 < K else _F0
        return pack2(a * inv * wa, b * inv * wb)

    @cuda.jit(device=True, inline="always")
    def load_run(x, m, k, M, K, x_sm, x_vec, inv, norm_weight):
        """x[m, k .. k + 8] as bits, zeros past M and K, permuted to [0, 4, 1, 5, 2, 6, 3, 7]
        (four words): one 16-byte load when x allows it (``x_vec``), else element by element;
        ``x_norm``: each element times ``inv`` and the norm weight, rounded."""
        if m < M and x_vec and k < K:
            w0, w1, w2, w3 = ptx.load_u32x4(x, m * x_sm + k)
        else:
            v = cuda.local.array(8, np.uint32)
            for e in range(8):
                bits = np.uint32(0)
                if m < M and k + e < K:
                    bits = np.uint32(x[m * x_sm + k + e])
                v[e] = bits
            w0 = v[0] | (v[1] << _U16)
            w1 = v[2] | (v[3] << _U16)
            w2 = v[4] | (v[5] << _U16)
            w3 = v[6] | (v[7] << _U16)
        if x_norm:
            w0 = normed_word(w0, inv, norm_weight, k, K)
            w1 = normed_word(w1, inv, norm_weight, k + 2, K)
            w2 = normed_word(w2, inv, norm_weight, k + 4, K)
            w3 = normed_word(w3, inv, norm_weight, k + 6, K)
        return (ptx.prmt(w0, w2, _LOW_HALVES), ptx.prmt(w0, w2, _HIGH_HALVES),
                ptx.prmt(w1, w3, _LOW_HALVES), ptx.prmt(w1, w3, _HIGH_HALVES))

    @cuda.jit(device=True, inline="always")
    def row_inv_rms(x, M, K, x_sm, x_vec, eps, inv, partials, tid):
        """``inv[m] = 1 / sqrt(mean(x[m]^2) + eps)`` for every row m < M (``x_norm``): every
        thread sums a part of the row (16-byte runs when x allows), each warp its threads' sums
        (shuffles), then thread m the warps' sums in warp order (one barrier for all rows)."""
        lane = tid & 31
        warp = tid >> 5
        for m in range(M):
            ss = _F0
            if x_vec:
                runs = K // 8
                for r0 in range(tid, runs, threads * X_RUNS_IN_FLIGHT):
                    got = cuda.local.array((X_RUNS_IN_FLIGHT, 4), np.uint32)
                    for b in range(X_RUNS_IN_FLIGHT):    # loads first
                        r = r0 + b * threads
                        if r < runs:
                            w0, w1, w2, w3 = ptx.load_u32x4(x, m * x_sm + 8 * r)
                            got[b, 0] = w0
                            got[b, 1] = w1
                            got[b, 2] = w2
                            got[b, 3] = w3
                    for b in range(X_RUNS_IN_FLIGHT):
                        if r0 + b * threads < runs:
                            for w in range(4):
                                lo, hi = unpack2(got[b, w])
                                ss += lo * lo + hi * hi
            else:
                for k in range(tid, K, threads):
                    v = load_x_element(x, m * x_sm + k)
                    ss += v * v
            mask = 16
            while mask > 0:
                ss += ptx.shfl_xor_f32(ss, mask)
                mask //= 2
            if lane == 0:
                partials[warp * m_block + m] = ss
        cuda.syncthreads()
        if tid < M:
            total = partials[tid]
            for w in range(1, warp_slots):
                total += partials[w * m_block + tid]
            inv[tid] = _F1 / math.sqrt(total / np.float32(K) + eps)
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def stage_x(ring, x, tid, x_base, x_words, chunk_begin, kspan, M, K, x_sm, x_vec, inv,
                norm_weight):
        """x[0:m_block, the block's kspan chunks] in shared memory (zeros past M and K: the
        consumers run whole stages, and a code past K, finite, meets a zero), each run of 8 k
        permuted; ``X_RUNS_IN_FLIGHT`` runs a thread loaded before any is stored; ``x_norm``:
        row m normed by ``inv[m]`` and the norm weight."""
        runs = kspan * (CHUNK_K // 8)
        row_runs = x_words // 4     # padded row, in runs (the pad is never read)
        total = m_block * runs
        k0 = chunk_begin * CHUNK_K
        for first in range(tid, total, threads * X_RUNS_IN_FLIGHT):
            got = cuda.local.array((X_RUNS_IN_FLIGHT, 4), np.uint32)
            for b in range(X_RUNS_IN_FLIGHT):
                i = first + b * threads
                m = udiv(i, runs)
                r = i - m * runs
                mm = m if i < total else M
                w0, w1, w2, w3 = load_run(x, mm, k0 + 8 * r, M, K, x_sm, x_vec,
                                          inv[mm] if x_norm and mm < M else _F1, norm_weight)
                got[b, 0] = w0
                got[b, 1] = w1
                got[b, 2] = w2
                got[b, 3] = w3
            for b in range(X_RUNS_IN_FLIGHT):
                i = first + b * threads
                if i < total:
                    m = udiv(i, runs)
                    r = i - m * runs
                    ptx.store_u32x4(ring, x_base + (m * row_runs + r) * 4, got[b, 0], got[b, 1],
                                    got[b, 2], got[b, 3])

    x_value = _half_loader(x_dtype)

    @cuda.jit(device=True, inline="always")
    def sum_x_units(ring, tid, x_base, x_words, xsum_base, split_units):
        """Affine weights: the sum of each staged x row over each scale unit, as fp32 bits."""
        for i in range(tid, m_block * split_units, threads):
            m = i // split_units
            u = i - m * split_units
            total = _F0
            first = x_base + m * x_words + u * unit * (CHUNK_K // 2)
            for w in range(unit * CHUNK_K // 2):
                word = ring[first + w]
                total += x_value(word, 0) + x_value(word, 1)
            ring[xsum_base + i] = ptx.f32_bits(total)

    @cuda.jit(device=True, inline="always")
    def pairs(word, offset):
        """The word's 8 codes minus the zero point as 4 exact half pairs: nibbles (0, 4),
        (1, 5), (2, 6), (3, 7). Even and odd nibbles are split into bytes (two masks, a
        shift), then each pair's two bytes are put beside the magic's exponent bytes (PRMT)."""
        even = word & _NIBBLE_BYTES
        odd = (word >> _U4) & _NIBBLE_BYTES
        p0 = sub(ptx.prmt(even, magic, _BYTES_0_2), offset)
        p1 = sub(ptx.prmt(odd, magic, _BYTES_0_2), offset)
        p2 = sub(ptx.prmt(even, magic, _BYTES_1_3), offset)
        p3 = sub(ptx.prmt(odd, magic, _BYTES_1_3), offset)
        return p0, p1, p2, p3

    @cuda.jit(device=True, inline="always")
    def unit_offset(ring, base, u, row):
        """(magic + zero point) pair of ``row`` for scale unit ``u`` of the stage at ``base``."""
        if per_group_zero:
            at = (base + codes_words + scale_words) * 4 + u * block_n + row
            z = (ring[at >> 2] >> np.uint32(8 * (at & 3))) & np.uint32(0xFF)
            return magic | (z << _U16) | z
        return const_offset

    @cuda.jit(device=True, inline="always")
    def unit_value(ring, first_word, row, size):
        """Element ``row`` of a (block_n,) array of ``size``-byte values at ``first_word``."""
        if size == 4:
            return load_scale(ring[first_word + np.uint64(row)], 0)
        return load_scale(ring[first_word + np.uint64(row >> 1)], row & 1)

    @cuda.jit(device=True, inline="always")
    def mma_into(sums, i, a0, a1, a2, a3, b0, b1):
        """``sums[i:i + 4] += A B`` for one m16n8k16 fragment."""
        d = mma(a0, a1, a2, a3, b0, b1, sums[i], sums[i + 1], sums[i + 2], sums[i + 3])
        sums[i] = d[0]
        sums[i + 1] = d[1]
        sums[i + 2] = d[2]
        sums[i + 3] = d[3]

    def chunk_step(c):
        """Device function: chunk ``c`` of a stage (its two k16 MMAs per fragment), opening its
        scale unit first and closing it after (``c`` a compile-time constant)."""
        u = c // unit
        opens = c % unit == 0
        closes = c % unit == unit - 1
        code_offset = np.uint64(c * block_n * 4)
        x_offset = np.uint64(c * (CHUNK_K // 2))

        @cuda.jit(device=True, inline="always")
        def step(ring, tmp0, tmp1, acc, offs, codes_at, x_rows, x_at, base, row, t, left, j,
                 xsum_base, split_units):
            if opens:
                for i in range(n_acc):
                    tmp0[i] = _F0
                    tmp1[i] = _F0
                offs[0] = unit_offset(ring, base, u, row)
                offs[1] = unit_offset(ring, base, u, row + 8)
            at = codes_at + code_offset
            lo0, lo1, lo2, lo3 = pairs(ring[at], offs[0])
            hi0, hi1, hi2, hi3 = pairs(ring[at + np.uint64(32)], offs[1])
            for f in range(m_frags):
                x0, x1, x2, x3 = ptx.load_u32x4(ring, x_rows[f] + x_at + x_offset)
                mma_into(tmp0, 4 * f, lo0, hi0, lo1, hi1, x0, x1)
                mma_into(tmp1, 4 * f, lo2, hi2, lo3, hi3, x2, x3)
            if closes and u * unit < left:
                # the unit's sums scaled per row (a unit past K has no scales: skipped)
                scale_first = np.uint64(base + codes_words + u * (block_n * ss // 4))
                s_lo = unit_value(ring, scale_first, row, ss)
                s_hi = unit_value(ring, scale_first, row + 8, ss)
                m_lo = m_hi = _F0
                if affine:
                    min_first = np.uint64(base + codes_words + scale_words
                                          + u * (block_n * ss // 4))
                    m_lo = unit_value(ring, min_first, row, ss)
                    m_hi = unit_value(ring, min_first, row + 8, ss)
                for f in range(m_frags):
                    for i in range(4):
                        sc = s_lo if i < 2 else s_hi
                        a = acc[4 * f + i] + sc * (tmp0[4 * f + i] + tmp1[4 * f + i])
                        if affine:
                            token = min(8 * f + 2 * t + (i & 1), m_block - 1)
                            xs = ptx.f32_from_bits(ring[np.uint64(
                                xsum_base + token * split_units + j * units + u)])
                            a += (m_lo if i < 2 else m_hi) * xs
                        acc[4 * f + i] = a

        return step

    def chain(first, rest):
        @cuda.jit(device=True, inline="always")
        def both(ring, tmp0, tmp1, acc, offs, codes_at, x_rows, x_at, base, row, t, left, j,
                 xsum_base, split_units):
            first(ring, tmp0, tmp1, acc, offs, codes_at, x_rows, x_at, base, row, t, left, j,
                  xsum_base, split_units)
            rest(ring, tmp0, tmp1, acc, offs, codes_at, x_rows, x_at, base, row, t, left, j,
                 xsum_base, split_units)

        return both

    stage_steps = chunk_step(S - 1)
    for c in range(S - 2, -1, -1):
        stage_steps = chain(chunk_step(c), stage_steps)

    norm_tail = fused_norm_tail(threads, x_dtype, norm_dtype or "float32")

    @cuda.jit(device=True, inline="always")
    def run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan, so_m, so_n,
            x_vec, norm_weight, eps):
        """The kernel's work; True in a block that stored final outputs (every block without a
        split, a column block's last one with). ``norm_weight``, ``eps``: ``x_norm``'s (else
        unused)."""
        ring = cuda.shared.array(0, np.uint32)
        bars = cuda.shared.array(barriers, np.uint64)  # full[s] = bars[s], empty: stages + s
        inv = cuda.shared.array(m_block, np.float32)     # x_norm: each row's 1 / rms
        partials = cuda.shared.array(norm_partials, np.float32)  # x_norm: warps' row sums
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        n0 = cuda.blockIdx.x * block_n
        rows = min(block_n, N - n0)
        total_chunks = (K + CHUNK_K - 1) // CHUNK_K
        chunk_begin = cuda.blockIdx.y * kspan
        chunk_end = min(total_chunks, chunk_begin + kspan)
        block_stages = (chunk_end - chunk_begin + S - 1) // S
        x_base = stages * words_per_stage
        x_words = kspan * (CHUNK_K // 2) + X_ROW_PAD_WORDS   # x_row_words(kspan)
        xsum_base = x_base + m_block * x_words
        split_units = kspan // unit
        if programmatic:
            ptx.griddep_launch_dependents()
        init_stage_barriers(bars, stages, 1, warps, tid)
        if tid == producer_tid:
            for j in range(min(stages, block_stages)):
                issue_stage(ring, bars, qw, scales, aux, j, j, chunk_begin, chunk_end, n0, rows, N)
        if programmatic:
            ptx.griddep_wait()
        if x_norm:
            row_inv_rms(x, M, K, x_sm, x_vec, eps, inv, partials, tid)
        stage_x(ring, x, tid, x_base, x_words, chunk_begin, kspan, M, K, x_sm, x_vec, inv,
                norm_weight)
        cuda.syncthreads()
        if affine:
            sum_x_units(ring, tid, x_base, x_words, xsum_base, split_units)
            cuda.syncthreads()
        acc = cuda.local.array(n_acc, np.float32)
        for i in range(n_acc):
            acc[i] = _F0
        g = lane >> 2
        t = lane & 3
        if warp == warps:
            if tid == producer_tid:
                s = 0
                phase = 0   # the stage's phase a consumer release completes
                for j in range(stages, block_stages):
                    ptx.mbarrier_wait_parity(bars, stages + s, phase)
                    issue_stage(ring, bars, qw, scales, aux, j, s, chunk_begin, chunk_end, n0,
                                rows, N)
                    s += 1
                    if s == stages:
                        s = 0
                        phase ^= 1
        else:
            row = 16 * warp + g
            tmp0 = cuda.local.array(n_acc, np.float32)
            tmp1 = cuda.local.array(n_acc, np.float32)
            # x rows of this lane's B fragments: tokens past m_block read the last staged row
            # (their sums are never stored), so every lane loads and none is predicated off
            x_rows = cuda.local.array(m_frags, np.uint64)
            for f in range(m_frags):
                x_rows[f] = np.uint64(x_base + min(8 * f + g, m_block - 1) * x_words + 4 * t)
            offs = cuda.local.array(2, np.uint32)
            s = 0
            phase = 0
            for j in range(block_stages):
                ptx.mbarrier_wait_parity(bars, s, phase)
                base = s * words_per_stage
                # unsigned word indices: no negative-index wrap, constant offsets folded
                codes_at = np.uint64(base + row * 4 + t)
                x_at = np.uint64(j * S * (CHUNK_K // 2))
                left = np.int32(chunk_end - chunk_begin - j * S)   # chunks of K in the stage
                # whole stages (a chunk past K is finite codes times zero x), written out
                stage_steps(ring, tmp0, tmp1, acc, offs, codes_at, x_rows, x_at, base, row, t,
                            left, j, xsum_base, split_units)
                ptx.syncwarp()
                if lane == 0:
                    ptx.mbarrier_arrive(bars, stages + s)
                s += 1
                if s == stages:
                    s = 0
                    phase ^= 1
        # without a split each lane stores its outputs; split K: fp32 partial sums (splits, M,
        # N), and the column block's last block sums them in split order (deterministic) and
        # applies the epilogue. Gated (``act`` a gated activation, rows interleaved in blocks of
        # GATE_BLOCK = 8): a lane's rows g and g + 8 are a gate row and its up row, so its
        # accumulators i and i + 2 make output column (n0 + 16 warp) / 2 + g
        if warp < warps:
            for f in range(m_frags):
                for i in range(2 if gated and not partial else 4):
                    n = n0 + 16 * warp + g + (8 if i >= 2 else 0)
                    token = 8 * f + 2 * t + (i & 1)
                    if n < N and token < M:
                        if partial:
                            work[(cuda.blockIdx.y * M + token) * N + n] = acc[4 * f + i]
                        elif gated:
                            bias_gate, bias_up = bias_pair(bias, n, N)
                            column = (n0 >> 1) + 8 * warp + g
                            store_value(out, token * so_m + column * so_n,
                                        combine(acc[4 * f + i], acc[4 * f + i + 2], bias_gate,
                                                bias_up, _F1))
                        else:
                            store_out(acc[4 * f + i], n, out, token * so_m + n * so_n, out, 0,
                                      bias, _F1, _F0)
        if not partial:
            return True
        splits = cuda.gridDim.y
        if last_block(counters, cuda.blockIdx.x, 1, splits) == 0:
            return False
        if gated:
            half = block_n // 2
            for i in range(tid, half * M, threads):
                m = i // half
                j = i - m * half
                n = n0 + gate_column(j)
                if n < N:
                    bias_gate, bias_up = bias_pair(bias, n, N)
                    store_value(out, m * so_m + ((n0 >> 1) + j) * so_n,
                                combine(sum_splits(work, m * N + n, M * N, splits),
                                        sum_splits(work, m * N + n + GATE_BLOCK, M * N, splits),
                                        bias_gate, bias_up, _F1))
            return True
        for i in range(tid, block_n * M, threads):
            m = i // block_n
            n = n0 + i - m * block_n
            if n < N:
                store_out(sum_splits(work, m * N + n, M * N, splits), n, out,
                          m * so_m + n * so_n, out, 0, bias, _F1, _F0)
        return True

    def quant_stream_kernel(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan,
                            so_m, so_n, x_vec):
        run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan, so_m, so_n,
            x_vec, x, _F0)

    def quant_stream_x_norm_kernel(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm,
                                   kspan, so_m, so_n, x_vec, norm_weight, eps):
        run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan, so_m, so_n,
            x_vec, norm_weight, eps)

    def quant_stream_norm_kernel(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm,
                                 kspan, so_m, so_n, x_vec, residual, norm_weight, normed, r_sm,
                                 n_sm, eps, vec):
        if run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, kspan, so_m, so_n,
               x_vec, x, _F0):
            norm_tail(counters, out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm,
                      n_sm, eps, vec)

    if norm_dtype is not None:
        return quant_stream_norm_kernel
    return quant_stream_x_norm_kernel if x_norm else quant_stream_kernel


def signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype, norm_dtype=None,
              x_norm_dtype=None):
    i32, i64 = types.int32, types.int64
    sig = operand_types(mode, scale_dtype, x_dtype, out_dtype, bias_dtype) + (
        array1d(np.float32), array1d(np.int32), i32, i32, i32, i64, i32, i64, i64, types.boolean)
    if x_norm_dtype is not None:
        return sig + (array1d(STORAGE[x_norm_dtype]), types.float32)
    return sig if norm_dtype is None else sig + norm_types(x_dtype, norm_dtype)


@functools.cache
def stream_kernel(warps, stages, m_block, group_chunks, mode, zero_point, scale_dtype, x_dtype,
                  out_dtype, bias_dtype, act, partial, programmatic=False, norm_dtype=None,
                  x_norm_dtype=None, accumulate=False):
    fn = kernel_fn(warps, stages, m_block, group_chunks, mode, zero_point, scale_dtype, x_dtype,
                   out_dtype, bias_dtype, act, partial, programmatic, norm_dtype, x_norm_dtype,
                   accumulate)
    return Kernel(jit(fn), signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype,
                                     norm_dtype, x_norm_dtype),
                  "quant_stream_kernel", programmatic=programmatic)
