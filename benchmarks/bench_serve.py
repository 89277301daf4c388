"""Serving throughput of the engine against transformers' ``generate`` on the same random
weights, in the same run (H200; rows to ``benchmarks/results/serve.csv`` + PNG).

Per model shape (``--models``, presets of ``llmspeed_numba.models.random_model``):
- batch-1 decode tokens/s (one request, prompt 512, output 256; ours: the median time per
  output token) against transformers' eager ``generate`` of one prompt, and against the
  weight-streaming limit (the weights' bytes a token over the copy bandwidth of this run);
- output tokens/s of 16, 64 and 256 concurrent requests (prompt 512, output 256 each) against
  transformers' eager ``generate`` of a batch of 16;
- with ``--quantization int4`` (or int8, fp8, comma-separated): the engine with its weights
  quantized at load, batch-1 decode tokens/s against the bf16 engine's of the same run (issue
  21's model target is int4 at 2.5x), and against its own weight-streaming limit.

transformers runs first (its model is then freed), so the engine's KV cache can take the memory.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from llmspeed_numba.engine import LLM  # noqa: E402
from llmspeed_numba.engine.bench_serve import run  # noqa: E402
from llmspeed_numba.ops.quant_weight import QuantizedWeight  # noqa: E402
from llmspeed_numba.models.random_model import preset_config, random_weights  # noqa: E402

PROMPT, OUTPUT = 512, 256
HF_BATCH = 16


def _hf_tokens_per_s(config, batch, new_tokens):
    from bench_model import _hf_model

    weights = random_weights(config, seed=0, dtype=torch.bfloat16, device="cuda")
    hf = _hf_model(config, weights)
    del weights
    ids = torch.randint(0, config.vocab_size, (batch, PROMPT), device="cuda")
    with torch.no_grad():
        hf.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del hf
    torch.cuda.empty_cache()
    return batch * new_tokens / elapsed


def _row(results, name, case, ours, base_name, base, note=""):
    t = {"median": 1e3 / ours, "p20": 1e3 / ours, "p80": 1e3 / ours}
    b = {"median": 1e3 / base, "p20": 1e3 / base, "p80": 1e3 / base} if base else None
    results.add("serve", f"{name} {case}", f"prompt {PROMPT} out {OUTPUT}", "bfloat16", t,
                base_name, b, "tok/s", ours, base, note=note)


def bench(name, results, concurrency, hf_decode_tokens, compare_sync=False, quantizations=()):
    config = preset_config(name)
    hf_b1 = _hf_tokens_per_s(config, 1, hf_decode_tokens)
    hf_batch = _hf_tokens_per_s(config, HF_BATCH, OUTPUT)
    copy_gbs = _harness.copy_bandwidth()
    llm = LLM(name, load_format="dummy", max_num_seqs=max(concurrency))
    print(f"{name}: start-up warm-up {llm.warm_up_seconds:.1f} s ({len(llm.runner.graphs)} "
          f"decode graphs)", flush=True)
    weight_bytes = sum(_nbytes(p) for p in _weights_of(llm))
    limit = copy_gbs * 1e9 / weight_bytes
    # warm: the timed runs' kinds of step once (replay plans, workspaces); LLM() made every
    # kernel ready and captured every decode graph
    for n in [1] + list(concurrency):
        run(llm, num_requests=n, prompt_len=PROMPT, output_len=4, random_lengths=False)
    bf16_b1 = None
    for overlap in (True, False) if compare_sync else (True,):
        llm.async_scheduling = overlap
        kind = "" if overlap else " (sync)"
        b1 = run(llm, num_requests=1, prompt_len=PROMPT, output_len=OUTPUT,
                 random_lengths=False)
        ours_b1 = 1e3 / b1["tpot_median_ms"]
        bf16_b1 = bf16_b1 or ours_b1    # the async-scheduled one: what the engine runs
        _row(results, name, "decode b1" + kind, ours_b1, "transformers", hf_b1,
             note=f"{100 * ours_b1 / limit:.1f}% of the weight-streaming limit {limit:.0f} "
                  f"tok/s ({weight_bytes / 1e9:.2f} GB at {copy_gbs:.0f} GB/s); {_host(b1)}")
        for n in concurrency:
            stats = run(llm, num_requests=n, prompt_len=PROMPT, output_len=OUTPUT,
                        random_lengths=False)
            _row(results, name, f"{n} concurrent" + kind, stats["output_tokens_per_s"],
                 f"transformers b{HF_BATCH}", hf_batch,
                 note=f"TTFT median {stats['ttft_median_ms']:.0f} ms p99 "
                      f"{stats['ttft_p99_ms']:.0f}; TPOT median {stats['tpot_median_ms']:.2f} "
                      f"ms p99 {stats['tpot_p99_ms']:.2f}; {stats['elapsed_s']:.1f} s; "
                      f"{_host(stats)}")
    llm.llama.release()
    del llm
    torch.cuda.empty_cache()
    for q in quantizations:
        _quantized_b1(name, q, results, bf16_b1, copy_gbs)


def _quantized_b1(name, quantization, results, bf16_b1, copy_gbs):
    """Batch-1 decode of the engine with ``quantization`` weights against ``bf16_b1`` (the bf16
    engine's tokens/s in this run)."""
    llm = LLM(name, load_format="dummy", max_num_seqs=1, quantization=quantization)
    weight_bytes = sum(_nbytes(p) for p in _weights_of(llm))
    limit = copy_gbs * 1e9 / weight_bytes
    run(llm, num_requests=1, prompt_len=PROMPT, output_len=4, random_lengths=False)   # warm
    b1 = run(llm, num_requests=1, prompt_len=PROMPT, output_len=OUTPUT, random_lengths=False)
    ours = 1e3 / b1["tpot_median_ms"]
    t = {"median": 1e3 / ours, "p20": 1e3 / ours, "p80": 1e3 / ours}
    b = {"median": 1e3 / bf16_b1, "p20": 1e3 / bf16_b1, "p80": 1e3 / bf16_b1}
    results.add("serve", f"{name} decode b1 {quantization}", f"prompt {PROMPT} out {OUTPUT}",
                quantization, t, "ours bf16 engine", b, "tok/s", ours, bf16_b1,
                note=f"{100 * ours / limit:.1f}% of its weight-streaming limit {limit:.0f} tok/s "
                     f"({weight_bytes / 1e9:.2f} GB at {copy_gbs:.0f} GB/s); {_host(b1)}")
    print(f"{name} {quantization}: decode b1 {ours:.1f} tok/s = {ours / bf16_b1:.2f}x the bf16 "
          f"engine ({bf16_b1:.1f}), {100 * ours / limit:.1f}% of its streaming limit",
          flush=True)
    llm.llama.release()
    del llm
    torch.cuda.empty_cache()


def _nbytes(t):
    """Device bytes of a weight: a tensor, or a ``QuantizedWeight``'s arrays."""
    if isinstance(t, QuantizedWeight):
        parts = (t.qweight, t.scales, t.zeros, t.mins)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)
    return t.numel() * t.element_size()


