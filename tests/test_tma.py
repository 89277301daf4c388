"""Tensor maps and the TMA copy (``_tensor_map.tensor_map_2d``, ``ptx.cp_async_bulk_tensor_2d_g2s``,
through ``ops/tma_stage.py``'s mbarrier ring): every box of a random matrix comes back exactly,
swizzled and read back, with the elements past the matrix's edges zero; a strided (sliced)
matrix; the ring wrapping over several phases per stage; the map's input checks. The GPU cases
check the driver's encoding and the hardware copy on larger matrices over many blocks.
"""

import contextlib
import gc
import weakref

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR, have_gpu
from llmspeed_numba._arrays import as_tensor
from llmspeed_numba._tensor_map import tensor_map_2d
from llmspeed_numba.ops import tma_stage

POISON = 0xBEEF

gpu = pytest.mark.skipif(SIMULATOR or not have_gpu(),
                         reason="needs a CUDA GPU: part of the GPU suite (pytest -m gpu)")


def _device(a):
    if SIMULATOR:
        return a
    from numba import cuda

    return cuda.to_device(a)


def _expected_boxes(src, box_rows):
    rows, cols = src.shape
    by, bx = tma_stage.box_grid(rows, cols, box_rows)
    padded = np.zeros((by * box_rows, bx * tma_stage.BOX_COLS), src.dtype)
    padded[:rows, :cols] = src
    return padded.reshape(by, box_rows, bx, tma_stage.BOX_COLS).transpose(0, 2, 1, 3).reshape(
        by * bx, box_rows * tma_stage.BOX_COLS)


def _copy_boxes(src_device, shape, box_rows, stages, consumer_warps, grid):
    rows, cols = shape
    tmap = tensor_map_2d(as_tensor(src_device, "src"), box_rows, tma_stage.BOX_COLS)
    by, bx = tma_stage.box_grid(rows, cols, box_rows)
    boxes = _device(np.full(by * bx * box_rows * tma_stage.BOX_COLS, POISON, np.uint16))
    kernel = tma_stage.staging_kernel(box_rows, stages, consumer_warps)
    if not SIMULATOR:   # the GPU's map: a Buffer in a chunk of maps; the dispatcher takes arrays
        chunk = tmap.owner.chunk
        first = (tmap.ptr - chunk.device_ptr) // 8
        tmap = chunk.device[first:first + tmap.size]
    kernel[grid, tma_stage.threads_for(consumer_warps)](tmap, boxes, np.int32(bx),
                                                        np.int32(by * bx))
    out = boxes if SIMULATOR else boxes.copy_to_host()
    return out.reshape(by * bx, box_rows * tma_stage.BOX_COLS)


def _assert_boxes(got, expected):
    wrong = np.argwhere(got != expected)
    assert wrong.size == 0, (f"{len(wrong)} of {expected.size} elements differ, first (box, "
                             f"element) {wrong[:4].tolist()}: got {got[tuple(wrong[0])]}, "
                             f"expected {expected[tuple(wrong[0])]}")


def _check_random_boxes(case, rng):
    rows, cols, box_rows, stages, warps, grid = case
    src = rng.integers(0, 2**16, (rows, cols), dtype=np.uint16)
    got = _copy_boxes(_device(src), src.shape, box_rows, stages, warps, grid)
    _assert_boxes(got, _expected_boxes(src, box_rows))


# (rows, cols, box_rows, stages, consumer warps, grid)
SIM_CASES = [
    (37, 152, 16, 2, 2, 2),    # ragged in both dimensions: zero fill; 9 boxes over 2 stages
    (8, 64, 8, 2, 1, 1),       # one whole box
    (70, 64, 8, 3, 1, 1),      # 9 boxes, one block: each stage through three phases
]
GPU_CASES = [
    (4096, 4096, 64, 4, 4, 132),
    (1000, 1000, 128, 3, 8, 64),
    (37, 152, 16, 2, 2, 2),
]


