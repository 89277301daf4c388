"""The softmax kernels and their device helpers (``softmax.py`` plans and launches them).

Online softmax state (m, z): the running max m of x and z = sum 2^((x - m) * scale), kept in x's
units so every exponent is (x - m) * scale, as exact as the plain fp32 exp(x - max). A span of a
row is reduced to its state by ``_span_stats`` and written by ``_span_writer`` / ``_tail_writer``;
the fused kernel holds a whole row in registers, the split kernel one span of a row a block.
"""

import functools

import numpy as np
from numba import types

from .. import ptx
from .._env import SIMULATOR, cuda
from .._launch import Kernel, array1d, jit
from . import _rowwise as rw
from . import _split_rows as rs
from ._last_block import draw_ticket

#: Nanoseconds a waiting block sleeps between polls.
SPIN_SLEEP_NS = 128

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
_U64_LOW = np.uint64(0xFFFFFFFF)
_U64_32 = np.uint64(32)


# ---- device helpers ----------------------------------------------------------------------------

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
    (the resident and streamed paths and their fallback share them)."""
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

def fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt):
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


def one_kernel_fn(x_kind, o_kind, vec, tpr, cpt, unroll, polls):
    """Split rows in one kernel, grid (rows, splits): each block's span statistics, published
    and merged across the row's blocks through ``parts`` / ``counts``, then the span written.
    ``cpt > 0``: the span (``cpt`` chunks a thread) stays in registers; ``cpt == 0``: streamed
    (``unroll`` chunks a thread in flight) and re-read for the write."""
    slots = rw.scratch_slots(tpr, 1)
    nwords = (cpt if cpt > 0 else unroll) * rw.words_per_chunk(vec)
    max_splits = rs.MAX_SPLITS
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
        if splits > 1 and t == 0 and draw_ticket(counts, 2 * row + 1, np.uint32(splits - 1)):
            # the last block to leave: every block has arrived and read the partials
            cuda.atomic.exch(counts, 2 * row, np.uint32(0))
        inv = _F1 / row_z
        write_span(x, out, xo, oo, c_begin, c_end, row_m, inv, scale, words, a)
        write_tail(x, out, xo, oo, s == splits - 1, cols, row_m, inv, scale, w1, a)

    return softmax_one_kernel


def fused_signature(x_kind, o_kind):
    x, o = rs.buffer_type(x_kind), rs.buffer_type(o_kind)
    return (x, o, types.int32, types.int32, types.int64, types.int64, types.float32)


def one_kernel_signature(x_kind, o_kind):
    x, o = rs.buffer_type(x_kind), rs.buffer_type(o_kind)
    return (x, o, array1d(np.uint64), array1d(np.uint32), types.int32, types.int64, types.int64,
            types.int32, types.float32)


@functools.lru_cache(maxsize=None)
def fused_kernel(x_kind, o_kind, vec, tpr, rpb, cpt):
    return Kernel(jit(fused_kernel_fn(x_kind, o_kind, vec, tpr, rpb, cpt)),
                  fused_signature(x_kind, o_kind), "softmax_fused_kernel")


def one_kernel_options(tpr):
    """Two blocks of ``tpr`` (512) threads an SM: at most 64 registers, which the resident span
    (32 registers of words) needs to be capped to (it takes 77 unbounded)."""
    return {"launch_bounds": (tpr, max(1, 1024 // tpr))}


@functools.lru_cache(maxsize=None)
def one_kernel(x_kind, o_kind, vec, tpr, cpt, unroll, polls):
    return Kernel(jit(one_kernel_fn(x_kind, o_kind, vec, tpr, cpt, unroll, polls),
                      **one_kernel_options(tpr)),
                  one_kernel_signature(x_kind, o_kind),
                  f"softmax_{'resident' if cpt else 'streamed'}_kernel")
