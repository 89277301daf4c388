"""Whole-model speed: our Llama forward against transformers (bf16, SDPA attention) on the same
random weights, in the same process.

Cases per model shape (``--models``: presets of ``llmspeed_numba.models.random_model``):
- prefill 1 x 2048 and 8 x 512 tokens: the time a caller waits for the last token's logits
  (host included; transformers with ``logits_to_keep=1`` so both compute one row of logits);
- batch-1 decode: time a token, ``(t(64 new tokens) - t(1 new token)) / 63`` of a greedy
  generation from a 128-token prompt, for both; ours with the decode step replayed from a CUDA
  graph (the default) and eager (every op called from Python), and the GPU time a token (the sum
  of kernel durations of 16 profiled eager decode steps), so the host's share is visible.

``--quantization int4,int8``: also our model with its projection weights quantized at load
(``Model(..., quantization=)``), prefill 1 x 2048 and batch-1 graph decode, against our bf16 model
of the same weights in the same run (issue 21's target: int4 decode at least 2.5x bf16's tokens/s
on Llama-3-8B shapes).

``--programmatic``: the whole run with ``launch.programmatic`` on (programmatic dependent
launches; cases named "... [programmatic launch]"): run with and without in one device call for
the A/B of the decode step.

``--warm``: run each of our paths once with one layer (compiles every kernel the timed run needs,
in parallel processes per model) and exit. Rows: ``benchmarks/results/model.csv`` (+ PNG).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from llmspeed_numba._overrides import overrides  # noqa: E402
from llmspeed_numba.models.model import Model  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402

DECODE_PROMPT = 128
DECODE_TOKENS = 64
PROFILED_STEPS = 16
#: Kernels listed (most time first) under each quantized model's decode.
KERNELS_SHOWN = 10


def _hf_model(config, weights):
    import transformers

    hf_config = transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, attn_implementation="sdpa")
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"transformers' model does not take our weights: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf.eval()


def _wall(fn, rep):
    """Median wall time (ms) of ``fn()``, synchronised, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    times.sort()
    return {"median": times[len(times) // 2], "p20": times[int(0.2 * len(times))],
            "p80": times[min(len(times) - 1, int(0.8 * len(times)))]}


def _our_prefill(model, prompts):
    """A function running one packed prefill of ``prompts`` (a fresh sequence each call)."""
    import numpy as np

    arrays = [np.asarray(p) for p in prompts]
    cache, _ = model._new_cache(arrays, 0)

    def run():
        for seq in list(cache.sequences):
            cache.free(seq)
        seqs = [cache.add_sequence() for _ in arrays]
        return model.llama.forward(model._prefill_step(cache, seqs, arrays), cache)

    return run


def _decode_gpu_ms(model, prompt, top=0):
    """``(kernel ms, kernels)`` of a decode step: its kernels' time summed and their number,
    averaged over ``PROFILED_STEPS`` profiled steps; ``top``: also print that many kernels with
    the most time, us a step each."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    arrays = [np.asarray(prompt)]
    cache, seqs = model._new_cache(arrays, PROFILED_STEPS + 4)
    logits = model.llama.forward(model._prefill_step(cache, seqs, arrays), cache)
    token = model.llama.ops.argmax(logits).tolist()
    for _ in range(2):  # warm
        token = model.llama.ops.argmax(model.llama.forward(
            model._decode_step(cache, seqs, token), cache)).tolist()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            token = model.llama.ops.argmax(model.llama.forward(
                model._decode_step(cache, seqs, token), cache)).tolist()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time_total for e in kernels)
    if top:
        by_name = {}
        for e in kernels:
            calls, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (calls + 1, us + e.device_time_total)
        for name, (calls, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"    {us / PROFILED_STEPS:8.1f} us a step, {calls / PROFILED_STEPS:5.1f} calls: "
                  f"{name[:90]}", flush=True)
    return kernel_us / 1e3 / PROFILED_STEPS, len(kernels) / PROFILED_STEPS


def decode_times(model, prompt, graphs=True):
    """(ms a token in steady state, ms of the first decode step) of batch-1 greedy generations
    of ``DECODE_TOKENS``, 2 and 1 tokens. A generation with graphs captures its decode graph on
    its first decode step, so the difference of the long and the 2-token runs is replays alone,
    and that of the 2- and 1-token runs the first step, capture included."""
    def gen(n):
        return _wall(lambda: model.generate_greedy([prompt], n, stop_at_eos=False,
                                                   cuda_graphs=graphs), rep=3)["median"]

    long, two, one = gen(DECODE_TOKENS), gen(2), gen(1)
    return (long - two) / (DECODE_TOKENS - 2), two - one


def _decode_ms(model, prompt, graphs=True):
    """ms a token of a batch-1 greedy generation in steady state (``decode_times``; before
    session 34 the first step and its capture were spread over the tokens)."""
    ms = decode_times(model, prompt, graphs)[0]
    return {"median": ms, "p20": ms, "p80": ms}


def bench_quantized(name, config, weights, quantizations, results, rep, shape, base):
    """Our quantized models against our bf16 one (``base``: its prefill 1x2048 and decode ms)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (2048,), generator=gen).tolist()]
    prompt = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), generator=gen).tolist()
    for q in quantizations:
        model = Model(config, None, weights, quantization=q)
        t_prefill = _wall(_our_prefill(model, prompts), rep)
        t_decode = _decode_ms(model, prompt)
        gpu_ms, launches = _decode_gpu_ms(model, prompt, top=KERNELS_SHOWN)
        results.add("model", f"{name} prefill 1x2048 {q}", shape, q, t_prefill,
                    "ours bf16", base["prefill"], "ms", t_prefill["median"],
                    base["prefill"]["median"], note="time to last-token logits, host included")
        results.add("model", f"{name} decode b1 {q}", shape, q, t_decode, "ours bf16",
                    base["decode"], "ms", t_decode["median"], base["decode"]["median"],
                    note=f"ms a token in steady state, CUDA-graph decode (kernels {gpu_ms:.3f} "
                         f"ms of it, {launches:.0f} launches); ratio = bf16 time / quantized "
                         f"time")
        print(f"  {name} {q}: prefill 1x2048 {t_prefill['median']:.2f} ms "
              f"(bf16 {base['prefill']['median']:.2f}), decode {t_decode['median']:.3f} ms a "
              f"token (bf16 {base['decode']['median']:.3f}), kernels {gpu_ms:.3f} ms, "
              f"{launches:.0f} launches a step", flush=True)
        model.release()
        del model
        torch.cuda.empty_cache()


