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
driver call itself. Both halves are generated Python (compiled once per code shape): per op and
argument pattern, straight-line code reading the key (``OpCalls._specialise``), compared with
the op's last key found before it is hashed (``_Plans.last``: an op called once a layer
repeats its previous call's signature); per plan, its checks, stream, allocations,
workspaces, launches and result (``Plan._compile``).

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
from functools import lru_cache

from . import _workspace
from ._arrays import (_REPLAY_KEYS, Buffer, current_stream_reader, device_address, replay_key,
                      stream_handle, torch_tensor_type)
from ._env import SIMULATOR
from ._launch import PreparedLaunch
from ._recording import _ALL, Recorder, _state
from ._recording import clear  # noqa: F401  (the public name of the reset)
from ._tensor_map import cached_map  # noqa: F401  (read by the generated code)
from ._workspace import capturing, own_in_graph_pointers, workspace_pointer

#: ``LLMSPEED_NUMBA_REPLAY=0`` turns the fast path off (every call checked), for debugging and
#: for timing the checked path (benchmarks/bench_host.py).
ENABLED = not SIMULATOR and os.environ.get("LLMSPEED_NUMBA_REPLAY", "1") not in ("", "0")

#: Returned by ``OpCalls.replay`` when the call must take the checked path.
MISS = object()

#: Plans kept per op: a workload cycles through a few signatures; a caller whose options change
#: every call (a fresh float each time) must not grow memory without bound.
MAX_PLANS = 256

#: Argument patterns per op with generated key code (``OpCalls._specialise``); a call of another
#: pattern takes the generic loop.
MAX_PATTERNS = 4

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


# The key: one flat tuple, per array argument a torch tensor's ``shape, stride(), dtype,
# get_device(), ptr & 31`` (``replay_key``'s fields, read inline), ``None`` for None, ``class,
# value`` for a Python number, another array's ``replay_key`` part (one tuple); then the options,
# their types and whether a stream was given. An argument's first entry tells its kind (a
# torch.Size, None, a class, a tuple that is not of ints), so the layout is unambiguous. Flat:
# no tuple per array to build, hash and compare.
_WIDTH = {"torch": 5, None: 1, "number": 2, "other": 1}


def _kind(x, torch_type):
    """An argument's kind in the key: "torch", None, "number" or "other"."""
    if torch_type is not None and type(x) is torch_type:
        return "torch"
    if x is None:
        return None
    return "number" if type(x) in _SCALARS else "other"


class _Plans(dict):
    """An op's plans by key, and ``last``: the (key, plan) a replay found last (a replay of
    the same signature compares keys without hashing); cleared with them."""

    __slots__ = ("last",)

    def __init__(self):
        super().__init__()
        self.last = (None, None)

    def clear(self):
        self.last = (None, None)
        super().clear()


