"""Host share of batch-1 graph-decode steps (Llama-3-8B shapes, dummy weights), by how the decode
graphs were captured, one variant a process (run each after the others, one GPU):

- ``startup``: ``LLM()`` captures every (batch bucket, table width) graph (57a51f5 on);
- ``lazy``: ``ModelRunner.capture`` (``warm_up`` since) a no-op, graphs captured at first use
  (before 57a51f5);
- ``freeze``: ``startup``, then ``gc.freeze()`` (the objects made so far leave the collector's
  generations, as vLLM does after its capture).

For the b1 host share that rose from 2.1% (51d35e6) to 5.8% (57a51f5, another machine): per
timed run the time per output token, the host share (``bench_serve.run``'s), and the garbage
collections in it (count and seconds by generation), with the objects the collector tracks.

    python benchmarks/probes/probe_decode_host_share.py startup|lazy|freeze
"""
import gc
import sys
import time

from llmspeed_numba.engine import LLM
from llmspeed_numba.engine.bench_serve import run
from llmspeed_numba.engine.runner import ModelRunner

variant = sys.argv[1]
if variant == "lazy":
    # no start-up work (the method's name at baa912c, and since)
    for name in ("capture", "warm_up"):
        if hasattr(ModelRunner, name):
            setattr(ModelRunner, name, lambda self, *args, **kwargs: 0.0)
t0 = time.perf_counter()
llm = LLM("llama-3-8b", load_format="dummy", max_num_seqs=256)
if variant == "freeze":
    gc.freeze()
print(f"{variant}: LLM() {time.perf_counter() - t0:.1f} s, {len(llm.runner.graphs)} graphs, "
      f"{len(gc.get_objects())} objects tracked", flush=True)

collections = {}
started = [0.0]


def on_gc(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        n, s = collections.get(info["generation"], (0, 0.0))
        collections[info["generation"]] = (n + 1, s + time.perf_counter() - started[0])


run(llm, num_requests=1, prompt_len=512, output_len=8, random_lengths=False)   # warm
gc.callbacks.append(on_gc)
for rep in range(3):
    collections.clear()
    stats = run(llm, num_requests=1, prompt_len=512, output_len=256, random_lengths=False,
                out=open("/dev/null", "w"))
    gcs = ", ".join(f"gen{g} {n}x {1e3 * s:.1f} ms" for g, (n, s) in sorted(collections.items()))
    print(f"{variant} rep {rep}: TPOT median {stats['tpot_median_ms']:.3f} ms, host "
          f"{100 * stats['decode_host_share']:.2f}% of {stats['decode_steps']} graph-decode steps; "
          f"gc: {gcs or 'none'}", flush=True)