def bench(name, results, rep, layers=None, quantizations=()):
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    config = preset_config(name, **overrides)
    weights = random_weights(config, seed=0, dtype=torch.bfloat16, device="cuda")
    ours = Model(config, None, weights)
    hf = _hf_model(config, weights)
    if not quantizations:
        del weights
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    shape = (f"{config.num_hidden_layers}L h{config.hidden_size} i{config.intermediate_size} "
             f"q{config.num_attention_heads} kv{config.num_key_value_heads} "
             f"v{config.vocab_size}")

    base = {}
    for batch, length in ((1, 2048), (8, 512)):
        prompts = [torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
                   for _ in range(batch)]
        ids = torch.tensor(prompts, device="cuda")
        t_ours = _wall(_our_prefill(ours, prompts), rep)
        base.setdefault("prefill", t_ours)
        with torch.no_grad():
            t_hf = _wall(lambda: hf(ids, logits_to_keep=1), rep)
        results.add("model", f"{name} prefill {batch}x{length}", shape, "bfloat16", t_ours,
                    "transformers", t_hf, "ms", t_ours["median"], t_hf["median"],
                    note="time to last-token logits, host included")

    prompt = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), generator=gen).tolist()
    ids = torch.tensor([prompt], device="cuda")

    def hf_gen(n):
        with torch.no_grad():
            return _wall(lambda: hf.generate(ids, max_new_tokens=n, min_new_tokens=n,
                                             do_sample=False), rep=3)

    long, short = hf_gen(DECODE_TOKENS), hf_gen(1)
    hf_ms = (long["median"] - short["median"]) / (DECODE_TOKENS - 1)
    per_token = {"ours": _decode_ms(ours, prompt), "ours eager": _decode_ms(ours, prompt, False),
                 "hf": {"median": hf_ms, "p20": hf_ms, "p80": hf_ms}}
    base["decode"] = per_token["ours"]
    gpu_ms, launches = _decode_gpu_ms(ours, prompt, top=KERNELS_SHOWN if quantizations else 0)
    for who, label in (("ours", "decode b1"), ("ours eager", "decode b1 eager")):
        ms = per_token[who]["median"]
        results.add("model", f"{name} {label}", shape, "bfloat16", per_token[who],
                    "transformers", per_token["hf"], "ms", ms, per_token["hf"]["median"],
                    note=f"ms a token in steady state; kernels {gpu_ms:.3f} ms of it "
                         f"({launches:.0f} launches), host and gaps {ms - gpu_ms:.3f} ms")
    print(f"  {name} decode: ours {per_token['ours']['median']:.3f} ms a token (graph), "
          f"{per_token['ours eager']['median']:.3f} ms eager, kernels {gpu_ms:.3f} ms "
          f"({launches:.0f} launches); "
          f"transformers {per_token['hf']['median']:.3f} ms", flush=True)
    ours.release()
    hf = ours = None
    torch.cuda.empty_cache()
    if quantizations:
        bench_quantized(name, config, weights, quantizations, results, rep, shape, base)


