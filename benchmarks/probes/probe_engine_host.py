"""Host CPU time of an engine decode step's Python work, without a GPU: the scheduler's
``schedule`` and ``update`` and the runner's input preparation (``ModelRunner._decode`` up to the
graph replay: block tables, token / position arrays, sampling parameters) for N running
requests; the model's forward is replaced by a fixed token. Not covered: the host-to-device
copies of the inputs and the graph replay itself (GPU only).

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/probes/probe_engine_host.py [N] [--profile]
"""

import cProfile
import pstats
import sys
import time

import numpy as np

from llmspeed_numba.engine.runner import BATCH_BUCKETS, ModelRunner, _bucket
from llmspeed_numba.engine.sampling_params import SamplingParams
from llmspeed_numba.engine.scheduler import Request, Scheduler
from llmspeed_numba.paged_cache import PageAllocator

STEPS = 300


class InputsOnly(ModelRunner):
    """``ModelRunner._decode``'s host work up to ``DecodeGraph.run``."""

    def __init__(self, allocator):
        self.cache, self.max_width, self.scratch_page = allocator, 256, 0

    def prepare(self, entries):
        seqs = [e.seq_id for e in entries]
        longest = max(self.cache.num_pages(s) for s in seqs)
        table, seq_lens = self.cache.host_tables(seqs, width=self._width(longest))
        tokens = np.array([e.token_ids[0] for e in entries], np.int64)
        positions = np.array([e.start_position for e in entries], np.int32)
        _bucket(len(entries), BATCH_BUCKETS)
        return tokens, positions, table, seq_lens, self._params(entries)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 64
    allocator = PageAllocator(20000, 16)
    scheduler = Scheduler(allocator, max_num_seqs=256, max_num_batched_tokens=8192,
                          max_model_len=4096, eos_token_ids=(0,))
    for i in range(n):
        scheduler.add(Request(i, list(range(1, 513)),
                              SamplingParams(max_tokens=10000, ignore_eos=True)))
    runner = InputsOnly(allocator)
    while True:  # prefill steps until every request decodes
        batch = scheduler.schedule()
        scheduler.update(batch, {batch.entries[i].request.request_id: 5
                                 for i in batch.sample_indices})
        if batch.num_decodes == len(batch.entries):
            break
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    spent = {"schedule": 0.0, "prepare inputs": 0.0, "update": 0.0}
    for _ in range(STEPS):
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        if profile:
            profile.enable()
        runner.prepare(batch.entries)
        if profile:
            profile.disable()
        t2 = time.perf_counter()
        scheduler.update(batch, {e.request.request_id: 7 for e in batch.entries})
        t3 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2)):
            spent[key] += dt
    parts = ", ".join(f"{k} {v / STEPS * 1e6:.0f} us" for k, v in spent.items())
    print(f"{n} decodes a step: {parts}; total {sum(spent.values()) / STEPS * 1e6:.0f} us")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
