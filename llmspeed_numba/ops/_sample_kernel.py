"""The sampling kernel (``sample.py`` is the op: its conventions, filters and checks).

Kernel: one block of ``threads`` (a power of two, 1..``MAX_THREADS``, from the vocabulary alone:
about ``TILES_PER_THREAD`` tiles a thread) per row; blocks of a warp or more reduce with warp
shuffles, smaller ones (vocabularies under 1024) through shared memory. The row is read in tiles
of 8 elements (one 16-byte load of halves, two of floats when aligned; scalar loads otherwise),
thread t owning tiles t, t + threads, ... in that order. Passes over the row (the first from HBM,
the later ones mostly from L2):
1. argmax: the row max M and its index (greedy rows, and rows with NaN / +-inf max, stop here
   and return it, as ``argmax`` does).
2. top-k / top-p only: a histogram of the logit deficit ``M - x`` in ``BINS`` bins of
   ``1 / BINS_PER_LOGIT`` (the last bin catches the rest), counts and probability masses
   (``exp2((x - M) log2(e) / T)`` in 2^-40 fixed point: integer sums, so the block's totals are
   the same bits on every run) in shared memory. Bins are linear in the logit, so the bulk of a
   vocabulary spreads over many bins (few atomic conflicts). A block-wide scan finds the bin
   holding the k-th largest logit, then the top-p bin.
3. inside a threshold bin, radix select over the order-preserving bits of the logit (digits of at
   most 11 bits: 2 passes for fp16 / bf16, 3 for fp32), histograms of the bin's tokens only; the
   exact threshold, ties included. top-k then top-p: up to 2 + 2 x digits passes.
4. sampling: each thread sums ``exp2((x - M) scale)`` over its kept tokens in fp32 (in its tile
   order), the sums go to 2^-32 fixed point, an integer block scan finds the thread where
   ``floor(u * total)`` falls, and that thread re-walks its tiles (same sums, same bits) to the
   token: inverse-transform sampling over a fixed token order, one exponential per token.

So plain temperature (or min-p) sampling reads the row twice; top-k or top-p add 3 (halves) or 4
(fp32) passes each. Shared memory: the histograms (``BINS`` and ``2^11`` bins of u32 counts and
u64 masses) and the scan buffers, 38 KB at 512 threads. Registers (sm_90a, 512 threads): 109,
no local memory.

Compile-time configuration (closure constants of ``_sample_kernel``): the storage kind, whether
rows are 16-byte aligned, the block's threads (``threads_for``) and the histogram sizes
(``bins``, ``digit_bits``: ``sample.TUNING``).
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit
from . import _rowwise as rw
from ._block_scan import (block_scan2, block_search, block_total, small_pair_reducer,
                          small_reducer, syncer)
from .argmax import _argmax_key, _key_max

#: Elements of a tile (one 16-byte load of halves, two of floats).
TILE = 8
#: Threads of a row's block at most (one block a row; 512 leaves room for 2 blocks an SM).
MAX_THREADS = 512
#: Tiles a thread aims for when the vocabulary is small (fewer threads for short rows).
TILES_PER_THREAD = 4
#: Tiles loaded before any is used (loads in flight per thread). The kernel holds every pass in
#: one body: at 4 it needs 128 registers and still spills a few words (sm_90a, 512 threads); at 2,
#: 109 registers and no local memory.
UNROLL = 2
#: Logit-deficit histogram: bins per logit unit and bins (the last catches every deficit beyond
#: (BINS - 1) / BINS_PER_LOGIT = 32 logits, p / p_max < 1e-13 at temperature 1).
BINS_PER_LOGIT = 16
BINS = 512
#: Widest radix digit (histogram of 2^11 bins).
DIGIT_BITS = 11
#: Fixed-point scales: bin masses (p / p_max in [0, 1], summed over at most 2^23 tokens) and the
#: per-thread sums of the sampling pass (at most 2^16 tokens a thread).
MASS_ONE = 2.0**40
SUM_ONE = 2.0**32

#: Bits of the per-row parameter mask telling which parameters are arrays.
_T_ARRAY, _K_ARRAY, _P_ARRAY, _MINP_ARRAY, _SEED_ARRAY = 1, 2, 4, 8, 16

_F0 = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_LOG2E = np.float32(math.log2(math.e))
_U32_MAX = np.uint32(0xFFFFFFFF)
_U32_SIGN = np.uint32(0x80000000)
_U64_0 = np.uint64(0)
_U64_1 = np.uint64(1)
_U32_0 = np.uint32(0)
_U32_1 = np.uint32(1)
_MASS_ONE = np.float32(MASS_ONE)
_SUM_ONE = np.float64(SUM_ONE)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_2_M53 = np.float64(2.0**-53)


# ---- device helpers ----------------------------------------------------------------------------

if SIMULATOR:  # NumPy warns on uint64 wrap-around: Python ints, masked
    _M64 = (1 << 64) - 1

    @cuda.jit(device=True, inline="always")
    def _uniform(seed):
        z = (int(seed) + int(_GOLDEN)) & _M64
        z = ((z ^ (z >> 30)) * int(_MIX1)) & _M64
        z = ((z ^ (z >> 27)) * int(_MIX2)) & _M64
        z = z ^ (z >> 31)
        return np.float64(z >> 11) * _2_M53
else:
    @cuda.jit(device=True, inline="always")
    def _uniform(seed):
        """A uniform double in [0, 1) from a 64-bit seed (splitmix64: one step, then the
        finaliser)."""
        z = np.uint64(seed) + _GOLDEN
        z = (z ^ (z >> _S30)) * _MIX1
        z = (z ^ (z >> _S27)) * _MIX2
        z = z ^ (z >> _S31)
        return np.float64(z >> _S11) * _2_M53


@cuda.jit(device=True, inline="always")
def _key(v):
    """Order-preserving uint32 of a float32 (-0 and 0 equal)."""
    bits = ptx.f32_bits(v)
    if v == _F0:
        bits = _U32_0
    if bits & _U32_SIGN:
        return bits ^ _U32_MAX
    return bits | _U32_SIGN


@cuda.jit(device=True, inline="always")
def _from_key(k):
    """Inverse of ``_key`` (argmax keys: NaN is 0x7FFFFFFF)."""
    if k & _U32_SIGN:
        return ptx.f32_from_bits(k ^ _U32_SIGN)
    return ptx.f32_from_bits(k ^ _U32_MAX)


@functools.lru_cache(maxsize=None)
def _binner(bins, per_logit):
    """Device function ``bin(v, m)``: the deficit bin of logit v below the row max m, in
    ``bins`` bins of ``1 / per_logit`` logits, the last one catching the rest (monotone: larger
    logits, lower bins)."""
    last = np.float32(bins - 1)
    rx = np.float32(per_logit)

    @cuda.jit(device=True, inline="always")
    def bin_of(v, m):
        d = (m - v) * rx
        if d < last:
            return np.int32(d)
        return np.int32(bins - 1)

    return bin_of


@cuda.jit(device=True, inline="always")
def _weight(v, m, scale):
    """p / p_max = 2^((v - m) scale); 0 for -inf (also at temperature inf)."""
    if v > _NEG_INF:
        return ptx.ex2_approx((v - m) * scale)
    return _F0


@cuda.jit(device=True, inline="always")
def _min_f32(a, b):
    return a if a <= b else b


@functools.lru_cache(maxsize=None)
def _tile_loader(k, vector):
    """Device function ``load(x, xo, tile, cols, a, a0)``: the tile's 8 elements as float32 into
    ``a[a0:a0 + 8]`` (-inf past the row's end); 16-byte loads for full tiles when ``vector``."""
    load8 = rw.chunk_loader(k, TILE)
    load1 = rw.chunk_loader(k, 1)

    @cuda.jit(device=True, inline="always")
    def load(x, xo, tile, cols, a, a0):
        j = tile * TILE
        if vector and j + TILE <= cols:
            load8(x, xo + j, a, a0)
        else:
            for i in range(TILE):
                if j + i < cols:
                    load1(x, xo + j + i, a, a0 + i)
                else:
                    a[a0 + i] = _NEG_INF

    return load


def _key_digits(k, digit_bits):
    """``(low_bit, width, levels)`` of the radix select: the significant bits of the float32 key
    of a ``k`` element (bf16: the top 16; fp16 values in fp32: the top 19), cut into
    ``levels`` digits of at most ``digit_bits``."""
    low = {rw.KIND_BF16: 16, rw.KIND_F16: 13, rw.KIND_F32: 0}[k]
    bits = 32 - low
    levels = -(-bits // digit_bits)
    return low, -(-bits // levels), levels


# ---- the kernel --------------------------------------------------------------------------------

def _sample_kernel_fn(k, vector, threads, bins, digit_bits):
    load = _tile_loader(k, vector)
    if threads >= 32:
        reduce_key = rw.row_pair_reducer(threads, _key_max, False)
        reduce_min = rw.row_reducer(threads, _min_f32)
    else:
        reduce_key = small_pair_reducer(threads, _key_max)
        reduce_min = small_reducer(threads, _min_f32)
    scan = block_scan2(threads)
    search = block_search(threads)
    total = block_total(threads)
    pair_slots = 2 * max(rw.scratch_slots(threads, 1), threads if threads < 32 else 1)
    sync = syncer(threads)
    bin_of = _binner(bins, BINS_PER_LOGIT)
    low, width, levels = _key_digits(k, digit_bits)
    hist = 1 << digit_bits
    step = UNROLL * threads
    na = UNROLL * TILE

    @cuda.jit(device=True, inline="always")
    def kept_weight(v, valid, m, scale, kb, kt, lmin):
        """Weight of a token in the sampling pass: 0 unless valid and kept by every filter."""
        w = _F0
        if valid and (v - m) * scale >= lmin:
            b = bin_of(v, m)
            if b < kb or (b == kb and _key(v) >= kt):
                w = _weight(v, m, scale)
        return w

    @cuda.jit(device=True, inline="always")
    def refine(x, xo, cols, ntiles, m, scale, b, need, by_mass, floor_t, dcnt, dmass, buf_a,
               buf_b, res, a):
        """Radix select inside deficit bin ``b`` over the tokens with key >= ``floor_t``: the
        largest key threshold t such that the tokens with key >= t reach ``need`` of the count
        (``by_mass`` False: top-k) or of the mass (True: top-p), i.e. the first key, from the
        top, where the running count / mass reaches ``need``. Returns (t, count, mass) of the
        tokens of the bin with key >= t (every token of key t is kept: ties)."""
        t = cuda.threadIdx.x
        prefix = _U32_0
        above_c = _U64_0
        above_m = _U64_0
        c_at = _U64_0
        m_at = _U64_0
        for level in range(levels):
            hi = 32 - level * width
            lo = max(hi - width, low)
            nd = 1 << (hi - lo)
            for s in range(t, nd, threads):
                dcnt[s] = _U32_0
                dmass[s] = _U64_0
            sync()
            tile = t
            while tile < ntiles:
                for u in range(UNROLL):
                    if tile + u * threads < ntiles:
                        load(x, xo, tile + u * threads, cols, a, u * TILE)
                for u in range(UNROLL):
                    tu = tile + u * threads
                    if tu < ntiles:
                        for i in range(TILE):
                            v = a[u * TILE + i]
                            if tu * TILE + i < cols and bin_of(v, m) == b:
                                kv = _key(v)
                                if (kv >= floor_t
                                        and (np.uint64(kv ^ prefix) >> np.uint64(hi)) == _U64_0):
                                    d = (nd - 1) - np.int32((kv >> np.uint32(lo))
                                                            & np.uint32(nd - 1))
                                    cuda.atomic.add(dcnt, d, _U32_1)
                                    cuda.atomic.add(
                                        dmass, d, np.uint64(_weight(v, m, scale) * _MASS_ONE))
                tile += step
            sync()
            if by_mass:
                d, m_before, c_before, m_at, c_at = search(dmass, dcnt, nd, need - above_m,
                                                           buf_a, buf_b, res)
            else:
                d, c_before, m_before, c_at, m_at = search(dcnt, dmass, nd, need - above_c,
                                                           buf_a, buf_b, res)
            above_c += c_before
            above_m += m_before
            prefix |= np.uint32((nd - 1) - d) << np.uint32(lo)
            sync()
        return prefix, above_c + c_at, above_m + m_at

    def sample_kernel(x, out, temps, top_ks, top_ps, min_ps, seeds, temp_s, top_k_s, top_p_s,
                      min_p_s, seed_s, arrays, cols, x_stride, o_stride):
        scratch = cuda.shared.array(pair_slots, np.float32)
        bcnt = cuda.shared.array(bins, np.uint32)
        bmass = cuda.shared.array(bins, np.uint64)
        dcnt = cuda.shared.array(hist, np.uint32)
        dmass = cuda.shared.array(hist, np.uint64)
        buf_a = cuda.shared.array(threads, np.uint64)
        buf_b = cuda.shared.array(threads, np.uint64)
        res = cuda.shared.array(5, np.uint64)
        a = cuda.local.array(na, np.float32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        xo = np.int64(row) * x_stride
        ntiles = (cols + TILE - 1) // TILE

        # ---- pass 1: argmax (the lowest index of the max; NaN counts as the largest) --------
        bv = _NEG_INF
        bi = np.int32(-1)
        tile = t
        while tile < ntiles:
            for u in range(UNROLL):
                if tile + u * threads < ntiles:
                    load(x, xo, tile + u * threads, cols, a, u * TILE)
            for u in range(UNROLL):
                tu = tile + u * threads
                if tu < ntiles:
                    for i in range(TILE):
                        v = a[u * TILE + i]
                        if tu * TILE + i < cols and (bi < 0 or v > bv or (v != v and bv == bv)):
                            bv = v
                            bi = np.int32(tu * TILE + i)
            tile += step
        hi, lo = _argmax_key(bv, bi)
        hf, lf = reduce_key(ptx.f32_from_bits(hi), ptx.f32_from_bits(lo), scratch)
        best = np.int64(_U32_MAX - ptx.f32_bits(lf))
        m = _from_key(ptx.f32_bits(hf))

        temp = temps[row] if arrays & _T_ARRAY else temp_s
        if not (temp > _F0) or not (m > _NEG_INF and m < -_NEG_INF):
            if t == 0:
                out[np.int64(row) * o_stride] = best
            return
        top_k = top_ks[row] if arrays & _K_ARRAY else top_k_s
        top_p = top_ps[row] if arrays & _P_ARRAY else top_p_s
        min_p = min_ps[row] if arrays & _MINP_ARRAY else min_p_s
        seed = seeds[row] if arrays & _SEED_ARRAY else seed_s
        scale = _LOG2E / temp
        use_k = top_k > 0 and top_k < cols
        use_p = top_p < np.float32(1.0)  # NaN: off
        lmin = _NEG_INF
        if min_p > _F0:
            lmin = min(math.log2(min_p), _F0)

        # kept: deficit bin < kb, or == kb with key >= kt (kb = bins: every bin)
        kb = np.int32(bins)
        kt = _U32_0
        if use_k or use_p:
            # ---- pass 2: deficit histogram (counts, and masses for top-p) -------------------
            for s in range(t, bins, threads):
                bcnt[s] = _U32_0
                bmass[s] = _U64_0
            sync()
            far_cnt = _U32_0
            far_mass = _U64_0
            tile = t
            while tile < ntiles:
                for u in range(UNROLL):
                    if tile + u * threads < ntiles:
                        load(x, xo, tile + u * threads, cols, a, u * TILE)
                for u in range(UNROLL):
                    tu = tile + u * threads
                    if tu < ntiles:
                        for i in range(TILE):
                            if tu * TILE + i < cols:
                                v = a[u * TILE + i]
                                b = bin_of(v, m)
                                q = _U64_0
                                if use_p:
                                    q = np.uint64(_weight(v, m, scale) * _MASS_ONE)
                                if b < bins - 1:
                                    cuda.atomic.add(bcnt, b, _U32_1)
                                    if use_p:
                                        cuda.atomic.add(bmass, b, q)
                                else:
                                    far_cnt += _U32_1
                                    far_mass += q
                tile += step
            if far_cnt > _U32_0:
                cuda.atomic.add(bcnt, bins - 1, far_cnt)
                cuda.atomic.add(bmass, bins - 1, far_mass)
            sync()

            total_mass = _U64_0
            if use_k:
                b, c_before, m_before, c_at, m_at = search(
                    bcnt, bmass, bins, np.uint64(top_k), buf_a, buf_b, res)
                kb = b
                kept_cnt = c_at
                kept_mass = m_at
                if c_before + c_at > np.uint64(top_k):
                    kt, kept_cnt, kept_mass = refine(
                        x, xo, cols, ntiles, m, scale, b, np.uint64(top_k) - c_before, False,
                        _U32_0, dcnt, dmass, buf_a, buf_b, res, a)
                total_mass = m_before + kept_mass
                if use_p:
                    sync()
                    if t == 0:  # the top-p scan sees only what top-k keeps
                        bcnt[b] = np.uint32(kept_cnt)
                        bmass[b] = kept_mass
                    sync()
            if use_p:
                if not use_k:
                    total_mass = total(bmass, bins, buf_a, buf_b)
                tf = math.ceil(np.float64(top_p) * np.float64(total_mass))
                target = _U64_1
                if tf > 1:
                    target = np.uint64(tf)
                b, m_before, c_before, m_at, c_at = search(bmass, bcnt, bins, target, buf_a,
                                                           buf_b, res)
                floor_t = kt if b == kb else _U32_0
                if c_at > _U64_1:
                    pt, _, _ = refine(x, xo, cols, ntiles, m, scale, b, target - m_before,
                                      True, floor_t, dcnt, dmass, buf_a, buf_b, res, a)
                else:
                    pt = floor_t
                kb = b
                kt = pt

        # ---- sampling pass: per-thread sums of the kept tokens' weights --------------------
        z = _F0
        tile = t
        while tile < ntiles:
            for u in range(UNROLL):
                if tile + u * threads < ntiles:
                    load(x, xo, tile + u * threads, cols, a, u * TILE)
            for u in range(UNROLL):
                tu = tile + u * threads
                if tu < ntiles:
                    for i in range(TILE):
                        z += kept_weight(a[u * TILE + i], tu * TILE + i < cols, m, scale, kb,
                                         kt, lmin)
            tile += step
        zq = np.uint64(np.float64(z) * _SUM_ONE)
        incl, _ = scan(zq, _U64_0, buf_a, buf_b)
        z_total = buf_a[threads - 1]
        target = np.uint64(_uniform(seed) * np.float64(z_total))
        if target >= z_total and z_total > _U64_0:
            target = z_total - _U64_1
        # the first thread whose inclusive sum passes the target (integer sums: exactly one
        # thread has excl <= target < incl, unless the total is 0)
        mine = np.float32(t) if incl > target else np.float32(threads)
        owner = np.int32(reduce_min(mine, scratch))
        if t == owner:
            r = np.float64(target - (incl - zq))
            c = _F0
            pick = best
            found = False
            tile = t
            while tile < ntiles and not found:
                for u in range(UNROLL):
                    if tile + u * threads < ntiles:
                        load(x, xo, tile + u * threads, cols, a, u * TILE)
                for u in range(UNROLL):
                    tu = tile + u * threads
                    if tu < ntiles:
                        for i in range(TILE):
                            c += kept_weight(a[u * TILE + i], tu * TILE + i < cols, m, scale,
                                             kb, kt, lmin)
                            if not found and np.float64(c) * _SUM_ONE > r:
                                pick = np.int64(tu * TILE + i)
                                found = True
                tile += step
            out[np.int64(row) * o_stride] = pick
        elif owner >= threads and t == 0:  # no mass at all (cannot happen for finite rows)
            out[np.int64(row) * o_stride] = best

    return sample_kernel


def _buf(k):
    return array1d(np.float32 if k == rw.KIND_F32 else np.uint16)


def _signature(k):
    f32 = array1d(np.float32)
    return (_buf(k), array1d(np.int64), f32, array1d(np.int32), f32, f32, array1d(np.int64),
            types.float32, types.int32, types.float32, types.float32, types.int64, types.int32,
            types.int32, types.int64, types.int64)


def _options(threads):
    """One block of up to 512 threads an SM (109 registers: a 64-register cap spills)."""
    return {"launch_bounds": (threads, 1)}


@functools.lru_cache(maxsize=None)
def _sample_kernel(k, vector, threads, bins, digit_bits):
    return Kernel(jit(_sample_kernel_fn(k, vector, threads, bins, digit_bits),
                      **_options(threads)),
                  _signature(k), "sample_kernel")


def threads_for(vocab):
    """Threads of a row's block: a function of the vocabulary only, so a row's token does not
    depend on the batch or the layout."""
    tiles = -(-vocab // TILE)
    return min(rw.pow2_ceil(-(-tiles // TILES_PER_THREAD)), MAX_THREADS)


# (the fp32 variant compiles to 108 registers, no local memory either: not registered, to keep
# CI's compile check short)
compile_check.register(
    "sample_bf16",
    lambda: (_sample_kernel_fn(rw.KIND_BF16, True, MAX_THREADS, BINS, DIGIT_BITS),
             _signature(rw.KIND_BF16), _options(MAX_THREADS)),
    sass_must_have=("LDG.E.128",))