def warm(name, quantizations=()):
    """Compile every kernel the benchmark's paths launch (one layer is enough)."""
    config = preset_config(name, num_hidden_layers=1)
    weights = random_weights(config, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), generator=gen).tolist()
    for q in (None, *quantizations):
        ours = Model(config, None, weights, quantization=q)
        shapes = ((1, 2048), (8, 512)) if q is None else ((1, 2048),)
        for batch, length in shapes:
            prompts = [torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
                       for _ in range(batch)]
            _our_prefill(ours, prompts)()
        for graphs in ((False, True) if q is None else (True,)):
            ours.generate_greedy([prompt], 3, stop_at_eos=False, cuda_graphs=graphs)
        torch.cuda.synchronize()
        ours.release()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3-8b",
                        help="comma-separated presets (default: %(default)s)")
    parser.add_argument("--warm", action="store_true", help="compile only, time nothing")
    parser.add_argument("--rep", type=int, default=10, help="timed repetitions of a prefill")
    parser.add_argument("--quantization", default="",
                        help="comma-separated weight quantizations also timed against our bf16 "
                             "model (int4, int8; default: none)")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the layer count (quick runs)")
    parser.add_argument("--programmatic", action="store_true",
                        help="programmatic dependent launches on (launch.programmatic)")
    parser.add_argument("--override", action="append", default=[], metavar="SCOPE.KNOB=VALUE",
                        help="time under a knob override (repeatable), e.g. "
                             "quant_gemm.fused_norm_max_m=0: the unfused path as a baseline")
    args = parser.parse_args(argv)
    bad = [q for q in args.quantization.split(",") if q and q not in ("int4", "int8")]
    if bad:
        parser.error(f"--quantization: expected int4 or int8, got {bad}")
    try:
        knobs = _harness.knob_settings(args.override)
    except ValueError as e:
        parser.error(f"--override: {e}")
    suffix = "".join(f" [{item}]" for item in args.override)
    if args.programmatic:
        knobs.setdefault("launch", {})["programmatic"] = True
        suffix += " [programmatic launch]"
    with overrides(**knobs):
        return _run(args, suffix)


class _Suffixed:
    """``Results`` whose case names end in ``suffix``."""

    def __init__(self, results, suffix):
        self.results, self.suffix, self.path = results, suffix, results.path

    def add(self, op, case, *args, **kwargs):
        self.results.add(op, case + self.suffix, *args, **kwargs)


def _run(args, suffix):
    names = args.models.split(",")
    quantizations = tuple(q for q in args.quantization.split(",") if q)
    if args.warm:
        for name in names:
            start = time.perf_counter()
            warm(name, quantizations)
            print(f"warm {name}: {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    results = _Suffixed(_harness.Results("model"), suffix)
    for name in names:
        bench(name, results, args.rep, args.layers, quantizations)
    _harness.plot_csv(results.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
