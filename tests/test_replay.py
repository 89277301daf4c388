"""The repeated-call fast path (``_replay``, ``_recording``) on a fake op, without a GPU.

The fake op below is built as the real ones are: ``OpCalls.replay`` first, else
``OpCalls.record`` of a checked path that validates, builds ``Buffer``s of its arrays and
"launches" (noting the launch for the recorder, as ``Kernel.__call__`` does). Caller arrays are
CPU torch tensors; ``PreparedLaunch`` is replaced by ``FakeLaunch``, which logs what a replayed
launch received instead of calling the driver, and torch's current stream by a number the tests
set. Both paths log to ``LAUNCHES``, so a replay can be compared with what the checked path
launches for the same arrays (``checked``).
"""

import weakref
from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmspeed_numba import _arrays, _checks, _recording, _replay, _tensor_map, _workspace
from llmspeed_numba._arrays import Buffer, Tensor
from llmspeed_numba._launch import pointer_patch


class Launch(NamedTuple):
    path: str        # "checked" or "replayed"
    grid: tuple
    block: tuple
    pointers: list   # the Buffer parameters' addresses, in order
    scalars: list    # the other parameters
    stream: int


LAUNCHES = []          # every launch of the fake op, by either path
RUNS = []              # the x of every run of the checked path
CURRENT_STREAM = [0]   # torch's "current stream" (``_replay._CURRENT_STREAM`` patched)
CAPTURING = [False]    # whether a graph capture is under way (``_replay.capturing`` patched)
MAP_LAYOUT = (0, 8, 8, 8, 4, 8, 8, 0)   # a tensor map's layout (``_tensor_map.device_map``)
MAPS_MADE = []         # the addresses the fake map maker was asked for, in order
TABLE = torch.arange(4, dtype=torch.float32)   # kept for the process: may be baked in
STRAY = torch.zeros(4)                          # memory the recorder is not told about
F32 = np.dtype(np.float32)
DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class FakeLaunch:
    """``PreparedLaunch``'s interface: packed once, then bound to each buffer's pointer source
    and called with each replay's pointer bases. The pointers go through ``pointer_patch``, the
    code a real bound launch runs, into a parameter block laid out as ``PreparedLaunch``'s (a
    buffer's pointer is word 4 of its seven)."""

    def __init__(self, kernel, grid, block, args, shared):
        self.grid, self.block = grid, block
        self.scalars = [a for a in args if not isinstance(a, Buffer)]
        self.recorded = [a.ptr for a in args if isinstance(a, Buffer)]

    def bind(self, sources):
        words = [7 * k + 4 for k in range(len(sources))]
        patch = pointer_patch([(w, i, off) for w, (i, off) in zip(words, sources) if i >= 0])

        def launch(bases, stream):
            values = [None] * (7 * len(sources))
            for w, ptr in zip(words, self.recorded):  # the template's recorded pointers
                values[w] = ptr
            patch(values, bases)
            LAUNCHES.append(Launch("replayed", self.grid, self.block, [values[w] for w in words],
                                   self.scalars, stream))

        return launch


class DeviceArray:
    """A replayable array that is not a torch tensor (as a numba device array is)."""

    def __init__(self, t):
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    def data_ptr(self):
        return self.t.data_ptr()

    def element_size(self):
        return self.t.element_size()


# ---- the fake op ------------------------------------------------------------------------------

FAKE = _replay.OpCalls("fake")


def fake_op(x, y=None, *, scale=1.0, out=None, table=None, check=None, sync=False, pair=False,
            stream=0):
    """"out = x * scale (+ y)": allocates ``out`` when not given; returns it, or ``(out, None)``
    with ``pair`` (None with ``pair="none"``). ``table``: "persistent", "stray" or "ownerless" also hands the kernel such
    memory, "null" a null pointer, "workspace" / "private" a ``_workspace`` (private: with
    ``own_in_graph``); ``check(x)``: a data check repeated on replays; ``sync``: reads device data on the host."""
    result = FAKE.replay((x, y, out), (scale, table, check, sync, pair), stream)
    if result is _replay.MISS:
        result = FAKE.record(_fake_checked, x, y, scale, out, table, check, sync, pair, stream)
    return result


