"""What a demo module returns: ``DemoCase`` (label, shape, ``run()``) and the timer they use.
Kept here so that the demos need nothing from ``llmspeed_numba._demo``, which runs them."""

import dataclasses
import time


@dataclasses.dataclass
class DemoCase:
    op: str
    shape: str
    run: object


def time_call(fn, on_gpu, repeat=10):
    """Seconds per call of ``fn`` (GPU: synchronised, after one warm-up call)."""
    from numba import cuda

    fn()
    if on_gpu:
        cuda.synchronize()
    repeat = repeat if on_gpu else 1
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if on_gpu:
        cuda.synchronize()
    return (time.perf_counter() - start) / repeat
