"""Host cost of a TMA call whose operand is new to the map cache (issues 18 and 20): the map is
made on the call's stream (``_tensor_map._upload``), where it used to be a synchronous upload
that waited for the device's queued work (session 24: 519 us a call).

Each case times ``--calls`` eager calls of bf16 ``gemm(x, w.T)`` with the TMA 64 x 128 tile,
each on an activation ``x`` at a new address (a pool of distinct tensors made beforehand) and one
weight, after ~``--queued-ms`` of GPU work queued on the stream (``torch.cuda._sleep``), so a
call that waits for the device shows it. Printed: host us a call (mean over the calls), whether
the host got ahead of the queued work, and the calls' results checked against torch. Run from
two trees in one device call to compare (``--label`` names the row).

    python benchmarks/probes/probe_map_upload.py [--calls 50] [--queued-ms 50] [--label new]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from llmspeed_numba import gemm  # noqa: E402

CONFIG = "wg_64x128x64_s8_p_tma_k1"
SHAPES = ((192, 4096, 4096), (512, 1536, 576))   # Llama few-row TMA pick; SmolLM2 prefill


def run(M, N, K, calls, queued_ms, label):
    import torch

    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(calls + 1)]
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    gemm(xs[-1], w.T, out=out, config=CONFIG)       # compiled, recorded, the weight's map made
    torch.cuda.synchronize()
    cycles_per_ms = 1.7e6                            # H200 SM clock ~1.7-1.98 GHz
    torch.cuda._sleep(int(queued_ms * cycles_per_ms))
    start = time.perf_counter()
    for x in xs[:calls]:
        gemm(x, w.T, out=out, config=CONFIG)
    host_s = time.perf_counter() - start
    pending = not torch.cuda.current_stream().query()   # the queued work still running?
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    expected = (xs[calls - 1].float() @ w.float().T).to(torch.bfloat16).float()
    err = (out.float() - expected).abs().max().item()
    ok = err <= 0.05 * expected.abs().max().item()
    print(f"{label:>8} {M}x{N}x{K}: {host_s / calls * 1e6:8.1f} us a call (host), "
          f"{total_s * 1e3:7.1f} ms until done, host ahead of the queued work: {pending}, "
          f"result {'ok' if ok else f'WRONG (max err {err:.3g})'}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--queued-ms", type=float, default=50.0)
    parser.add_argument("--label", default="tree")
    args = parser.parse_args()
    for M, N, K in SHAPES:
        run(M, N, K, args.calls, args.queued_ms, args.label)


if __name__ == "__main__":
    main()
