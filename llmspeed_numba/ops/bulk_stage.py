"""Producer / consumer staging through an mbarrier ring: the smallest kernel that uses the Hopper
asynchronous-copy ops together, as a FlashAttention-3 style kernel's K/V producer does (issue 22).

``out[:] = src[:]`` for ``uint32`` buffers of ``n`` elements (``n`` a multiple of 4: whole
16-byte units), in tiles of ``tile`` elements that each block takes in turn (block b: tiles b,
b + grid, ...). Per block:

- one producer warp: its elected lane waits until a ring stage is free (``empty[s]``), announces
  the tile's bytes on ``full[s]`` (``mbarrier_arrive_expect_tx``) and issues ``chunks`` 1-D bulk
  copies global -> shared that complete on ``full[s]``; the last tile may be short (its copies
  and announced bytes shrink with it);
- ``consumer_warps`` consumer warps: wait for ``full[s]``'s phase, copy the tile from shared to
  ``out``, and each thread arrives on ``empty[s]`` (count: every consumer thread);
- ``stages`` ring stages; stage s's barriers go through one phase per use, so the j-th tile of a
  block waits on parity ``(j // stages) & 1`` (the producer on the opposite parity of
  ``empty``, which a fresh barrier passes at once).

With ``maxnreg = (producer_regs, consumer_regs)`` the producer is a whole warpgroup that gives
registers back (``setmaxnreg_dec``) and the consumers are warpgroups that take them
(``setmaxnreg_inc``): the warp-specialised register split. ptxas honours it only with
``launch_bounds=(threads, 1)`` and when it compiles the whole program, which numba's default LTO
link does (``benchmarks/NOTES.md``, "Hopper PTX building blocks").

Not exported: a self-test of the PTX op layer (simulator and GPU tests, compile check), like
``warp_tile``.
"""

import functools

import numpy as np
from numba import types

from .. import compile_check, ptx
from .._env import cuda
from .._launch import array1d, jit
from ._stage_ring import init_stage_barriers

ELEMENT_BYTES = 4   # uint32 elements
#: (producer, consumer) registers of the warp-specialised variant: 128 x 40 + 256 x 232 = 64512
#: of the SM's 65536, the split of CUTLASS's two-consumer-warpgroup kernels.
MAXNREG = (40, 232)

_SIGNATURE = (array1d(np.uint32), array1d(np.uint32), types.int32)


def threads_for(consumer_warps, maxnreg):
    """Threads of a block: the producer (a warp, or a warpgroup with ``maxnreg``) first."""
    return 32 * (producer_warps(maxnreg) + consumer_warps)


def producer_warps(maxnreg):
    return 4 if maxnreg else 1


def staging_kernel_fn(tile, stages, chunks, consumer_warps, maxnreg=None):
    """The kernel function (not yet jitted): ``kernel[grid, threads_for(...)](src, out, n)``."""
    if tile * ELEMENT_BYTES % (16 * chunks):
        raise ValueError(f"tile: expected {tile} elements to split into {chunks} chunks of "
                         f"whole 16-byte units")
    if maxnreg and consumer_warps % 4:
        raise ValueError(f"consumer_warps: expected whole warpgroups with maxnreg, got "
                         f"{consumer_warps}")
    chunk = tile // chunks
    producer_threads = 32 * producer_warps(maxnreg)
    consumer_threads = 32 * consumer_warps
    split = bool(maxnreg)
    producer_regs, consumer_regs = maxnreg if maxnreg else MAXNREG
    ring_elements = stages * tile      # shared array shapes: compile-time constants
    barriers = 2 * stages

    def staging_kernel(src, out, n):
        ring = cuda.shared.array(ring_elements, np.uint32, alignment=128)
        bars = cuda.shared.array(barriers, np.uint64)  # full[s] = bars[s], empty: stages + s
        tid = cuda.threadIdx.x
        init_stage_barriers(bars, stages, 1, consumer_threads, tid)
        tiles = (n + tile - 1) // tile
        first = cuda.blockIdx.x
        step = cuda.gridDim.x
        if tid < producer_threads:
            if split:
                ptx.setmaxnreg_dec(producer_regs)
            if tid < 32 and ptx.elect_sync():
                j = 0   # this block's tile count (a division of t costs 8 registers more)
                for t in range(first, tiles, step):
                    s = j % stages
                    ptx.mbarrier_wait_parity(bars, stages + s, ((j // stages) & 1) ^ 1)
                    count = min(tile, n - t * tile)
                    ptx.mbarrier_arrive_expect_tx(bars, s, count * ELEMENT_BYTES)
                    for c in range(chunks):
                        begin = c * chunk
                        if begin < count:
                            ptx.cp_async_bulk_g2s(ring, s * tile + begin, src, t * tile + begin,
                                                  min(chunk, count - begin) * ELEMENT_BYTES,
                                                  bars, s)
                    j += 1
        else:
            if split:
                ptx.setmaxnreg_inc(consumer_regs)
            ctid = tid - producer_threads
            j = 0
            for t in range(first, tiles, step):
                s = j % stages
                ptx.mbarrier_wait_parity(bars, s, (j // stages) & 1)
                count = min(tile, n - t * tile)
                for i in range(ctid, count, consumer_threads):
                    out[t * tile + i] = ring[s * tile + i]
                ptx.mbarrier_arrive(bars, stages + s)
                j += 1

    return staging_kernel


def launch_options(consumer_warps, maxnreg):
    """``cuda.jit`` options: both launch bounds for the register split (setmaxnreg needs them)."""
    return {"launch_bounds": (threads_for(consumer_warps, maxnreg), 1)} if maxnreg else {}


@functools.cache
def staging_kernel(tile, stages, chunks, consumer_warps, maxnreg=None):
    """The jitted kernel (numba dispatcher) of one configuration."""
    return jit(staging_kernel_fn(tile, stages, chunks, consumer_warps, maxnreg),
               **launch_options(consumer_warps, maxnreg))


def _compile_target(maxnreg):
    def build():
        options = launch_options(8, maxnreg)
        if maxnreg:
            options["lto"] = True   # the whole-program link numba uses on a GPU (see NOTES)
        return staging_kernel_fn(1024, 2, 2, 8, maxnreg), _SIGNATURE, options

    return build


_PTX = ("mbarrier.init.shared::cta.b64", "fence.mbarrier_init.release.cluster",
        "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "elect.sync")
_SASS = ("SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "UBLKCP",
         "ELECT")
compile_check.register("bulk_stage", _compile_target(None), ptx_must_have=_PTX,
                       sass_must_have=_SASS)
compile_check.register("bulk_stage_setmaxnreg", _compile_target(MAXNREG),
                       ptx_must_have=_PTX + ("setmaxnreg.dec.sync.aligned.u32 40",
                                             "setmaxnreg.inc.sync.aligned.u32 232"),
                       sass_must_have=_SASS + ("USETMAXREG.DEALLOC", "USETMAXREG.TRY_ALLOC"))
