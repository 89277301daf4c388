"""Paged decode's launch fast path and its per-stream split workspaces.

A decode step is a few tens of microseconds of GPU time, as long as the generic launcher's
Python work (reading six arrays, validating, planning, packing ~40 parameters). So the first
call with torch tensors of a given signature (shapes, strides, dtypes, device, options)
records its launch with every parameter packed (``remember``); later calls of the same
signature (``fast_key``) only read the buffers' pointers, patch them in and launch (``replay``).
Validation results depend only on the signature, except for the caches' 16-byte alignment, which
is checked on every call.

Split partials and the folded merge's tickets live in a workspace per (device, stream) of eager
calls (``workspace``); each call captured into a CUDA graph gets its own (see
``_torch_workspace``). Every other op records and replays through ``_replay`` and takes its
scratch from ``_workspace``; unlike ``_workspace``, a call captured here into a CUDA graph gets
partials and tickets of its own, which no other graph or eager call shares.
"""

import numpy as np

from .. import _recording
from .._arrays import Buffer, kernel_buffer, stream_handle, torch_current_stream, torch_signature
from .._checks import tensor
from .._env import SIMULATOR, cuda
from .._launch import PreparedLaunch, collecting
from ._paged_decode_kernel import ARRAY_PARAMS

#: The kernel's array parameters in the order ``_FastCall`` patches their pointers.
_POINTERS = ("q", "kc", "vc", "bt", "sl", "out", "lse", "part_o", "part_lse", "tickets")
if _POINTERS != ARRAY_PARAMS:
    raise ImportError(f"_paged_decode_fast patches pointers {_POINTERS}, the kernel's arrays are "
                      f"{ARRAY_PARAMS}")

#: Signatures kept (first come, first kept).
_FAST_MAX = 256
_FAST = {}
# forgotten with every op's recorded plans (``_overrides`` changed the kernel choice)
_recording.on_clear(_FAST.clear)
#: (device, stream) -> _Workspace: split partials and folded-merge tickets of eager calls, kept
#: and grown, never shrunk (kernels on one stream run in order, so one stream's launches can
#: share it; the folded merge leaves every ticket 0 again). Calls captured into a CUDA graph
#: never use these (``_torch_workspace``).
_WORKSPACES = {}
#: Workspaces of captured calls: each captured call's own, alive as long as the process (the
#: graph replays into them).
_CAPTURED = []


def _sig(x):
    return (type(x),) + torch_signature(x)


def fast_key(q, k_cache, v_cache, block_table, seq_lens, out, softmax_scale, window_size,
             return_lse, stream, num_splits, check_bounds):
    """The fast-path signature of a call with torch CUDA tensors, else None."""
    if SIMULATOR or type(q).__module__ != "torch":
        return None
    try:
        key = (_sig(q), _sig(k_cache), _sig(v_cache), _sig(block_table), _sig(seq_lens),
               None if out is None else _sig(out), softmax_scale, type(softmax_scale),
               tuple(window_size), tuple(map(type, window_size)), return_lse,
               type(return_lse), stream is None, num_splits, type(num_splits), check_bounds)
        hash(key)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return key


def replay(key, q, k_cache, v_cache, block_table, seq_lens, out, stream):
    """The result of ``key``'s recorded launch on these arrays, or None (not recorded, or the
    checked path must run: it raises)."""
    fast = _FAST.get(key)
    if fast is None:
        return None
    return fast(q, k_cache, v_cache, block_table, seq_lens, out, stream)


def remember(key, kernel, launch, out_given, tq, lse_shape, work):
    """Record a checked call's launch ``(grid, block, args, shared_bytes)`` of ``kernel`` for
    later calls of signature ``key``; ``lse_shape``: None without ``return_lse``; ``work``: the
    workspace sizes of a split launch (else None)."""
    if len(_FAST) < _FAST_MAX and not collecting():
        _FAST[key] = _FastCall(kernel, launch, out_given, tq, lse_shape, work)


class _Workspace:
    """Split partials (float32 part_o, part_lse, made uninitialised) and tickets (int32, made
    zero) of one (device, stream) of eager calls; ``context``: the numba context the arrays
    belong to (a closed context's arrays are not reused)."""

    __slots__ = ("context", "pl", "po", "tickets")

    def __init__(self, context=None):
        self.po = self.pl = self.tickets = None
        self.context = context


def _grown(old, n, make):
    """``old`` when it holds ``n`` elements, else ``make(max(n, 2 x old size))``. The old one is
    dropped: only calls on this workspace's stream used it, and they run before anything that
    reuses its memory (torch's allocator orders by stream; numba frees synchronously)."""
    size = 0 if old is None else old.shape[0]
    if size >= max(n, 1):
        return old
    return make(max(n, 2 * size, 1))


_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


