"""GPU time of one replay of the batch-1 decode graph (table width 64, a 700-token sequence;
Llama-3-8B shapes, dummy weights) by which graphs the process captured before and after it:
``all`` (``LLM()``'s start-up capture: every bucket x width, batch 1 first), ``reverse`` (the
same shapes, largest first), ``single`` (that graph alone, as a lazy capture made it). For the
b1 time per token that was 0.15 ms (3%) higher with the start-up capture (NOTES, session 20).
Timed with CUDA events over 200 back-to-back replays, 5 rounds; one variant a process.

    python benchmarks/probes/probe_decode_graph_order.py all|reverse|single
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import back_to_back_ms  # noqa: E402

from llmspeed_numba.engine import LLM  # noqa: E402
from llmspeed_numba.engine.runner import ModelRunner  # noqa: E402

variant = sys.argv[1]
SHAPE = (1, 64)
shapes = ModelRunner.decode_shapes
if variant == "reverse":
    ModelRunner.decode_shapes = lambda self, max_rows: shapes(self, max_rows)[::-1]
elif variant == "single":
    ModelRunner.decode_shapes = lambda self, max_rows: [SHAPE]
llm = LLM("llama-3-8b", load_format="dummy", max_num_seqs=256)
seq = llm.cache.add_sequence(700)
graph = llm.runner.graphs[SHAPE]
staged = graph.staged()
llm.cache.host_tables([seq], width=SHAPE[1], out=(staged.table, staged.seq_lens))
staged.token_ids[0], staged.positions[0] = 1, 699
staged.pad(1)
graph.inputs.copy()
torch.cuda.synchronize()
times = back_to_back_ms(graph.graph.replay)
print(f"{variant}: {len(llm.runner.graphs)} graphs; replay of {SHAPE} "
      f"{statistics.median(times):.4f} ms (rounds {', '.join(f'{t:.4f}' for t in times)})",
      flush=True)
