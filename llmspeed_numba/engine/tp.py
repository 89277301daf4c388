"""Tensor parallelism in the engine: ``LLM(..., tensor_parallel_size=N)`` on N GPUs.

Rank 0 is the ``LLM``'s own process (GPU: its current device); ``TensorParallelGroup.start``
spawns ranks 1 .. N - 1 (``launch.spawn``, torchrun's variables; GPUs: the other visible ones in
order), and every rank builds its part the same way (``load_rank``): the config, its weight
shards, its model (``LlamaModel`` with a ``TensorParallel``), its KV cache holding only its KV
heads, as many pages on every rank (the smallest of the ranks' budgets).

Rank 0 alone runs the scheduler. A step's device work is ``ModelRunner.run_decode`` or
``run_prefill`` of host arrays (token ids, positions, block tables, sequence lengths, sampling
parameters); rank 0's runner (``_BroadcastingRunner``) sends the call and its arguments to the
workers, then makes it; each worker (``worker``) makes the same call with the same arguments.
So every collective, and every CUDA graph captured with collectives in it, has its partner on
each rank, in the same order. The logits are all-gathered and the sampler's inputs and seeds are
the same everywhere, so every rank draws the same tokens; rank 0's are used.

Messages travel over gloo (``Communicator.broadcast_object``: a pickled tuple a step, tens of
microseconds on one host); ``None`` stops the workers (``close``).
"""

import sys
from dataclasses import dataclass

from .loading import cache_pages, load, model_config
from .runner import ModelRunner

#: Seconds ``close`` waits for the workers to exit before terminating them.
JOIN_TIMEOUT_S = 60
#: The runner's methods a worker repeats.
_STEP_METHODS = ("run_decode", "run_prefill")


@dataclass(frozen=True)
class RankSpec:
    """What every rank loads: ``LLM``'s arguments of the same names (``dtype`` a torch dtype)."""

    model: object
    dtype: object
    load_format: str
    seed: int
    quantization: object
    kv_cache_memory: object


def load_rank(spec, comm):
    """``(config, tokenizer, llama)``: the whole model's config and tokenizer, and this rank's
    share of the model (``comm`` a ``distributed.Communicator``)."""
    from ..distributed import TensorParallel, shard_config
    from ..models.llama import LlamaModel

    config, weights, tokenizer = load(spec.model, spec.dtype, spec.load_format, spec.seed,
                                      spec.quantization, shard=(comm.rank, comm.size))
    llama = LlamaModel(shard_config(config, comm.size), weights, spec.dtype, spec.quantization,
                       tp=TensorParallel(comm, config.vocab_size))
    return config, tokenizer, llama


def rank_pages(spec, comm, llama):
    """The KV-cache pages of every rank: the fewest any rank's memory holds."""
    return comm.min_int(cache_pages(llama.config, spec.kv_cache_memory, spec.dtype))


class _BroadcastingRunner(ModelRunner):
    """Rank 0's runner: each step's device work is sent to the workers, then done."""

    def __init__(self, *args, comm, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = comm

    def run_decode(self, *args):
        self.comm.broadcast_object(("run_decode", args))
        return super().run_decode(*args)

    def run_prefill(self, *args):
        self.comm.broadcast_object(("run_prefill", args))
        return super().run_prefill(*args)


def worker(spec):
    """A spawned rank's life: join the group, load its share, then repeat rank 0's steps until
    told to stop."""
    from ..distributed import init_from_env

    comm = init_from_env()
    try:
        _, _, llama = load_rank(spec, comm)
        pages = rank_pages(spec, comm, llama)
        setup = comm.broadcast_object()
        if setup is None:       # rank 0 gave up (a bad argument found after loading)
            return
        runner = ModelRunner(llama, llama.new_cache(pages), **setup)
        while (message := comm.broadcast_object()) is not None:
            method, args = message
            if method not in _STEP_METHODS:
                raise ValueError(f"tensor parallelism: unknown step {method!r} from rank 0")
            getattr(runner, method)(*args)
        runner.graphs.clear()       # graphs holding collectives go before the communicator
    finally:
        comm.close()


def _devices(size):
    """GPU indices of ranks 0 .. size - 1: the current device, then the other visible ones;
    ValueError when fewer than ``size`` are visible. Under the simulator: 0 .. size - 1."""
    from .. import _env

    if _env.SIMULATOR:
        return list(range(size))
    import torch

    count = torch.cuda.device_count()
    if size > count:
        raise ValueError(f"tensor_parallel_size: {size} exceeds the {count} visible GPU(s)")
    first = torch.cuda.current_device()
    return [first] + [d for d in range(count) if d != first][:size - 1]


class TensorParallelGroup:
    """Rank 0's side of the group: ``comm``, the spawned workers, and rank 0's ``config``,
    ``tokenizer`` and ``llama``."""

    def __init__(self, comm, processes):
        self.comm, self.processes = comm, processes
        self.config = self.tokenizer = self.llama = None
        self.closed = False

    @classmethod
    def start(cls, spec, size):
        """Check that the model splits over ``size`` ranks (ValueError / NotImplementedError
        before any process starts), start the workers, join the group and load rank 0."""
        from ..distributed import check_tensor_parallel
        from ..distributed.comm import Communicator
        from ..distributed.launch import LOCALHOST, free_port, rank_env, spawn

        check_tensor_parallel(model_config(spec.model, spec.load_format), size,
                              spec.quantization)
        devices = _devices(size)
        port = free_port()
        processes = spawn(worker, (spec,),
                          [rank_env(r, size, devices[r], port) for r in range(1, size)])
        try:
            comm = Communicator.connect(0, size, init_method=f"tcp://{LOCALHOST}:{port}",
                                        local_rank=devices[0])
        except BaseException:
            processes.terminate()
            raise
        group = cls(comm, processes)
        try:
            group.config, group.tokenizer, group.llama = load_rank(spec, comm)
        except BaseException:
            group.close(abort=True)
            raise
        return group

    def pages(self, spec):
        """The KV-cache pages of every rank (a collective: the workers wait for it)."""
        return rank_pages(spec, self.comm, self.llama)

    def runner(self, cache, **setup):
        """Rank 0's runner over ``cache``; the workers build theirs from the same ``setup``
        (``ModelRunner``'s keyword arguments: scratch_page, cuda_graphs, max_width)."""
        self.comm.broadcast_object(setup)
        return _BroadcastingRunner(self.llama, cache, comm=self.comm, **setup)

    def close(self, abort=False):
        """Stop the workers (``abort``: terminate them, for a rank 0 that failed at an unknown
        point of the protocol) and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if not abort:
                self.comm.broadcast_object(None)
                abort = not self.processes.join(timeout=JOIN_TIMEOUT_S)
        except BaseException:
            abort = True
            raise
        finally:
            if abort:
                try:
                    self.processes.join(timeout=0)
                except Exception as failure:    # a worker's own error: the cause, likely
                    print(f"tensor parallelism: a worker failed: {failure}", file=sys.stderr)
                self.processes.terminate()
            self.comm.close()
