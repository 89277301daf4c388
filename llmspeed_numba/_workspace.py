"""Device workspaces kept per (device, stream, name): one runtime helper for every op.

Launches on one stream run in order, so they can share a scratch buffer as long as each kernel
leaves it as it found it (zero, say). A workspace is made with torch when the caller's array is a
torch tensor, so that a first call inside CUDA-graph capture allocates from the graph's pool and
records the zeroing; with numba otherwise; a NumPy array under the simulator. A workspace that
grows is replaced, and the old one kept alive: a captured CUDA graph may still point at it.
"""

import numpy as np

from . import _recording
from ._arrays import Buffer, device_address
from ._env import SIMULATOR, cuda

_WORKSPACE: dict = {}
_RETIRED: list = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them


def workspace(like, stream, name, size, dtype):
    """A device buffer of at least ``size`` elements of ``dtype``, zero when first made, one per
    (device, ``stream``, ``name``); ``like`` is the call's input ``Tensor`` (its kind and device
    decide how the buffer is made). Returns a ``Buffer`` (a NumPy array under the simulator)."""
    device = 0 if SIMULATOR else (like.obj.device.index if like.kind == "torch"
                                  else cuda.get_current_device().id)
    kind = "torch" if like.kind == "torch" else "numba"
    buf = _buffer(kind, device, stream, name, size, dtype)
    if SIMULATOR:
        return buf
    _recording.note_workspace(buf, device, name, size, dtype, kind)
    return Buffer(device_address(buf), buf.shape[0], np.dtype(dtype), buf)


def workspace_pointer(kind, device, stream, name, size, dtype):
    """Address of ``workspace``'s buffer for a replayed call (``_replay``)."""
    buf = _WORKSPACE.get((device, stream, name))
    if buf is None or buf.shape[0] < size:
        buf = _buffer(kind, device, stream, name, size, dtype)
    return device_address(buf)


def _buffer(kind, device, stream, name, size, dtype):
    key = (device, stream, name)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[0] < size:
        if buf is not None:
            _RETIRED.append(buf)
        n = max(size, 1024)
        if SIMULATOR:
            buf = np.zeros(n, dtype)
        elif kind == "torch":
            import torch

            storage = {1: torch.uint8, 4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]
            buf = torch.zeros(n, dtype=storage, device=device)
        else:
            buf = cuda.to_device(np.zeros(n, dtype))
        _WORKSPACE[key] = buf
    return buf