def _torch_buffer(t, dtype):
    """The ``Buffer`` of a 1-D torch workspace tensor, read directly (this runs on the fast
    path, where ``kernel_buffer(tensor(...))`` would cost about a microsecond an array)."""
    return Buffer(t.data_ptr(), t.numel(), dtype, t)


def workspace(tq, stream, n_o, n_lse, n_tickets):
    """Kernel buffers (part_o, part_lse, tickets) of at least n_o / n_lse float32 and n_tickets
    zero int32 for split partials on ``stream``."""
    if tq.kind == "torch":
        return _torch_workspace(tq.obj.device, stream, n_o, n_lse, n_tickets)
    if SIMULATOR:
        device, context = 0, None

        def zeros(n, dtype):
            return np.zeros(n, dtype)
    else:
        context = cuda.current_context()
        device = context.device.id

        def zeros(n, dtype):
            array = cuda.to_device(np.zeros(n, dtype))
            cuda.synchronize()  # zero before any stream's kernel reads it (made rarely)
            return array
    ws = _WORKSPACES.get((device, stream))
    if ws is None or ws.context is not context:
        ws = _WORKSPACES[(device, stream)] = _Workspace(context)
    ws.po = _grown(ws.po, n_o, lambda n: zeros(n, np.float32))
    ws.pl = _grown(ws.pl, n_lse, lambda n: zeros(n, np.float32))
    ws.tickets = _grown(ws.tickets, n_tickets, lambda n: zeros(n, np.int32))
    return tuple(kernel_buffer(tensor(a, "workspace")) for a in (ws.po, ws.pl, ws.tickets))


def _torch_workspace(device, stream, n_o, n_lse, n_tickets):
    """As ``workspace``, for torch tensors. Under CUDA-graph capture each captured call gets a
    workspace of its own, its tickets zeroed by a memset captured before the kernel: a graph
    then starts every replay from zero tickets whatever ran before, and never shares partials
    or tickets with another graph (replayed concurrently, or captured after it) or with eager
    calls. Eager calls share one workspace per (device, stream), its tickets zeroed on that
    stream when made."""
    import torch

    current = torch_current_stream(device.index)
    if stream == current:
        capturing = torch.cuda.is_current_stream_capturing()
        launch_stream = None
    else:
        launch_stream = torch.cuda.ExternalStream(stream, device=device)
        with torch.cuda.stream(launch_stream):
            capturing = torch.cuda.is_current_stream_capturing()

    def alloc(n, dtype, make=torch.empty):
        # on the launch stream, so torch's allocator orders the memory's reuse after our kernels
        if launch_stream is None:
            return make(n, dtype=dtype, device=device)
        with torch.cuda.stream(launch_stream):
            return make(n, dtype=dtype, device=device)

    if capturing:
        po = alloc(max(n_o, 1), torch.float32)
        pl = alloc(max(n_lse, 1), torch.float32)
        tickets = alloc(max(n_tickets, 1), torch.int32, torch.zeros)
        _CAPTURED.append((po, pl, tickets))
    else:
        ws = _WORKSPACES.get((device, stream))
        if ws is None:
            ws = _WORKSPACES[(device, stream)] = _Workspace()
        ws.po = _grown(ws.po, n_o, lambda n: alloc(n, torch.float32))
        ws.pl = _grown(ws.pl, n_lse, lambda n: alloc(n, torch.float32))
        ws.tickets = _grown(ws.tickets, n_tickets, lambda n: alloc(n, torch.int32, torch.zeros))
        po, pl, tickets = ws.po, ws.pl, ws.tickets
    return _torch_buffer(po, _F32), _torch_buffer(pl, _F32), _torch_buffer(tickets, _I32)


class _FastCall:
    """The recorded launches of one call signature (see above)."""

    def __init__(self, kernel, main, out_given, tq, lse_shape, work):
        self.main = PreparedLaunch(kernel, *main)
        self.out_given = out_given
        self.shape, self.dtype, self.device = tuple(tq.shape), tq.obj.dtype, tq.obj.device
        self.lse_shape = lse_shape
        self.work = work

    def __call__(self, q, k_cache, v_cache, block_table, seq_lens, out, stream):
        import torch

        kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
        if (kp | vp) & 15:
            return None  # the generic path raises
        if not self.out_given:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        lse = None
        lp = 0
        if self.lse_shape is not None:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            lp = lse.data_ptr()
        handle = torch_current_stream() if stream is None else stream_handle(stream, ())
        op = out.data_ptr()
        wo = wl = wt = 0
        if self.work is not None:
            po, pl, tickets = _torch_workspace(self.device, handle, *self.work)
            wo, wl, wt = po.ptr, pl.ptr, tickets.ptr
        self.main((q.data_ptr(), kp, vp, block_table.data_ptr(), seq_lens.data_ptr(), op, lp,
                   wo, wl, wt), handle)
        return (out, lse) if self.lse_shape is not None else out

