"""The repeated-call fast path every op shares: record a call's launches once, replay them.

An op's validation, planning and argument packing depend only on its call *signature*: each
array's kind, shape, strides, dtype and device, the low five bits of its address (alignment picks
vector widths), the options and their types, and whether a stream was given. The first call of a
signature runs the op's checked path under a ``Recorder``, which notes every kernel launch
(``Kernel.__call__``), every array the op allocates (``_arrays.empty``), every workspace
(``_workspace.workspace``) and persistent table it uses, and the pairs of arrays it required not
to overlap. From these it builds a ``Plan``: for each launch, which of the call's arrays (or
fresh allocations, or the stream's workspace) each pointer parameter points into, at what
offset. A later call of the same signature checks what depends on its new addresses (the
recorded overlaps) and on its data (checks an op registered with ``recheck``), then allocates,
patches the pointers into the recorded parameter blocks and launches: about the cost of the
driver call itself.

A call is replayed only if its checked path told the recorder everything: a path that reads
device data on the host, autotunes, launches outside ``Kernel`` or hands a kernel memory the
recorder cannot place calls ``not_replayable`` (or is detected) and stays on the checked path.
Arrays other than torch tensors and numba device arrays (CuPy, foreign, simulator arrays) always
take the checked path. Under the simulator nothing is recorded.

Usage in an op (the checked body moved to ``_op``):

    _CALLS = OpCalls("op")

    def op(x, y, *, flag=False, out=None, stream=None):
        result = _CALLS.replay((x, y, out), (flag,), stream)
        if result is MISS:
            result = _CALLS.record(_op, x, y, flag, out, stream)
        return result
"""

import os
from operator import itemgetter

from . import _workspace
from ._arrays import (Buffer, current_stream_reader, device_address, replay_key, stream_handle,
                      torch_tensor_type)
from ._env import SIMULATOR
from ._launch import PreparedLaunch
from ._recording import _ALL, Recorder, _state
from ._recording import clear  # noqa: F401  (the public name of the reset)
from ._workspace import capturing, own_in_graph_pointers, workspace_pointer

#: ``LLMSPEED_NUMBA_REPLAY=0`` turns the fast path off (every call checked), for debugging and
#: for timing the checked path (benchmarks/bench_host.py).
ENABLED = not SIMULATOR and os.environ.get("LLMSPEED_NUMBA_REPLAY", "1") not in ("", "0")

#: Returned by ``OpCalls.replay`` when the call must take the checked path.
MISS = object()

#: Plans kept per op: a workload cycles through a few signatures; a caller whose options change
#: every call (a fresh float each time) must not grow memory without bound.
MAX_PLANS = 256

_TORCH = []                  # [torch.Tensor, torch.empty] once torch is seen
_TORCH_TENSOR = [None]       # torch.Tensor once seen: the hot loop's one-step type test
#: [device index -> raw handle of torch's current stream there], set with ``_TORCH``
_CURRENT_STREAM = [None]
_SCALARS = (int, float, bool)


def _torch():
    if not _TORCH:
        import torch

        _TORCH.extend((torch.Tensor, torch.empty))
        _TORCH_TENSOR[0] = torch.Tensor
        _CURRENT_STREAM[0] = current_stream_reader()
    return _TORCH


