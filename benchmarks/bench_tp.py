"""Tensor parallelism: batch-1 decode tokens/s of the engine over 1, 2 and 4 GPUs, in one run
(random bf16 weights; rows to ``benchmarks/results/tp.csv`` + PNG).

Per model shape (``--models``, presets of ``llmspeed_numba.models.random_model``) and GPU count
(``--sizes``, those the machine has): ``LLM(name, load_format="dummy",
tensor_parallel_size=N)``, one request of a 128-token prompt and 256 greedy output tokens
(end-of-sequence ignored), after a short warm-up request (kernels compiled, each rank's decode
graph captured); tokens/s = 1 / the time per output token (``engine.bench_serve.run``, host
included). The baseline of a row is the smallest GPU count of the same model in this run (1 GPU
for Llama-3-8B: the ratio is the speed-up; issue 23's target is 1.6x at 2 GPUs). Llama-3-70B
(140 GB of weights, more than one H200 holds) runs from 2 GPUs up. The weight-streaming limit
(a rank's weight bytes over the copy bandwidth of this run) goes in each row's note.

Needs as many GPUs as the largest size; run as a script (each rank is a process that imports
this module: ``if __name__ == "__main__"`` guards it).
"""

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

from llmspeed_numba.engine import LLM  # noqa: E402
from llmspeed_numba.engine.bench_serve import run  # noqa: E402
from llmspeed_numba.models.random_model import preset_config  # noqa: E402

PROMPT, OUTPUT = 128, 256
#: KV-cache bytes a GPU: a few requests' worth, leaving the rest of the memory alone.
KV_CACHE_BYTES = 4 << 30
#: Smallest GPU count of a model (Llama-3-70B's bf16 weights do not fit one GPU).
MIN_SIZE = {"llama-3-70b": 2}


def _weight_bytes(config, size):
    """Bytes of one rank's weights: the model's over ``size`` (norms are negligible)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    total = c.num_hidden_layers * layer + (1 if c.tie_word_embeddings else 2) * (
        c.vocab_size * c.hidden_size)
    return 2 * total / size


def decode_tokens_per_s(name, size, layers):
    """Batch-1 tokens/s and the host's share of a decode step, of ``name`` on ``size`` GPUs."""
    config = preset_config(name) if layers is None else preset_config(
        name, num_hidden_layers=layers)
    llm = LLM(config, load_format="dummy", tensor_parallel_size=size, max_num_seqs=1,
              max_model_len=PROMPT + OUTPUT, kv_cache_memory=KV_CACHE_BYTES)
    try:
        run(llm, num_requests=1, prompt_len=PROMPT, output_len=8, random_lengths=False)
        stats = run(llm, num_requests=1, prompt_len=PROMPT, output_len=OUTPUT,
                    random_lengths=False)
    finally:
        llm.close()
        llm.llama.release()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return 1e3 / stats["tpot_median_ms"], stats["decode_host_share"], config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-3-8b,llama-3-70b")
    parser.add_argument("--sizes", default="1,2,4",
                        help="GPU counts (those above the machine's are left out)")
    parser.add_argument("--layers", type=int, default=None,
                        help="fewer layers (a quick run), the same for every model")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    sizes = [n for n in (int(s) for s in args.sizes.split(",")) if n <= gpus]
    results = _harness.Results("tp")
    copy_gbs = _harness.copy_bandwidth()
    for name in args.models.split(","):
        base = None
        for size in sizes:
            if size < MIN_SIZE.get(name, 1):
                continue
            tok_s, host, config = decode_tokens_per_s(name, size, args.layers)
            limit = copy_gbs * 1e9 / _weight_bytes(config, size)
            ours = {"median": 1e3 / tok_s, "p20": 1e3 / tok_s, "p80": 1e3 / tok_s}
            if base is None:
                base = (size, ours, tok_s)
            shape = f"{name} L{config.num_hidden_layers} prompt {PROMPT} out {OUTPUT}"
            results.add("tp_decode", f"{name} b1 tp{size}", shape, "bfloat16", ours,
                        f"tp{base[0]}", base[1] if size != base[0] else None, "tok/s", tok_s,
                        base[2] if size != base[0] else None,
                        note=f"{100 * tok_s / limit:.1f}% of the weight-streaming limit "
                             f"{limit:.0f} tok/s (a rank's weights at {copy_gbs:.0f} GB/s); "
                             f"host {100 * host:.1f}% of a decode step")
    _harness.plot_csv(results.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
