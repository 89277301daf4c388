"""Engine steps of a serving load on the GPU (Llama-3-8B shapes, dummy weights; no transformers
baseline): each step's wall time (synchronised), its decodes, prefill chunks and tokens, whether
its decodes replayed a graph, preemptions and free pages; a summary by step kind. For the
256-request case that ran slower than 64 at 51d35e6 (NOTES, session 19).

    python benchmarks/probes/probe_serve_steps.py [N]     (default 256; about 4 min from cold)
"""
import sys, time, collections
import torch
from llmspeed_numba.engine import LLM
from llmspeed_numba.engine.bench_serve import run
from llmspeed_numba import _launch

# Kernels resolved (compiled, or loaded from a cache) while the timed runs go: a step that
# meets a new specialisation pays for it there.
resolved = []
_handle = _launch.Kernel.handle


def handle(self):
    if self._handle is not None:
        return self._handle
    start = time.perf_counter()
    found = _handle(self)
    resolved.append((self.name, time.perf_counter() - start))
    return found


_launch.Kernel.handle = handle

n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
t0 = time.perf_counter()
llm = LLM("llama-3-8b", load_format="dummy", max_num_seqs=256)
startup = getattr(llm, "warm_up_seconds", getattr(llm, "capture_seconds", 0.0))
print(f"LLM() {time.perf_counter() - t0:.1f} s; decode graphs at start-up: "
      f"{len(llm.runner.graphs)}, warm-up {startup:.1f} s; kernels resolved so far: "
      f"{len(resolved)}", flush=True)
alloc = llm.scheduler.allocator if hasattr(llm.scheduler, "allocator") else None
print("cache blocks", getattr(alloc, "num_blocks", "?"), "block size", getattr(alloc, "block_size", "?"),
      "max_num_batched_tokens", llm.scheduler.max_num_batched_tokens, flush=True)
for m in (1, 64, 256):
    run(llm, num_requests=m, prompt_len=512, output_len=4, random_lengths=False)
print(f"warm done; decode graphs {len(llm.runner.graphs)}", flush=True)
log = []
orig_schedule, orig_step = llm.scheduler.schedule, llm.step
state = {}
def schedule():
    b = orig_schedule(); state["b"] = b; return b
def step():
    t = time.perf_counter(); out = orig_step(); torch.cuda.synchronize()
    b = state["b"]
    log.append((time.perf_counter() - t, b.num_decodes, len(b.entries) - b.num_decodes,
                b.num_tokens - b.num_decodes, len(b.preempted), llm.runner.last_replayed,
                len(getattr(alloc, "_free", []))))
    return out
llm.scheduler.schedule, llm.step = schedule, step
for m in (64, n):
    log.clear(); resolved.clear(); pre0 = llm.num_preemptions
    stats = run(llm, num_requests=m, prompt_len=512, output_len=256, random_lengths=False)
    print(f"== {m} requests: {stats['output_tokens_per_s']:.0f} tok/s, TTFT median "
          f"{stats['ttft_median_ms']:.0f} ms, elapsed {stats['elapsed_s']:.1f} s, steps {len(log)}, "
          f"preemptions {llm.num_preemptions - pre0}", flush=True)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0])
    for dt, dec, pre, ptok, preempt, replayed, free in log:
        k = ("decode-graph" if replayed and pre == 0 else "decode-eager" if pre == 0 else "mixed")
        kinds[k][0] += 1; kinds[k][1] += dt; kinds[k][2] += ptok
    print(f"   decode graphs after the run: {len(llm.runner.graphs)}; "
          f"kernels resolved during the run: {len(resolved)}, "
          f"{sum(t for _, t in resolved):.2f} s: {sorted(set(n for n, _ in resolved))}")
    for k, (c, s, p) in kinds.items():
        print(f"   {k:13s} steps {c:4d} total {s:7.2f} s mean {1e3 * s / c:7.1f} ms prefill tokens {p}")
    print("   mixed steps (ms, decodes, prefill tokens):",
          [(round(r[0] * 1e3), r[1], r[3]) for r in log if r[2]])
    for row in log[:40:2]:
        print("   step dt %.1f ms dec %d prefills %d ptok %d preempt %d replayed %s free %d" % (row[0] * 1e3, *row[1:]))
