"""The collectives of tensor parallelism, over ``torch.distributed``: NCCL between GPUs, gloo on
the CPU (the simulator, and every rank's control messages).

Why ``torch.distributed`` rather than ``nccl4py`` (NVIDIA's Python binding of NCCL): it is in
the image already (torch is the model layer's tensor library; nccl4py is not installed), it
starts the group from the torchrun environment or a TCP address with one call, it has a gloo
backend, so the same code runs two CPU processes in the simulator (the CI test), and its NCCL
collectives are capturable in CUDA graphs: ``ProcessGroupNCCL`` runs a collective issued while
the current stream captures on its NCCL stream forked from and joined back into the current
stream (events the capture records as graph edges), and keeps captured work away from its
watchdog. A collective issued from the model's forward is therefore ordered with our kernels,
which launch on torch's current stream, and the decode step's all-reduces replay inside its
CUDA graph. NCCL must have run one collective eagerly first (the graph's first step is eager),
and every rank must capture and replay the same graphs in the same order (the engine's workers
run the same steps as rank 0).

NVLink multicast (NVLS) is left to NCCL's environment: nothing here sets ``NCCL_NVLS_ENABLE``.
"""

import datetime

#: Seconds a collective or the group's start may wait for the other ranks.
TIMEOUT_S = 600
#: Days a control message (``broadcast_object``, ``min_int``) may wait.
CONTROL_TIMEOUT_DAYS = 3650


class Communicator:
    """This process's rank in a group of ``size`` processes, one device each.

    ``all_reduce`` and ``all_gather`` take tensors on ``device`` ("cuda": NCCL on the current
    stream; "cpu": gloo); ``min_int`` and ``broadcast_object`` carry host values over a gloo
    group of their own, without a practical timeout. Create with ``connect`` (or
    ``launch.init_from_env``); ``close`` ends the group."""

    def __init__(self, rank, size, device, group, cpu_group):
        self.rank, self.size, self.device = rank, size, device
        self.group, self.cpu_group = group, cpu_group

    @classmethod
    def connect(cls, rank, size, *, init_method, local_rank=0, device=None):
        """Join the group of ``size`` ranks as ``rank``: ``init_method`` is torch.distributed's
        ("tcp://ADDR:PORT", rank 0 listening there; "env://": torchrun's variables, which
        also finds torchrun's own store). ``device``: "cuda" (NCCL; this process's GPU becomes
        ``local_rank``, for torch and numba both) or "cpu" (gloo); default: "cpu" under the
        simulator, else "cuda". RuntimeError if this process is in a group already."""
        import torch.distributed as dist

        from .._env import SIMULATOR

        if dist.is_initialized():
            raise RuntimeError("tensor parallelism: this process is in a torch.distributed "
                               "group already (one tensor-parallel model per process)")
        device = device or ("cpu" if SIMULATOR else "cuda")
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        if device == "cpu":
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                    timeout=timeout)
        else:
            import torch
            from numba import cuda

            torch.cuda.set_device(local_rank)
            cuda.select_device(local_rank)
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size,
                                    timeout=timeout,
                                    device_id=torch.device("cuda", local_rank))
        # a worker waits for rank 0's next step as long as the user leaves the engine idle
        cpu_group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(days=CONTROL_TIMEOUT_DAYS))
        return cls(rank, size, device, dist.group.WORLD, cpu_group)

    def all_reduce(self, x):
        """``x`` summed over the ranks, in place; returns ``x``."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x):
        """Every rank's ``x`` (same shape on each), stacked in rank order: (size, *x.shape)."""
        import torch.distributed as dist

        shape = tuple(x.shape)
        out = x.new_empty((self.size * shape[0],) + shape[1:])     # the ranks' x concatenated
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out.view((self.size,) + shape)

    def min_int(self, value):
        """The smallest of the ranks' ints ``value``."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` (any picklable value) on every rank; other ranks pass nothing."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self):
        """End the group (this process may then join another)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