class OpCalls:
    """The recorded plans of one op, keyed by call signature (see the module docstring).

    ``replay`` is the generic key loop; once a call of an argument pattern (each argument's kind
    and class) is recorded, the instance's ``replay`` is generated code for that pattern, falling
    back to the previously specialised patterns and then to the generic loop."""

    def __init__(self, name):
        self.name = name
        self.plans = _Plans()  # cleared in place, never replaced: generated replays hold it
        self._patterns = []  # (pattern, option count), the most recently recorded first
        _ALL.add(self)

    def replay(self, arrays, options, stream):
        """Run the recorded plan of this call's signature and return its result, or ``MISS``
        (not recorded yet, not replayable, or a check needs the checked path). ``arrays``: the
        op's array arguments (None for absent ones; a Python number where the op takes an array
        or a number); ``options``: its other arguments that shape the work, hashable."""
        if not ENABLED or _state.recorder is not None:
            return MISS
        torch_type = _TORCH_TENSOR[0]
        key = []
        ptrs = []
        for x in arrays:
            cls = type(x)
            if cls is torch_type:
                p = x.data_ptr()
                key += (x.shape, x.stride(), x.dtype, x.get_device(), p & 31)
                ptrs.append(p)
            elif x is None:
                key.append(None)
                ptrs.append(0)
            elif cls in _SCALARS:  # a parameter given as an array or a number
                key += (cls, x)
                ptrs.append(0)
            else:
                if torch_type is None and cls.__module__.startswith("torch"):
                    torch_type = _torch()[0]  # first torch call of the process
                    if cls is torch_type:
                        p = x.data_ptr()
                        key += (x.shape, x.stride(), x.dtype, x.get_device(), p & 31)
                        ptrs.append(p)
                        continue
                found = replay_key(x)
                if found is None:  # CuPy, foreign, host: the checked path
                    _state.pending = None
                    return MISS
                key.append(found[0])
                ptrs.append(found[1])
        key = (*key, *options, *map(type, options), stream is None)
        try:
            plan = self.plans.get(key)
        except TypeError:  # an unhashable option: never recorded
            _state.pending = None
            return MISS
        if plan is None:
            _state.pending = (self, key, arrays, ptrs, stream, len(options))
            return MISS
        return plan(arrays, ptrs, key, stream)

    def _unaliased(self, arrays, ptrs, key, stream):
        """A call whose plan was recorded with one object in two argument positions (out=x),
        made with distinct objects: that plan reads and writes through the first; this call
        has its own plan."""
        aliased = (key, _aliases(arrays))
        plan = self.plans.get(aliased)
        if plan is None:
            _state.pending = (self, aliased, arrays, ptrs, stream, None)
            return MISS
        return plan(arrays, ptrs, key, stream)

    def record(self, fn, *args):
        """Run the checked path ``fn(*args)``; if the preceding ``replay`` on this thread missed
        with a signature, record the call's plan under it."""
        pending = _state.pending
        _state.pending = None
        if pending is None or pending[0] is not self:
            return fn(*args)
        _, key, arrays, ptrs, stream, n_options = pending
        rec = Recorder()
        _state.recorder = rec
        try:
            result = fn(*args)
        finally:
            _state.recorder = None
        if rec.reason is None and rec.launches:
            plan = Plan.build(self, rec, arrays, ptrs, stream, result)
            if plan is not None:
                if len(self.plans) >= MAX_PLANS:
                    self.plans.clear()
                self.plans[key] = plan.run
                if n_options is not None:
                    self._specialise(arrays, n_options)
        return result

    def _specialise(self, arrays, n_options):
        """Make ``self.replay`` generated code for this call's argument pattern (kept with up to
        ``MAX_PATTERNS - 1`` earlier ones): the generic loop's key, read without the loop."""
        torch_type = _TORCH_TENSOR[0]
        pattern = (tuple((_kind(x, torch_type), None if x is None else type(x)) for x in arrays),
                   n_options)
        if self._patterns and self._patterns[0] == pattern:
            return
        if pattern in self._patterns:
            self._patterns.remove(pattern)
        self._patterns.insert(0, pattern)
        del self._patterns[MAX_PATTERNS:]
        replay = OpCalls.replay.__get__(self)
        for kinds, count in reversed(self._patterns):
            source, classes = _replay_source(kinds, count)
            replay = _factory(source)(self, self.plans, replay, torch_type, *classes)
        self.replay = replay


def _replay_source(kinds, n_options):
    """Source of ``make(calls, plans, generic, T, *classes)`` returning a ``replay`` for one
    argument pattern (``kinds``: ``(kind, class)`` per argument), and those classes."""
    classes, guard, reads, key, ptrs = [], [], [], [], []
    for i, (kind, cls) in enumerate(kinds):
        x = f"x{i}"
        if kind == "torch":
            guard.append(f"type({x}) is not T")
            reads.append(f"p{i} = {x}.data_ptr()")
            key.append(f"{x}.shape, {x}.stride(), {x}.dtype, {x}.get_device(), p{i} & 31")
            ptrs.append(f"p{i}")
        elif kind is None:
            guard.append(f"{x} is not None")
            key.append("None")
            ptrs.append("0")
        else:
            c = f"C{len(classes)}"
            classes.append(cls)
            guard.append(f"type({x}) is not {c}")
            if kind == "number":
                key.append(f"{c}, {x}")
                ptrs.append("0")
            else:  # ``replay_key``'s cache read inline, else the function
                reads += [f"e = _REPLAY_KEYS.get(id({x}))",
                          f"if e is not None and e[0]() is {x}:",
                          f"    f{i} = e[1]",
                          "else:",
                          f"    f{i} = replay_key({x})",
                          f"    if f{i} is None:",
                          "        _state.pending = None",
                          "        return MISS"]
                key.append(f"f{i}[0]")
                ptrs.append(f"f{i}[1]")
    opts = [f"o{j}" for j in range(n_options)]
    key += opts + [f"type({o})" for o in opts] + ["stream is None"]
    indent = "\n" + " " * 8
    source = f"""
def make(calls, plans, generic, T, {"".join(f"C{j}, " for j in range(len(classes)))}):
    def replay(arrays, options, stream):
        if not ENABLED or _state.recorder is not None:
            return MISS
        try:
            [{", ".join(f"x{i}" for i in range(len(kinds)))}] = arrays
            [{", ".join(opts)}] = options
        except (TypeError, ValueError):
            return generic(arrays, options, stream)
        if {" or ".join(guard) or "False"}:
            return generic(arrays, options, stream)
        {indent.join(reads) or "pass"}
        key = ({", ".join(key)},)
        ptrs = [{", ".join(ptrs)}]
        last = plans.last
        try:
            same = key == last[0]
        except Exception:  # an option whose == gives no bool (an array): the lookup decides
            same = False
        if same:
            return last[1](arrays, ptrs, key, stream)
        try:
            plan = plans.get(key)
        except TypeError:  # an unhashable option: never recorded
            _state.pending = None
            return MISS
        if plan is None:
            _state.pending = (calls, key, arrays, ptrs, stream, {n_options})
            return MISS
        plans.last = (key, plan)
        return plan(arrays, ptrs, key, stream)
    return replay
"""
    return source, classes


