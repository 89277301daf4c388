"""The kernels of ``quant_gemm`` (layout of the packed weight: ``quant_weight``).

Codes become floats without a conversion instruction or a table: a code ``u`` (4 or 8 bits) OR-ed
into the mantissa of 2^23 is the float ``2^23 + u`` (one LOP3 with the shift's mask), and one
FADD of ``-(2^23 + z)`` leaves ``u - z`` exactly (``_code``). The scale is applied once per
16-byte chunk and row, not per element: ``acc += s * sum_k x[k] (u_k - z)``, so an element costs
its LOP3 (plus a shift), one FADD and one FFMA per row of x. The affine form (GGUF Q4_1,
``q s + m``) adds ``m * sum_k x[k]``, the chunk's sums of x computed once per block.

``decode_kernel_fn``: small M (decode). A block owns ``block_n`` consecutive output columns (rows
n of the weight, one a thread) and a range of K (split-K over ``gridDim.y``). Per tile of
``tile_k`` k (four 16-byte chunks of codes) x[0:M, tile] is staged in shared memory as fp32
(zeros past M and K); each thread unpacks its row's codes of the tile and reads x with 16-byte
shared loads (every lane the same address: broadcast). Loads run one tile ahead: the next tile's
codes (four 16-byte loads a thread; chunk-major layout, so a warp's loads are 512 contiguous
bytes) and the thread's share of its x are in flight in registers while the current tile is
computed. M is padded to ``m_block`` (a power of two up to 16), a
compile-time constant, so the accumulators stay in registers. The epilogue (bias, activation,
rounding) is applied in the kernel; with K split, by the last block of each column range to
finish, over the fp32 partial sums of all splits (one launch, no separate reduce kernel).

The Tensor Core kernel of larger M (``_quant_tc``) converts codes with the same ``_code``.
"""

import functools
import math

import numpy as np
from numba import types

from .. import ptx
from .._arrays import STORAGE
from .._env import cuda
from .._launch import Kernel, array1d, jit
from ._epilogue import epilogue, loader, storer
from ._index32 import udiv
from ._last_block import last_block
from . import _rowwise as rw

#: 2^23 as float bits: OR-ing a code into the mantissa makes the float 2^23 + code.
_MAGIC = np.uint32(0x4B000000)
_TWO23 = np.float32(8388608.0)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)


def _storage(dtype):
    return array1d(STORAGE[dtype])


def _aux_storage(mode, scale_dtype):
    """The per-group array beside the scales: uint8 zero points, minimums in the scale dtype, or
    (one zero point) an unused placeholder of the scales' type."""
    return array1d(np.uint8) if mode == "zeros" else _storage(scale_dtype)


@functools.cache
def _code(bits, shift):
    """Device function ``(word, off) -> float32``: the code at bit ``shift`` of ``word`` minus
    ``off - 2^23`` (``off`` = 2^23 + zero point), exact."""
    mask = np.uint32((1 << bits) - 1)
    sh = np.uint32(shift)

    @cuda.jit(device=True, inline="always")
    def code(word, off):
        return ptx.f32_from_bits(((word >> sh) & mask) | _MAGIC) - off

    return code


def _group_offset(mode, zero_point):
    """Device function ``(aux, i) -> float32``: 2^23 + the zero point of group entry ``i``."""
    const = np.float32(8388608.0 + (zero_point or 0))
    per_group = mode == "zeros"

    @cuda.jit(device=True, inline="always")
    def offset(aux, i):
        if per_group:
            return _TWO23 + np.float32(aux[i])
        return const

    return offset


#: 16-byte chunks of codes per thread and staged x tile: four loads in flight before any use.
CHUNKS_PER_TILE = 4
#: Partial sums loaded at once by the last block of a split launch.
REDUCE_UNROLL = 8


