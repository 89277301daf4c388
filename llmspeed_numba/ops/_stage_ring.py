"""The mbarrier ring of the producer / consumer kernels (FlashAttention's and the GEMM's
warp-specialised forms, the staging self-tests): stage s has a ``full`` barrier ``bars[s]``,
which the producer side completes when the stage's data has landed, and an ``empty`` barrier
``bars[stages + s]``, which every consumer thread arrives on when done with it. A stage's j-th use
waits on parity ``(j // stages) & 1`` (the producer on the opposite parity of ``empty``, which a
fresh barrier passes at once)."""

from .. import ptx
from .._env import cuda


@cuda.jit(device=True, inline="always")
def init_stage_barriers(bars, stages, full_arrivals, empty_arrivals, tid):
    """Thread 0 makes the ring's barriers (``full``: ``full_arrivals`` arrivals a phase, plus
    any bytes announced on it; ``empty``: ``empty_arrivals``), then the block meets, so no thread
    waits on a barrier before it exists."""
    if tid == 0:
        for s in range(stages):
            ptx.mbarrier_init(bars, s, full_arrivals)
            ptx.mbarrier_init(bars, stages + s, empty_arrivals)
        ptx.fence_mbarrier_init()
    cuda.syncthreads()
