"""Serving throughput of the engine: ``python -m llmspeed_numba bench-serve``.

``num_requests`` requests with random prompt and output lengths (uniform in ``[length / 2,
length]``, a fixed seed) are all submitted at once, at most ``max_num_seqs`` running together;
each runs to its ``max_tokens`` (end-of-sequence ignored). Reported: output tokens/s, total
tokens/s, time to first token and time per output token (median and p99 over requests), with a
progress bar while it runs; and, of the decode steps replayed from CUDA graphs, the host's share
(the wall time not spent waiting for the GPU's tokens: with async scheduling it overlaps the GPU)
and the GPU's idle share (no work queued between two steps: what the host costs throughput).
"""

import sys
import time

import numpy as np


def _progress(done, total, start, out):
    width = 30
    filled = int(width * done / max(total, 1))
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests "
              f"{time.perf_counter() - start:6.1f} s")
    out.flush()


def run(llm, *, num_requests=64, prompt_len=512, output_len=256, seed=0, random_lengths=True,
        out=sys.stderr):
    """Run the load on ``llm`` (an ``LLM``); returns a dict of the measurements. With
    ``random_lengths=False`` every prompt and output has exactly the given length."""
    from .sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size

    def length(n):
        return int(rng.integers(max(1, n // 2), n + 1)) if random_lengths else n

    prompts = [rng.integers(0, vocab, length(prompt_len)).tolist() for _ in range(num_requests)]
    outputs = [length(output_len) for _ in range(num_requests)]
    from .llm import DecodeStats

    llm.decode_stats = DecodeStats()
    start = time.perf_counter()
    first, finish, slots = {}, {}, {}
    for prompt, n in zip(prompts, outputs):
        rid = llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        slots[rid] = n
    requests = {rid: llm.request(rid) for rid in slots}
    done, shown = 0, 0.0
    while llm.has_unfinished():
        finished = llm.step()
        now = time.perf_counter()
        for rid, request in list(requests.items()):
            if request.output_token_ids:
                first[rid] = now
                del requests[rid]
        for o in finished:
            finish[o.request_id] = now
        done += len(finished)
        if finished or now - shown > 0.5:
            _progress(done, num_requests, start, out)
            shown = now
    out.write("\n")
    elapsed = time.perf_counter() - start
    ttft = np.array([first[r] - start for r in slots])
    tpot = np.array([(finish[r] - first[r]) / max(slots[r] - 1, 1) for r in slots])
    generated = sum(outputs)
    return {
        "requests": num_requests, "elapsed_s": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + sum(map(len, prompts))) / elapsed,
        "ttft_median_ms": 1e3 * float(np.median(ttft)), "ttft_p99_ms": 1e3 * float(
            np.percentile(ttft, 99)),
        "tpot_median_ms": 1e3 * float(np.median(tpot)), "tpot_p99_ms": 1e3 * float(
            np.percentile(tpot, 99)),
        "decode_steps": llm.decode_stats.steps,
        "decode_host_share": llm.decode_stats.host_share,
        "decode_gpu_idle_share": llm.decode_stats.gpu_idle_share,
    }


def report(stats, out=sys.stdout):
    idle = stats["decode_gpu_idle_share"]
    print(f"{stats['requests']} requests in {stats['elapsed_s']:.2f} s: "
          f"{stats['output_tokens_per_s']:.1f} output tok/s, "
          f"{stats['total_tokens_per_s']:.1f} total tok/s; time to first token median "
          f"{stats['ttft_median_ms']:.1f} ms, p99 {stats['ttft_p99_ms']:.1f} ms; time per output "
          f"token median {stats['tpot_median_ms']:.2f} ms, p99 {stats['tpot_p99_ms']:.2f} ms; "
          f"of {stats['decode_steps']} graph-decode steps, host work "
          f"{100 * stats['decode_host_share']:.1f}% and the GPU idle {_share(idle)}", file=out)


def _share(value):
    return "(not measured)" if value is None else f"{100 * value:.1f}%"
