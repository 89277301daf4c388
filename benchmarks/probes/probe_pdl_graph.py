"""Does programmatic dependent launch overlap kernels on this GPU, eagerly and inside a CUDA
graph captured by torch? (Session 27 measured no gain in the decode step; this tells whether the
launch attribute takes effect at all.)

A pair: ``first`` releases its dependents at once, then sleeps ``--us``; ``second`` sleeps
``--us`` before its ``griddep_wait`` (touching no memory), then writes. Serialised, a pair takes
about 2 x us; overlapped, about 1 x us. ``--pairs`` pairs back to back, timed eagerly and as one
graph replay, with ``second`` launched plainly and programmatically; one line each (us a pair).

    python benchmarks/probes/probe_pdl_graph.py [--us 20] [--pairs 50]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import numpy as np
from numba import types

from llmspeed_numba import ptx
from llmspeed_numba._arrays import as_tensor, kernel_buffer
from llmspeed_numba._env import cuda
from llmspeed_numba._launch import Kernel, array1d, jit


def kernels(sleep_ns):
    steps = max(1, sleep_ns // 1000)

    def first(box, i):
        ptx.griddep_launch_dependents()
        for _ in range(steps):
            cuda.nanosleep(1000)
        box[0] = i

    def second(box, i):
        for _ in range(steps):
            cuda.nanosleep(1000)
        ptx.griddep_wait()
        box[1] = box[0] + i

    sig = (array1d(np.int32), types.int32)
    return (Kernel(jit(first), sig, "pdl_first"),
            {pdl: Kernel(jit(second), sig, "pdl_second", programmatic=pdl)
             for pdl in (False, True)})


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--us", type=int, default=20, help="each kernel's sleep")
    parser.add_argument("--pairs", type=int, default=50)
    args = parser.parse_args(argv)
    first, second = kernels(1000 * args.us)
    box = torch.zeros(2, dtype=torch.int32, device="cuda")
    buf = kernel_buffer(as_tensor(box, "box"))

    def chain(pdl):
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(args.pairs):
            first(1, 32, (buf, i), stream)
            second[pdl](1, 32, (buf, i), stream)

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / args.pairs)
        return best

    for pdl in (False, True):
        graph = torch.cuda.CUDAGraph()
        chain(pdl)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            chain(pdl)
        eager = timed(lambda pdl=pdl: chain(pdl))
        replay = timed(graph.replay)
        assert int(box[1]) == 2 * (args.pairs - 1), box.tolist()
        print(f"second {'programmatic' if pdl else 'plain':12s}: eager {eager:6.1f} us a pair, "
              f"graph {replay:6.1f} us a pair (each kernel sleeps {args.us} us)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