@lru_cache(maxsize=512)
def _factory(source):
    """The ``make`` function of generated ``source`` (compiled once per distinct source: plans
    of one op share their code shape, their values come as arguments). Its functions' globals
    are this module's, read when they run."""
    namespace: dict = {}
    exec(compile(source, "<_replay generated>", "exec"), globals(), namespace)  # noqa: S102
    return namespace["make"]


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


def _capture_reader():
    """``() -> bool``: whether torch's current stream on the current device is capturing a
    CUDA graph: the C accessor behind ``torch.cuda.is_current_stream_capturing`` (one call less
    a replay), the public function where torch has no CUDA."""
    import torch

    raw = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if raw is None or not torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing
    return raw


class Plan:
    """One signature's recorded work: allocations, workspaces, launches, result; ``run``, the
    generated function ``run(arrays, ptrs, key, stream)`` that replays it.

    ``launches`` are ``PreparedLaunch.bind`` functions of the pointer sources ``bases``: the
    call's arrays' pointers (``0 .. n-1``), then the fresh allocations', then the workspaces',
    then the tensor maps' (``maps``: each the map of an argument's memory at an offset, with a
    recorded layout, found again for each replay's address).
    """

    __slots__ = ("name", "allocs", "workspaces", "own_specs", "own_device", "maps", "launches",
                 "result", "overlaps", "rechecks", "stream_source", "torch_stream", "aliases",
                 "workspace_memo", "run")

    @classmethod
    def build(cls, calls, rec, arrays, ptrs, stream, result):
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
        # pointer sources: 0..n-1 the call's arrays, then allocations, then workspaces, then maps
        bases = list(ptrs) + alloc_ptrs + ws_ptrs
        maps = []   # (argument, offset, layout, torch device)

        def map_source(buf):
            for map_buf, obj, ptr, layout, torch_device in rec.maps:
                if map_buf is buf:
                    i = find(obj, arrays)
                    if i is None:
                        return None
                    entry = (i, ptr - ptrs[i], layout, torch_device)
                    if entry not in maps:
                        maps.append(entry)
                    return (len(bases) + maps.index(entry), 0)
            return False

        def source(buf):
            found = map_source(buf)
            if found is not False:
                return found
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
        self.name = calls.name
        self.aliases = _aliases(arrays)
        self.launches = []
        self.stream_source = _stream_source(arrays, stream)
        if self.stream_source is None:
            return None
        kind, first = self.stream_source
        self.torch_stream = first if kind == "torch" else None
        if kind == "torch":
            handle = _CURRENT_STREAM[0](arrays[first].get_device())
        elif kind == "given":
            handle = stream if type(stream) is int else stream_handle(stream)
        else:
            handle = 0
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
        self.maps = tuple(maps)
        self.allocs = tuple((kind, shape, _torch_dtype(dtype) if kind == "torch" else dtype,
                             device) for _, kind, shape, dtype, device in rec.allocs)
        self.workspaces = tuple(w[1:] for w in rec.workspaces)
        # torch workspaces of their own under graph capture: one capture check a replay
        self.own_specs = tuple((name, size, dtype, own)
                               for _, name, size, dtype, kind, own in self.workspaces
                               if own and kind == "torch")
        self.own_device = next((w[0] for w in self.workspaces if w[-1] and w[4] == "torch"),
                               None)
        self.workspace_memo = [(None, None, None)]  # [(generation, stream, addresses)]
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
            rechecks.append((fn, idx))
        self.rechecks = tuple(rechecks)
        self.run = self._compile(calls, arrays)
        return self

    def _compile(self, calls, arrays):
        """``run(arrays, ptrs, key, stream)``: this plan's replay as straight-line code, its
        values (launches, sizes, allocation specs) passed in as arguments."""
        values = []

        def value(v):
            values.append(v)
            return f"v{len(values) - 1}"

        lines = []
        if self.aliases:
            same = " or ".join(f"arrays[{i}] is not arrays[{j}]" for i, j in self.aliases)
            lines += [f"if {same}:",
                      f"    return {value(calls._unaliased)}(arrays, ptrs, key, stream)"]
        for i, j, ei, ej in self.overlaps:
            if ei and ej:  # an empty array overlaps nothing
                lines += [f"if ptrs[{i}] < ptrs[{j}] + {value(ej)} and "
                          f"ptrs[{j}] < ptrs[{i}] + {value(ei)}:",
                          "    _state.pending = None",
                          "    return MISS  # the checked path raises"]
        for fn, idx in self.rechecks:
            lines.append(f"{value(fn)}({', '.join(f'arrays[{i}]' for i in idx)})")
        kind, first = self.stream_source

        def capture_test(device):
            """Source of "is this replay's stream capturing a graph" (torch ``device``)."""
            if kind == "torch" and _same_device(device, arrays[first].get_device()):
                # ``handle`` is torch's current stream there: ``capturing``'s first test
                return f"{value(_capture_reader())}()"
            return f"capturing({value(device)}, handle)"

        if kind == "torch":
            offset = sum(_WIDTH[_kind(x, _TORCH_TENSOR[0])] for x in arrays[:first])
            lines.append(f"handle = _CURRENT_STREAM[0](key[{offset + 3}])")  # its get_device()
        elif kind == "given":
            lines.append("handle = stream if type(stream) is int else stream_handle(stream)")
        else:
            lines.append("handle = 0")
        if self.maps:   # found (or made) before anything is allocated or launched
            devices = [m[3] for m in self.maps if m[3] is not None]
            lines.append(f"cap = {capture_test(devices[0]) if devices else False}")
            for k, (i, offset, layout, _) in enumerate(self.maps):
                lines += [f"mb{k} = cached_map({value(layout)}, ptrs[{i}] + {offset}, cap, handle)",
                          f"if mb{k} is None:",
                          "    _state.pending = None",
                          "    return MISS  # inside a capture, no map of this address landed yet"]
        extra = []
        for k, (akind, shape, dtype, device) in enumerate(self.allocs):
            if akind == "torch":
                lines.append(f"m{k} = _TORCH[1]({value(shape)}, dtype={value(dtype)}, "
                             f"device={value(device)})")
                extra.append(f"m{k}.data_ptr()")
            else:
                lines.append(f"m{k} = _allocate({value(akind)}, {value(shape)}, "
                             f"{value(dtype)}, {value(device)})")
                extra.append(f"device_address(m{k})")
        bases = "ptrs"
        if extra:
            bases += f" + [{', '.join(extra)}]"
        if self.workspaces:
            lines.append(f"memo = {value(self.workspace_memo)}[0]")
            test = "if"
            if self.own_specs:
                lines += [f"if {capture_test(self.own_device)}:",
                          "    ws = plan.captured_pointers(handle)"]
                test = "elif"
            lines += [f"{test} memo[0] == _workspace.GENERATION[0] and memo[1] == handle:",
                      "    ws = memo[2]",
                      "else:",
                      "    ws = plan.workspace_lookup(handle)"]
            bases += " + ws"
        if self.maps:
            bases += f" + [{', '.join(f'mb{k}.ptr' for k in range(len(self.maps)))}]"
        if bases != "ptrs":
            lines.append(f"bases = {bases}")
            bases = "bases"
        for launch in self.launches:
            lines.append(f"{value(launch)}({bases}, handle)")

        def placed(p):
            return {"arg": lambda: f"arrays[{p[1]}]", "alloc": lambda: f"m{p[1]}",
                    "none": lambda: "None"}[p[0]]()

        rkind, where = self.result
        if rkind == "one":
            lines.append(f"return {placed(where)}")
        else:
            lines.append(f"return ({''.join(placed(p) + ', ' for p in where)})")
        source = (f"\ndef make(plan, {''.join(f'v{k}, ' for k in range(len(values)))}):\n"
                  "    def run(arrays, ptrs, key, stream):\n"
                  + "".join(f"        {line}\n" for line in lines)
                  + "    return run\n")
        return _factory(source)(self, *values)

    def workspace_lookup(self, handle):
        """The shared workspaces' addresses on stream ``handle``, kept for later replays while
        no shared workspace is made or replaced (``_workspace.GENERATION``)."""
        found = [workspace_pointer(kind, device, handle, name, size, dtype, own_in_graph)
                 for device, name, size, dtype, kind, own_in_graph in self.workspaces]
        # a lookup may have made a workspace (a new stream): read the generation after it
        self.workspace_memo[0] = (_workspace.GENERATION[0], handle, found)
        return found

    def captured_pointers(self, handle):
        """The workspaces' addresses under graph capture: ``own_in_graph`` ones are the captured
        call's own (made now)."""
        own = iter(own_in_graph_pointers(self.own_device, handle, self.own_specs))
        return [next(own) if own_in_graph and kind == "torch"
                else workspace_pointer(kind, device, handle, name, size, dtype)
                for device, name, size, dtype, kind, own_in_graph in self.workspaces]


def _same_device(index, device):
    """Whether a workspace's device ``index`` (``torch.device.index``) is the device whose
    ``get_device()`` is ``device`` (a CPU tensor's: None and -1)."""
    return index == device or (index is None and device == -1)


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
