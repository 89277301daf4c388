"""A model's rank in tensor parallelism: the collectives its forward calls, on its tensors.

``LlamaModel(..., tp=TensorParallel(comm, vocab_size))`` with the rank's weights
(``sharding.shard_weights``) and config (``sharding.shard_config``) runs the one-GPU forward with
four additions:

- embedding, vocabulary-parallel: each rank looks its slice up (``local_ids``: ids shifted by the
  slice's start; the embedding op gives zeros for ids outside its rows), then ``all_reduce``;
- after o_proj and after down_proj (row-parallel): ``all_reduce`` of the partial sums;
- the LM head gives each rank its slice of the logits: ``gather_logits`` all-gathers them (the
  sampler needs every row whole); greedy decoding gathers only each rank's winner instead
  (``argmax``).
"""


class TensorParallel:
    """Rank ``comm.rank`` of ``comm.size`` (a ``comm.Communicator``) of a model of
    ``vocab_size`` tokens (the whole vocabulary; ``sharding.check_tensor_parallel`` first)."""

    def __init__(self, comm, vocab_size):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.vocab_per_rank = vocab_size // comm.size
        self.vocab_start = comm.rank * self.vocab_per_rank

    def local_ids(self, token_ids):
        """``token_ids`` as rows of this rank's embedding slice (outside it: out of range)."""
        return token_ids if self.vocab_start == 0 else token_ids - self.vocab_start

    def all_reduce(self, x):
        """``x`` summed over the ranks, in place."""
        return self.comm.all_reduce(x)

    def gather_logits(self, logits):
        """(rows, vocab) logits from each rank's (rows, vocab / size) slice."""
        rows = logits.shape[0]
        parts = self.comm.all_gather(logits)                    # (size, rows, vocab / size)
        return parts.permute(1, 0, 2).reshape(rows, self.size * self.vocab_per_rank)

    def argmax(self, logits, index):
        """The greedy tokens (int64 (rows,)) of the whole vocabulary, from this rank's logits
        slice and ``index``, each row's argmax in it (the argmax op's result): the ranks
        exchange only their winners' (value, index) and the largest value wins, the lowest
        rank among equals (so the lowest index, as one argmax over the whole row; a NaN
        wins as it does there)."""
        import torch

        index = index.to(torch.int64)
        value = logits.gather(1, index.unsqueeze(1)).squeeze(1).to(torch.float64)
        # float64 holds an fp32 value and an index below 2^53 exactly
        winner = torch.stack([value, (index + self.vocab_start).to(torch.float64)], dim=1)
        every = self.comm.all_gather(winner)                    # (size, rows, 2)
        best = torch.argmax(every[:, :, 0], dim=0)              # (rows,)
        return every[best, torch.arange(every.shape[1], device=best.device), 1].to(torch.int64)