class OpCalls:
    """The recorded plans of one op, keyed by call signature (see the module docstring)."""

    def __init__(self, name):
        self.name = name
        self.plans = {}
        _ALL.add(self)

    def replay(self, arrays, options, stream):
        """Run the recorded plan of this call's signature and return its result, or ``MISS``
        (not recorded yet, not replayable, or a check needs the checked path). ``arrays``: the
        op's array arguments (None for absent ones; a Python number where the op takes an array
        or a number); ``options``: its other arguments that shape the work, hashable."""
        if not ENABLED or getattr(_state, "recorder", None) is not None:
            return MISS
        torch_type = _TORCH_TENSOR[0]
        # one key part per array: a torch tensor's is ``replay_key``'s, read inline (this loop
        # is most of a replay's Python); the pointers go to ``ptrs``
        parts = []
        ptrs = []
        part, ptr = parts.append, ptrs.append  # bound once: this loop runs per array per call
        for x in arrays:
            cls = type(x)
            if cls is torch_type:
                p = x.data_ptr()
                part((x.shape, x.stride(), x.dtype, x.get_device(), p & 31))
                ptr(p)
            elif x is None:
                part(None)
                ptr(0)
            elif cls in _SCALARS:  # a parameter given as an array or a number
                part((cls, x))
                ptr(0)
            else:
                if torch_type is None and cls.__module__.startswith("torch"):
                    _torch()  # first torch call of the process: the fast test above from now on
                found = replay_key(x)
                if found is None:  # CuPy, foreign, host: the checked path
                    _state.pending = None
                    return MISS
                part(found[0])
                ptr(found[1])
        try:
            key = (*parts, *options, *map(type, options), stream is None)
            plan = self.plans.get(key)
        except TypeError:  # an unhashable option: never recorded
            _state.pending = None
            return MISS
        if plan is not None and plan.aliases:
            # recorded with one object in two argument positions (out=x): that plan reads and
            # writes through the first; a call with distinct objects has its own plan
            for i, j in plan.aliases:
                if arrays[i] is not arrays[j]:
                    key = (key, _aliases(arrays))
                    plan = self.plans.get(key)
                    break
        if plan is None:
            _state.pending = (self, key, arrays, ptrs, stream)
            return MISS
        if plan.plain:  # the common plan, inline: launches on torch's stream, out= returned
            handle = _CURRENT_STREAM[0](parts[plan.torch_stream][3])
            for launch in plan.launches:
                launch(ptrs, handle)
            return plan.result_of(arrays)
        result = plan.run(arrays, ptrs, parts, stream)
        if result is MISS:
            _state.pending = None
        return result

    def record(self, fn, *args):
        """Run the checked path ``fn(*args)``; if the preceding ``replay`` on this thread missed
        with a signature, record the call's plan under it."""
        pending = getattr(_state, "pending", None)
        _state.pending = None
        if pending is None or pending[0] is not self:
            return fn(*args)
        _, key, arrays, ptrs, stream = pending
        rec = Recorder()
        _state.recorder = rec
        try:
            result = fn(*args)
        finally:
            _state.recorder = None
        if rec.reason is None and rec.launches:
            plan = Plan.build(self.name, rec, arrays, ptrs, stream, result)
            if plan is not None:
                if len(self.plans) >= MAX_PLANS:
                    self.plans.clear()
                self.plans[key] = plan
        return result


def _aliases(arrays):
    """Pairs ``(i, j)``, ``j < i``, of argument positions holding the very same array object
    (``j`` its first position). A plan places each buffer by identity, at the first position of
    its owner, so a plan recorded with aliased arguments replays only calls aliased the same way;
    a plan recorded without replays aliased calls too (each position gets its own pointer)."""
    pairs = []
    for i, x in enumerate(arrays):
        if x is not None and type(x) not in _SCALARS:
            for j in range(i):
                if arrays[j] is x:
                    pairs.append((i, j))
                    break
    return tuple(pairs)


def _stream_source(arrays, stream):
    """How a replay finds its stream handle, by ``stream_handle``'s rule: ("given", None) for a
    stream argument; for None, ("torch", i) when the arrays are torch tensors, ``arrays[i]`` the
    first (its device's current stream), ("default", None) when none is. None (not recorded)
    for None and torch tensors mixed with other arrays: whether the op launched on torch's
    current stream depends on which arrays it handed ``stream_handle``, and a current stream
    that is the default one at the recording cannot tell."""
    if stream is not None:
        return "given", None
    torch_type = torch_tensor_type()
    first, others = None, False
    for i, x in enumerate(arrays):
        if x is None or type(x) in _SCALARS:
            continue
        if type(x) is torch_type:
            first = i if first is None else first
        else:
            others = True
    if first is None:
        return "default", None
    return None if others else ("torch", first)


def _stream_of(source, parts, stream):
    """The stream handle of a call by its plan's ``_stream_source``; ``parts``: the call's key
    parts (a torch tensor's holds its device index)."""
    kind, i = source
    if kind == "torch":
        return _CURRENT_STREAM[0](parts[i][3])
    if kind == "given":
        return stream if type(stream) is int else stream_handle(stream)
    return 0


