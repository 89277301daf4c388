"""A decode step captured once as a CUDA graph and replayed for every later token.

An eager decode step of a 32-layer model makes about 400 op calls from Python, each costing the
host tens of microseconds, so the host, not the GPU, sets the speed. A replayed graph launches the
same kernels for a few microseconds in all. The step's inputs (token ids, positions, block table,
lengths) live in tensors the graph captured; each step copies its values into them and replays.

The first step of a graph runs eagerly on those tensors (its result is used: capture itself runs
nothing), which also compiles every kernel and creates the ops' workspaces before capture.
"""

from .llama import Step


class DecodeGraph:
    """Decode steps of ``batch`` sequences with block tables ``width`` pages wide, over
    ``cache``, for ``llama`` (a ``LlamaModel`` on the GPU)."""

    def __init__(self, llama, cache, batch, width):
        import torch

        self.llama, self.cache = llama, cache
        cuda = torch.device("cuda")
        self.token_ids = torch.zeros(batch, dtype=torch.int64, device=cuda)
        self.positions = torch.zeros(batch, dtype=torch.int32, device=cuda)
        self.table = torch.zeros((batch, width), dtype=torch.int32, device=cuda)
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=cuda)
        self.step = Step(token_ids=self.token_ids, positions=self.positions,
                         token_tables=self.table,
                         last_rows=torch.arange(batch, dtype=torch.int64, device=cuda),
                         block_table=self.table, seq_lens=self.seq_lens)
        self.graph = None
        self.next_tokens = None

    def _forward(self):
        logits = self.llama.forward(self.step, self.cache)
        return self.llama.ops.argmax(logits)

    def run(self, token_ids, positions, table, seq_lens):
        """One decode step from host (NumPy) inputs; returns the greedy next tokens (a list)."""
        import torch

        for dst, src in ((self.token_ids, token_ids), (self.positions, positions),
                         (self.table, table), (self.seq_lens, seq_lens)):
            dst.copy_(torch.from_numpy(src), non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            return self.next_tokens.tolist()
        tokens = self._forward().tolist()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.next_tokens = self._forward()
        self.graph = graph
        return tokens
