"""Device workspaces kept per (device, stream, name), and placeholder buffers: the one runtime
helper every op takes its scratch memory from.

Launches on one stream run in order, so they can share a scratch buffer as long as each kernel
leaves it as it found it (zero, say). A workspace is made with torch when the caller's array is a
torch tensor, on the launch stream (torch's allocator then orders the memory's reuse after our
kernels), so that a first call inside CUDA-graph capture allocates from the graph's pool and
records the zeroing; with numba otherwise; a NumPy array under the simulator. A workspace that
grows is replaced (at least doubled), the old one kept alive: a captured CUDA graph may still
point at it.

CUDA graphs. A shared workspace is shared by every graph captured on its stream and by eager
calls there: right for scratch that a launch writes before it reads. State that must be zero
when a kernel starts (tickets, counters, atomic maxima; each kernel leaves it zero) cannot be
shared by graphs: a buffer made during one graph's capture comes from that graph's memory pool,
which graphs sharing the pool also use as their own scratch on replay, so another graph's
replay can leave it dirty for the next (a wrong merge, not an error). Such state is asked for
with ``own_in_graph``: under capture, ``"graph"`` gives each captured graph one buffer of its
own (all its calls share it, one after another), ``True`` each captured call its own (paged
decode: a graph that may run concurrently with another); either is made, and its zeroing
captured, at the first call that needs it, so every replay zeroes it before its first use. They
live as long as the process, unless the capture runs inside ``graph_owned()``: then they live as
long as the object it returns (keep it with the graph). The eager workspace of such state, never
seen by a graph, is dropped when it grows.
"""

import contextlib
import threading
import weakref

import numpy as np

from . import _recording
from ._arrays import Buffer, device_address, torch_current_stream
from ._env import SIMULATOR, cuda

_WORKSPACE: dict = {}
_RETIRED: list = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them


class GraphWorkspaces:
    """The own-in-graph workspaces made while capturing one or more graphs: ``buffers``
    (``(name, buffer)`` of each captured call) and ``per_graph`` (``(device, stream, name,
    capture id)`` -> a graph's own buffer). Its graphs replay into them: keep it as long as
    they live."""

    def __init__(self):
        self.buffers: list = []
        self.per_graph: dict = {}


_PROCESS = GraphWorkspaces()  # captures outside graph_owned(): kept for the life of the process
_ALL_OWNED = weakref.WeakSet()  # every graph_owned() owner still alive (captured_buffers)
_SCOPES = threading.local()  # .owners: this thread's open graph_owned() scopes, innermost last
_UNUSED: dict = {}
#: Bumped whenever a shared workspace is made or replaced: a replayed call may keep the addresses
#: it looked up while this stays the same (``_replay``).
GENERATION = [0]


def workspace(like, stream, name, size, dtype, own_in_graph=False):
    """A device buffer of at least ``size`` elements of ``dtype``, zero when first made, one per
    (device, ``stream``, ``name``) (``own_in_graph``: under CUDA-graph capture, one per captured
    graph for ``"graph"``, per captured call for ``True``; see above); ``like`` is the call's
    input ``Tensor`` (its kind and device decide how the buffer is made). Returns a ``Buffer``
    (a NumPy array under the simulator)."""
    device = 0 if SIMULATOR else (like.obj.device.index if like.kind == "torch"
                                  else cuda.get_current_device().id)
    kind = "torch" if like.kind == "torch" else "numba"
    buf = _buffer(kind, device, stream, name, size, dtype, own_in_graph)
    if SIMULATOR:
        return buf
    _recording.note_workspace(buf, device, name, size, dtype, kind, own_in_graph)
    return Buffer(device_address(buf), buf.shape[0], np.dtype(dtype), buf)


def workspace_pointer(kind, device, stream, name, size, dtype, own_in_graph=False):
    """Address of ``workspace``'s shared buffer for a replayed call (``_replay``; under capture,
    an ``own_in_graph`` workspace comes from ``own_in_graph_pointers`` instead)."""
    buf = _WORKSPACE.get((device, stream, name))
    if buf is None or buf.shape[0] < size:
        buf = _shared(kind, device, stream, name, size, dtype, own_in_graph)
    return device_address(buf)


def own_in_graph_pointers(device, stream, specs):
    """Addresses of the torch ``own_in_graph`` workspaces ``specs`` (``(name, size, dtype,
    own_in_graph)`` each) for a replayed call (``_replay``): one capture check for them all."""
    if capturing(device, stream):
        bufs = [_captured(device, stream, name, size, dtype, own)
                for name, size, dtype, own in specs]
    else:
        bufs = [_shared("torch", device, stream, name, size, dtype, True)
                for name, size, dtype, _ in specs]
    return [device_address(b) for b in bufs]


