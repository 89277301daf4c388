"""Text in, text out: what ``python -m llmspeed_numba generate`` runs.

On a GPU: load the model (the embedded SmolLM2-135M-Instruct by default), tokenize the prompt
(through the model's chat template with ``chat``), generate greedily, print the continuation and
the time to first token and decode speed. Under the simulator (no GPU): a tiny random-weight model
with a byte tokenizer runs the same path for a few tokens; its text is noise, the point is that
every op of the forward pass runs.
"""

import sys
import time

from .. import _env

#: New tokens at most under the simulator (each token takes seconds there).
SIMULATOR_MAX_TOKENS = 4


def _simulator_model(out, quantization=None):
    from .model import Model
    from .random_model import ByteTokenizer, preset_config, random_weights

    config = preset_config("tiny")
    print(f"No GPU: running a tiny random-weight model ({config.num_hidden_layers} layers, hidden "
          f"{config.hidden_size}, byte tokenizer) in numba's CUDA simulator to exercise the whole "
          f"path; its text is noise and each token takes seconds.", file=out)
    return Model(config, ByteTokenizer(), random_weights(config, seed=0),
                 quantization=quantization)


def generate_text(prompt, *, model=None, max_new_tokens=64, chat=False, dtype="bfloat16",
                  quantization=None, out=sys.stdout, log=sys.stderr):
    """Generate a continuation of ``prompt`` and print it to ``out`` (timings to ``log``).
    ``quantization``: None, "int4", "int8", "fp8" or "gguf" (``load_model``). Returns
    ``(text, timings)``."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {type(prompt).__name__}")
    start = time.perf_counter()
    if _env.SIMULATOR:
        if model is not None:
            raise ValueError("model: real checkpoints need a GPU; the simulator runs only the "
                             "tiny random-weight model")
        m = _simulator_model(log, quantization)
        max_new_tokens = min(max_new_tokens, SIMULATOR_MAX_TOKENS)
    else:
        from .model import load_model

        print(f"Loading {model or 'the embedded SmolLM2-135M-Instruct'} ...", file=log,
              flush=True)
        from ..warm import is_warm, run_with_progress

        m = load_model(model, dtype=dtype, quantization=quantization)
        print(f"Loaded in {time.perf_counter() - start:.1f} s.", file=log, flush=True)
        if not is_warm(model, dtype, quantization):
            print("First run of this model on this GPU: compiling its kernels (cached on disk; "
                  "later runs skip this).", file=log, flush=True)
            run_with_progress(model, dtype=dtype, quantization=quantization, loaded=m, log=log)
    tok = m.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text, add_special_tokens=not chat)
    if not ids:
        raise ValueError("prompt: encodes to no tokens; give some text")
    new = m.generate_greedy([ids], max_new_tokens)[0]
    continuation = tok.decode(new, skip_special_tokens=True)
    print(continuation, file=out, flush=True)
    t = m.timings
    decode = (f"{len(t.decode_steps)} more token(s) at {1 / t.decode_per_token:.1f} tok/s "
              f"({1e3 * t.decode_per_token:.2f} ms a token, median)"
              if t.decode_steps else "no decode steps")
    print(f"prompt {len(ids)} tokens; time to first token {1e3 * t.prefill:.1f} ms; {decode}",
          file=log, flush=True)
    return continuation, t
