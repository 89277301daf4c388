"""Tensor maps for Hopper's Tensor Memory Accelerator (TMA): the 128-byte descriptor of a 2-D
tensor in global memory and of the box that ``ptx.cp_async_bulk_tensor_2d_g2s`` copies from it.

On a GPU the descriptor is the driver's (``cuTensorMapEncodeTiled`` through cuda-bindings), kept
in 128 bytes of device memory: PTX reads a tensor map from global memory as well as from a kernel
parameter, so kernels take it as an ordinary array argument (numba has no ``__grid_constant__``
parameters). A map describes an address, shape, strides and box, not an owner, so maps are
cached by those: a later tensor at the same address with the same layout reuses its map. Under
the simulator the buffer holds a key to the twin's table (``ptx._twins.async_copy``), whose
entry tells the twin what the hardware would copy.

A new map is written on the stream of the call that needs it (``_upload``: a slot of a pinned
host chunk, copied asynchronously into the same slot of a device chunk), so making one never
waits for the device's queued work; a call on another stream finds it through the upload's
event (``_ready_on``).
"""

import os
import threading
from collections import OrderedDict

import numpy as np

from . import _driver, _recording
from ._arrays import STORAGE, Buffer, Tensor, device_address
from ._env import SIMULATOR, cuda
from ._workspace import capturing

#: Swizzle spans (bytes) a map can have: 0 (rows stored as they are) or 128 (the layout wgmma's
#: 128-byte-swizzle descriptors read: each 128-byte row's 16-byte chunks XOR-ed with the row
#: within its 1024 bytes).
SWIZZLES = (0, 128)
MAP_BYTES = 128
_MAX_BOX = 256   # elements along each box dimension