@pytest.mark.skipif(not SIMULATOR, reason="simulator cases (the GPU ones: test_gpu_tma_boxes)")
@pytest.mark.parametrize("case", SIM_CASES, ids=str)
def test_tma_boxes(case, rng):
    _check_random_boxes(case, rng)


@pytest.mark.skipif(not SIMULATOR, reason="simulator case (the GPU one is test_gpu_tma_strided)")
def test_tma_strided_rows(rng):
    """A column slice of a wider matrix: the map's row stride is the parent's."""
    parent = rng.integers(0, 2**16, (24, 200), dtype=np.uint16)
    src = parent[:, 8:8 + 96]
    got = _copy_boxes(src, src.shape, 8, 2, 1, 1)
    _assert_boxes(got, _expected_boxes(np.ascontiguousarray(src), 8))


def test_tensor_map_input_checks():
    a = _device(np.zeros((16, 64), np.uint16))
    t = as_tensor(a, "a")
    with pytest.raises(ValueError, match="box: a row must be"):
        tensor_map_2d(t, 8, 32)                 # 64-byte rows with the 128-byte swizzle
    with pytest.raises(ValueError, match="box: expected 1-256"):
        tensor_map_2d(t, 512, 64)
    with pytest.raises(ValueError, match="swizzle"):
        tensor_map_2d(t, 8, 64, swizzle=64)
    with pytest.raises(ValueError, match="2-D"):
        tensor_map_2d(as_tensor(_device(np.zeros(64, np.uint16)), "v"), 8, 64)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        tensor_map_2d(as_tensor(_device(np.zeros((16, 60), np.uint16)), "odd"), 8, 64)
    with pytest.raises(ValueError, match="box_rows: expected a multiple of 8"):
        tma_stage.staging_kernel_fn(12, 2, 1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_tma_boxes(case, rng):
    _check_random_boxes(case, rng)


@pytest.mark.gpu
@gpu
def test_gpu_tma_strided(rng):
    from numba import cuda

    host = rng.integers(0, 2**16, (300, 512), dtype=np.uint16)
    src = cuda.to_device(host)[:, 64:64 + 320]
    got = _copy_boxes(src, src.shape, 32, 2, 4, 16)
    _assert_boxes(got, _expected_boxes(host[:, 64:64 + 320], 32))


def test_map_cache_drops_the_least_recently_used_and_keeps_pinned_maps():
    """Device maps stay bounded (a server's varlen totals change every step): past the capacity
    the least recently used map goes; a map looked up during a graph capture (``pin``) stays for
    good, since the captured graph keeps reading its buffer."""
    from llmspeed_numba._tensor_map import MapCache

    made = []

    def maker(key):
        def make(asked, stream):
            assert asked == key and stream == 0
            made.append(key)
            return f"map {key}"
        return make

    cache = MapCache(3)
    for key in "abc":
        assert cache.get(key, maker(key), pin=False) == f"map {key}"
    assert cache.get("a", maker("a"), pin=False) == "map a"   # a hit refreshes "a"
    cache.get("d", maker("d"), pin=False)                      # drops "b", the oldest
    assert made == list("abcd") and len(cache) == 3
    assert cache.get("b", None, pin=False) is None             # gone; not made without make
    assert cache.get("c", None, pin=True) == "map c"           # found during a capture: pinned
    for key in "efgh":
        cache.get(key, maker(key), pin=False)
    assert cache.get("c", None, pin=False) == "map c"          # outlived four newer maps
    assert cache.get("a", None, pin=False) is None
    assert len(cache) == 4 and made == list("abcdefgh")


# ---- maps made on the call's stream (the device half, on a fake driver) -------------------------

LAYOUT = (0, 64, 64, 64, 2, 64, 64, 128)   # (device, rows, cols, row stride, item, box, swizzle)


class _FakeChunk:
    """``_tensor_map._Chunk`` without a GPU: numpy halves, made-up addresses."""
    made = 0

    def __init__(self):
        from llmspeed_numba import _tensor_map

        _FakeChunk.made += 1
        self.device = np.zeros(_tensor_map.CHUNK_MAPS * _tensor_map.MAP_WORDS, np.uint64)
        self.host = np.zeros_like(self.device)
        self.device_ptr = 0x10000 * _FakeChunk.made
        self.host_ptr = 0x90000000 + 0x10000 * _FakeChunk.made
        self.used = 0


_CAPTURING = set()   # streams the fake driver says are being captured


@pytest.fixture
def fake_driver(monkeypatch):
    """Every driver call of the map upload logged as ``(name, args)``; ``DONE`` holds the events
    whose work has completed; ``CAPTURE_MODE`` the thread's mode while a call ran."""
    from llmspeed_numba import _driver, _tensor_map

    calls, done, mode, capturing = [], set(), ["global"], _CAPTURING
    capturing.clear()
    events = iter(range(1000, 2000))

    @contextlib.contextmanager
    def relaxed():
        mode[0] = "relaxed"
        yield
        mode[0] = "global"

    def log(name, result=None):
        def fn(*args):
            calls.append((name, args, mode[0]))
            return result(*args) if result else None
        return fn

    monkeypatch.setattr(_driver, "stream_capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(_driver, "copy_to_device_async", log("copy"))
    monkeypatch.setattr(_driver, "new_event", log("new_event", lambda: next(events)))
    monkeypatch.setattr(_driver, "record_event", log("record"))
    monkeypatch.setattr(_driver, "event_done", log("query", lambda e: e in done))
    monkeypatch.setattr(_driver, "destroy_event", log("destroy"))
    monkeypatch.setattr(_driver, "stream_wait_event", log("wait"))
    monkeypatch.setattr(_driver, "relaxed_capture_mode", relaxed)
    monkeypatch.setattr(_tensor_map, "_Chunk", _FakeChunk)
    monkeypatch.setattr(_tensor_map, "_CHUNKS", {})
    monkeypatch.setattr(_tensor_map, "_DEVICE_MAPS", _tensor_map.MapCache(1024))
    monkeypatch.setattr(_tensor_map, "_encode",
                        lambda ptr, *rest: np.arange(16, dtype=np.uint64) + np.uint64(ptr))
    return calls, done


def test_a_new_map_is_copied_on_its_calls_stream_from_its_own_pinned_slot(fake_driver):
    from llmspeed_numba import _tensor_map

    calls, _ = fake_driver
    buf = _tensor_map.cached_map(LAYOUT, 0x5000, False, 7)
    chunk = buf.owner.chunk
    assert [c[0] for c in calls] == ["copy", "new_event", "record"]
    (_, (dst, src, nbytes, stream), _), _, (_, (event, on), _) = calls
    assert (dst, src, nbytes, stream) == (chunk.device_ptr, chunk.host_ptr, 128, 7)
    assert on == 7 and buf.owner.event == event and buf.ptr == dst
    np.testing.assert_array_equal(chunk.host[:16], np.arange(16) + 0x5000)
    calls.clear()
    assert _tensor_map.cached_map(LAYOUT, 0x5000, False, 7).ptr == dst   # same stream: ordered
    assert calls == []
    second = _tensor_map.cached_map(LAYOUT, 0x6000, False, 7)
    assert second.ptr == dst + 128 and calls[0][1][1] == chunk.host_ptr + 128   # next slot


def test_a_map_used_on_another_stream_waits_for_its_upload_until_it_is_done(fake_driver):
    from llmspeed_numba import _tensor_map

    calls, done = fake_driver
    buf = _tensor_map.cached_map(LAYOUT, 0x5000, False, 7)
    event = buf.owner.event
    calls.clear()
    assert _tensor_map.cached_map(LAYOUT, 0x5000, False, 9).ptr == buf.ptr
    assert calls == [("query", (event,), "relaxed"), ("wait", (9, event), "global")]
    done.add(event)
    calls.clear()
    _tensor_map.cached_map(LAYOUT, 0x5000, False, 9)
    assert calls == [("query", (event,), "relaxed")] and buf.owner.event is None
    calls.clear()
    _tensor_map.cached_map(LAYOUT, 0x5000, False, 11)     # settled: any stream, no calls
    assert calls == []
    slot = buf.owner
    del buf
    _tensor_map._DEVICE_MAPS.recent.clear()
    del slot
    gc.collect()
    assert calls == [("destroy", (event,), "global")]     # the event lives as long as its map


def test_inside_a_capture_a_map_whose_upload_has_not_landed_is_not_used(fake_driver):
    """A capture may not wait on work recorded outside it: the map's upload is queried (in the
    relaxed capture mode, so the query does not invalidate the capture) and, not done, the call
    gets no map (it copies with cp.async); once done, it gets the map, pinned."""
    from llmspeed_numba import _tensor_map

    calls, done = fake_driver
    buf = _tensor_map.cached_map(LAYOUT, 0x5000, False, 7)
    calls.clear()
    assert _tensor_map.cached_map(LAYOUT, 0x5000, True, 9) is None
    assert calls == [("query", (buf.owner.event,), "relaxed")]
    assert _tensor_map.cached_map(LAYOUT, 0x6000, True, 9) is None      # none made in a capture
    # its own stream too: a replay of the graph may run on another stream
    assert _tensor_map.cached_map(LAYOUT, 0x5000, True, 7) is None
    assert not _tensor_map._DEVICE_MAPS.pinned           # pinned only once usable
    done.add(buf.owner.event)
    assert _tensor_map.cached_map(LAYOUT, 0x5000, True, 9).ptr == buf.ptr
    assert (0x5000,) + LAYOUT in _tensor_map._DEVICE_MAPS.pinned


def test_a_map_is_not_made_on_a_stream_being_captured(fake_driver):
    """A numba or CuPy caller capturing its stream (torch callers are kept out before): the copy
    would be recorded into the graph, not run, leaving the cached map unwritten."""
    from llmspeed_numba import _tensor_map

    _CAPTURING.add(7)
    with pytest.raises(RuntimeError, match="captured"):
        _tensor_map.cached_map(LAYOUT, 0x5000, False, 7)
    assert len(_tensor_map._DEVICE_MAPS) == 0


def test_the_per_thread_default_stream_is_never_taken_for_the_same_stream(fake_driver):
    from llmspeed_numba import _tensor_map

    calls, _ = fake_driver
    buf = _tensor_map.cached_map(LAYOUT, 0x5000, False, 2)
    calls.clear()
    _tensor_map.cached_map(LAYOUT, 0x5000, False, 2)     # maybe another thread's stream
    assert [c[0] for c in calls] == ["query", "wait"] and buf.owner.stream is None


def test_map_slots_fill_a_chunk_then_the_next_and_are_never_reused(fake_driver):
    from llmspeed_numba import _tensor_map

    """A slot is never written twice (a queued kernel on any stream may still read an evicted
    map); a chunk goes once none of its maps is cached."""
    _tensor_map._DEVICE_MAPS.capacity = 4
    first = _tensor_map.cached_map(LAYOUT, 0x100000, False, 0)
    first_chunk = weakref.ref(first.owner.chunk)
    del first
    n = _tensor_map.CHUNK_MAPS + 4          # the 4 cached: the second chunk's
    ptrs = [_tensor_map.cached_map(LAYOUT, 0x100000 + 0x1000 * i, False, 0).ptr
            for i in range(1, n)]
    assert len(set(ptrs)) == n - 1 and first_chunk() is not _tensor_map._CHUNKS[0]
    assert len(_tensor_map._DEVICE_MAPS) == 4 and _tensor_map._CHUNKS[0].used == 4
    gc.collect()
    assert first_chunk() is None                  # its 64 maps all dropped from the cache
