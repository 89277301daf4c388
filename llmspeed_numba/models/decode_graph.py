"""A decode step captured once as a CUDA graph and replayed for every later token.

An eager decode step of a 32-layer model makes about 400 op calls from Python, each costing the
host tens of microseconds, so the host, not the GPU, sets the speed. A replayed graph launches the
same kernels for a few microseconds in all. The step's inputs (token ids, positions, block table,
lengths and, when sampling, each row's sampling parameters) live in tensors the graph captured;
each step copies its values into them and replays.

The first step of a graph runs eagerly on those tensors (its result is used: capture itself runs
nothing), which also compiles every kernel and creates the ops' workspaces before capture.
"""

import time

from .llama import Step

#: Each row's sampling parameters, in ``DecodeGraph.run``'s ``params`` order, and their dtypes.
SAMPLING_PARAMS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"),
                   ("min_p", "float32"), ("seed", "int64"))


class DecodeGraph:
    """Decode steps of ``batch`` sequences with block tables ``width`` pages wide, over
    ``cache``, for ``llama`` (a ``LlamaModel`` on the GPU): greedy (``argmax``), or with
    ``sampling`` the ``sample`` op on per-row parameters. ``pool``: a graph memory pool to share
    with other graphs replayed one at a time (``DecodeGraph.pool`` of another)."""

    def __init__(self, llama, cache, batch, width, *, sampling=False, pool=None):
        import torch

        self.llama, self.cache, self.sampling, self.pool = llama, cache, sampling, pool
        cuda = torch.device("cuda")
        self.token_ids = torch.zeros(batch, dtype=torch.int64, device=cuda)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=cuda)
        self.table = torch.zeros((batch, width), dtype=torch.int32, device=cuda)
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=cuda)
        self.params = tuple(torch.zeros(batch, dtype=getattr(torch, dtype), device=cuda)
                            for _, dtype in SAMPLING_PARAMS) if sampling else ()
        self.step = Step(token_ids=self.token_ids, positions=self.positions,
                         token_tables=self.table,
                         last_rows=torch.arange(batch, dtype=torch.int64, device=cuda),
                         block_table=self.table, seq_lens=self.seq_lens)
        self.graph = None
        self.next_tokens = None
        #: seconds the host waited for the GPU in the last replayed step (reading its tokens)
        self.last_wait = 0.0

    def _forward(self):
        if not self.sampling:
            return self.llama.greedy(self.step, self.cache)
        logits = self.llama.forward(self.step, self.cache)
        return self.llama.ops.sample(
            logits, **{name: value for (name, _), value in zip(SAMPLING_PARAMS, self.params)})

    def run(self, token_ids, positions, table, seq_lens, params=()):
        """One decode step from host (NumPy) inputs, ``params`` the per-row sampling arrays
        when sampling; returns the next tokens (a list)."""
        import torch

        for dst, src in zip((self.token_ids, self.positions, self.table, self.seq_lens)
                            + self.params, (token_ids, positions, table, seq_lens) + tuple(params)):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            start = time.perf_counter()
            tokens = self.next_tokens.tolist()
            self.last_wait = time.perf_counter() - start
            return tokens
        tokens = self._forward().tolist()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.next_tokens = self._forward()
        self.graph, self.pool = graph, graph.pool()
        return tokens