class MapCache:
    """Device maps by (address, device, layout, box), the least recently used dropped beyond
    ``capacity``: a server whose packed varlen totals change every step would otherwise add a
    map a step for as long as it runs. A map looked up during a CUDA-graph capture is pinned,
    never dropped: the captured graph reads its buffer at every replay. A dropped map's buffer
    is freed as numba frees any device array a launch used: deferred, then ``cuMemFree``, which
    synchronises for memory from ``cuMemAlloc`` (numba's default memory manager)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.recent = OrderedDict()
        self.pinned = {}
        self._lock = threading.Lock()   # ops may be called from several threads

    def __len__(self):
        return len(self.recent) + len(self.pinned)

    def get(self, key, make, pin, stream=0):
        """The map of ``key``; ``make(key, stream)`` builds a missing one on ``stream`` (``make``
        None: return None); ``pin``: the caller is capturing a graph that will read it."""
        with self._lock:
            buf = self.pinned.get(key)
            if buf is not None:
                return buf
            buf = self.recent.get(key)
            if buf is None:
                if make is None:
                    return None
                buf = self.recent[key] = make(key, stream)
                while len(self.recent) > self.capacity:
                    self.recent.popitem(last=False)
            else:
                self.recent.move_to_end(key)
            if pin:
                self.pinned[key] = self.recent.pop(key)
            return buf


#: Calls whose kernels read tensor maps are recorded and replayed (``_replay``), each replay
#: finding the map of its own operands' addresses (``cached_map``).
#: ``LLMSPEED_NUMBA_REPLAY_MAPS=0`` turns it off: such a call then takes the checked path every
#: time (the map holds its operand's address), ~170 us of host time a torch call against ~16-21
#: replayed (H200, session 31).
REPLAY_MAPS = os.environ.get("LLMSPEED_NUMBA_REPLAY_MAPS", "1") not in ("", "0")

#: 1024 maps of 128 bytes: more than any one workload's live operands (a model's GEMMs and
#: attention calls use tens), few enough that a long-running server's memory stays flat.
_DEVICE_MAPS = MapCache(1024)


def may_make_map(t: Tensor, stream):
    """Whether a missing map of ``t`` may be made now (``tensor_map_2d``'s ``make``): not inside
    a torch CUDA-graph capture of ``stream`` (a raw handle), which refuses the map's synchronous
    host-to-device copy."""
    if SIMULATOR or t.kind != "torch":
        return True
    return not capturing(t.obj.device.index, stream)


def tensor_map_2d(t: Tensor, box_rows, box_cols, swizzle=128, name="tensor", make=True,
                  stream=0):
    """The map (a ``Buffer`` of 16 device ``uint64``; a numpy array under the simulator) of 2-D
    tensor ``t`` (rows ``t.shape[0]``, unit column stride) with boxes of ``box_rows x box_cols``
    elements, for a kernel launched on ``stream`` (a raw handle). Requirements (the hardware's): the base address and the row stride in bytes
    multiples of 16; box dimensions 1-256, a box row a multiple of 16 bytes, exactly 128 bytes
    with the 128-byte swizzle. ``ValueError`` naming ``name`` otherwise. ``make=False``: None
    unless the map is already cached (a capture would record a new map's copy into the graph but
    not run it now), and a map it finds is kept for good (``MapCache``). A call that
    gets a map is replayed only with ``REPLAY_MAPS`` (each replay then finds its own operands'
    maps): the map holds ``t``'s address."""
    if t.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array, got {t.ndim} dimensions")
    rows, cols = t.shape
    item = STORAGE[t.dtype].itemsize
    if rows < 1 or cols < 1:
        raise ValueError(f"{name}: expected a non-empty array, got shape {t.shape}")
    if cols > 1 and t.strides[1] != 1:
        raise ValueError(f"{name}: expected unit column stride, got strides {t.strides}")
    row_stride = t.strides[0] if rows > 1 else cols
    if (row_stride * item) % 16 or t.ptr % 16:
        raise ValueError(f"{name}: the address and the row stride must be multiples of 16 "
                         f"bytes, got address {t.ptr:#x} and {row_stride * item} bytes a row")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle: expected one of {SWIZZLES}, got {swizzle}")
    if not (1 <= box_rows <= _MAX_BOX and 1 <= box_cols <= _MAX_BOX):
        raise ValueError(f"box: expected 1-{_MAX_BOX} elements along each dimension, got "
                         f"({box_rows}, {box_cols})")
    row_bytes = box_cols * item
    if row_bytes % 16 or (swizzle and row_bytes != swizzle):
        raise ValueError(f"box: a row must be a multiple of 16 bytes (exactly {swizzle} with "
                         f"the {swizzle}-byte swizzle), got {row_bytes} bytes")
    if SIMULATOR:
        _recording.not_replayable("its tensor maps hold the operands' addresses")
        return _twin_map(t, rows, cols, row_stride, box_rows, box_cols, swizzle)
    layout = (cuda.get_current_device().id, rows, cols, row_stride, item, box_rows, box_cols,
              swizzle)
    torch_device = t.obj.device.index if t.kind == "torch" else None
    return device_map(t.obj, t.ptr, layout, torch_device, make, stream)


def device_map(obj, ptr, layout, torch_device, make, stream=0):
    """``tensor_map_2d``'s device half: the cached map of the memory at ``ptr`` (in array
    ``obj``) with ``layout`` ``(device id, rows, cols, row stride, item bytes, box rows, box
    cols, swizzle)``, made when missing if ``make``, readable by kernels on ``stream``; told to
    the recorder (or, without ``REPLAY_MAPS``, the call marked not replayable). ``make=False``
    is asked inside a graph capture (``may_make_map``): what it finds is pinned."""
    buf = cached_map(layout, ptr, not make, stream)
    if buf is not None:
        if REPLAY_MAPS:
            # a parameter object of its own: two arguments at one address with one layout
            # share the cached map, and the plan tells parameters apart by identity
            buf = Buffer(buf.ptr, buf.size, buf.dtype, buf.owner)
            _recording.note_map(buf, obj, ptr, layout, torch_device)
        else:
            _recording.not_replayable("its tensor maps hold the operands' addresses")
    return buf


def cached_map(layout, ptr, in_capture, stream=0):
    """The ``Buffer`` of the map of ``ptr`` with ``layout`` (``device_map``; a replayed call's
    too, which holds it until it has launched), made on ``stream`` if missing; None inside a
    graph capture when it is missing, or when its upload on another stream may not have landed
    yet (a replay then takes its checked path). One found inside a capture is pinned."""
    key = (ptr,) + layout
    if in_capture:   # pinned only once usable: the capture's graph reads it for good
        buf = _DEVICE_MAPS.get(key, None, False)
        if buf is None or (buf.owner.event is not None and not _ready_on(buf.owner, stream,
                                                                         True)):
            return None
        return _DEVICE_MAPS.get(key, None, True)
    buf = _DEVICE_MAPS.get(key, _new_map_of_key, False, stream)
    slot = buf.owner
    if slot.event is not None and slot.stream != stream:
        _ready_on(slot, stream, False)
    return buf


def _new_map_of_key(key, stream):
    """``MapCache``'s maker (no closure a lookup: replays look maps up on every call)."""
    return _new_map(key[0], key[1:], stream)


def _new_map(ptr, layout, stream):
    device_id, rows, cols, row_stride, item, box_rows, box_cols, swizzle = layout
    words = _encode(ptr, rows, cols, row_stride * item, item, box_rows, box_cols, swizzle)
    return _upload(words, device_id, stream)


#: Map slots of one chunk (128 bytes each, on the device and in pinned host memory).
CHUNK_MAPS = 64


class _Chunk:
    """``CHUNK_MAPS`` map slots of device memory and their pinned host twins, taken in order
    and never reused: a chunk lives while a map in it does (each map's ``MapSlot`` holds it),
    then numba frees both halves (deferred; ``cuMemFree`` and ``cuMemFreeHost`` wait for the
    device, so no queued copy or kernel still uses them)."""

    __slots__ = ("device", "host", "device_ptr", "host_ptr", "used")

    def __init__(self):
        self.device = cuda.device_array(CHUNK_MAPS * MAP_WORDS, np.uint64)
        self.host = cuda.pinned_array(CHUNK_MAPS * MAP_WORDS, np.uint64)
        self.device_ptr = device_address(self.device)
        self.host_ptr = self.host.ctypes.data
        self.used = 0


class MapSlot:
    """The owner of one map's device bytes: its chunk, the stream its upload was queued on
    (None for the per-thread default stream, a different stream in each thread), and the event
    recorded after the upload (``event``: None once a kernel on any stream may read the map; the
    event itself lives until the slot does, so a thread that read it before another settled the
    slot still holds a valid event)."""

    __slots__ = ("chunk", "stream", "event", "_event", "__weakref__")

    def __init__(self, chunk, stream, event):
        self.chunk, self.stream, self.event, self._event = chunk, stream, event, event

    def __del__(self):
        try:
            if self._event is not None:
                _driver.destroy_event(self._event)
        except Exception:  # noqa: BLE001  (at interpreter exit the driver may be gone)
            pass


MAP_WORDS = MAP_BYTES // 8
#: ``CU_STREAM_PER_THREAD``: the same handle names another stream in each thread
_PER_THREAD_STREAM = 2
_CHUNKS = {}   # device id -> the chunk new maps take slots of (``MapCache``'s lock held)


def _upload(words, device_id, stream):
    """The map ``words`` in the next free slot, written on ``stream``: into the slot's pinned
    host twin, then an asynchronous copy queued on ``stream`` (no wait for the device's queued
    work, as a copy from pageable memory or on the legacy stream would), then an event for
    calls on other streams (``_ready_on``). Called under ``MapCache``'s lock. A stream being
    captured into a CUDA graph is refused: the copy would be recorded, not run (torch callers
    never get here then: ``may_make_map``)."""
    if _driver.stream_capturing(stream):
        raise RuntimeError("a tensor map cannot be made while the call's stream is captured "
                           "into a CUDA graph: run the call once before capturing it")
    chunk = _CHUNKS.get(device_id)
    if chunk is None or chunk.used == CHUNK_MAPS:
        chunk = _CHUNKS[device_id] = _Chunk()
    i = chunk.used
    chunk.used += 1
    chunk.host[i * MAP_WORDS:(i + 1) * MAP_WORDS] = words
    dst = chunk.device_ptr + i * MAP_BYTES
    _driver.copy_to_device_async(dst, chunk.host_ptr + i * MAP_BYTES, MAP_BYTES, stream)
    event = _driver.new_event()
    _driver.record_event(event, stream)
    # the fast launch path takes a Buffer for an array parameter
    owner = MapSlot(chunk, None if stream == _PER_THREAD_STREAM else stream, event)
    return Buffer(dst, MAP_WORDS, np.dtype(np.uint64), owner)


def _ready_on(slot, stream, in_capture):
    """Whether a kernel queued on ``stream`` now reads the map of ``slot``, whose upload may not
    have landed (queued on another stream, or inside a capture on any): yes once the upload has
    completed (the slot is then settled for every stream); else outside a capture ``stream`` is
    made to wait for the upload's event (yes), while inside one the map is not used (no: a
    capture may not wait on work recorded outside it, and a replay may run on another stream;
    the call copies without a map). The query runs in the relaxed capture mode: in the default
    global mode any thread's capture forbids it (and is invalidated by it)."""
    event = slot._event
    with _driver.relaxed_capture_mode():
        done = _driver.event_done(event)
    if done:
        slot.event = None
    elif not in_capture:
        _driver.stream_wait_event(stream, event)
        return True
    return done


def _encode(address, rows, cols, row_stride_bytes, item, box_rows, box_cols, swizzle):
    """The driver's encoding, as 16 host ``uint64`` words. The element type only sizes the
    elements (a copy moves bits): unsigned integers of the storage width."""
    from cuda.bindings import driver

    dtypes = {1: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
              2: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16,
              4: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32,
              8: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT64}
    swizzles = {0: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        dtypes[item], 2, address, [u64(cols), u64(rows)], [u64(row_stride_bytes)],
        [u32(box_cols), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzles[swizzle],
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused the map: {err!r} (address "
                         f"{address:#x}, {rows} x {cols}, row stride {row_stride_bytes} B, box "
                         f"{box_rows} x {box_cols}, swizzle {swizzle})")
    return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)


def _twin_map(t, rows, cols, row_stride, box_rows, box_cols, swizzle):
    from .ptx._twins.async_copy import TwinTensorMap, register_tensor_map

    if t.host is None:
        raise TypeError("simulator arrays must be numpy-backed")
    flat = np.lib.stride_tricks.as_strided(
        t.host.view(STORAGE[t.dtype]), shape=((rows - 1) * row_stride + cols,),
        strides=(STORAGE[t.dtype].itemsize,))
    words = np.zeros(MAP_BYTES // 8, np.uint64)
    words[0] = register_tensor_map(
        TwinTensorMap(flat, rows, cols, row_stride, box_rows, box_cols, swizzle))
    return words
