"""Paged decode's launch fast path, and its split workspaces.

A decode step is a few tens of microseconds of GPU time, as long as the generic launcher's
Python work (reading six arrays, validating, planning, packing ~40 parameters). So the first
call with torch tensors of a given signature (shapes, strides, dtypes, device, options)
records its launch with every parameter packed (``remember``); later calls of the same
signature (``fast_key``) only read the buffers' pointers, patch them in and launch (``replay``).
Validation results depend only on the signature, except for the caches' 16-byte alignment, which
is checked on every call.

Split partials and the split merge's tickets are ``_workspace`` workspaces of their own under
CUDA-graph capture (``own_in_graph``): a captured call gets partials and tickets no other graph
or eager call shares, its tickets zeroed in the graph.
"""

import numpy as np

from .. import _recording
from .._arrays import stream_handle, torch_current_stream, torch_signature
from .._env import SIMULATOR
from .._launch import PreparedLaunch, collecting
from .._workspace import own_in_graph_pointers, workspace
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
#: The split launch's workspaces: partial outputs, partial log2-sum-exps, tickets (zero).
WORK = (("paged_decode_part_o", np.float32), ("paged_decode_part_lse", np.float32),
        ("paged_decode_tickets", np.int32))


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


def split_workspace(tq, stream, n_o, n_lse, n_tickets):
    """Kernel buffers (part_o, part_lse, tickets) of at least n_o / n_lse float32 and n_tickets
    zero int32 for split partials on ``stream``."""
    return tuple(workspace(tq, stream, name, n, dtype, own_in_graph=True)
                 for (name, dtype), n in zip(WORK, (n_o, n_lse, n_tickets), strict=True))


class _FastCall:
    """The recorded launches of one call signature (see above)."""

    def __init__(self, kernel, main, out_given, tq, lse_shape, work):
        self.main = PreparedLaunch(kernel, *main)
        self.out_given = out_given
        self.shape, self.dtype, self.device = tuple(tq.shape), tq.obj.dtype, tq.obj.device
        self.lse_shape = lse_shape
        self.work = None if work is None else tuple(
            (name, n, dtype) for (name, dtype), n in zip(WORK, work, strict=True))

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
            wo, wl, wt = own_in_graph_pointers(self.device.index, handle, self.work)
        self.main((q.data_ptr(), kp, vp, block_table.data_ptr(), seq_lens.data_ptr(), op, lp,
                   wo, wl, wt), handle)
        return (out, lse) if self.lse_shape is not None else out

