"""Host CPU time of an engine decode step's Python work, without a GPU: the scheduler's
``schedule`` and ``update`` and the runner's input preparation for N running requests (block
tables, token / position arrays, sampling parameters, padded to the batch bucket) up to and
including their host-to-device copy, here into CPU tensors (the copies' Python and dispatch cost;
on a GPU the DMA itself runs asynchronously); the model's forward is replaced by a fixed token.
Not covered: the graph replay and the token read-back (GPU only). Times are the thread's CPU
time (a shared machine's other work not counted).

With the staged inputs (``ModelRunner._stage``: one ``StagedInputs`` buffer written in place, one
copy) it times that path; on an older checkout (no ``_stage``) the arrays built one by one,
padded by concatenation and copied with one ``copy_`` each, as ``DecodeGraph.run`` did, so the
same script times both sides of the change.

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/probes/probe_engine_host.py [N] [--profile]
"""

import cProfile
import pstats
import sys
import time

import numpy as np
import torch

from llmspeed_numba.engine.runner import BATCH_BUCKETS, ModelRunner, _bucket
from llmspeed_numba.engine.sampling_params import SamplingParams
from llmspeed_numba.engine.scheduler import Request, Scheduler
from llmspeed_numba.paged_cache import PageAllocator

STEPS = 300
STAGED = hasattr(ModelRunner, "_stage")


class InputsOnly(ModelRunner):
    """``ModelRunner._decode``'s host work up to the graph replay (CPU "device" tensors)."""

    def __init__(self, allocator):
        self.cache, self.max_width, self.scratch_page = allocator, 256, 0
        self.inputs = {}

    def prepare(self, entries):
        seqs = [e.seq_id for e in entries]
        if STAGED:
            width = self._width(self.cache.most_pages(seqs))
            key = (_bucket(len(entries), BATCH_BUCKETS), width)
            from llmspeed_numba.models.decode_graph import StagedInputs

            inputs = self.inputs.get(key)
            if inputs is None:
                inputs = self.inputs[key] = StagedInputs(*key, sampling=True, device="cpu",
                                                         pad_page=self.scratch_page)
            self._stage(entries, seqs, inputs.writable())
            inputs.copy()
            inputs.copied()
            return
        width = self._width(max(self.cache.num_pages(s) for s in seqs))
        key = (_bucket(len(entries), BATCH_BUCKETS), width)
        table, seq_lens = self.cache.host_tables(seqs, width=width)
        tokens = np.array([e.token_ids[0] for e in entries], np.int64)
        positions = np.array([e.start_position for e in entries], np.int32)
        params = self._params(entries)
        pad = key[0] - len(entries)
        if pad:
            tokens = np.concatenate([tokens, np.zeros(pad, np.int64)])
            positions = np.concatenate([positions, np.zeros(pad, np.int32)])
            table = np.concatenate([table, np.full((pad, table.shape[1]), self.scratch_page,
                                                   np.int32)])
            seq_lens = np.concatenate([seq_lens, np.ones(pad, np.int32)])
            params = tuple(np.concatenate([col, np.zeros(pad, col.dtype)]) for col in params)
        dsts = self.inputs.get(key)
        if dsts is None:
            dsts = self.inputs[key] = [
                torch.zeros(a.shape, dtype=getattr(torch, a.dtype.name))
                for a in (tokens, positions, table, seq_lens) + params]
        for dst, src in zip(dsts, (tokens, positions, table, seq_lens) + tuple(params)):
            dst.copy_(torch.from_numpy(src), non_blocking=True)


def main():
    # the copies stand in for DMAs: one thread (torch splits a copy of 32K+ elements among its
    # threads, whose hand-offs on a busy 2-core machine cost milliseconds)
    torch.set_num_threads(1)
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
    spent = {"schedule": 0.0, "inputs + copy": 0.0, "update": 0.0}
    for _ in range(STEPS):
        t0 = time.thread_time()
        batch = scheduler.schedule()
        t1 = time.thread_time()
        if profile:
            profile.enable()
        runner.prepare(batch.entries)
        if profile:
            profile.disable()
        t2 = time.thread_time()
        scheduler.update(batch, {e.request.request_id: 7 for e in batch.entries})
        t3 = time.thread_time()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2)):
            spent[key] += dt
    parts = ", ".join(f"{k} {v / STEPS * 1e6:.0f} us" for k, v in spent.items())
    print(f"{n} decodes a step ({'staged' if STAGED else 'arrays'}): {parts}; total "
          f"{sum(spent.values()) / STEPS * 1e6:.0f} us")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
