"""GPU time of one decode step (a CUDA-graph replay) at each batch bucket, Llama-3-8B shapes
(dummy weights), every row a 700-token sequence (block-table width 64): what the engine's
decode step costs the GPU at 1-256 running sequences, to compare library trees (the GEMM tiles
of batched decode, issue 20) in one run. Timed with CUDA events over 100 back-to-back replays,
5 rounds, median; one process a tree.

    python benchmarks/probes/probe_decode_buckets.py [LABEL] [--buckets 1,16,64,128,256]
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from _harness import back_to_back_ms  # noqa: E402

from llmspeed_numba.engine import LLM  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("label", nargs="?", default="")
parser.add_argument("--buckets", default="1,16,64,128,256")
args = parser.parse_args()
buckets = [int(b) for b in args.buckets.split(",")]
WIDTH, LENGTH = 64, 700

llm = LLM("llama-3-8b", load_format="dummy", max_num_seqs=max(buckets))
seqs = [llm.cache.add_sequence(LENGTH) for _ in range(max(buckets))]
line = []
for bucket in buckets:
    graph = llm.runner.graphs[(bucket, WIDTH)]
    staged = graph.staged()
    llm.cache.host_tables(seqs[:bucket], width=WIDTH, out=(staged.table, staged.seq_lens))
    staged.token_ids[:bucket] = 1
    staged.positions[:bucket] = LENGTH - 1
    staged.pad(bucket)
    graph.inputs.copy()
    torch.cuda.synchronize()
    times = back_to_back_ms(graph.graph.replay, calls=100)
    line.append(f"b{bucket} {statistics.median(times):.3f} ms")
print(f"{args.label}: decode step " + ", ".join(line), flush=True)
