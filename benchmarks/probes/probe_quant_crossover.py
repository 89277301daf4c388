"""Where the decode (SIMT) kernel of ``quant_gemm`` should hand over to the Tensor Core kernel:
both forced on the same int4 / int8 weights at M in 1..16, CUDA-graph replay, L2 flushed (the
harness's ``time_gpu``). Prints one line a (shape, format, M): us of each path and the faster.

    python benchmarks/probes/probe_quant_crossover.py [--m 1,2,4,8,16]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import graphed, time_gpu  # noqa: E402

import llmspeed_numba as lsn  # noqa: E402
from llmspeed_numba._overrides import overrides  # noqa: E402


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="1,2,4,8,16")
    parser.add_argument("--shapes", default="4096x14336,14336x4096,4096x4096")
    parser.add_argument("--formats", default="int4,int8")
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for fmt in args.formats.split(","):
            qw = lsn.quantize_weight(w, fmt, kind="torch")
            for M in map(int, args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                us = {}
                for path, max_m in (("simt", 16), ("tc", 0)):
                    with overrides(quant_gemm={"decode_max_m": max_m}):
                        fn = lambda: lsn.quant_gemm(x, qw)  # noqa: E731
                        fn()
                        us[path] = 1e3 * time_gpu(graphed(fn))["median"]
                best = min(us, key=us.get)
                print(f"{N}x{K} {fmt} M={M}: simt {us['simt']:.1f} us, tc {us['tc']:.1f} us "
                      f"-> {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
