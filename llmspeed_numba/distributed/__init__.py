"""Tensor parallelism: a Llama model split over several GPUs, one process each, NCCL between
them (through ``torch.distributed``; gloo between CPU processes under the simulator).

- ``sharding``: each rank's part of every weight (Megatron-style) and its model's config;
- ``comm``: ``Communicator``, the collectives (all-reduce, all-gather) and control messages;
- ``parallel``: ``TensorParallel``, what a rank's forward adds to the one-GPU forward;
- ``launch``: the processes, in torchrun's convention.

``LLM(..., tensor_parallel_size=N)`` (``engine/tp.py``) puts them together. Needs torch.
"""

from .comm import Communicator
from .launch import init_from_env, run, spawn
from .parallel import TensorParallel
from .sharding import check_tensor_parallel, shard_config, shard_tensor, shard_weights

__all__ = ["Communicator", "TensorParallel", "check_tensor_parallel", "init_from_env", "run",
           "shard_config", "shard_tensor", "shard_weights", "spawn"]