class Plan:
    """One signature's recorded work: allocations, workspaces, launches, result.

    ``launches`` are ``PreparedLaunch.bind`` functions of the pointer sources ``bases``: the
    call's arrays' pointers (``0 .. n-1``), then the fresh allocations', then the workspaces'.
    """

    __slots__ = ("name", "allocs", "workspaces", "own_specs", "own_device", "launches", "result",
                 "result_of", "overlaps", "rechecks", "stream_source", "torch_stream", "aliases",
                 "workspace_memo", "plain")

    @classmethod
    def build(cls, name, rec, arrays, ptrs, stream, result):
        def find(obj, pool):
            for i, candidate in enumerate(pool):
                if candidate is obj:
                    return i
            return None

        alloc_objs = [a[0] for a in rec.allocs]
        alloc_ptrs = [device_address(o) for o in alloc_objs]
        ws_objs = [w[0] for w in rec.workspaces]
        ws_ptrs = [device_address(o) for o in ws_objs]
        n = len(arrays)
        # pointer sources: 0..n-1 the call's arrays, then allocations, then workspaces
        bases = list(ptrs) + alloc_ptrs + ws_ptrs

        def source(buf):
            owner = buf.owner
            if owner is None:  # a null pointer (an unused parameter) is a constant; else stray
                return (-1, 0) if buf.ptr == 0 else None
            i = find(owner, arrays)
            if i is None:
                i = find(owner, alloc_objs)
                i = None if i is None else n + i
            if i is None:
                i = find(owner, ws_objs)
                i = None if i is None else n + len(alloc_objs) + i
            if i is None:
                if any(owner is p for p in rec.persistent):
                    return (-1, buf.ptr)
                return None
            return (i, buf.ptr - bases[i])

        self = cls()
        self.name = name
        self.aliases = _aliases(arrays)
        self.launches = []
        self.stream_source = _stream_source(arrays, stream)
        if self.stream_source is None:
            return None
        kind, first = self.stream_source
        self.torch_stream = first if kind == "torch" else None
        handle = (_CURRENT_STREAM[0](arrays[first].get_device()) if kind == "torch"
                  else _stream_of(self.stream_source, None, stream))
        for kernel, grid, block, args, launch_stream, shared in rec.launches:
            if launch_stream != handle:
                return None  # launched somewhere a replay would not
            sources = []
            for arg in args:
                if isinstance(arg, Buffer):
                    found = source(arg)
                    if found is None:
                        return None
                    sources.append(found)
            self.launches.append(PreparedLaunch(kernel, grid, block, args, shared).bind(sources))
        self.launches = tuple(self.launches)
        self.allocs = tuple((kind, shape, _torch_dtype(dtype) if kind == "torch" else dtype,
                             device) for _, kind, shape, dtype, device in rec.allocs)
        self.workspaces = tuple(w[1:] for w in rec.workspaces)
        # torch workspaces of their own under graph capture: one capture check a replay
        self.own_specs = tuple((name, size, dtype, own)
                               for _, name, size, dtype, kind, own in self.workspaces
                               if own and kind == "torch")
        self.own_device = next((w[0] for w in self.workspaces if w[-1] and w[4] == "torch"),
                               None)
        self.workspace_memo = None
        # the result: None, one array, or a tuple of arrays / None
        def place(obj):
            if obj is None:
                return ("none",)
            i = find(obj, arrays)
            if i is not None:
                return ("arg", i)
            i = find(obj, alloc_objs)
            if i is not None:
                return ("alloc", i)
            return None
        if isinstance(result, tuple):
            placed = tuple(place(r) for r in result)
            if any(p is None for p in placed):
                return None
            self.result = ("tuple", placed)
        else:
            placed = place(result)
            if placed is None:
                return None
            self.result = ("one", placed)
        # a result made of the call's arrays and None (out=, in place): ``result_of(arrays)``
        self.result_of = _result_of(self.result)
        self.overlaps = []
        for a, b, a_bytes, b_bytes in rec.overlaps:
            i, j = find(a, arrays), find(b, arrays)
            if i is None or j is None:
                return None
            self.overlaps.append((i, j, a_bytes, b_bytes))
        self.overlaps = tuple(self.overlaps)
        rechecks = []
        for fn, objs in rec.rechecks:
            idx = tuple(find(o, arrays) for o in objs)
            if any(i is None for i in idx):
                return None
            rechecks.append((fn, idx[0] if len(idx) == 1 else idx))
        self.rechecks = tuple(rechecks)
        # what ``run`` does reduced to launches on torch's current stream, returning an argument
        self.plain = (self.torch_stream is not None and self.result_of is not None
                      and not (self.overlaps or self.rechecks or self.allocs or self.workspaces))
        return self

    def run(self, arrays, ptrs, parts, stream):
        if self.overlaps:
            for i, j, ei, ej in self.overlaps:
                a, b = ptrs[i], ptrs[j]
                if a < b + ej and b < a + ei and ei and ej:
                    return MISS  # the checked path raises
        if self.rechecks:
            for fn, idx in self.rechecks:
                if type(idx) is int:  # one array, the usual case
                    fn(arrays[idx])
                else:
                    fn(*[arrays[i] for i in idx])
        if self.torch_stream is not None:
            handle = _CURRENT_STREAM[0](parts[self.torch_stream][3])
        else:
            handle = _stream_of(self.stream_source, parts, stream)
        made = None
        if self.allocs or self.workspaces:
            bases = list(ptrs)
            if self.allocs:
                made = []
                for kind, shape, dtype, device in self.allocs:
                    obj = _allocate(kind, shape, dtype, device)
                    made.append(obj)
                    bases.append(device_address(obj))
            if self.workspaces:
                bases += self._workspace_pointers(handle)
        else:
            bases = ptrs
        for launch in self.launches:
            launch(bases, handle)
        if self.result_of is not None:
            return self.result_of(arrays)
        kind, placed = self.result
        if kind == "one":
            return _placed(placed, arrays, made)
        return tuple(_placed(p, arrays, made) for p in placed)

    def _workspace_pointers(self, handle):
        """The workspaces' addresses on stream ``handle``: looked up again only when another
        stream is used or some workspace was made or replaced since the last lookup; under
        graph capture, ``own_in_graph`` ones are the captured call's own (made now)."""
        workspaces = self.workspaces
        if self.own_specs and capturing(self.own_device, handle):
            own = iter(own_in_graph_pointers(self.own_device, handle, self.own_specs))
            return [next(own) if own_in_graph and kind == "torch"
                    else workspace_pointer(kind, device, handle, name, size, dtype)
                    for device, name, size, dtype, kind, own_in_graph in workspaces]
        memo = self.workspace_memo
        if memo is not None and memo[0] == _workspace.GENERATION[0] and memo[1] == handle:
            return memo[2]
        found = [workspace_pointer(kind, device, handle, name, size, dtype, own_in_graph)
                 for device, name, size, dtype, kind, own_in_graph in workspaces]
        # a lookup may have made a workspace (a new stream): read the generation after it
        self.workspace_memo = (_workspace.GENERATION[0], handle, found)
        return found


