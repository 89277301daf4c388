"""Quality cost of weight-only quantization: perplexity of a fixed public-domain text
(``tests/data/alice_ch1.txt``, the opening of *Alice's Adventures in Wonderland*) with the model
in bf16 and with its projection weights quantized (``quantization=`` of ``load_model``).

Modes (``--modes``): "bf16" (no quantization), "int8" (per channel), "int4" (groups of 128,
or 64 / 32 where K is not a multiple of 128: SmolLM2-135M's hidden size 576 takes 64) and "fp8"
(e4m3 per channel, activations per token: W8A8, Hopper only), quantized at load from the bf16
weights, and "gguf" (a .gguf's own Q4_0 / Q4_1 / Q8_0 blocks,
kept packed; only for a .gguf model).

Model (``--model``): a Hugging Face directory or a .gguf; default the embedded
SmolLM2-135M-Instruct, a Q4_1 GGUF. Its "bf16" is those Q4_1 weights dequantized to bf16, so
with it int8 / int4 quantize Q4_1 values again and "gguf" equals "bf16" up to rounding; the
cost of int4 / int8 on SmolLM2's own bf16 weights needs its Hugging Face directory
(HuggingFaceTB/SmolLM2-135M-Instruct) as ``--model``.

Perplexity: exp of the mean negative log-likelihood of each token given those before it, in
non-overlapping windows of ``--window`` tokens (each window's first token is context only), from
the float32 logits of one packed prefill a window, reduced in float64.

Rows: ``benchmarks/results/quant_quality.csv`` (or ``$OUT``): ours_value the mode's perplexity,
baseline bf16's, ratio mode / bf16 (above 1: worse), ours_ms the wall time of the forward
passes, the note the projection weights' bytes. ``--load-format dummy --config tiny
--max-tokens 16``: a tiny random model with the byte tokenizer, cheap enough for numba's CUDA
simulator (checks the code path; its perplexity means nothing).
"""

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "data",
                    "alice_ch1.txt")
MODES = ("bf16", "int8", "int4", "fp8", "gguf")


def perplexity(model, ids, window):
    """(perplexity, tokens scored, seconds of forward passes) of ``ids`` under ``model``."""
    nll, count, seconds = 0.0, 0, 0.0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        t = time.perf_counter()
        logits = model.prefill_logits([chunk])[0].numpy().astype(np.float64)
        seconds += time.perf_counter() - t
        logits = logits[:-1]
        top = logits.max(axis=-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        targets = np.asarray(chunk[1:])
        nll -= logp[np.arange(targets.size), targets].sum()
        count += targets.size
    return math.exp(nll / count), count, seconds


def projection_bytes(llama):
    """Device bytes of every layer's four projection weights."""
    from llmspeed_numba import QuantizedWeight

    total = 0
    for layer in llama.layers:
        for w in (layer.qkv_t, layer.o_t, layer.gate_up_t, layer.down_t):
            total += w.nbytes() if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
    return total


def load(args, mode):
    """A ``Model`` in ``mode``, or None when the mode does not apply (gguf on a non-GGUF)."""
    from llmspeed_numba.models.model import Model, load_model

    quantization = None if mode == "bf16" else mode
    if args.load_format == "dummy":
        if mode == "gguf":
            return None
        from llmspeed_numba import SIMULATOR
        from llmspeed_numba.models.random_model import (ByteTokenizer, preset_config,
                                                        random_weights)

        config = preset_config(args.config)
        weights = random_weights(config, seed=0, device="cpu" if SIMULATOR else "cuda")
        tokenizer = ByteTokenizer() if args.config == "tiny" else None
        return Model(config, tokenizer, weights, "bfloat16", quantization)
    if mode == "gguf" and not (args.model is None or str(args.model).endswith(".gguf")):
        return None
    return load_model(args.model, dtype="bfloat16", quantization=quantization)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", default=None,
                        help="a Hugging Face directory or .gguf (default: the embedded "
                             "SmolLM2-135M-Instruct Q4_1 GGUF)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes of %s (default: %%(default)s)" % (MODES,))
    parser.add_argument("--window", type=int, default=1024,
                        help="tokens a forward pass (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="score only the text's first N tokens (quick runs)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights of --config (default: %(default)s)")
    parser.add_argument("--config", default="tiny",
                        help="the preset of --load-format dummy (default: %(default)s)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: expected modes of {MODES}, got {unknown}")
    if args.window < 2:
        parser.error(f"--window: expected at least 2, got {args.window}")
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    results = _harness.Results("quant_quality")
    name = args.config if args.load_format == "dummy" else (args.model or "smollm2-135m-q4_1")
    base = None
    for mode in modes:
        model = load(args, mode)
        if model is None:
            print(f"{mode}: skipped (needs a .gguf model)", flush=True)
            continue
        if model.tokenizer is None:
            parser.error("the model has no tokenizer (use --config tiny with dummy weights)")
        ids = model.tokenizer.encode(text)
        ids = ids[:args.max_tokens] if args.max_tokens else ids
        ppl, count, seconds = perplexity(model, ids, args.window)
        size = projection_bytes(model.llama)
        model.release()
        if base is None and mode == "bf16":
            base = (ppl, seconds)
        ms = {"median": 1e3 * seconds, "p20": 1e3 * seconds, "p80": 1e3 * seconds}
        results.add("quant_quality", f"{os.path.basename(str(name))} {mode}",
                    f"{count} tokens, window {args.window}", "bfloat16", ms, "bf16",
                    None if base is None else {"median": 1e3 * base[1]}, "ppl", ppl,
                    None if base is None else base[0],
                    note=f"projection weights {size / 2**20:.2f} MiB")
    print(f"rows: {results.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