def tile_k(bits):
    """k per staged x tile of the decode kernel: 128 (int4) or 64 (int8)."""
    return CHUNKS_PER_TILE * 4 * (32 // bits)


def _word_dot(bits, m_block, tile):
    """Device function ``(w, off, xs, kk, part)``: ``part[m] += sum_i x[m, kk + i] * code_i``
    over the codes of word ``w`` (x from the staged tile ``xs``, 16-byte shared loads)."""
    per_word = 32 // bits
    code0, code1, code2, code3 = (_code(bits, bits * i) for i in range(4))
    code4, code5, code6, code7 = (_code(bits, bits * (4 + i)) for i in range(4))
    two_quads = per_word == 8

    @cuda.jit(device=True, inline="always")
    def quad(xs, i, part, m, v0, v1, v2, v3):
        x0, x1, x2, x3 = ptx.load_u32x4(xs, i)
        p = part[m] + ptx.f32_from_bits(x0) * v0
        p += ptx.f32_from_bits(x1) * v1
        p += ptx.f32_from_bits(x2) * v2
        part[m] = p + ptx.f32_from_bits(x3) * v3

    @cuda.jit(device=True, inline="always")
    def word_dot(w, off, xs, kk, part):
        v0, v1, v2, v3 = code0(w, off), code1(w, off), code2(w, off), code3(w, off)
        for m in range(m_block):
            quad(xs, m * tile + kk, part, m, v0, v1, v2, v3)
        if two_quads:
            v4, v5, v6, v7 = code4(w, off), code5(w, off), code6(w, off), code7(w, off)
            for m in range(m_block):
                quad(xs, m * tile + kk + 4, part, m, v4, v5, v6, v7)

    return word_dot


@cuda.jit(device=True, inline="always")
def sum_splits(work, index, stride, splits):
    """``sum_s work[index + s * stride]`` over ``splits`` fp32 partial sums, in split order
    (deterministic), ``REDUCE_UNROLL`` loads issued before their adds."""
    vals = cuda.local.array(REDUCE_UNROLL, np.float32)
    total = _F0
    for s0 in range(0, splits, REDUCE_UNROLL):
        for u in range(REDUCE_UNROLL):  # loads first: their latencies overlap
            v = _F0
            if s0 + u < splits:
                v = work[index + (s0 + u) * stride]
            vals[u] = v
        for u in range(REDUCE_UNROLL):
            total += vals[u]
    return total


#: 16-byte chunks of a row a thread of the fused norm loads before it uses any (a row of up to
#: threads x this many chunks then takes one round trip to L2, and stays in registers for its
#: second pass). Two took the streaming kernel to 90 registers (two blocks an SM, not three;
#: offline sm_90a), one to 72.
NORM_CHUNKS_IN_FLIGHT = 1


@functools.cache
def add_rms_norm_rows(threads, x_dtype, norm_dtype):
    """Device function ``(out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm, n_sm,
    eps, vec, scratch, tid)``, run by a whole block of ``threads`` threads (``scratch``: a
    float32 shared array of ``norm_scratch_slots(threads)``): ``rms_norm(out, norm_weight, eps,
    residual=residual, out=normed)`` over the M rows of N (``quant_gemm_rms_norm``'s fused
    tail), as ``ops/rms_norm.py`` computes it: each row's ``s = out + residual`` rounded to x's
    dtype (stored into ``residual``), its mean square in fp32, ``s * inv * w`` rounded once.
    The mean square is summed in another order (a block reduction), so a result may differ in
    the last bit. ``vec``: 16-byte chunks (N a multiple of 8, every row 16-byte aligned, out's
    columns contiguous), ``NORM_CHUNKS_IN_FLIGHT`` a thread loaded before any is used; else
    element by element."""
    width = rw.vector_width(x_dtype)     # 8 halves a 16-byte chunk, 4 words
    flight = NORM_CHUNKS_IN_FLIGHT
    words = 4 * flight                   # a thread's chunks in flight, as raw words
    one_pass = threads * flight          # a row of at most this many chunks stays in registers
    bf16 = x_dtype == "bfloat16"
    unpack2 = ptx.unpack_bf16x2 if bf16 else ptx.unpack_f16x2
    pack2 = ptx.pack_bf16x2 if bf16 else ptx.pack_f16x2
    w_words = norm_dtype == x_dtype      # else fp32 weights: 8 floats a chunk
    load_chunk = rw.chunk_words_loader(rw.kind(x_dtype), width)
    store_chunk = rw.chunk_words_storer(rw.kind(x_dtype), width)
    load_w_floats = rw.chunk_loader(rw.kind(norm_dtype), width)
    load_x = loader(x_dtype)
    store_x = storer(x_dtype)
    load_w1 = loader(norm_dtype)
    block_sum = rw.row_reducer(threads, rw.add_f32)

    @cuda.jit(device=True, inline="always")
    def add_row(out, residual, m, N, so_m, so_n, r_sm, vec, tid, ow, rwd):
        """``residual[m] += out[m]`` (rounded); this thread's part of the row's sum of
        squares. The rounded words stay in ``rwd`` (the whole row's, in one pass)."""
        ss = _F0
        if vec:
            chunks = N // width
            for c0 in range(0, chunks, one_pass):
                for u in range(flight):    # loads first
                    c = c0 + u * threads + tid
                    if c < chunks:
                        load_chunk(out, m * so_m + c * width, ow, 4 * u)
                        load_chunk(residual, m * r_sm + c * width, rwd, 4 * u)
                for u in range(flight):
                    c = c0 + u * threads + tid
                    if c < chunks:
                        for w in range(4 * u, 4 * u + 4):   # pairs: no float arrays
                            o0, o1 = unpack2(ow[w])
                            r0, r1 = unpack2(rwd[w])
                            rwd[w] = pack2(o0 + r0, o1 + r1)    # rounded to x's dtype
                            s0, s1 = unpack2(rwd[w])
                            ss += s0 * s0 + s1 * s1
                        store_chunk(residual, m * r_sm + c * width, rwd, 4 * u)
        else:
            for n in range(tid, N, threads):
                store_x(residual, m * r_sm + n,
                        load_x(out, m * so_m + n * so_n) + load_x(residual, m * r_sm + n))
                v = load_x(residual, m * r_sm + n)     # as rounded (this thread's own store)
                ss += v * v
        return ss

    @cuda.jit(device=True, inline="always")
    def norm_row(residual, norm_weight, normed, m, N, r_sm, n_sm, inv, vec, tid, ow, rwd, wf):
        """``normed[m] = residual[m] * inv * w``."""
        if vec:
            chunks = N // width
            for c0 in range(0, chunks, one_pass):
                for u in range(flight):
                    c = c0 + u * threads + tid
                    if c < chunks:
                        if chunks > one_pass:   # else still in rwd from ``add_row``
                            load_chunk(residual, m * r_sm + c * width, rwd, 4 * u)
                        if w_words:
                            load_chunk(norm_weight, c * width, ow, 4 * u)
                for u in range(flight):
                    c = c0 + u * threads + tid
                    if c < chunks:
                        if not w_words:
                            load_w_floats(norm_weight, c * width, wf, 0)
                        for w in range(4 * u, 4 * u + 4):
                            s0, s1 = unpack2(rwd[w])
                            if w_words:
                                w0, w1 = unpack2(ow[w])
                            else:
                                w0 = wf[2 * (w - 4 * u)]
                                w1 = wf[2 * (w - 4 * u) + 1]
                            ow[w] = pack2(s0 * inv * w0, s1 * inv * w1)
                        store_chunk(normed, m * n_sm + c * width, ow, 4 * u)
        else:
            for n in range(tid, N, threads):
                store_x(normed, m * n_sm + n,
                        load_x(residual, m * r_sm + n) * inv * load_w1(norm_weight, n))

    @cuda.jit(device=True, inline="always")
    def rows(out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm, n_sm, eps, vec,
             scratch, tid):
        ow = cuda.local.array(words, np.uint32)
        rwd = cuda.local.array(words, np.uint32)
        wf = cuda.local.array(width, np.float32)
        for m in range(M):
            ss = add_row(out, residual, m, N, so_m, so_n, r_sm, vec, tid, ow, rwd)
            total = block_sum(ss, scratch)
            inv = _F1 / math.sqrt(total / np.float32(N) + eps)
            norm_row(residual, norm_weight, normed, m, N, r_sm, n_sm, inv, vec, tid, ow, rwd,
                     wf)

    return rows


def norm_scratch_slots(threads):
    """float32 shared slots ``add_rms_norm_rows`` needs: one a warp."""
    return -(-threads // 32)


@functools.cache
def fused_norm_tail(threads, x_dtype, norm_dtype):
    """Device function ``(counters, out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm,
    n_sm, eps, vec)``: the end of a fused-norm kernel, called by every thread of each block that
    stored final outputs: a ticket on ``counters[gridDim.x]`` (one a column block), and the
    block drawing the last one (every column's outputs visible to it) runs
    ``add_rms_norm_rows``."""
    rows = add_rms_norm_rows(threads, x_dtype, norm_dtype)
    slots = norm_scratch_slots(threads)

    @cuda.jit(device=True, inline="always")
    def tail(counters, out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm, n_sm, eps,
             vec):
        scratch = cuda.shared.array(slots, np.float32)
        if last_block(counters, cuda.gridDim.x, 1, cuda.gridDim.x):
            rows(out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm, n_sm, eps, vec,
                 scratch, cuda.threadIdx.x)

    return tail


def norm_types(x_dtype, norm_dtype):
    """Numba types of a fused-norm kernel's seven extra parameters: residual, norm weight,
    normed, their row strides, eps, and whether the rows go by 16-byte chunks."""
    i64 = types.int64
    return (_storage(x_dtype), _storage(norm_dtype), _storage(x_dtype), i64, i64,
            types.float32, types.boolean)


def operand_types(mode, scale_dtype, x_dtype, out_dtype, bias_dtype):
    """Numba types of the quant kernels' first six parameters: (x, codes, scales, aux, out,
    bias)."""
    return (_storage(x_dtype), array1d(np.uint32), _storage(scale_dtype),
            _aux_storage(mode, scale_dtype), _storage(out_dtype), _storage(bias_dtype or out_dtype))


def decode_kernel_fn(bits, m_block, block_n, mode, zero_point, scale_dtype, x_dtype, out_dtype,
                     bias_dtype, act, partial, norm_dtype=None):
    """Kernel ``(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, group_shift,
    k_split, so_m, so_n)`` (see the module docstring). The group of k is ``k >> group_shift``
    (group sizes are powers of two; one group a row: 31), a shift, not a 64-bit division.
    ``partial`` (K split over ``gridDim.y``): each block writes fp32 partial sums (splits, M, N)
    to ``work`` and draws a ticket from ``counters[blockIdx.x]`` (int32, zero before the launch
    and left zero); the last block of a column range sums the partials and applies the
    epilogue, so a split launch is still one kernel. Without ``partial``, ``work`` and
    ``counters`` are unused. ``k_split`` is a multiple of ``tile_k(bits)``. The tile's four
    chunks and each chunk's four words are written out (device functions called four times),
    not looped: a rolled loop indexes the loaded words, which puts them in local memory.
    ``norm_dtype``: the fused add + RMSNorm tail (``_quant_stream.kernel_fn``'s), six more
    parameters (``norm_types``) and one more counter."""
    per_word = 32 // bits
    ck = 4 * per_word
    tile = tile_k(bits)
    chunks = CHUNKS_PER_TILE
    affine = mode == "affine"
    load_x = loader(x_dtype)
    load_s = loader(scale_dtype)
    offset = _group_offset(mode, zero_point)
    word_dot = _word_dot(bits, m_block, tile)
    store_out = epilogue(out_dtype, None, bias_dtype, act)
    xs_size = m_block * tile
    x_per_thread = -(-xs_size // block_n)
    xsum_size = m_block * chunks if affine else 1

    @cuda.jit(device=True, inline="always")
    def load_chunk(qw, k, k_end, N, n):
        if k < k_end:
            return ptx.load_u32x4(qw, ((k // ck) * N + n) * 4)
        z = np.uint32(0)
        return z, z, z, z

    @cuda.jit(device=True, inline="always")
    def load_tile(qw, k0, k_end, N, n):
        """The tile's four chunks of row n (zeros past ``k_end``): 16 words, every load issued
        before any is used."""
        a0, a1, a2, a3 = load_chunk(qw, k0, k_end, N, n)
        b0, b1, b2, b3 = load_chunk(qw, k0 + ck, k_end, N, n)
        c0, c1, c2, c3 = load_chunk(qw, k0 + 2 * ck, k_end, N, n)
        d0, d1, d2, d3 = load_chunk(qw, k0 + 3 * ck, k_end, N, n)
        return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3

    @cuda.jit(device=True, inline="always")
    def load_x_tile(x, xr, t, k0, k_end, M, K, x_sm):
        """This thread's share of the x tile at ``k0`` (fp32, zeros past M and K) into the
        registers ``xr``: element ``t + j * block_n`` of the (m_block, tile) tile."""
        for j in range(x_per_thread):
            i = t + j * block_n
            m = i // tile
            k = k0 + i - m * tile
            v = _F0
            if i < xs_size and m < M and k < K and k0 < k_end:
                v = load_x(x, m * x_sm + k)
            xr[j] = v

    @cuda.jit(device=True, inline="always")
    def chunk(w0, w1, w2, w3, c, k0, k_end, N, n, group_shift, scales, aux, xs, xsum, part,
              acc):
        if k0 + c * ck < k_end:
            g = ((k0 + c * ck) >> group_shift) * N + n
            s = load_s(scales, g)
            off = offset(aux, g)
            for m in range(m_block):
                part[m] = _F0
            word_dot(w0, off, xs, c * ck, part)
            word_dot(w1, off, xs, c * ck + per_word, part)
            word_dot(w2, off, xs, c * ck + 2 * per_word, part)
            word_dot(w3, off, xs, c * ck + 3 * per_word, part)
            if affine:
                mn = load_s(aux, g)
                for m in range(m_block):
                    acc[m] += s * part[m] + mn * xsum[m * chunks + c]
            else:
                for m in range(m_block):
                    acc[m] += s * part[m]

    @cuda.jit(device=True, inline="always")
    def run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, group_shift, k_split,
            so_m, so_n):
        """The kernel's work; True in a block that stored final outputs (every block without a
        split, a column block's last one with)."""
        xs = cuda.shared.array(xs_size, np.float32, alignment=16)
        xsum = cuda.shared.array(xsum_size, np.float32)
        acc = cuda.local.array(m_block, np.float32)
        part = cuda.local.array(m_block, np.float32)
        xr = cuda.local.array(x_per_thread, np.float32)
        t = cuda.threadIdx.x
        n = cuda.blockIdx.x * block_n + t
        live = n < N
        kp = (K + ck - 1) // ck * ck
        k_begin = cuda.blockIdx.y * k_split
        k_end = min(kp, k_begin + k_split)
        k_codes = k_end if live else 0  # a thread past N loads no codes (zeros)
        for m in range(m_block):
            acc[m] = _F0
        # one tile ahead: the codes and this thread's x of tile k0 + tile are loaded into
        # registers while tile k0 is computed, so no load's latency is waited for in the loop
        k0 = k_begin
        cur = load_tile(qw, k0, k_codes, N, n)
        load_x_tile(x, xr, t, k0, k_end, M, K, x_sm)
        while k0 < k_end:
            cuda.syncthreads()  # every read of the previous tile's x is done
            for j in range(x_per_thread):
                i = t + j * block_n
                if i < xs_size:
                    xs[i] = xr[j]
            cuda.syncthreads()
            if affine:
                for i in range(t, m_block * chunks, block_n):
                    m = i // chunks
                    base = m * tile + (i - m * chunks) * ck
                    s = _F0
                    for j in range(ck):
                        s += xs[base + j]
                    xsum[i] = s
                cuda.syncthreads()
            kn = k0 + tile
            nxt = load_tile(qw, kn, k_codes, N, n)
            load_x_tile(x, xr, t, kn, k_end, M, K, x_sm)
            if live:
                chunk(cur[0], cur[1], cur[2], cur[3], 0, k0, k_end, N, n, group_shift, scales, aux,
                      xs, xsum, part, acc)
                chunk(cur[4], cur[5], cur[6], cur[7], 1, k0, k_end, N, n, group_shift, scales, aux,
                      xs, xsum, part, acc)
                chunk(cur[8], cur[9], cur[10], cur[11], 2, k0, k_end, N, n, group_shift, scales, aux,
                      xs, xsum, part, acc)
                chunk(cur[12], cur[13], cur[14], cur[15], 3, k0, k_end, N, n, group_shift, scales,
                      aux, xs, xsum, part, acc)
            cur = nxt
            k0 = kn
        if not partial:
            if live:
                for m in range(m_block):
                    if m < M:
                        store_out(acc[m], n, out, m * so_m + n * so_n, out, 0, bias, _F1, _F0)
            return True
        # split K: fp32 partial sums to ``work`` (splits, M, N); the block of these columns that
        # finishes last sums them in split order (deterministic) and applies the epilogue
        splits = cuda.gridDim.y
        if live:
            for m in range(m_block):
                if m < M:
                    work[(cuda.blockIdx.y * M + m) * N + n] = acc[m]
        if last_block(counters, cuda.blockIdx.x, 1, splits) == 0:
            return False
        if live:
            for m in range(m_block):
                if m < M:
                    store_out(sum_splits(work, m * N + n, M * N, splits), n, out,
                              m * so_m + n * so_n, out, 0, bias, _F1, _F0)
        return True

    def quant_decode_kernel(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm,
                            group_shift, k_split, so_m, so_n):
        run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, group_shift, k_split,
            so_m, so_n)

    norm_tail = fused_norm_tail(block_n, x_dtype, norm_dtype or "float32")

    def quant_decode_norm_kernel(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm,
                                 group_shift, k_split, so_m, so_n, residual, norm_weight, normed,
                                 r_sm, n_sm, eps, vec):
        if run(x, qw, scales, aux, out, bias, work, counters, M, N, K, x_sm, group_shift,
               k_split, so_m, so_n):
            norm_tail(counters, out, residual, norm_weight, normed, M, N, so_m, so_n, r_sm,
                      n_sm, eps, vec)

    return quant_decode_kernel if norm_dtype is None else quant_decode_norm_kernel


def decode_signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype, norm_dtype=None):
    i32, i64 = types.int32, types.int64
    sig = operand_types(mode, scale_dtype, x_dtype, out_dtype, bias_dtype) + (
        array1d(np.float32), array1d(np.int32), i32, i32, i32, i64, i32, i32, i64, i64)
    return sig if norm_dtype is None else sig + norm_types(x_dtype, norm_dtype)


def decode_options(block_n, m_block, norm=False):
    """Launch bounds: none (ptxas's choice), except for the fused norm's kernel at m_block up to
    4, held to the plain kernel's 64 registers (its 16-byte norm passes took 72: one block an
    SM fewer than the split plan counts on, ``BLOCKS_PER_SM``)."""
    if norm and m_block <= 4:
        return {"launch_bounds": (block_n, max(1, 65536 // (block_n * 64)))}
    return {}


@functools.cache
def decode_kernel(bits, m_block, block_n, mode, zero_point, scale_dtype, x_dtype, out_dtype,
                  bias_dtype, act, partial, norm_dtype=None):
    fn = decode_kernel_fn(bits, m_block, block_n, mode, zero_point, scale_dtype, x_dtype,
                          out_dtype, bias_dtype, act, partial, norm_dtype)
    return Kernel(jit(fn, **decode_options(block_n, m_block, norm_dtype is not None)),
                  decode_signature(mode, scale_dtype, x_dtype, out_dtype, bias_dtype,
                                   norm_dtype),
                  "quant_decode_kernel")



#: Threads a block of ``gather_kernel``.
GATHER_THREADS = 256


@functools.cache
def gather_kernel(x_dtype):
    """Kernel ``(x, perm, out, M, K, x_sm)``: ``out[m, j] = x[m, perm[j]]``, out (M, K)
    contiguous: x's columns in an act-order weight's stored order (``QuantizedWeight.k_perm``).
    One element a thread; M * K threads."""

    def gather_columns_kernel(x, perm, out, M, K, x_sm):
        i = cuda.grid(1)
        if i < M * K:
            m = i // K
            j = i - m * K
            out[i] = x[m * x_sm + perm[j]]

    i32, i64 = types.int32, types.int64
    return Kernel(jit(gather_columns_kernel),
                  (_storage(x_dtype), array1d(np.int32), _storage(x_dtype), i32, i32, i64),
                  "gather_columns_kernel")


#: Threads a block of ``dequant_kernel``.
DEQUANT_THREADS = 256


#: Elements a thread of ``dequant_kernel`` writes with one 16-byte store (the vector form).
DEQUANT_VECTOR = 8


def dequant_kernel_fn(bits, mode, zero_point, scale_dtype, w_dtype, vector):
    """Kernel ``(qw, scales, aux, w, N, K, group_shift)``: the weight (N, K) row-major in
    ``w_dtype`` (fp16 / bf16), each element ``(q - z) s`` (affine: ``q s + m``) computed in fp32
    and rounded once, as the Tensor Core kernel's operand is (the large-M path of
    ``quant_gemm``: this, then ``gemm``). Threads walk the packed words in the layout's order
    (four words of a row, then the next row), so a warp reads contiguous bytes.
    ``vector`` (K a multiple of 8): a thread takes the words of 8 codes (one int4 word, two
    int8 words) and writes them with one 16-byte store, a warp 64 contiguous bytes in each of
    8 rows: whole 32-byte sectors an instruction (2-byte stores, or a thread a row's whole
    chunk, write half sectors and ran 5x slower); otherwise one word a thread, an element at a
    time. ``group_shift``: ``quant_gemm.group_shift``."""
    per_word = 32 // bits
    chunk = 4 * per_word
    words_per_thread = DEQUANT_VECTOR // per_word if vector else 1
    threads_per_chunk_row = 4 // words_per_thread
    mask = np.uint32((1 << bits) - 1)
    code = _code(bits, 0)
    offset = _group_offset(mode, zero_point)
    load_scale = loader(scale_dtype)
    affine = mode == "affine"
    store = storer(w_dtype)
    pack = ptx.pack_bf16x2 if w_dtype == "bfloat16" else ptx.pack_f16x2

    @cuda.jit(device=True, inline="always")
    def element(word0, word1, e, off, s, m):
        # e: a constant after inlining, so the word and shift are chosen at compile time
        word = word0 if e < per_word else word1
        q = code(word >> np.uint32(bits * (e % per_word)) & mask, off)
        return q * s + m if affine else q * s

    def dequant_weight_kernel(qw, scales, aux, w, N, K, group_shift):
        t = cuda.grid(1)
        if t >= ((K + chunk - 1) // chunk) * N * threads_per_chunk_row:
            return
        i = t * words_per_thread
        c = udiv(i, 4 * N)   # the layout's words number below 2^31
        rest = np.int32(i - c * (4 * N))
        n = rest >> 2
        k0 = np.int32(c) * chunk + (rest & 3) * per_word
        if k0 >= K:
            return
        g = (k0 >> group_shift) * N + n
        s = load_scale(scales, g)
        off = _TWO23
        m = _F0
        if affine:
            m = load_scale(aux, g)
        else:
            off = offset(aux, g)
        row = np.int64(n) * K
        word0 = qw[i]
        if vector:
            word1 = qw[i + 1] if words_per_thread == 2 else word0
            ptx.store_u32x4(
                w, row + k0,
                pack(element(word0, word1, 0, off, s, m), element(word0, word1, 1, off, s, m)),
                pack(element(word0, word1, 2, off, s, m), element(word0, word1, 3, off, s, m)),
                pack(element(word0, word1, 4, off, s, m), element(word0, word1, 5, off, s, m)),
                pack(element(word0, word1, 6, off, s, m), element(word0, word1, 7, off, s, m)))
        else:
            for e in range(per_word):
                if k0 + e < K:
                    store(w, row + k0 + e, element(word0, word0, e, off, s, m))

    return dequant_weight_kernel


def dequant_threads(bits, K_padded, N, vector):
    """Threads of a ``dequant_kernel`` launch over a weight of ``K_padded`` columns."""
    words = K_padded // (32 // bits) * N
    return words // (DEQUANT_VECTOR // (32 // bits)) if vector else words


def dequant_signature(mode, scale_dtype, w_dtype):
    i32 = types.int32
    return (array1d(np.uint32), _storage(scale_dtype), _aux_storage(mode, scale_dtype),
            _storage(w_dtype), i32, i32, i32)


@functools.cache
def dequant_kernel(bits, mode, zero_point, scale_dtype, w_dtype, vector):
    return Kernel(jit(dequant_kernel_fn(bits, mode, zero_point, scale_dtype, w_dtype, vector)),
                  dequant_signature(mode, scale_dtype, w_dtype), "dequant_weight_kernel")