def _args_of(idx):
    """``arrays -> tuple(arrays[i] for i in idx)``."""
    if not idx:
        return lambda arrays: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda arrays: (arrays[i],)
    return itemgetter(*idx)


def _result_of(result):
    """``arrays -> result`` for a plan's ``result`` made only of the call's arrays and None,
    else None (it holds fresh allocations: ``Plan.run`` places them)."""
    kind, placed = result
    if any(p[0] == "alloc" for p in (placed if kind == "tuple" else (placed,))):
        return None
    if kind == "one":
        return itemgetter(placed[1]) if placed[0] == "arg" else (lambda arrays: None)
    if all(p[0] == "arg" for p in placed):
        return _args_of(tuple(p[1] for p in placed))
    return lambda arrays: tuple(None if p[0] == "none" else arrays[p[1]] for p in placed)


def _placed(p, arrays, made):
    if p[0] == "arg":
        return arrays[p[1]]
    if p[0] == "alloc":
        return made[p[1]]
    return None


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _allocate(kind, shape, dtype, device):
    if kind == "torch":
        empty = _TORCH[1] if _TORCH else _torch()[1]
        return empty(shape, dtype=dtype, device=device)
    from ._arrays import numpy_dtype
    from ._env import cuda

    return cuda.device_array(shape, dtype=numpy_dtype(dtype))
