"""Softmax over the vocabulary and greedy argmax: the sampling end of an LLM.

    softmax(x, temperature)[r, j] = exp((x[r, j] - max_j x[r, :]) / T) / sum_j exp(...)
    argmax(x)[r] = the lowest j with x[r, j] = max x[r, :]

``x`` (..., vocab) fp16 / bf16 / fp32 with a contiguous last dimension (leading dimensions
collapsing into one row stride), vocab up to 2^31 - 1. Accumulation in fp32 (the max, the sum of
exponentials, each probability); the softmax output has x's dtype or float32 (``dtype=``,
``out=``).

Special values, as torch: a NaN anywhere in a row makes that row's softmax NaN and is its argmax
(NaN compares above everything, lowest NaN index); a row of -inf only has a NaN softmax (0 / 0 -
torch's answer too: a fully masked row is an upstream bug worth seeing) and argmax 0; +inf in a
row makes its softmax NaN. ``-0.0`` and ``0.0`` tie (lowest index wins).

Kernels (``_rowwise`` layout):
- rows that fit in registers (<= 32768 halves / 16384 floats) with enough rows to fill the GPU:
  one fused kernel, the row read once into registers, max and sum reduced, probabilities written;
- otherwise (few long rows, e.g. 64 x 128256) each row is split over ``splits`` blocks of
  ``SPLIT_THREADS``, grid (rows, splits), sized to what the GPU holds at once (occupancy of the
  compiled kernel x SMs), so the whole grid is one wave. One kernel per call: each block
  computes its span's (max, sum of exp), publishes it (a 64-bit atomic per block), counts itself
  in the row's arrival counter and waits until the row's other blocks have arrived; then every
  block merges the row's partials (fixed order: every block gets the same bits) and writes its
  span. When the span fits in registers (``RESIDENT_CHUNKS`` 16-byte chunks a thread: 64 x 128256
  in half precision) x is read once; otherwise (fp32 there) the write pass re-reads the span, just
  read by the same block, from L2. Waiting needs the row's blocks running together: the host
  launches this only when the grid fits at once, and a block that has polled ``SPIN_POLLS`` times
  in vain (another kernel holding SMs, a debugger serialising blocks, the simulator's sequential
  blocks) computes the missing spans' statistics itself - the same code, so the same bits - and
  carries on: never a deadlock. The last block to leave resets the row's counters (workspace kept
  per device and stream, so calls on one stream reuse it and CUDA graphs can capture the kernel).
  ``SPLIT_PATH = "two_kernels"`` selects the previous layout (a stats kernel, then a write kernel
  merging the partials, the same span code), never chosen by the planner: kept as a manual
  fallback and for comparison (``benchmarks/probes/probe_softmax.py``).
- argmax: one kernel. Each thread scans its chunks cheaply (chunk max and a NaN probe, the exact
  index search only for a chunk that beats the thread's best), the block reduces 64-bit keys
  (ordered value bits above the complemented index), and with split rows each block merges its
  key into the row's with ``atomicMax``; the last block of a row (an atomic ticket) writes the
  index and resets key and ticket.
"""

import functools
import math

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._arrays import Buffer, dtype_name, empty, kernel_buffer, stream_handle
from .._checks import output, tensor
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit, sm_count
from .._typing import ArrayLike, DTypeLike, StreamLike
from . import _rowwise as rw

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
#: Threads per row when rows are split over several blocks.
SPLIT_THREADS = 512
#: 16-byte chunks each thread loads before using any (loads in flight per thread) when streaming.
UNROLL = 4
#: Blocks aimed for per SM when rows are split (at most what fits on the GPU at once).
BLOCKS_PER_SM = 4
#: A span of a split row is at least this many chunks per thread (amortises the partials).
MIN_CHUNKS_PER_THREAD = 4
#: Chunks a thread keeps in registers in the one-kernel split path (32 registers of words).
RESIDENT_CHUNKS = rw.MAX_CHUNKS_PER_THREAD
#: Most blocks per row (their partials are merged through shared memory).
MAX_SPLITS = 256
#: argmax on split rows: blocks per SM at most. At 64 x 128256 on the H200, 4 splits (2 blocks an
#: SM) took 14.0 / 14.2 / 16.2 us (fp16 / bf16 / fp32) against 18.5 / 16.0 / 17.4 for a full wave
#: of 6 (3 an SM): the scan is issue-bound, so a third block an SM only adds merge work.
ARGMAX_BLOCKS_PER_SM = 2
#: Split-row softmax: "auto" (one kernel, the span in registers when the grid fits at once with
#: it, else streamed), "resident" / "streamed" (forced, for tests and probes) or "two_kernels".
SPLIT_PATH = "auto"
#: Polls of a row's arrival counter before a block computes the missing spans itself (about
#: 10-30 ms on a GPU; a block whose row is complete never gets there). Negative: never wait
#: (tests: every block takes the fallback).
SPIN_POLLS = 2 if SIMULATOR else 1 << 14
#: Nanoseconds a waiting block sleeps between polls.
SPIN_SLEEP_NS = 128
#: Blocks that fit on the "GPU" at once under the simulator (which runs blocks one by one).
SIM_RESIDENT_BLOCKS = 64
#: Blocks per row forced (probes sweeping the split count); None: planned.
FORCE_SPLITS = None

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_LOG2E = math.log2(math.e)
_U32_MAX = np.uint32(0xFFFFFFFF)
_U64_LOW = np.uint64(0xFFFFFFFF)
_U64_32 = np.uint64(32)


