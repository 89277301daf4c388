"""What a checked op call did, noted for ``_replay`` (the hooks at the bottom of the runtime).

``_launch``, ``_arrays``, ``_workspace``, ``_checks`` and ``_tuning_cache`` report here while a
call is being recorded (a ``Recorder`` is active on the thread); ``_replay`` sits above them all
and turns a finished record into a plan. Nothing here imports the rest of the package.
"""

import threading
import weakref


class _State(threading.local):
    """Per thread: the active ``Recorder`` and ``_replay``'s pending miss (class defaults: a
    replay reads ``recorder`` as a plain attribute, never missing)."""

    recorder = None
    pending = None


_state = _State()
_ALL = weakref.WeakSet()     # every _replay.OpCalls, for clear()
_ON_CLEAR = []               # other repeated-call caches' reset functions, for clear()


def clear():
    """Forget every recorded plan (kernel-choice overrides or the autotune cache changed)."""
    for calls in list(_ALL):
        calls.plans.clear()
    for fn in _ON_CLEAR:
        fn()


def on_clear(fn):
    """Have ``clear`` call ``fn()`` too (an op's own cache of recorded calls)."""
    _ON_CLEAR.append(fn)


def recording():
    """The active ``Recorder`` of this thread, or None."""
    return getattr(_state, "recorder", None)


def not_replayable(reason):
    """Called by a checked path whose work the recorder cannot reproduce (a host read of device
    data, autotuning, work launched outside ``Kernel``): the call is not recorded."""
    rec = getattr(_state, "recorder", None)
    if rec is not None and rec.reason is None:
        rec.reason = reason


def recheck(fn, *arrays):
    """Run ``fn(*arrays)`` on every replay too (with the replayed call's arrays in place of
    these): a data-dependent check made cheap enough to repeat, e.g. a validation cached on the
    array's version. It raises as the checked path does."""
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        rec.rechecks.append((fn, arrays))


class Recorder:
    """What one checked call did, as the plan needs it (filled by the hooks in ``_launch``,
    ``_arrays``, ``_workspace`` and ``_checks``)."""

    __slots__ = ("launches", "allocs", "workspaces", "persistent", "maps", "overlaps",
                 "rechecks", "reason")

    def __init__(self):
        self.launches = []      # (kernel, grid, block, args, stream, shared_bytes)
        self.allocs = []        # (obj, kind, shape, dtype name, torch device or None)
        self.workspaces = []    # (obj, device, name, size, numpy dtype, kind, own_in_graph)
        self.persistent = []    # objects that live as long as the process (tables, dummies)
        self.maps = []          # (map buffer, array, address, layout, torch device or None)
        self.overlaps = []      # (obj_a, obj_b, bytes_a, bytes_b) required disjoint
        self.rechecks = []      # (fn, objs)
        self.reason = None      # why the call cannot be replayed, if it cannot


def note_launch(kernel, grid, block, args, stream, shared_bytes):
    _state.recorder.launches.append((kernel, grid, block, tuple(args), stream, shared_bytes))


def note_alloc(obj, kind, shape, dtype):
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        device = obj.device if kind == "torch" else None
        rec.allocs.append((obj, kind, tuple(shape), dtype, device))


def note_workspace(obj, device, name, size, dtype, kind, own_in_graph=False):
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        rec.workspaces.append((obj, device, name, size, dtype, kind, own_in_graph))


def note_persistent(obj):
    """``obj`` (a device array the op keeps for the life of the process) may be baked in."""
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        rec.persistent.append(obj)


def note_map(buf, obj, ptr, layout, torch_device):
    """``buf`` (a kernel parameter) is the tensor map of the memory at ``ptr`` in array ``obj``
    with ``layout`` (``_tensor_map.device_map``): a replay finds the map of its own array's
    address (``_tensor_map.cached_map``); ``torch_device``: where a graph capture is checked
    (None: not a torch tensor)."""
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        rec.maps.append((buf, obj, ptr, layout, torch_device))


def note_overlap_check(a, b, a_bytes, b_bytes):
    """Arrays ``a`` and ``b`` (spanning these many bytes) were required not to overlap."""
    rec = getattr(_state, "recorder", None)
    if rec is not None:
        rec.overlaps.append((a, b, a_bytes, b_bytes))
