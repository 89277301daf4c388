"""GPU token sampling (``llmspeed_numba.sample``) against torch's sort-based sampling (vLLM's
fallback: softmax, top-k / top-p masks after ``torch.sort``, ``torch.multinomial``) and against a
plain read of the logits (the bandwidth floor of any sampler).

    python benchmarks/bench_sample.py [--quick] [--eager] [--dtypes bfloat16,float32]

Cases: rows in (1, 16, 64, 256) x vocab (32000, 128256), fp32 and bf16 logits (``--quick``:
64 x 128256 bf16 only), for each: greedy (temperature 0), plain temperature sampling, top-k 50,
top-p 0.9, and top-k 50 + top-p 0.9 + min-p 0.05; per-row parameters as device arrays (what the
engine's CUDA graphs use). torch's baseline for greedy is ``argmax``; for the others the vLLM
fallback composition at the same parameters (plain sampling: softmax + multinomial, no sort).
The read floor is ``logits.sum(-1)`` in fp32 (one pass over the logits, a torch reduction) and the
GB/s of a same-size device copy. Each call is captured in a CUDA graph and the replay timed with
``_harness.time_gpu`` (L2 flushed before each call, median of 20; ``--eager``: plain calls).
Rows go to ``sample.csv`` (in ``$OUT`` or ``benchmarks/results/``) with a PNG beside it.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, copy_bandwidth, graphed, plot_csv, time_gpu  # noqa: E402

from llmspeed_numba.ops.sample import sample  # noqa: E402
from llmspeed_numba.reference.sample import torch_probabilities  # noqa: E402

ROWS = (1, 16, 64, 256)
VOCABS = (32000, 128256)
MODES = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.8),
    "top_k50": dict(temperature=0.8, top_k=50),
    "top_p0.9": dict(temperature=0.8, top_p=0.9),
    "k50_p0.9_minp0.05": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
}


def torch_sampler(logits, temperature, greedy, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's torch fallback (``TopKTopPSampler.forward_native`` + min-p, in float32), per-row
    temperature tensor (``greedy`` decided on the host: reading the tensor would sync inside a
    capture)."""
    import torch

    if greedy:
        return logits.argmax(dim=-1)
    probs = torch_probabilities(logits, temperature, top_k, top_p, min_p, dtype=torch.float32)
    return torch.multinomial(probs, 1).squeeze(1)


def cases(args):
    import torch

    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows_list = (64,) if args.quick else ROWS
    vocabs = (128256,) if args.quick else VOCABS
    for dtype in dtypes:
        for vocab in vocabs:
            for rows in rows_list:
                yield dtype, vocab, rows


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 x 128256 bf16 only")
    parser.add_argument("--eager", action="store_true", help="time plain calls, not graphs")
    parser.add_argument("--dtypes", default=None, help="comma list (default bfloat16,float32)")
    args = parser.parse_args(argv)
    if args.dtypes is None:
        args.dtypes = "bfloat16" if args.quick else "bfloat16,float32"

    def timed(fn):
        replay = None if args.eager else graphed(fn)
        return time_gpu(replay or fn), ("eager" if replay is None else "graph")

    results = Results("sample")
    copy = copy_bandwidth()
    print(f"device-to-device copy: {copy:.1f} GB/s (read + write, 2 GiB)")
    summary = []
    for dtype, vocab, rows in cases(args):
        name = str(dtype).replace("torch.", "")
        shape = f"{rows}x{vocab}"
        gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(dtype)
        nbytes = logits.numel() * logits.element_size()
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
        read, _ = timed(lambda: logits.sum(dim=-1, dtype=torch.float32))
        read_gbs = nbytes / (read["median"] * 1e-3) / 1e9
        for mode, params in MODES.items():
            t0 = time.perf_counter()
            arrays = {
                "temperature": torch.full((rows,), params["temperature"], device="cuda"),
                "top_k": torch.full((rows,), params.get("top_k", 0), device="cuda",
                                    dtype=torch.int32),
                "top_p": torch.full((rows,), params.get("top_p", 1.0), device="cuda"),
                "min_p": torch.full((rows,), params.get("min_p", 0.0), device="cuda"),
            }

            def ours_fn():
                sample(logits, seed=seeds, out=out, **arrays)

            def torch_fn():
                torch_sampler(logits, arrays["temperature"], params["temperature"] == 0,
                              params.get("top_k", 0),
                              params.get("top_p", 1.0), params.get("min_p", 0.0))

            ours, how = timed(ours_fn)
            base, how_base = timed(torch_fn)
            note = (f"{how}/{how_base}; logits read (sum) {read['median'] * 1e3:.1f} us = "
                    f"{read_gbs:.0f} GB/s; ours {nbytes / (ours['median'] * 1e-3) / 1e9:.0f} GB/s "
                    f"of logits; copy {copy:.0f} GB/s")
            results.add("sample", mode, shape, name, ours, "torch (vLLM fallback)", base, "us",
                        ours["median"] * 1e3, base["median"] * 1e3, note=note)
            summary.append((mode, shape, name, ours["median"] * 1e3, base["median"] * 1e3,
                            read["median"] * 1e3))
            print(f"    {mode} {shape} {name}: {ours['median'] * 1e3:.1f} us ours, "
                  f"{base['median'] * 1e3:.1f} us torch, read {read['median'] * 1e3:.1f} us "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        logits = None  # freed before the next case's (the closures above hold the name)
        torch.cuda.empty_cache()

    path = results.write()
    png = plot_csv(path)
    lines = ["| mode | shape | dtype | ours us | torch us | x torch | read us | ours / read |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, shape, name, ours_us, torch_us, read_us in summary:
        lines.append(f"| {mode} | {shape} | {name} | {ours_us:.1f} | {torch_us:.1f} | "
                     f"{torch_us / ours_us:.2f} | {read_us:.1f} | {ours_us / read_us:.1f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(os.path.dirname(path), "sample_headline.md"), "w") as f:
        f.write(table + "\n")
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