# ---- device helpers ----------------------------------------------------------------------------
# Online softmax state (m, z): the running max m of x and z = sum 2^((x - m) * scale), kept in x's
# units so every exponent is (x - m) * scale, as exact as the plain fp32 exp(x - max).

_NAN = np.float32(np.nan)


@cuda.jit(device=True, inline="always")
def _merge(m1, z1, m2, z2, scale):
    """Merge two online-softmax states."""
    m = rw.max_f32(m1, m2)
    if m == _NEG_INF:
        return m, _F0
    return m, z1 * ptx.ex2_approx((m1 - m) * scale) + z2 * ptx.ex2_approx((m2 - m) * scale)


@cuda.jit(device=True, inline="always")
def _rescale(m, z, row_m, scale):
    """A thread's sum z (about its max m) re-expressed about the row's max."""
    if m == _NEG_INF:
        return z  # 0, or NaN already
    return z * ptx.ex2_approx((m - row_m) * scale)


@functools.lru_cache(maxsize=None)
def _online_update(n):
    """Device function ``update(m, z, a, scale) -> (m, z)`` folding ``a[0:n]`` into the state
    (a NaN poisons z, so the row comes out NaN whatever the other threads saw)."""

    @cuda.jit(device=True, inline="always")
    def update(m, z, a, scale):
        cm = a[0]
        for i in range(1, n):
            cm = rw.max_f32(cm, a[i])
        if cm != cm:
            z = _NAN
        elif cm > m:
            z = z * ptx.ex2_approx((m - cm) * scale)
            m = cm
        if m != _NEG_INF:
            for i in range(n):
                z += ptx.ex2_approx((a[i] - m) * scale)
        return m, z

    return update


@functools.lru_cache(maxsize=None)
def _argmax_scan(n):
    """Device function ``scan(bv, bi, a, i0) -> (bv, bi)`` over ``a[0:n]`` at indices i0.. in
    increasing order (a tie keeps the earlier index)."""

    @cuda.jit(device=True, inline="always")
    def scan(bv, bi, a, i0):
        for i in range(n):
            v = a[i]
            if bi < 0 or v > bv or (v != v and bv == bv):
                bv = v
                bi = i0 + i
        return bv, bi

    return scan


