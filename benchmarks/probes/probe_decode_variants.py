"""Batch-1 CUDA-graph decode of one model under knob overrides, the variants alternating in one
process on the same weights (a fused path against the unfused one it replaces, same run), and
our bf16 model once for the ratio. Decode is timed in steady state
(``bench_model.decode_times``: each generation's first decode step, its graph capture
included, is reported apart). Each variant builds its own ``Model`` inside its ``overrides``
block, so its graphs are captured with those settings.

    python benchmarks/probes/probe_decode_variants.py --model llama-3-8b --layers 8 \\
        --quantization int4 --variants "fused=;unfused=quant_gemm.fused_norm_max_m=0" [--warm]

``--variants``: ``name=SCOPE.KNOB=VALUE,...`` separated by ``;`` (an empty list: the defaults);
the first is the baseline of the others' rows. ``--warm``: compile every variant's kernels (one
layer, three graph-decoded tokens) and time nothing. Rows: ``model.csv`` (``$OUT`` or
benchmarks/results/), ms a token and the profiled kernels' share.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import _harness  # noqa: E402
from bench_model import DECODE_PROMPT, _decode_gpu_ms, decode_times  # noqa: E402

from llmspeed_numba._overrides import overrides  # noqa: E402
from llmspeed_numba.models.model import Model  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402


def parse_variants(spec):
    """``{name: {scope: {knob: value}}}`` in the order given."""
    variants = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, settings = item.partition("=")
        try:
            variants[name] = _harness.knob_settings(filter(None, settings.split(",")))
        except ValueError as e:
            raise ValueError(f"--variants: {e}") from None
    if not variants:
        raise ValueError("--variants: at least one variant")
    return variants


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quantization", default="int4", help="int4, int8 or none")
    parser.add_argument("--variants", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", action="store_true")
    args = parser.parse_args(argv)
    variants = parse_variants(args.variants)
    quantization = None if args.quantization == "none" else args.quantization
    config = preset_config(args.model, num_hidden_layers=1 if args.warm else args.layers)
    weights = random_weights(config, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), generator=gen).tolist()
    shape = f"{config.num_hidden_layers}L h{config.hidden_size} i{config.intermediate_size}"

    def run(knobs, q, profile_top):
        with overrides(**knobs):
            model = Model(config, None, weights, quantization=q)
            if args.warm:
                model.generate_greedy([prompt], 3, stop_at_eos=False, cuda_graphs=True)
                result = None
            else:
                result = (*decode_times(model, prompt),
                          *_decode_gpu_ms(model, prompt, top=profile_top))
            model.release()
        del model
        torch.cuda.empty_cache()
        return result

    bf16 = run({}, None, 0)
    if args.warm:
        for knobs in variants.values():
            run(knobs, quantization, 0)
        print("warm: done", flush=True)
        return 0
    print(f"{args.model} {shape} bf16: {bf16[0]:.3f} ms a token (first step {bf16[1]:.2f} ms; "
          f"kernels {bf16[2]:.3f} ms, {bf16[3]:.0f} launches)", flush=True)
    times: dict = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, knobs in variants.items():
            ms, first_ms, gpu_ms, launches = run(knobs, quantization, 8 if r == 0 else 0)
            times[name].append((ms, gpu_ms, launches, first_ms))
            print(f"round {r} {name}: {ms:.3f} ms a token (first step {first_ms:.2f} ms), "
                  f"kernels {gpu_ms:.3f} ms, {launches:.0f} launches "
                  f"(bf16 / this {bf16[0] / ms:.3f}x)", flush=True)
    results = _harness.Results("model")
    first = next(iter(variants))
    base = min(t[0] for t in times[first])
    for name, rows in times.items():
        best = min(rows, key=lambda t: t[0])
        timing = {"median": best[0], "p20": min(t[0] for t in rows),
                  "p80": max(t[0] for t in rows)}
        results.add("model", f"{args.model} decode b1 {args.quantization} [{name}]", shape,
                    args.quantization, timing, f"[{first}]", {"median": base, "p20": base,
                                                              "p80": base},
                    "ms", best[0], base,
                    note=f"steady-state replays (capture excluded), best of {args.rounds} "
                         f"alternating rounds; first decode step (capture) {best[3]:.2f} ms; "
                         f"kernels {best[1]:.3f} ms, {best[2]:.0f} launches; our bf16 "
                         f"{bf16[0]:.3f} ms in this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