def _fake_checked(x, y, scale, out, table, check, sync, pair, stream):
    RUNS.append(x)
    if x.dtype not in DTYPES:
        raise TypeError(f"x: unsupported dtype {x.dtype}")
    n = x.shape[0]
    if out is None:
        out = torch.empty(n, dtype=x.dtype)
        _recording.note_alloc(out, "torch", (n,), DTYPES[x.dtype])  # as _arrays.empty does
    else:
        _checks.no_overlap("out", _tensor(out), "x", _tensor(x))
    if sync:
        _recording.not_replayable("reads x on the host")
    if check is not None:
        check(x)
        _recording.recheck(check, x)
    args = [_buffer(x), _buffer(x, 1), _buffer(out)]
    if y is not None:
        args.append(_buffer(y))
    if table == "persistent":
        _recording.note_persistent(TABLE)
        args.append(_buffer(TABLE))
    elif table == "stray":
        args.append(_buffer(STRAY))
    elif table == "null":
        args.append(Buffer(0, 1, F32))
    elif table == "ownerless":
        args.append(Buffer(STRAY.data_ptr(), 4, F32))
    elif table in ("map", "maps"):   # as tensor_map_2d hands a kernel maps (none made in a
        #                               capture); "maps": of x and of y, the same layout
        for a in (x, y) if table == "maps" else (x,):
            found = _tensor_map.device_map(a, a.data_ptr(), MAP_LAYOUT, 0, not CAPTURING[0])
            args.append(found or Buffer(0, 1, F32))
    handle = _stream(stream, x, y)
    if table in ("workspace", "private"):
        args.append(_workspace.workspace(_tensor(x), handle, "fake", n + 4, F32,
                                         own_in_graph=table == "private"))
    _launch((-(-n // 32), 1, 1), (32, 1, 1), args + [n, scale], handle)
    _launch((1, 1, 1), (1, 1, 1), [_buffer(out)], handle)  # a second kernel: "the epilogue"
    if pair == "none":  # an op working in place returns None
        return None
    return (out, None) if pair else out


def _tensor(t):
    return Tensor(t, "torch", t.data_ptr(), t.shape, t.stride(), DTYPES[t.dtype])


def _buffer(t, offset=0):
    return Buffer(t.data_ptr() + offset * t.element_size(), t.shape[0] - offset, F32, owner=t)


def _stream(stream, *arrays):
    """``stream_handle``'s rule: the given stream; else torch's current one when the op's arrays
    include a torch tensor; else the default stream."""
    if stream is not None:
        return stream
    return CURRENT_STREAM[0] if any(type(a) is torch.Tensor for a in arrays) else 0


def _launch(grid, block, args, stream):
    """``Kernel.__call__``: noted while recording, then "launched"."""
    if _recording.recording() is not None:
        _recording.note_launch("fake_kernel", grid, block, args, stream, 0)
    LAUNCHES.append(Launch("checked", grid, block, [a.ptr for a in args if isinstance(a, Buffer)],
                           [a for a in args if not isinstance(a, Buffer)], stream))


# ---- helpers ----------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def fast_path(monkeypatch):
    monkeypatch.setattr(_replay, "ENABLED", True)  # off under the simulator
    monkeypatch.setattr(_replay, "PreparedLaunch", FakeLaunch)
    _replay._torch()  # as a first call with a torch tensor first does
    monkeypatch.setattr(_replay, "_CURRENT_STREAM", [lambda device: CURRENT_STREAM[0]])
    FAKE.plans.clear()
    LAUNCHES.clear()
    RUNS.clear()
    CURRENT_STREAM[0] = 0
    yield monkeypatch
    FAKE.plans.clear()


def vec(n=8, dtype=torch.float32, offset=0):
    """A fresh 1-D tensor whose data starts ``offset`` elements past a 64-byte boundary."""
    base = torch.randn(n + offset + 16, dtype=dtype)
    start = (-base.data_ptr() % 64) // base.element_size() + offset
    return base[start:start + n]


def launched(fn):
    """``fn()``'s result and the launches it made."""
    start = len(LAUNCHES)
    result = fn()
    return result, LAUNCHES[start:]


def checked(fn, monkeypatch):
    """What ``fn()`` launches with the fast path off (``work``): what a replay must launch."""
    with monkeypatch.context() as m:
        m.setattr(_replay, "ENABLED", False)
        _, launches = launched(fn)
    assert {launch.path for launch in launches} == {"checked"}
    return work(launches)


def work(launches):
    """The launches without the path that made them."""
    return [launch[1:] for launch in launches]


def replayed(fn):
    """Run ``fn()``, which must replay (the checked path not run); its result and launches."""
    runs = len(RUNS)
    result, launches = launched(fn)
    assert len(RUNS) == runs, "the call took the checked path"
    assert launches and {launch.path for launch in launches} == {"replayed"}
    return result, launches


# ---- tests ------------------------------------------------------------------------------------

def test_first_call_records_and_new_arrays_replay_with_their_pointers(fast_path):
    x, out = vec(), vec()
    assert fake_op(x, out=out) is out
    assert len(RUNS) == 1 and RUNS[0] is x and len(FAKE.plans) == 1

    x2, out2 = vec(), vec()
    result, launches = replayed(lambda: fake_op(x2, out=out2))
    assert result is out2
    assert [launch.pointers for launch in launches] == [
        [x2.data_ptr(), x2.data_ptr() + 4, out2.data_ptr()], [out2.data_ptr()]]
    assert work(launches) == checked(lambda: fake_op(x2, out=out2), fast_path)


def call(n=8, dtype=torch.float32, offset=0, y=False, **options):
    return fake_op(vec(n, dtype, offset), vec(n, dtype) if y else None, out=vec(n, dtype),
                   **options)


@pytest.mark.parametrize("first, second", [
    (lambda: call(), lambda: call(n=16)),                        # shape
    (lambda: call(), lambda: call(dtype=torch.float64)),         # dtype
    (lambda: call(), lambda: call(y=True)),                      # an optional array given
    (lambda: call(scale=1.0), lambda: call(scale=2.0)),          # an option's value
    (lambda: call(scale=1), lambda: call(scale=True)),           # its type (1 == True)
    (lambda: call(scale=1), lambda: call(scale=1.0)),
    (lambda: call(), lambda: call(offset=1)),                    # alignment (low address bits)
    (lambda: call(stream=0), lambda: call(stream=None)),         # a stream given or not
], ids=["shape", "dtype", "optional array", "option value", "True vs 1", "1 vs 1.0",
        "alignment", "stream None"])
def test_a_different_signature_misses_and_records_anew(first, second):
    first()
    assert len(RUNS) == 1 and len(FAKE.plans) == 1
    second()
    assert len(RUNS) == 2 and len(FAKE.plans) == 2
    replayed(second)
    replayed(first)


def test_a_given_stream_replays_on_each_calls_stream_and_none_on_the_current_one(fast_path):
    call(stream=5)
    _, launches = replayed(lambda: call(stream=9))
    assert [launch.stream for launch in launches] == [9, 9]
    call(stream=None)                        # recorded on the current stream, 0
    CURRENT_STREAM[0] = 7
    _, launches = replayed(lambda: call(stream=None))
    assert [launch.stream for launch in launches] == [7, 7]


def test_an_unhashable_option_is_never_recorded():
    call(scale=[1.0])
    call(scale=[1.0])
    assert len(RUNS) == 2 and not FAKE.plans


def test_a_call_marked_not_replayable_is_not_recorded():
    call(sync=True)
    call(sync=True)
    assert len(RUNS) == 2 and not FAKE.plans


def test_a_recorded_overlap_check_sends_overlapping_arrays_to_the_checked_path():
    call()                                   # recorded: out and x must not overlap
    buf = vec(16)
    replayed(lambda: fake_op(buf[:8], out=buf[8:]))  # adjacent: disjoint
    with pytest.raises(ValueError, match="does not overlap x"):
        fake_op(buf[:8], out=buf[:8])        # the same layout and alignment, one memory
    assert len(RUNS) == 2                    # raised by the checked path


def test_results_map_to_the_calls_arrays_and_fresh_allocations():
    first = fake_op(vec())                   # allocates out
    second, launches = replayed(lambda: fake_op(vec()))
    assert second is not first and second.shape == (8,) and second.dtype == torch.float32
    assert launches[0].pointers[2] == launches[1].pointers[0] == second.data_ptr()

    fake_op(vec(), pair=True)
    (out, none), launches = replayed(lambda: fake_op(vec(), pair=True))
    assert none is None and launches[1].pointers == [out.data_ptr()]
    out2 = vec()
    fake_op(vec(), out=vec(), pair=True)
    (out, none), _ = replayed(lambda: fake_op(vec(), out=out2, pair=True))
    assert out is out2 and none is None
    fake_op(vec(), out=vec(), pair="none", stream=None)
    result, _ = replayed(lambda: fake_op(vec(), out=out2, pair="none", stream=None))
    assert result is None
    fake_op(vec(), out=out2, stream=None)    # a plain plan: out= returned
    result, _ = replayed(lambda: fake_op(vec(), out=out2, stream=None))
    assert result is out2


def test_persistent_memory_is_baked_in_and_memory_of_unknown_owner_is_not_recorded():
    call(table="persistent")
    _, launches = replayed(lambda: call(table="persistent"))
    assert launches[0].pointers[-1] == TABLE.data_ptr()
    call(table="stray")
    call(table="stray")
    assert len(RUNS) == 3 and len(FAKE.plans) == 1


def test_rechecks_run_on_every_replay_with_that_calls_arrays():
    seen = []

    def check(x):
        seen.append(x)
        if x[0] < 0:
            raise ValueError("x: expected x[0] >= 0")

    def run(x):
        return fake_op(x, out=vec(), check=check)

    x = vec().abs()
    run(x)
    assert len(seen) == 1 and seen[0] is x   # by the checked path
    x2 = vec().abs()
    replayed(lambda: run(x2))
    assert seen[-1] is x2
    x3 = vec()
    x3[0] = -1.0
    with pytest.raises(ValueError, match=r"x\[0\] >= 0"):
        run(x3)
    assert seen[-1] is x3 and len(RUNS) == 1  # raised by the replay, nothing launched
    assert len(LAUNCHES) == 4


def test_clear_forgets_every_plan():
    call()
    _recording.clear()
    assert not FAKE.plans
    call()
    assert len(RUNS) == 2


def test_plans_are_bounded(fast_path):
    fast_path.setattr(_replay, "MAX_PLANS", 3)
    for scale in range(10):
        call(scale=float(scale))
        assert 1 <= len(FAKE.plans) <= 3
    replayed(lambda: call(scale=9.0))


def test_one_array_in_two_positions_is_part_of_the_signature(fast_path):
    x = vec()
    fake_op(x, x, out=vec())                 # y is x: recorded with one array in two places
    x2, y2, out2 = vec(), vec(), vec()
    result = fake_op(x2, y2, out=out2)       # distinct arrays: must read y2, not x2 twice (here
                                             # through the checked path, recording their plan)
    assert result is out2
    assert LAUNCHES[-2].pointers[3] == y2.data_ptr()
    assert work(LAUNCHES[-2:]) == checked(lambda: fake_op(x2, y2, out=out2), fast_path)
    replayed(lambda: fake_op(x2, y2, out=out2))  # recorded too
    x3 = vec()
    _, launches = replayed(lambda: fake_op(x3, x3, out=vec()))  # the aliased plan still serves
    assert launches[0].pointers[3] == x3.data_ptr()


def test_a_plan_without_aliasing_serves_aliased_calls():
    call(y=True)
    x = vec()
    _, launches = replayed(lambda: fake_op(x, x, out=vec()))
    assert launches[0].pointers[0] == launches[0].pointers[3] == x.data_ptr()


def test_mixed_array_kinds_without_a_stream_are_not_recorded(fast_path):
    """Which array's stream the op takes is the op's business: with torch's current stream the
    default one at the first call, a replay could not tell it from the default stream."""
    fast_path.setattr(_replay, "replay_key", lambda a: (
        (("device", a.shape, a.dtype), a.data_ptr()) if type(a) is DeviceArray else None))
    fake_op(DeviceArray(vec()), vec(), stream=None)
    CURRENT_STREAM[0] = 7
    _, launches = launched(lambda: fake_op(DeviceArray(vec()), vec(), stream=None))
    assert [launch.stream for launch in launches] == [7, 7]
    fake_op(DeviceArray(vec()), None, stream=None)   # one kind: the default stream
    replayed(lambda: fake_op(DeviceArray(vec()), None, stream=None))
    fake_op(DeviceArray(vec()), vec(), stream=3)     # mixed, with a stream
    replayed(lambda: fake_op(DeviceArray(vec()), vec(), stream=3))


def test_pointer_patch_writes_each_target_once():
    for targets in ([], [(4, 0, 0)], [(4, 2, 0), (11, 0, 16), (18, 2, 8)]):
        values = [None] * 20
        pointer_patch(targets)(values, [1000, 2000, 3000])
        want = [None] * 20
        for word, i, offset in targets:
            want[word] = [1000, 2000, 3000][i] + offset
        assert values == want


def test_programmatic_launch_config_carries_the_driver_attribute():
    """``CUlaunchConfig`` of a programmatic kernel: one ``CUlaunchAttribute`` (72 bytes: id,
    padding, 64-byte value) with id 6 (PROGRAMMATIC_STREAM_SERIALIZATION) and value 1; a plain
    kernel's carries none. The knob gates the variants."""
    import ctypes

    from llmspeed_numba import _launch
    from llmspeed_numba._overrides import overrides

    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    config = _launch._launch_config(True, (2, 1, 1), (64, 1, 1), 0)
    assert config.num_attrs == 1 and tuple(config.grid) == (2, 1, 1)
    attr = _launch._LaunchAttribute.from_address(config.attrs)
    assert (attr.id, attr.value) == (6, 1)
    assert _launch._launch_config(False).num_attrs == 0 and not _launch._launch_config(False).attrs
    assert not _launch.programmatic_launch()
    with overrides(launch={"programmatic": True}):
        assert _launch.programmatic_launch() == (
            _launch.SIMULATOR or _launch.cuda.get_current_device().compute_capability >= (9, 0))


def test_a_null_pointer_is_a_constant_and_memory_of_no_owner_is_not_recorded():
    call(table="null")
    _, launches = replayed(lambda: call(table="null"))
    assert launches[0].pointers[-1] == 0
    runs = len(RUNS)
    call(table="ownerless")
    call(table="ownerless")
    assert len(RUNS) == runs + 2 and len(FAKE.plans) == 1


@pytest.fixture
def workspaces(fast_path):
    """``_workspace`` as on a GPU (torch CPU tensors as its buffers), no capture unless a test
    sets ``CAPTURING``; restored afterwards."""
    fast_path.setattr(_workspace, "SIMULATOR", False)
    fast_path.setattr(_workspace, "_make", lambda kind, device, stream, n, dtype: torch.zeros(
        n, dtype={4: torch.int32, 8: torch.int64}[np.dtype(dtype).itemsize]))
    fast_path.setattr(_workspace, "_WORKSPACE", {})
    fast_path.setattr(_workspace, "_PROCESS", _workspace.GraphWorkspaces())
    capturing = lambda device, stream: CAPTURING[0]  # noqa: E731
    fast_path.setattr(_workspace, "capturing", capturing)
    fast_path.setattr(_replay, "capturing", capturing)
    CAPTURING[0] = False
    return fast_path


CAPTURING = [False]


def _workspace_of(stream):
    return _workspace._WORKSPACE[(None, stream, "fake")]


def test_a_replay_finds_a_replaced_or_new_streams_workspace(workspaces):
    call(table="workspace", stream=1)
    _, launches = replayed(lambda: call(table="workspace", stream=1))
    assert launches[0].pointers[-1] == _workspace_of(1).data_ptr()
    # another op grows the workspace: it is replaced, and the next replay follows
    _workspace.workspace(_tensor(vec()), 1, "fake", 100_000, F32)
    _, launches = replayed(lambda: call(table="workspace", stream=1))
    assert launches[0].pointers[-1] == _workspace_of(1).data_ptr()
    assert _workspace_of(1).shape[0] >= 100_000
    _, launches = replayed(lambda: call(table="workspace", stream=2))  # a stream of its own
    assert launches[0].pointers[-1] == _workspace_of(2).data_ptr() != _workspace_of(1).data_ptr()
    _, launches = replayed(lambda: call(table="workspace", stream=1))
    assert launches[0].pointers[-1] == _workspace_of(1).data_ptr()


def test_a_private_workspace_is_fresh_and_zeroed_in_each_captured_call(workspaces):
    call(table="private", stream=1)              # eager: the stream's shared workspace
    _, launches = replayed(lambda: call(table="private", stream=1))
    assert launches[0].pointers[-1] == _workspace_of(1).data_ptr()
    CAPTURING[0] = True
    seen = set()
    for _ in range(3):
        _, launches = replayed(lambda: call(table="private", stream=1))
        private = _workspace.captured_buffers()[-1][1]
        assert launches[0].pointers[-1] == private.data_ptr() not in seen
        assert private.shape[0] >= 12 and not private.any()
        seen.add(private.data_ptr())
    assert len(_workspace.captured_buffers()) == 3
    CAPTURING[0] = False
    _, launches = replayed(lambda: call(table="private", stream=1))
    assert launches[0].pointers[-1] == _workspace_of(1).data_ptr()


def test_workspaces_captured_inside_graph_owned_are_freed_with_their_owner(workspaces):
    import gc
    import weakref

    call(table="private", stream=1)              # eager: records the call
    CAPTURING[0] = True
    with _workspace.graph_owned() as owned:
        _, launches = replayed(lambda: call(table="private", stream=1))
        # a graph's own buffer ("graph"): one a capture id, kept by the owner too
        workspaces.setattr(_workspace, "capture_id", lambda stream: 77)
        per_graph = _workspace.workspace(_tensor(vec()), 1, "fake_graph", 16, F32, "graph")
    private = owned.buffers[0][1]
    assert launches[0].pointers[-1] == private.data_ptr()
    assert owned.per_graph[(None, 1, "fake_graph", 77)] is per_graph.owner
    assert {id(b) for _, b in _workspace.captured_buffers()} == {id(private), id(per_graph.owner)}
    assert _workspace._PROCESS.buffers == []     # not the process's to keep
    _, launches = replayed(lambda: call(table="private", stream=1))  # outside: the process's
    assert len(_workspace._PROCESS.buffers) == 1
    freed = [weakref.ref(private), weakref.ref(per_graph.owner)]
    del owned, private, per_graph
    gc.collect()
    assert [ref() for ref in freed] == [None, None]
    assert len(_workspace.captured_buffers()) == 1


class NumbaLike:
    """What ``replay_key`` reads of a numba device array."""

    __module__ = "numba.fake"

    def __init__(self, n):
        self.host = np.zeros(n, np.float32)
        self.shape, self.strides, self.dtype = self.host.shape, self.host.strides, self.host.dtype

    @property
    def device_ctypes_pointer(self):
        return self.host.ctypes.data


def test_a_numba_arrays_key_is_read_once_and_forgotten_with_it(monkeypatch):
    monkeypatch.setattr(_arrays, "SIMULATOR", False)
    monkeypatch.setattr(_arrays, "require_cuda", lambda: None)
    a, b = NumbaLike(8), NumbaLike(16)
    key_a = _arrays.replay_key(a)
    assert key_a[1] == a.host.ctypes.data and key_a[0][1] == (8,)
    assert key_a[0][-1] == a.host.ctypes.data & 31
    a.shape = (99,)                       # a numba array never changes: read once
    assert _arrays.replay_key(a) is key_a
    assert _arrays.replay_key(b)[0][1] == (16,)
    assert _arrays.as_tensor(a, "a").shape == (8,)    # the checked path's cached read too
    ident, alive = id(a), weakref.ref(a)
    del a                                 # neither cache keeps the array alive
    assert alive() is None and ident not in _arrays._REPLAY_KEYS


# ---- tensor maps --------------------------------------------------------------------------------

@pytest.fixture
def maps(monkeypatch):
    """Replayable tensor maps with a fake maker: the map of address p is a Buffer at p + 1."""
    def new_map(ptr, layout, stream):
        assert layout == MAP_LAYOUT
        MAPS_MADE.append(ptr)
        return Buffer(ptr + 1, 16, np.dtype(np.uint64),
                      owner=_tensor_map.MapSlot(None, stream, None))

    monkeypatch.setattr(_tensor_map, "REPLAY_MAPS", True)
    monkeypatch.setattr(_tensor_map, "_new_map", new_map)
    monkeypatch.setattr(_tensor_map, "_DEVICE_MAPS", _tensor_map.MapCache(16))
    monkeypatch.setattr(_replay, "capturing", lambda device, stream: CAPTURING[0])
    MAPS_MADE.clear()
    CAPTURING[0] = False
    yield _tensor_map._DEVICE_MAPS
    CAPTURING[0] = False


def test_a_call_with_tensor_maps_replays_with_the_maps_of_its_own_addresses(maps, fast_path):
    x1, x2, out = vec(), vec(), vec()
    fake_op(x1, table="map", out=out)                          # recorded; x1's map made
    _, launches = replayed(lambda: fake_op(x2, table="map", out=out))   # x2's, by the replay
    assert MAPS_MADE == [x1.data_ptr(), x2.data_ptr()]
    assert launches[0].pointers[3] == x2.data_ptr() + 1
    assert work(launches) == checked(lambda: fake_op(x2, table="map", out=out), fast_path)
    _, launches = replayed(lambda: fake_op(x1, table="map", out=out))   # x1's found again
    assert launches[0].pointers[3] == x1.data_ptr() + 1 and len(MAPS_MADE) == 2


def test_inside_a_capture_a_replay_pins_the_maps_it_finds_and_makes_none(maps):
    x1, x2 = vec(), vec()
    fake_op(x1, table="map")
    CAPTURING[0] = True
    _, launches = replayed(lambda: fake_op(x1, table="map"))
    assert launches[0].pointers[3] == x1.data_ptr() + 1
    assert list(maps.pinned) == [(x1.data_ptr(),) + MAP_LAYOUT]   # the graph reads it for good
    runs = len(RUNS)
    fake_op(x2, table="map")            # no map of x2 yet, none can be made: the checked path
    assert len(RUNS) == runs + 1 and MAPS_MADE == [x1.data_ptr()]


def test_without_replay_maps_a_call_with_a_map_is_not_recorded(maps, monkeypatch):
    monkeypatch.setattr(_tensor_map, "REPLAY_MAPS", False)
    fake_op(vec(), table="map")
    runs = len(RUNS)
    fake_op(vec(), table="map")
    assert len(RUNS) == runs + 1


def test_two_arguments_at_one_address_keep_their_own_maps(maps):
    """x and another view of its memory share one cached map; a plan recorded so must still
    give each map parameter its own argument's map when a later call's arrays differ."""
    x, out = vec(), vec()
    fake_op(x, x[:], table="maps", out=out)       # two objects, one address: one cached map
    a, b = vec(), vec()
    _, launches = replayed(lambda: fake_op(a, b, table="maps", out=out))
    assert launches[0].pointers[4:6] == [a.data_ptr() + 1, b.data_ptr() + 1]