@functools.lru_cache(maxsize=None)
def _tail_element(vec):
    """Device function ``tail_element(cols, last) -> (index, live)``: the element of the row's
    scalar tail (``cols % vec`` elements, one a thread) this thread owns, live only in the row's
    ``last`` span."""
    has_tail = vec > 1

    @cuda.jit(device=True, inline="always")
    def tail_element(cols, last):
        tail = (cols // vec) * vec + cuda.threadIdx.x
        return tail, has_tail and last and tail < cols

    return tail_element


@functools.lru_cache(maxsize=None)
def _span_stats(x_kind, vec, tpr, cpt, unroll):
    """Device function ``stats(x, xo, c_begin, c_end, last, cols, scale, words, a, w1, scratch)
    -> (max, sum of 2^((x - max) * scale))`` of chunks ``[c_begin, c_end)`` of the row at ``xo``
    (thread t: chunks c_begin + t, + tpr, ...), the same in every thread of the block (every
    thread calls it: it reduces over the block); the ``last`` span also holds the row's scalar
    tail. ``cpt > 0``: the span (``cpt`` chunks a thread) is loaded into ``words`` and left
    there; ``cpt == 0``: streamed, ``unroll`` chunks a thread in flight. Both give the same bits
    (the stats kernel, the one-kernel paths and its fallback share them)."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    update = _online_update(vec)
    update1 = _online_update(1)
    row_max = rw.row_reducer(tpr, rw.max_f32)
    row_sum = rw.row_reducer(tpr, rw.add_f32)
    tail_element = _tail_element(vec)
    # the variant chosen here, not by a branch inside the device function: numba copies every
    # branch of an inlined function into the kernel before typing it
    if cpt > 0:
        @cuda.jit(device=True, inline="always")
        def resident_stats(x, xo, c_begin, c_end, last, cols, scale, words, a, w1, scratch):
            t = cuda.threadIdx.x
            tail, tail_live = tail_element(cols, last)
            # the tail first: converted at once, its latency stalls the few tail threads (vocab
            # % vec != 0 only) but keeps the kernel at 64 registers; loaded later it spills
            tv = _NEG_INF
            if tail_live:
                load1(x, xo + tail, w1, 0)
                unpack1(w1, 0, a)
                tv = a[0]
            for v in range(cpt):
                c = c_begin + v * tpr + t
                if c < c_end:
                    load(x, xo + c * vec, words, v * wpc)
            # online (max, sum) in one pass over the registers: a separate max pass keeps more
            # values live (77 registers against 64 for two blocks of 512 threads an SM)
            m = _NEG_INF
            z = _F0
            for v in range(cpt):
                if c_begin + v * tpr + t < c_end:
                    unpack(words, v * wpc, a)
                    m, z = update(m, z, a, scale)
            if tail_live:
                a[0] = tv
                m, z = update1(m, z, a, scale)
            row_m = row_max(m, scratch)
            return row_m, row_sum(_rescale(m, z, row_m, scale), scratch)

        return resident_stats

    @cuda.jit(device=True, inline="always")
    def streamed_stats(x, xo, c_begin, c_end, last, cols, scale, words, a, w1, scratch):
        tail, tail_live = tail_element(cols, last)
        m = _NEG_INF
        z = _F0
        c = c_begin + cuda.threadIdx.x
        while c < c_end:
            for u in range(unroll):
                if c + u * tpr < c_end:
                    load(x, xo + (c + u * tpr) * vec, words, u * wpc)
            for u in range(unroll):
                if c + u * tpr < c_end:
                    unpack(words, u * wpc, a)
                    m, z = update(m, z, a, scale)
            c += unroll * tpr
        if tail_live:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            m, z = update1(m, z, a, scale)
        row_m = row_max(m, scratch)
        return row_m, row_sum(_rescale(m, z, row_m, scale), scratch)

    return streamed_stats


@functools.lru_cache(maxsize=None)
def _span_writer(x_kind, o_kind, vec, tpr, cpt, unroll):
    """Device function ``write(x, out, xo, oo, c_begin, c_end, m, inv, scale, words, a)``:
    probabilities ``2^((x - m) * scale) * inv`` of chunks ``[c_begin, c_end)`` (not the tail).
    ``cpt > 0``: from the span ``_span_stats`` left in ``words`` (x not read); ``cpt == 0``: x
    re-read, ``unroll`` chunks a thread in flight."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    store = rw.chunk_storer(o_kind, vec)

    if cpt > 0:
        @cuda.jit(device=True, inline="always")
        def resident_write(x, out, xo, oo, c_begin, c_end, m, inv, scale, words, a):
            t = cuda.threadIdx.x
            for v in range(cpt):
                c = c_begin + v * tpr + t
                if c < c_end:
                    unpack(words, v * wpc, a)
                    for i in range(vec):
                        a[i] = ptx.ex2_approx((a[i] - m) * scale) * inv
                    store(out, oo + c * vec, a, 0)

        return resident_write

    @cuda.jit(device=True, inline="always")
    def streamed_write(x, out, xo, oo, c_begin, c_end, m, inv, scale, words, a):
        c = c_begin + cuda.threadIdx.x
        while c < c_end:
            for u in range(unroll):
                if c + u * tpr < c_end:
                    load(x, xo + (c + u * tpr) * vec, words, u * wpc)
            for u in range(unroll):
                if c + u * tpr < c_end:
                    unpack(words, u * wpc, a)
                    for i in range(vec):
                        a[i] = ptx.ex2_approx((a[i] - m) * scale) * inv
                    store(out, oo + (c + u * tpr) * vec, a, 0)
            c += unroll * tpr

    return streamed_write


@functools.lru_cache(maxsize=None)
def _tail_writer(x_kind, o_kind, vec):
    """Device function ``write_tail(x, out, xo, oo, last, cols, m, inv, scale, w1, a)``: the
    row's scalar tail (``cols % vec`` elements, one a thread) when ``last`` (the row's last
    span)."""
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    store1 = rw.chunk_storer(o_kind, 1)
    tail_element = _tail_element(vec)

    @cuda.jit(device=True, inline="always")
    def write_tail(x, out, xo, oo, last, cols, m, inv, scale, w1, a):
        tail, live = tail_element(cols, last)
        if live:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            a[0] = ptx.ex2_approx((a[0] - m) * scale) * inv
            store1(out, oo + tail, a, 0)

    return write_tail


# ---- softmax kernels ---------------------------------------------------------------------------

def _softmax_fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt):
    """One pass: the row in registers (``cpt`` chunks a thread), max, sum, probabilities."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    store = rw.chunk_storer(o_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    store1 = rw.chunk_storer(o_kind, 1)
    row_max = rw.row_reducer(tpr, rw.max_f32)
    row_sum = rw.row_reducer(tpr, rw.add_f32)
    slots = rw.scratch_slots(tpr, rpb)
    has_tail = vec > 1
    nwords = cpt * wpc

    def softmax_fused_kernel(x, out, rows, cols, x_stride, o_stride, scale):
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        w1 = cuda.local.array(1, np.uint32)
        a = cuda.local.array(vec, np.float32)
        t = cuda.threadIdx.x % tpr
        row = cuda.blockIdx.x * rpb + cuda.threadIdx.x // tpr
        live = row < rows
        xo = np.int64(row) * x_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                load(x, xo + c * vec, words, v * wpc)
        tail = chunks * vec + t
        tail_live = has_tail and live and tail < cols
        tv = _NEG_INF
        if tail_live:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            tv = a[0]
        m = tv
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    m = rw.max_f32(m, a[i])
        m = row_max(m, scratch)
        z = _F0
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    z += ptx.ex2_approx((a[i] - m) * scale)
        if tail_live:
            z += ptx.ex2_approx((tv - m) * scale)
        z = row_sum(z, scratch)  # every lane takes part; rows past the end sum to zero
        inv = _F1 / z if live else _F0
        for v in range(cpt):
            c = v * tpr + t
            if live and c < chunks:
                unpack(words, v * wpc, a)
                for i in range(vec):
                    a[i] = ptx.ex2_approx((a[i] - m) * scale) * inv
                store(out, oo + c * vec, a, 0)
        if tail_live:
            a[0] = ptx.ex2_approx((tv - m) * scale) * inv
            store1(out, oo + tail, a, 0)

    return softmax_fused_kernel


def _softmax_split_kernel_fn(x_kind, o_kind, vec, tpr, unroll, write):
    """Split rows, grid (rows, splits): ``write=False`` computes each span's online state into
    ``pm`` / ``pl``; ``write=True`` merges the row's states and writes the span."""
    stats = _span_stats(x_kind, vec, tpr, 0, unroll)
    write_span = _span_writer(x_kind, o_kind, vec, tpr, 0, unroll)
    write_tail = _tail_writer(x_kind, o_kind, vec)
    slots = rw.scratch_slots(tpr, 1)
    nwords = unroll * rw.words_per_chunk(vec)

    def softmax_split_kernel(x, out, pm, pl, cols, x_stride, o_stride, span, scale):
        scratch = cuda.shared.array(slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        w1 = cuda.local.array(1, np.uint32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        s = cuda.blockIdx.y
        splits = cuda.gridDim.y
        xo = np.int64(row) * x_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        c_begin = s * span
        c_end = min(c_begin + span, chunks)
        if not write:
            m, z = stats(x, xo, c_begin, c_end, s == splits - 1, cols, scale, words, a, w1,
                         scratch)
            if t == 0:
                pm[row * splits + s] = m
                pl[row * splits + s] = z
        else:
            m = _NEG_INF
            z = _F0
            for j in range(splits):
                m, z = _merge(m, z, pm[row * splits + j], pl[row * splits + j], scale)
            inv = _F1 / z
            write_span(x, out, xo, oo, c_begin, c_end, m, inv, scale, words, a)
            write_tail(x, out, xo, oo, s == splits - 1, cols, m, inv, scale, w1, a)

    return softmax_split_kernel


if SIMULATOR:
    @cuda.jit(device=True, inline="always")
    def _pause(ns):
        pass
else:
    @cuda.jit(device=True, inline="always")
    def _pause(ns):
        cuda.nanosleep(np.uint32(ns))


@cuda.jit(device=True, inline="always")
def _pack_state(m, z):
    """An online-softmax state as one 64-bit word (max bits high, sum bits low)."""
    return (np.uint64(ptx.f32_bits(m)) << _U64_32) | np.uint64(ptx.f32_bits(z))


@cuda.jit(device=True, inline="always")
def _unpack_state(word):
    return (ptx.f32_from_bits(np.uint32(word >> _U64_32)),
            ptx.f32_from_bits(np.uint32(word & _U64_LOW)))


def _softmax_one_kernel_fn(x_kind, o_kind, vec, tpr, cpt, unroll, polls):
    """Split rows in one kernel, grid (rows, splits): each block's span statistics, published
    and merged across the row's blocks through ``parts`` / ``counts``, then the span written.
    ``cpt > 0``: the span (``cpt`` chunks a thread) stays in registers; ``cpt == 0``: streamed
    (``unroll`` chunks a thread in flight) and re-read for the write."""
    slots = rw.scratch_slots(tpr, 1)
    nwords = (cpt if cpt > 0 else unroll) * rw.words_per_chunk(vec)
    max_splits = MAX_SPLITS
    wait = polls >= 0
    span_stats = _span_stats(x_kind, vec, tpr, cpt, unroll)
    write_span = _span_writer(x_kind, o_kind, vec, tpr, cpt, unroll)
    write_tail = _tail_writer(x_kind, o_kind, vec)

    def softmax_one_kernel(x, out, parts, counts, cols, x_stride, o_stride, span, scale):
        scratch = cuda.shared.array(slots, np.float32)
        part_m = cuda.shared.array(max_splits, np.float32)
        part_z = cuda.shared.array(max_splits, np.float32)
        ready = cuda.shared.array(1, np.int32)
        words = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        w1 = cuda.local.array(1, np.uint32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        s = cuda.blockIdx.y
        splits = cuda.gridDim.y
        xo = np.int64(row) * x_stride
        oo = np.int64(row) * o_stride
        chunks = cols // vec
        c_begin = s * span
        c_end = min(c_begin + span, chunks)
        first = row * splits
        # One inlined span_stats (registers): its first pass is this block's span; if the row's
        # other blocks do not all arrive, later passes compute spans s + 1, ..., s (mod splits)
        # here, ending on this block's own span, so a resident span is back in ``words``.
        j = s
        k = -1  # spans recorded by the fallback; -1: this block's own pass
        while True:
            m, z = span_stats(x, xo, j * span, min(j * span + span, chunks), j == splits - 1,
                              cols, scale, words, a, w1, scratch)
            if k < 0:
                if splits == 1:
                    if t == 0:
                        part_m[0] = m
                        part_z[0] = z
                    break
                if t == 0:
                    cuda.atomic.exch(parts, first + s, _pack_state(m, z))
                    cuda.threadfence()  # the partial is visible before the arrival is
                    arrived = cuda.atomic.add(counts, 2 * row, np.uint32(1)) + np.uint32(1)
                    n = 0
                    while wait and arrived < splits and n < polls:
                        _pause(SPIN_SLEEP_NS)
                        arrived = cuda.atomic.add(counts, 2 * row, np.uint32(0))
                        n += 1
                    cuda.threadfence()
                    ready[0] = 1 if wait and arrived >= splits else 0
                cuda.syncthreads()
                if ready[0] != 0:
                    if t < splits:  # an atomic reads at L2: no stale L1 line of another row
                        part_m[t], part_z[t] = _unpack_state(
                            cuda.atomic.or_(parts, first + t, np.uint64(0)))
                    break
                k = 0
            else:
                if t == 0:
                    part_m[j] = m
                    part_z[j] = z
                k += 1
                if k == splits:
                    break
            j = j + 1 if j + 1 < splits else 0
        cuda.syncthreads()
        row_m = _NEG_INF
        row_z = _F0
        for j in range(splits):
            row_m, row_z = _merge(row_m, row_z, part_m[j], part_z[j], scale)
        if splits > 1 and t == 0 and (cuda.atomic.add(counts, 2 * row + 1, np.uint32(1))
                                      == np.uint32(splits - 1)):
            # the last block to leave: every block has arrived and read the partials
            cuda.atomic.exch(counts, 2 * row, np.uint32(0))
            cuda.atomic.exch(counts, 2 * row + 1, np.uint32(0))
        inv = _F1 / row_z
        write_span(x, out, xo, oo, c_begin, c_end, row_m, inv, scale, words, a)
        write_tail(x, out, xo, oo, s == splits - 1, cols, row_m, inv, scale, w1, a)

    return softmax_one_kernel


@cuda.jit(device=True, inline="always")
def _argmax_key(bv, bi):
    """A (value, index) candidate as a 64-bit key, (high, low) words, whose unsigned order is
    argmax's: order-preserving value bits (NaN highest, -0 == 0) above the complemented index
    (the lower index wins a tie). No candidate (index -1) is 0, below every real key."""
    if bi < 0:
        return np.uint32(0), np.uint32(0)
    bits = ptx.f32_bits(bv)
    if bv != bv:
        bits = np.uint32(0x7FFFFFFF)
    elif bv == _F0:
        bits = np.uint32(0)
    if bits & np.uint32(0x80000000):
        ordered = bits ^ _U32_MAX
    else:
        ordered = bits | np.uint32(0x80000000)
    return ordered, _U32_MAX - np.uint32(bi)


@cuda.jit(device=True, inline="always")
def _key_max(h1, l1, h2, l2):
    """The larger of two 64-bit keys ``(high, low)``, each word carried as the bits of a float32
    so that ``rw.row_pair_reducer`` can reduce them: they are only moved (shuffles, shared
    memory, selects), never computed with, so every bit pattern (NaN ones too) survives."""
    a = ptx.f32_bits(h1)
    b = ptx.f32_bits(h2)
    # one return: with a return in each branch NVVM leaves the 16-warp merge loop rolled
    if b > a or (b == a and ptx.f32_bits(l2) > ptx.f32_bits(l1)):
        h1 = h2
        l1 = l2
    return h1, l1


@functools.lru_cache(maxsize=None)
def _argmax_chunk(n):
    """Device function ``chunk(bv, bi, a, i0) -> (bv, bi)``: ``_argmax_scan`` of ``a[0:n]``,
    run only when the chunk can change the answer: its max (NaN-blind) beats
    ``bv``, or its sum is NaN (a NaN or infinities of both signs: scanned exactly) while ``bv``
    is not NaN, or there is no candidate yet. Three instructions an element on the common path
    instead of the exact scan's nine."""
    scan = _argmax_scan(n)

    @cuda.jit(device=True, inline="always")
    def chunk(bv, bi, a, i0):
        cm = a[0]
        probe = a[0]
        for i in range(1, n):
            cm = max(cm, a[i])
            probe += a[i]
        if bi < 0 or cm > bv or (probe != probe and bv == bv):
            bv, bi = scan(bv, bi, a, i0)
        return bv, bi

    return chunk


def _argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split):
    """Grid (row blocks, splits): each span's best (value, index) as a 64-bit key; with
    ``split`` merged across spans with ``atomicMax`` and a ticket counter."""
    wpc = rw.words_per_chunk(vec)
    load = rw.chunk_words_loader(x_kind, vec)
    unpack = rw.chunk_unpacker(x_kind, vec)
    load1 = rw.chunk_words_loader(x_kind, 1)
    unpack1 = rw.chunk_unpacker(x_kind, 1)
    chunk = _argmax_chunk(vec)
    scan1 = _argmax_scan(1)
    reduce = rw.row_pair_reducer(tpr, _key_max, False)
    pair_slots = 2 * rw.scratch_slots(tpr, rpb)
    has_tail = vec > 1
    nwords = unroll * wpc

    def argmax_kernel(x, out, keys, tickets, rows, cols, x_stride, span):
        scratch = cuda.shared.array(pair_slots, np.float32)
        words = cuda.local.array(nwords, np.uint32)
        a = cuda.local.array(vec, np.float32)
        w1 = cuda.local.array(1, np.uint32)
        t = cuda.threadIdx.x % tpr
        row = cuda.blockIdx.x * rpb + cuda.threadIdx.x // tpr
        live = row < rows
        s = cuda.blockIdx.y
        splits = cuda.gridDim.y
        xo = np.int64(row) * x_stride
        chunks = cols // vec
        c_begin = s * span
        c_end = min(c_begin + span, chunks)
        bv = _NEG_INF
        bi = np.int32(-1)
        c = c_begin + t
        while live and c < c_end:
            for u in range(unroll):
                if c + u * tpr < c_end:
                    load(x, xo + (c + u * tpr) * vec, words, u * wpc)
            for u in range(unroll):
                if c + u * tpr < c_end:
                    unpack(words, u * wpc, a)
                    bv, bi = chunk(bv, bi, a, np.int32((c + u * tpr) * vec))
            c += unroll * tpr
        tail = chunks * vec + t
        if has_tail and live and s == splits - 1 and tail < cols:
            load1(x, xo + tail, w1, 0)
            unpack1(w1, 0, a)
            bv, bi = scan1(bv, bi, a, np.int32(tail))
        hi, lo = _argmax_key(bv, bi)
        hf, lf = reduce(ptx.f32_from_bits(hi), ptx.f32_from_bits(lo), scratch)
        hi, lo = ptx.f32_bits(hf), ptx.f32_bits(lf)
        if not live or t != 0:
            return
        if not split:
            out[row] = np.int64(_U32_MAX - lo)
            return
        cuda.atomic.max(keys, row, (np.uint64(hi) << _U64_32) | np.uint64(lo))
        cuda.threadfence()
        if cuda.atomic.add(tickets, row, np.uint32(1)) == np.uint32(splits - 1):
            best = cuda.atomic.exch(keys, row, np.uint64(0))
            tickets[row] = np.uint32(0)
            out[row] = np.int64(_U32_MAX - np.uint32(best & _U64_LOW))

    return argmax_kernel


def _buf(k):
    return array1d(np.float32 if k == rw.KIND_F32 else np.uint16)


def _fused_signature(x_kind, o_kind):
    return (_buf(x_kind), _buf(o_kind), types.int32, types.int32, types.int64, types.int64,
            types.float32)


def _split_signature(x_kind, o_kind):
    f32 = array1d(np.float32)
    return (_buf(x_kind), _buf(o_kind), f32, f32, types.int32, types.int64, types.int64,
            types.int32, types.float32)


def _one_kernel_signature(x_kind, o_kind):
    return (_buf(x_kind), _buf(o_kind), array1d(np.uint64), array1d(np.uint32), types.int32,
            types.int64, types.int64, types.int32, types.float32)


def _argmax_signature(x_kind):
    return (_buf(x_kind), array1d(np.int64), array1d(np.uint64), array1d(np.uint32),
            types.int32, types.int32, types.int64, types.int32)


@functools.lru_cache(maxsize=None)
def _softmax_fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt):
    return Kernel(jit(_softmax_fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt)),
                  _fused_signature(x_kind, o_kind), "softmax_fused_kernel")


