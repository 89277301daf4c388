"""The processes of a tensor-parallel group: one per GPU, in torchrun's convention.

A rank learns its place from the environment torchrun sets: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` (its GPU on this host), ``MASTER_ADDR`` and ``MASTER_PORT`` (where rank 0
listens); ``init_from_env`` connects it. A script started by ``torchrun --nproc-per-node N`` and
a process started here (``spawn`` sets the same variables in the child before it runs anything)
join their group the same way.

- ``spawn(target, args, envs)``: one process per environment of ``envs`` (``rank_env``), each
  running ``target(*args)``; torch.multiprocessing's "spawn" start method (a process that has
  used CUDA cannot fork). ``LLM(..., tensor_parallel_size=N)`` starts ranks 1 .. N - 1 so, rank 0
  being the caller (``engine/tp.py``).
- ``run(fn, world_size, *args)``: ``fn(comm, *args)`` on every rank, each its own process; returns
  the ranks' results (tests and scripts that drive a model directly).

A script that starts ranks (``LLM`` with ``tensor_parallel_size > 1`` included) must guard its
top level with ``if __name__ == "__main__":``: each spawned process imports the script's module.
"""

import os
import queue as queue_module
import socket
import time

#: The variables of torchrun's convention a rank reads.
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOCALHOST = "127.0.0.1"


def free_port():
    """A TCP port free on this host now (for rank 0 to listen on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def rank_env(rank, world_size, local_rank, master_port, master_addr=LOCALHOST):
    """The environment (``ENV_VARS``, as strings) of rank ``rank``; the rendezvous store is
    rank 0's, not a torchrun agent's the parent may have run under."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "TORCHELASTIC_USE_AGENT_STORE": "False"}


def env_rank(environ=None):
    """``(rank, world_size, local_rank, master_addr, master_port)`` from ``environ`` (default
    ``os.environ``); ValueError naming a variable that is missing or not an int in range."""
    environ = os.environ if environ is None else environ
    missing = [name for name in ENV_VARS if name not in environ]
    if missing:
        raise ValueError(f"environment: {', '.join(missing)} not set (start the ranks with "
                         f"torchrun, or with llmspeed_numba.distributed.launch)")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            values[name] = int(environ[name])
        except ValueError:
            raise ValueError(f"environment: {name} must be an int, got "
                             f"{environ[name]!r}") from None
    if values["WORLD_SIZE"] < 1 or not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(f"environment: RANK must be in [0, WORLD_SIZE), got RANK "
                         f"{values['RANK']}, WORLD_SIZE {values['WORLD_SIZE']}")
    return (values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], environ["MASTER_ADDR"],
            values["MASTER_PORT"])


def init_from_env(device=None):
    """This process's ``Communicator`` from torchrun's variables (``env_rank``)."""
    from .comm import Communicator

    rank, size, local_rank, _, _ = env_rank()
    return Communicator.connect(rank, size, init_method="env://", local_rank=local_rank,
                                device=device)


class Processes:
    """Spawned ranks: ``join`` them, or ``terminate`` those still running."""

    def __init__(self, context):
        self.context = context

    def join(self, timeout=None):
        """True once every process has exited (None: wait for that); raises, after terminating
        the others, when one failed (torch.multiprocessing's ``ProcessRaisedException`` with
        its traceback, or ``ProcessExitedException``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.context.join(
                None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def terminate(self):
        for p in self.context.processes:
            if p.is_alive():
                p.terminate()
        for p in self.context.processes:
            p.join()


def _entry(index, envs, target, args):
    os.environ.update(envs[index])
    target(*args)


def spawn(target, args, envs):
    """Start one process per environment of ``envs`` (dicts of ``rank_env``), each running
    ``target(*args)`` (``target`` importable by name, ``args`` picklable); returns
    ``Processes``."""
    import torch.multiprocessing as mp

    return Processes(mp.start_processes(_entry, args=(envs, target, args), nprocs=len(envs),
                                        join=False, start_method="spawn"))


def _run_rank(fn, args, results, device):
    comm = init_from_env(device)
    try:
        results.put((comm.rank, fn(comm, *args)))
    finally:
        comm.close()


def run(fn, world_size, *args, device=None):
    """``fn(comm, *args)`` on ``world_size`` ranks, each in a process of its own (rank ``r`` on
    GPU ``r``; ``device``: see ``Communicator.connect``); returns the list of their results by
    rank. ``fn`` must be importable by name and its results picklable (NumPy arrays, not
    tensors). Raises as ``Processes.join`` when a rank fails."""
    import torch.multiprocessing as mp

    from .sharding import check_size

    world_size = check_size(world_size, "world_size")
    port = free_port()
    results = mp.get_context("spawn").Queue()
    procs = spawn(_run_rank, (fn, args, results, device),
                  [rank_env(r, world_size, r, port) for r in range(world_size)])
    out = {}
    try:
        while len(out) < world_size:
            try:
                rank, value = results.get(timeout=1.0)
                out[rank] = value
            except queue_module.Empty:
                if procs.join(timeout=0) and results.empty():
                    raise RuntimeError(f"run: the ranks exited with {world_size - len(out)} "
                                       f"result(s) missing") from None
        procs.join()
    finally:
        procs.terminate()
    return [out[r] for r in range(world_size)]