def _host(stats):
    idle = stats["decode_gpu_idle_share"]
    return (f"GPU idle {'-' if idle is None else f'{100 * idle:.1f}%'} and host busy "
            f"{100 * stats['decode_host_share']:.1f}% of a graph-decode step")


def _weights_of(llm):
    m = llm.llama
    yield m.embed
    if m.lm_head_t.data_ptr() != m.embed.data_ptr():
        yield m.lm_head_t
    yield m.norm
    for layer in m.layers:
        for name in layer.__slots__:
            t = getattr(layer, name)
            if t is not None:
                yield t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3-8b,smollm2-135m")
    parser.add_argument("--concurrency", default="16,64,256")
    parser.add_argument("--hf-decode-tokens", type=int, default=64,
                        help="tokens of transformers' batch-1 generation (default: %(default)s)")
    parser.add_argument("--compare-sync", action="store_true",
                        help="also time every case with async scheduling off (rows '(sync)')")
    parser.add_argument("--quantization", default="",
                        help="comma-separated int4 / int8 / fp8: also the batch-1 decode of the "
                             "engine with quantized weights, against the bf16 engine's")
    args = parser.parse_args(argv)
    quantizations = [q for q in args.quantization.split(",") if q]
    bad = [q for q in quantizations if q not in ("int4", "int8", "fp8")]
    if bad:
        parser.error(f"--quantization: expected int4, int8 or fp8, got {bad}")
    results = _harness.Results("serve")
    for name in args.models.split(","):
        bench(name, results, [int(c) for c in args.concurrency.split(",")],
              args.hf_decode_tokens, args.compare_sync, quantizations)
    _harness.plot_csv(results.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