@functools.lru_cache(maxsize=None)
def _softmax_split_kernel(x_kind, o_kind, vec, tpr, unroll, write):
    return Kernel(jit(_softmax_split_kernel_fn(x_kind, o_kind, vec, tpr, unroll, write)),
                  _split_signature(x_kind, o_kind),
                  f"softmax_{'write' if write else 'stats'}_kernel")


def _one_kernel_options(tpr):
    """Two blocks of ``tpr`` (512) threads an SM: at most 64 registers, which the resident span
    (32 registers of words) needs to be capped to (it takes 77 unbounded)."""
    return {"launch_bounds": (tpr, max(1, 1024 // tpr))}


@functools.lru_cache(maxsize=None)
def _softmax_one_kernel(x_kind, o_kind, vec, tpr, cpt, unroll, polls):
    return Kernel(jit(_softmax_one_kernel_fn(x_kind, o_kind, vec, tpr, cpt, unroll, polls),
                      **_one_kernel_options(tpr)),
                  _one_kernel_signature(x_kind, o_kind),
                  f"softmax_{'resident' if cpt else 'streamed'}_kernel")


@functools.lru_cache(maxsize=None)
def _argmax_kernel(x_kind, vec, tpr, rpb, unroll, split):
    return Kernel(jit(_argmax_kernel_fn(x_kind, vec, tpr, rpb, unroll, split)),
                  _argmax_signature(x_kind), "argmax_kernel")


# ---- workspace -----------------------------------------------------------------------------------

_WORKSPACE = {}
_RETIRED = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them


def _workspace(like, stream, name, size, dtype):
    """A device buffer of at least ``size`` elements, zero when first made, one per (device,
    stream, name): launches on one stream run in order, so they can share it (the argmax kernel
    leaves its keys and tickets zero again). Made with torch when ``like`` is a torch tensor, so
    that a first call inside CUDA-graph capture allocates from the graph's pool and records the
    zeroing; with numba otherwise."""
    device = 0 if SIMULATOR else (like.obj.device.index if like.kind == "torch"
                                  else cuda.get_current_device().id)
    key = (device, stream, name)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[0] < size:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(size, 1024)
        if SIMULATOR:
            buf = np.zeros(n, dtype)
        elif like.kind == "torch":
            import torch

            storage = {1: torch.uint8, 4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]
            buf = torch.zeros(n, dtype=storage, device=like.obj.device)
        else:
            buf = cuda.to_device(np.zeros(n, dtype))
        _WORKSPACE[key] = buf
    if SIMULATOR:
        return buf
    ptr = buf.data_ptr() if hasattr(buf, "data_ptr") else buf.__cuda_array_interface__["data"][0]
    return Buffer(ptr, buf.shape[0], np.dtype(dtype), buf)


# ---- planning --------------------------------------------------------------------------------

def _prepare(x, name="x"):
    tx = tensor(x, name, dtypes=FLOAT_DTYPES)
    rows, cols, x_stride = rw.rows_view(name, tx)
    if cols == 0:
        raise ValueError(f"{name}: expected a non-empty last dimension, got shape {tx.shape}")
    if cols >= 2**31:
        raise NotImplementedError(f"{name}: rows of at most 2^31 - 1 elements, got {cols}")
    return tx, rows, cols, x_stride


def _aim(rows, chunks, threads):
    """Blocks per row that fill the GPU: about ``BLOCKS_PER_SM`` blocks per SM in all, each span
    at least ``MIN_CHUNKS_PER_THREAD`` chunks a thread (``FORCE_SPLITS`` when set)."""
    if FORCE_SPLITS is not None:
        return max(1, min(int(FORCE_SPLITS), MAX_SPLITS))
    want = -(-BLOCKS_PER_SM * sm_count() // max(rows, 1))
    most = max(1, chunks // (threads * MIN_CHUNKS_PER_THREAD))
    return max(1, min(want, most, MAX_SPLITS))


_RESIDENT = {}


def _resident_blocks(kernel, threads):
    """Blocks of ``kernel`` (``threads`` each) the GPU holds at once: occupancy x SMs."""
    if SIMULATOR:
        return SIM_RESIDENT_BLOCKS
    key = (cuda.get_current_device().id, kernel.name, id(kernel), threads)
    n = _RESIDENT.get(key)
    if n is None:
        try:
            n = kernel.compiled().max_cooperative_grid_blocks(threads)
        except Exception:  # noqa: BLE001  the occupancy query failed: count registers (sm_90)
            regs = -(-max(kernel.resources()["registers"], 1) // 8) * 8
            n = min(32, 2048 // threads, 65536 // (regs * threads)) * sm_count()
        _RESIDENT[key] = n
    return n


def _softmax_split_plan(rows, chunks, x_kind, o_kind, vec):
    """``(kernels, splits, cpt)`` for rows split over blocks: one kernel with the span in
    registers (``cpt`` chunks a thread) when its grid fits on the GPU at once, else one kernel
    streaming the span (``cpt == 0``; more than one block a row only if they fit at once), or
    the stats and write kernels (``SPLIT_PATH = "two_kernels"``)."""
    threads = SPLIT_THREADS
    aim = _aim(rows, chunks, threads)
    if SPLIT_PATH == "two_kernels":
        return tuple(_softmax_split_kernel(x_kind, o_kind, vec, threads, UNROLL, write)
                     for write in (False, True)), aim, 0
    if SPLIT_PATH not in ("auto", "resident", "streamed"):
        raise ValueError(f"SPLIT_PATH: expected auto, resident, streamed or two_kernels, got "
                         f"{SPLIT_PATH!r}")
    most = min(MAX_SPLITS, threads)  # each partial read by one thread of the block
    need = -(-chunks // (threads * RESIDENT_CHUNKS))  # blocks a row for registers to hold it
    if SPLIT_PATH != "streamed" and need <= most:
        widest = _softmax_one_kernel(x_kind, o_kind, vec, threads, RESIDENT_CHUNKS, UNROLL,
                                     SPIN_POLLS)
        fit = _resident_blocks(widest, threads) // rows
        if SPLIT_PATH == "resident" or need <= fit:
            splits = min(most, max(need, aim if FORCE_SPLITS is not None else min(aim, fit)))
            span = -(-chunks // splits)
            cpt = rw.pow2_ceil(-(-span // threads))  # chunks a thread, a power of two
            return (_softmax_one_kernel(x_kind, o_kind, vec, threads, cpt, UNROLL, SPIN_POLLS),
                    ), splits, cpt
    kernel = _softmax_one_kernel(x_kind, o_kind, vec, threads, 0, UNROLL, SPIN_POLLS)
    if FORCE_SPLITS is None:
        aim = min(aim, _resident_blocks(kernel, threads) // rows)
    return (kernel,), max(1, min(aim, most)), 0


def _argmax_plan(rows, chunks, x_kind, vec):
    """``(kernel, splits, threads_per_row, rows_per_block)``: rows split over blocks when there
    are too few to fill the GPU, the grid then one wave (what fits at once)."""
    splits = _aim(rows, chunks, SPLIT_THREADS)
    if splits > 1:
        kernel = _argmax_kernel(x_kind, vec, SPLIT_THREADS, 1, UNROLL, True)
        if FORCE_SPLITS is None:  # no second, partly filled wave
            splits = max(1, min(splits, _resident_blocks(kernel, SPLIT_THREADS) // rows))
            if not SIMULATOR:  # (the simulator's one "SM" would never split)
                splits = max(1, min(splits, ARGMAX_BLOCKS_PER_SM * sm_count() // rows))
        if splits > 1:
            return kernel, splits, SPLIT_THREADS, 1
    tpr, rpb, _ = rw.row_plan(chunks)
    return _argmax_kernel(x_kind, vec, tpr, rpb, UNROLL, False), 1, tpr, rpb


def softmax(x: ArrayLike, *, temperature: float = 1.0, dtype: DTypeLike | None = None,
            out: ArrayLike | None = None, stream: StreamLike = None) -> ArrayLike:
    """Softmax of ``x / temperature`` over the last dimension, accumulated in fp32.

    Args:
        x: (..., vocab) fp16 / bf16 / fp32 logits, last dimension contiguous.
        temperature: a finite float > 0 (an int is a TypeError: pass ``float(t)``).
        dtype: output dtype, x's (default) or float32 (a name, numpy or torch dtype).
        out: optional output, x's shape, dtype ``dtype`` (or x's / float32 when ``dtype`` is
            None); may be ``x`` itself when the dtypes agree.
        stream: CUDA stream (default: the caller's framework's current stream).

    Returns:
        ``out``: probabilities, in x's array kind. Rows of -inf only (or with NaN or +inf) are
        NaN, as in torch.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` / ``dtype`` not x's dtype or float32,
            a non-float temperature.
        ValueError: an empty or non-contiguous last dimension, shapes that disagree, a
            temperature that is not finite and > 0.
    """
    tx, rows, cols, x_stride = _prepare(x)
    if not isinstance(temperature, (float, np.floating)):
        raise TypeError(f"temperature: expected a float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
    if dtype is not None:
        dtype = dtype_name(dtype, "dtype")
        if dtype not in (tx.dtype, "float32"):
            shown = "float32" if tx.dtype == "float32" else f"{tx.dtype} (x's) or float32"
            raise TypeError(f"dtype: expected {shown}, got {dtype}")
    if out is not None:
        to = tensor(out, "out")
        want = dtype or (to.dtype if to.dtype in (tx.dtype, "float32") else tx.dtype)
        to = output("out", out, tx.shape, want, tx)
    else:
        out = empty(tx, tx.shape, dtype or tx.dtype)
        to = tensor(out, "out")
    if rows == 0:
        return out
    _, _, o_stride = rw.rows_view("out", to)
    scale = _LOG2E / float(temperature)
    x_kind, o_kind = rw.kind(tx.dtype), rw.kind(to.dtype)
    vec = rw.vector_width(tx.dtype)
    one = rows == 1  # a single row's stride is never used: (1, vocab) still gets 16-byte access
    if not (rw.vector_aligned(tx, 0 if one else x_stride, vec)
            and rw.vector_aligned(to, 0 if one else o_stride, vec)):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    tpr, rpb, cpt = rw.row_plan(chunks)
    xb, ob = kernel_buffer(tx), kernel_buffer(to)
    if cpt > 0 and _aim(rows, chunks, SPLIT_THREADS) == 1:
        kernel = _softmax_fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt)
        kernel(-(-rows // rpb), tpr * rpb, (xb, ob, rows, cols, x_stride, o_stride, scale),
               handle)
        return out
    kernels, splits, _ = _softmax_split_plan(rows, chunks, x_kind, o_kind, vec)
    span = -(-chunks // splits)
    if len(kernels) == 2:
        pm = _workspace(tx, handle, "softmax_max", rows * splits, np.float32)
        pl = _workspace(tx, handle, "softmax_sum", rows * splits, np.float32)
        for kernel in kernels:
            kernel((rows, splits), SPLIT_THREADS,
                   (xb, ob, pm, pl, cols, x_stride, o_stride, span, scale), handle)
        return out
    parts = _workspace(tx, handle, "softmax_parts", rows * splits, np.uint64)
    counts = _workspace(tx, handle, "softmax_counts", 2 * rows, np.uint32)
    kernels[0]((rows, splits), SPLIT_THREADS,
               (xb, ob, parts, counts, cols, x_stride, o_stride, span, scale), handle)
    return out


def argmax(x: ArrayLike, *, out: ArrayLike | None = None,
           stream: StreamLike = None) -> ArrayLike:
    """Index of the largest element of each row of ``x`` (..., vocab): greedy sampling.

    Ties go to the lowest index; NaN counts as the largest value (as torch.argmax).

    Returns:
        ``out``: int64, shape ``x.shape[:-1]``, in x's array kind.

    Raises:
        TypeError: non-arrays, unsupported dtypes, ``out`` not int64.
        ValueError: an empty or non-contiguous last dimension, ``out`` of the wrong shape.
    """
    tx, rows, cols, x_stride = _prepare(x)
    out_shape = tx.shape[:-1]
    to = output("out", out, out_shape, "int64", tx)
    if to is None:
        out = empty(tx, out_shape, "int64")
        to = tensor(out, "out")
    if rows == 0:
        return out
    if to.ndim and not to.is_contiguous():
        raise ValueError(f"out: expected a contiguous array, got strides {to.strides}")
    vec = rw.vector_width(tx.dtype)
    if not rw.vector_aligned(tx, 0 if rows == 1 else x_stride, vec):
        vec = 1
    chunks = cols // vec
    handle = stream_handle(stream, (tx,))
    kernel, splits, tpr, rpb = _argmax_plan(rows, chunks, rw.kind(tx.dtype), vec)
    span = -(-chunks // splits)
    keys = _workspace(tx, handle, "argmax_keys", rows, np.uint64)
    tickets = _workspace(tx, handle, "argmax_tickets", rows, np.uint32)
    kernel((-(-rows // rpb), splits), tpr * rpb,
           (kernel_buffer(tx), kernel_buffer(to), keys, tickets, rows, cols, x_stride, span),
           handle)
    return out


def _register():
    f16, bf16, f32 = rw.KIND_F16, rw.KIND_BF16, rw.KIND_F32
    vec128 = ("LDG.E.128", "STG.E.128")
    threads = SPLIT_THREADS
    checks = {
        "softmax_fused_f16_4096": lambda: (
            _softmax_fused_kernel_fn(f16, f16, 8, *rw.row_plan(512)), _fused_signature(f16, f16)),
        "softmax_resident_bf16": lambda: (  # 64 x 128256 in half precision
            _softmax_one_kernel_fn(bf16, bf16, 8, threads, RESIDENT_CHUNKS, UNROLL, SPIN_POLLS),
            _one_kernel_signature(bf16, bf16), _one_kernel_options(threads)),
        "softmax_streamed_f32": lambda: (  # 64 x 128256 in fp32
            _softmax_one_kernel_fn(f32, f32, 4, threads, 0, UNROLL, SPIN_POLLS),
            _one_kernel_signature(f32, f32), _one_kernel_options(threads)),
        "softmax_stats_f32": lambda: (
            _softmax_split_kernel_fn(f32, f32, 4, threads, UNROLL, False),
            _split_signature(f32, f32)),
        "softmax_write_bf16_to_f32": lambda: (
            _softmax_split_kernel_fn(bf16, f32, 8, threads, UNROLL, True),
            _split_signature(bf16, f32)),
        "argmax_split_f32": lambda: (
            _argmax_kernel_fn(f32, 4, threads, 1, UNROLL, True), _argmax_signature(f32)),
        "argmax_bf16_rows": lambda: (
            _argmax_kernel_fn(bf16, 8, 128, 1, UNROLL, False), _argmax_signature(bf16)),
    }
    for name, build in checks.items():
        must = ("LDG.E.128",) if name.startswith("argmax") or "stats" in name else vec128
        compile_check.register(name, build, sass_must_have=must)


_register()