def unused(like, dtype):
    """A one-element buffer for a kernel parameter the launch does not read (an absent operand,
    a scalar given in place of an array): zero, one per device for every dtype (so a call
    first needing a new dtype inside a CUDA-graph capture, where allocation fails, finds it),
    kept for the life of the process."""
    if SIMULATOR:
        return np.zeros(1, dtype)
    device = like.obj.device.index if like.kind == "torch" else cuda.get_current_device().id
    buf = _UNUSED.get(device)
    if buf is None:
        buf = _UNUSED[device] = cuda.to_device(np.zeros(2, np.uint64))  # 16 bytes: any dtype
    _recording.note_persistent(buf)
    return Buffer(device_address(buf), 1, np.dtype(dtype), buf)


def capturing(device, stream):
    """Whether torch is capturing ``stream`` (a raw handle) into a CUDA graph."""
    import torch

    if stream == torch_current_stream(device):
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
        return torch.cuda.is_current_stream_capturing()


def _make(kind, device, stream, n, dtype):
    """A zero buffer of ``n`` elements, made on ``stream``."""
    if SIMULATOR:
        return np.zeros(n, dtype)
    if kind == "numba":
        buf = cuda.to_device(np.zeros(n, dtype))
        cuda.synchronize()  # zero before any stream's kernel reads it (made rarely)
        return buf
    import torch

    storage = {1: torch.uint8, 4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]
    if stream == torch_current_stream(device):
        return torch.zeros(n, dtype=storage, device=device)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
        return torch.zeros(n, dtype=storage, device=device)


@contextlib.contextmanager
def graph_owned():
    """Within it, captured calls' own-in-graph workspaces belong to the ``GraphWorkspaces`` it
    yields instead of the process: freed with it (with the graph that keeps it), so a program
    capturing graph after graph does not keep every old graph's buffers. Per thread: a capture
    runs on the thread that started it."""
    owner = GraphWorkspaces()
    _ALL_OWNED.add(owner)
    owners = _SCOPES.__dict__.setdefault("owners", [])
    owners.append(owner)
    try:
        yield owner
    finally:
        owners.remove(owner)


def _owner():
    """Whose a buffer made in a capture on this thread is: the innermost open scope's, else the
    process's."""
    owners = getattr(_SCOPES, "owners", None)
    return owners[-1] if owners else _PROCESS


def captured_buffers():
    """``(name, buffer)`` of every captured call's own workspace still kept (tests)."""
    return [pair for owner in [_PROCESS, *_ALL_OWNED] for pair in owner.buffers]


def _own(device, stream, name, size, dtype):
    """A captured call's own zero buffer (its zeroing captured into the graph)."""
    buf = _make("torch", device, stream, max(size, 1), dtype)
    _owner().buffers.append((name, buf))
    return buf


def capture_id(stream):
    """The driver's id of the capture sequence running on ``stream`` (a raw handle), unique in
    the process; None when it cannot be read."""
    from cuda.bindings import driver

    err, status, sequence, *_ = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
    if (err != driver.CUresult.CUDA_SUCCESS
            or status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE):
        return None
    return int(sequence)


def _per_graph(device, stream, name, size, dtype):
    """The graph being captured on ``stream``: its own zero buffer of ``name``, made (and its
    zeroing captured) at its first call that needs it; a later call needing more gets a bigger
    one (zeroed there) for the calls after it. Per call when the capture cannot be told."""
    sequence = capture_id(stream)
    if sequence is None:
        return _own(device, stream, name, size, dtype)
    key = (device, stream, name, sequence)
    per_graph = _owner().per_graph
    buf = per_graph.get(key)
    if buf is None or buf.shape[0] < size:
        buf = per_graph[key] = _own(device, stream, name, size, dtype)
    return buf


def _captured(device, stream, name, size, dtype, own_in_graph):
    if own_in_graph == "graph":
        return _per_graph(device, stream, name, size, dtype)
    return _own(device, stream, name, size, dtype)


def _shared(kind, device, stream, name, size, dtype, own_in_graph):
    key = (device, stream, name)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape[0] < size:
        old = 0
        if buf is not None:
            old = buf.shape[0]
            if own_in_graph is not True:  # no graph points at a per-call op's eager workspace
                _RETIRED.append(buf)
        buf = _WORKSPACE[key] = _make(kind, device, stream, max(size, 2 * old, 1024), dtype)
        GENERATION[0] += 1
    return buf


def _buffer(kind, device, stream, name, size, dtype, own_in_graph):
    if own_in_graph and kind == "torch" and not SIMULATOR and capturing(device, stream):
        return _captured(device, stream, name, size, dtype, own_in_graph)
    return _shared(kind, device, stream, name, size, dtype, own_in_graph)
