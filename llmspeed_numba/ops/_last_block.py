"""Split work finished in the same launch: the last block of a group to finish merges it.

A row split over blocks (argmax, softmax), a sequence split over blocks (paged decode), a K range
split over blocks (quant_gemm) each end with one block combining every block's partial result.
Instead of a second kernel, every block writes its partial, then draws a ticket from its group's
counter (an int workspace, an atomic add); the block drawing the group's last ticket does the
merge and sets the counter back to 0, so the counters are zeroed only when made and a CUDA graph
replays the kernel as it is.

Ordering: a block's partials are visible GPU-wide before its ticket (release: a fence before
the atomic), and the last block reads the others' partials only after its ticket (acquire: a
fence after it). ``last_block`` does both for a block-wide merge; a single thread that publishes
with atomics of its own (argmax's ``atomicMax``) draws with ``draw_ticket``.
"""

from .._env import cuda
from ._index32 import udiv


@cuda.jit(device=True, inline="always")
def draw_ticket(tickets, index, last_ticket):
    """The calling thread's ticket from counter ``tickets[index]``: True when it is
    ``last_ticket`` (the group's size - 1, of the counter's type), the counter then set back to
    0 for the next launch (every member has drawn)."""
    last = False
    if cuda.atomic.add(tickets, index, 1) == last_ticket:
        last = True
        tickets[index] = 0
    return last


@cuda.jit(device=True, inline="always")
def last_block(tickets, block, per_counter, count):
    """Called by every thread of a block once its partials are written: nonzero, in every
    thread, in the block that draws the last of the ``count`` tickets of counter
    ``tickets[block // per_counter]`` (see ``draw_ticket``); by then every other block's
    partials are visible to it. ``per_counter`` 1: the counter is ``tickets[block]``; else
    ``block`` and ``per_counter`` must be below 2^32 (a 32-bit division).

    The counter's index and the last ticket are computed by the drawing thread, after the
    fence, not passed in computed: computed by every thread before it, they changed the decode
    kernel's register allocation throughout (offline SASS, benchmarks/NOTES.md)."""
    cuda.threadfence()  # release: this thread's partials are visible before the block's ticket
    cuda.syncthreads()
    last = 0
    if cuda.threadIdx.x == 0:
        index = block
        if per_counter != 1:
            index = udiv(block, per_counter)
        if draw_ticket(tickets, index, count - 1):
            last = 1
        cuda.threadfence()  # acquire: the other blocks' partials, fenced before their tickets
    return cuda.syncthreads_or(last)
