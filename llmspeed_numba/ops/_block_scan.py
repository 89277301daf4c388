"""Block-wide collectives of kernels that give a whole row to one block (``sample``).

Integer scans, histogram searches and totals through shared memory (exact: the same bits on
every run), and reductions for blocks smaller than a warp, which cannot use the full-mask warp
shuffles of ``_rowwise.row_reducer``. Each is a cached factory of an ``inline="always"`` device
function for one block size; every thread of the block must call it.
"""

import functools

import numpy as np

from .._env import cuda

_U64_0 = np.uint64(0)


@functools.lru_cache(maxsize=None)
def syncer(threads):
    """``cuda.syncthreads`` for blocks of more than one thread (nothing for one thread)."""
    if threads > 1:
        @cuda.jit(device=True, inline="always")
        def sync():
            cuda.syncthreads()
    else:
        @cuda.jit(device=True, inline="always")
        def sync():
            pass
    return sync


@functools.lru_cache(maxsize=None)
def block_scan2(threads):
    """Device function ``scan(a, b, buf_a, buf_b) -> (a, b)``: inclusive block-wide prefix sums of
    two uint64 values (Hillis-Steele in shared memory; integer sums, exact). Every thread calls."""
    sync = syncer(threads)

    @cuda.jit(device=True, inline="always")
    def scan(a, b, buf_a, buf_b):
        t = cuda.threadIdx.x
        sync()  # earlier readers of the buffers are done
        buf_a[t] = a
        buf_b[t] = b
        sync()
        off = 1
        while off < threads:
            pa = _U64_0
            pb = _U64_0
            if t >= off:
                pa = buf_a[t - off]
                pb = buf_b[t - off]
            sync()
            a += pa
            b += pb
            buf_a[t] = a
            buf_b[t] = b
            sync()
            off *= 2
        return a, b

    return scan


@functools.lru_cache(maxsize=None)
def block_search(threads):
    """Device function ``search(prim, sec, n, need, buf_a, buf_b, res) -> (i, prim_before,
    sec_before, prim_at, sec_at)``: the first histogram slot ``i`` < n whose inclusive running
    sum of ``prim`` reaches ``need``, with the running sums of ``prim`` and ``sec`` before it and
    both values at it. Slot 0 (zeros before) when none does. Every thread calls; each sums a
    run of consecutive slots, an integer block scan places the crossing in one thread."""
    sync = syncer(threads)
    scan = block_scan2(threads)

    @cuda.jit(device=True, inline="always")
    def search(prim, sec, n, need, buf_a, buf_b, res):
        t = cuda.threadIdx.x
        per = (n + threads - 1) // threads
        lp = _U64_0
        ls = _U64_0
        for i in range(per):
            s = t * per + i
            if s < n:
                lp += np.uint64(prim[s])
                ls += np.uint64(sec[s])
        if t == 0:
            res[0] = _U64_0
            res[1] = _U64_0
            res[2] = _U64_0
            res[3] = np.uint64(prim[0])
            res[4] = np.uint64(sec[0])
        ip, is_ = scan(lp, ls, buf_a, buf_b)  # (synchronises before its first write)
        cp = ip - lp
        cs = is_ - ls
        if cp < need and need <= ip:
            found = False
            for i in range(per):
                s = t * per + i
                if s < n and not found:
                    vp = np.uint64(prim[s])
                    vs = np.uint64(sec[s])
                    if cp + vp >= need:
                        res[0] = np.uint64(s)
                        res[1] = cp
                        res[2] = cs
                        res[3] = vp
                        res[4] = vs
                        found = True
                    cp += vp
                    cs += vs
        sync()
        return np.int32(res[0]), res[1], res[2], res[3], res[4]

    return search


@functools.lru_cache(maxsize=None)
def block_total(threads):
    """Device function ``total(arr, n, buf_a, buf_b) -> uint64``: the sum of ``arr[0:n]``, the
    same in every thread (integer: exact). Every thread calls."""
    scan = block_scan2(threads)

    @cuda.jit(device=True, inline="always")
    def total(arr, n, buf_a, buf_b):
        s = _U64_0
        for i in range(cuda.threadIdx.x, n, threads):
            s += np.uint64(arr[i])
        scan(s, _U64_0, buf_a, buf_b)
        return buf_a[threads - 1]

    return total


@functools.lru_cache(maxsize=None)
def small_reducer(threads, combine):
    """``_rowwise.row_reducer`` for blocks of fewer than 32 threads (no warp shuffles, whose full
    lane mask needs a whole warp): every thread combines the block's values from shared memory,
    in thread order."""
    sync = syncer(threads)

    @cuda.jit(device=True, inline="always")
    def reduce(value, scratch):
        sync()
        scratch[cuda.threadIdx.x] = value
        sync()
        value = scratch[0]
        for i in range(1, threads):
            value = combine(value, scratch[i])
        return value

    return reduce


@functools.lru_cache(maxsize=None)
def small_pair_reducer(threads, combine):
    """``_rowwise.row_pair_reducer`` (float32 pairs) for blocks of fewer than 32 threads."""
    sync = syncer(threads)

    @cuda.jit(device=True, inline="always")
    def reduce(a, b, scratch):
        t = cuda.threadIdx.x
        sync()
        scratch[t] = a
        scratch[threads + t] = b
        sync()
        a = scratch[0]
        b = scratch[threads]
        for i in range(1, threads):
            a, b = combine(a, b, scratch[i], scratch[threads + i])
        return a, b

    return reduce
