"""The fused gate / up projection of an MLP on the GPU, against the unfused pair.

``gemm(x, w_gate_up.T, activation="silu_and_mul")`` against our ``gemm`` followed by our
``silu_and_mul``, and against
cuBLAS (``torch.matmul``) followed by torch's ``silu(h[:, :I]) * h[:, I:]``, same process, same
data, same stream.

    python benchmarks/bench_gemm_gated.py [--dtypes bfloat16,float16] [--activations
        silu_and_mul,gelu_and_mul] [--m 1,16,64,256,2048] [--eager] [--workers N]

Shapes (issue 20): M in {1, 16, 64, 256, 2048} x (N = 2 x 14336, K = 4096), Llama-3-8B's MLP.
Layout as the model's: x (M, K) row-major, the weight (N, K) row-major (out_features,
in_features) passed transposed; the fused call's weight is ``interleave_gate_up(w_gate, w_up)``,
the unfused calls' the halves [w_gate; w_up] (vLLM's layout). Target: the fused call faster
than ours unfused at every M.

Each call (the unfused pair as one) is captured in a CUDA graph and the replay is timed
(``_harness.time_gpu``: L2 flushed before each call, median of 20); ``--eager`` times plain calls.
Rows go to ``gemm_gated.csv`` (in ``$OUT`` or ``benchmarks/results/``), unit ms, ratio = baseline
time / fused time (above 1: the fused call is faster); the note has the fused call's TFLOP/s,
its weight bytes over its time, and the largest difference between fused and unfused outputs.
Before timing, ``--workers`` child processes run each case once, compiling its kernels into
numba's disk cache in parallel (as ``bench_gemm.py`` does).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, graphed, plot_csv, time_gpu
from bench_gemm import _lock_cache_writes, run_compile_workers

from llmspeed_numba.ops.activations import gelu_and_mul, silu_and_mul
from llmspeed_numba.ops.gemm import gemm
from llmspeed_numba.ops.gemm_gated import interleave_gate_up

M_VALUES = (1, 16, 64, 256, 2048)
INTERMEDIATE = 14336
HIDDEN = 4096


def timed(fn, eager):
    replay = None if eager else graphed(fn)
    return time_gpu(fn if replay is None else replay), "eager" if replay is None else "graph"


def make_case(M, dtype, activation):
    """Inputs and the three calls of one case: (fused, ours unfused, torch), outputs."""
    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, HIDDEN, device="cuda", dtype=dt, generator=g)
    w_gate = torch.randn(INTERMEDIATE, HIDDEN, device="cuda", dtype=dt, generator=g) * 0.02
    w_up = torch.randn(INTERMEDIATE, HIDDEN, device="cuda", dtype=dt, generator=g) * 0.02
    w_fused = interleave_gate_up(w_gate, w_up)          # (2 I, K)
    w_halves = torch.cat((w_gate, w_up))                 # (2 I, K)
    del w_gate, w_up
    out = torch.empty(M, INTERMEDIATE, device="cuda", dtype=dt)
    h = torch.empty(M, 2 * INTERMEDIATE, device="cuda", dtype=dt)
    out_unfused = torch.empty_like(out)
    h_torch = torch.empty_like(h)
    gated_op = silu_and_mul if activation == "silu_and_mul" else (
        lambda y, out: gelu_and_mul(y, approximate="tanh", out=out))
    torch_act = (torch.nn.functional.silu if activation == "silu_and_mul" else
                 (lambda y: torch.nn.functional.gelu(y, approximate="tanh")))

    def fused():
        gemm(x, w_fused.T, activation=activation, out=out)

    def unfused():
        gemm(x, w_halves.T, out=h)
        gated_op(h, out=out_unfused)

    def torch_pair():
        torch.matmul(x, w_halves.T, out=h_torch)
        return torch_act(h_torch[:, :INTERMEDIATE]) * h_torch[:, INTERMEDIATE:]

    return fused, unfused, torch_pair, out, out_unfused, w_fused


def bench_case(results, M, dtype, activation, eager):
    import torch

    fused, unfused, torch_pair, out, out_unfused, w = make_case(M, dtype, activation)
    t_fused, how = timed(fused, eager)
    t_unfused, _ = timed(unfused, eager)
    t_torch, _ = timed(torch_pair, eager)
    fused()
    unfused()
    torch.cuda.synchronize()
    diff = (out.float() - out_unfused.float()).abs().max().item()
    scale = out_unfused.float().abs().max().item() or 1.0
    N = 2 * INTERMEDIATE
    tflops = 2.0 * M * N * HIDDEN / (t_fused["median"] * 1e-3) / 1e12
    weight_gbs = w.numel() * w.element_size() / (t_fused["median"] * 1e-3) / 1e9
    note = (f"{how}; fused {tflops:.1f} TFLOP/s, weights {weight_gbs:.0f} GB/s; max |fused - "
            f"unfused| / max |unfused| = {diff / scale:.2e}")
    shape = f"{M}x{N}x{HIDDEN}"
    case = f"M={M} {activation}"
    for name, t in ((f"gemm + {activation}", t_unfused),
                    (f"torch.matmul + torch {activation}", t_torch)):
        results.add("gemm_gated", case, shape, dtype, t_fused, name, t, "ms",
                    t_fused["median"], t["median"], note=note)


def plan(args):
    return [(M, dtype, act) for act in args.activations for dtype in args.dtypes
            for M in args.m]


def compile_worker(spec):
    """Child process: run each case once (compiling its kernels into the disk cache)."""
    import torch

    _lock_cache_writes()
    for M, dtype, activation in json.loads(spec):
        fused, unfused, *_ = make_case(M, dtype, activation)
        fused()
        unfused()
        torch.cuda.synchronize()


def _csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", type=_csv(str), default=["bfloat16", "float16"])
    parser.add_argument("--activations", type=_csv(str), default=["silu_and_mul"],
                        help="silu_and_mul and / or gelu_and_mul (tanh form)")
    parser.add_argument("--m", type=_csv(int), default=list(M_VALUES), help="rows of x")
    parser.add_argument("--eager", action="store_true", help="time plain calls, no CUDA graph")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="parallel compile processes (0: compile in this process)")
    parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_worker:
        compile_worker(args.compile_worker)
        return 0
    start = time.perf_counter()
    results = Results("gemm_gated")
    print(f"GPU: {results.gpu}; commit {results.commit}", flush=True)
    cases = plan(args)
    if args.workers > 0:
        run_compile_workers(os.path.abspath(__file__), cases, args.workers, "cases")
    for M, dtype, activation in cases:
        try:
            bench_case(results, M, dtype, activation, args.eager)
        except Exception as exc:  # noqa: BLE001  (report and go on)
            print(f"  M={M} {dtype} {activation}: {type(exc).__name__}: {exc}", flush=True)
    path = results.write()
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    print(f"plot: {plot_csv(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
