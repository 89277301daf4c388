"""Zero-copy interop with the caller's arrays, and outputs in the caller's kind.

Public ops accept, without copying:
- numba device arrays and any object with ``__cuda_array_interface__`` (CuPy arrays included);
- PyTorch CUDA tensors (read through ``data_ptr``/``stride``, so bfloat16 works too);
- any other object with ``__dlpack__`` (through ``cuda.core``'s ``StridedMemoryView``).
Results come back in the kind of the op's first array argument: torch in, torch out; CuPy in,
CuPy out; numba in (or any other kind), numba out.

Host NumPy arrays: under the CUDA simulator they *are* the device arrays (results are NumPy
arrays). On a GPU they are rejected with a ``TypeError``: a silent host-to-device copy would hide
its cost in every call; move them first (``numba.cuda.to_device``, ``torch.as_tensor(...).cuda()``).

Inside the library an array is a ``Tensor``: pointer, shape, strides in elements, dtype name.
Kernels see every array as a flat 1-D buffer of its storage type (fp16 and bf16 as ``uint16``
bits) and index it with explicit strides, so any layout (transposed, sliced, packed qkv) reaches
them without a copy.
"""

import sys
import weakref

import numpy as np

from . import _recording
from ._env import SIMULATOR, cuda, require_cuda

#: dtype names the library knows, with their storage dtype inside kernels.
STORAGE = {
    "float16": np.dtype(np.uint16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
HALF_DTYPES = ("float16", "bfloat16")


def _dtype_name(dtype):
    """Library name of a dtype the library stores (``STORAGE``), given as anything
    ``dtype_name`` reads (an array-interface typestr such as "<f2" too), or None."""
    try:
        name = dtype_name(dtype, "dtype")
    except TypeError:
        return None
    return name if name in STORAGE else None


class Tensor:
    """The library's view of one caller array (no copy, no ownership)."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "host")

    def __init__(self, obj, kind, ptr, shape, strides, dtype, host=None):
        self.obj = obj            # the caller's object, kept alive while we use it
        self.kind = kind          # "torch", "cupy", "numba", "numpy", "foreign"
        self.ptr = ptr            # device address of element 0 (int)
        self.shape = tuple(shape)        # ints
        self.strides = tuple(strides)    # ints, in elements
        self.dtype = dtype        # library dtype name, e.g. "float16"
        self.host = host          # simulator only: the numpy array holding the data

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self):
        return STORAGE[self.dtype].itemsize

    def extent(self):
        """Elements from element 0 to one past the last element (strides must be >= 0)."""
        last = 0
        for n, s in zip(self.shape, self.strides):
            if n == 0:
                return 0
            last += (n - 1) * s
        return last + 1

    def is_contiguous(self):
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def __repr__(self):
        return f"Tensor({self.kind}, {self.dtype}, shape={self.shape}, strides={self.strides})"


def _c_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _from_interface(obj, kind, iface):
    dtype = _dtype_name(iface["typestr"])
    if dtype is None:
        raise TypeError(f"unsupported dtype {iface['typestr']!r}")
    itemsize = STORAGE[dtype].itemsize
    shape = tuple(iface["shape"])
    if iface.get("strides") is None:
        strides = _c_strides(shape)
    else:
        if any(s % itemsize for s in iface["strides"]):
            raise ValueError("strides that are not a multiple of the element size are unsupported")
        strides = tuple(s // itemsize for s in iface["strides"])
    return Tensor(obj, kind, int(iface["data"][0] or 0), shape, strides, dtype)


_TORCH_DTYPES = {}


def _torch_tensor(obj):
    import torch

    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({
            torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
            torch.float64: "float64", torch.int8: "int8", torch.uint8: "uint8",
            torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
            torch.bool: "bool",
        })
    dtype = _TORCH_DTYPES.get(obj.dtype)
    if dtype is None:
        raise TypeError(f"unsupported dtype {obj.dtype}")
    if not obj.is_cuda:
        raise TypeError("expected a CUDA tensor, got a CPU tensor (use .cuda())")
    return Tensor(obj, "torch", obj.data_ptr(), obj.shape, obj.stride(), dtype)


_RAW_STREAM = []


def current_stream_reader():
    """A function ``device_index -> raw handle of torch's current stream on that device``: the
    private accessor, ~5x cheaper than ``torch.cuda.current_stream()`` (NOTES, "Launch path"),
    or the public one if a torch release drops it."""
    if not _RAW_STREAM:
        import torch

        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device))
    raw = _RAW_STREAM[0]
    if raw is None:
        import torch

        return lambda device_index: torch.cuda.current_stream(device_index).cuda_stream
    return raw


def torch_current_stream(device_index=None):
    """Raw handle of torch's current stream on a device (default: the current one)."""
    read = current_stream_reader()
    return read(_RAW_STREAM[1]() if device_index is None else device_index)


def torch_tensor_type():
    """``torch.Tensor`` if torch has been imported (by the caller), else None: hot paths compare
    ``type(x) is`` this instead of importing torch or reading module names."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


def torch_signature(x):
    """Hashable description of a torch tensor's layout (no data pointer), for plan caches."""
    return (x.shape, x.stride(), x.dtype, x.get_device())


def _numpy_array(obj):
    dtype = "bfloat16" if obj.dtype.name == "bfloat16" else _dtype_name(obj.dtype)
    if dtype is None:
        raise TypeError(f"unsupported dtype {obj.dtype}")
    if any(s % obj.itemsize for s in obj.strides):
        raise ValueError("strides that are not a multiple of the element size are unsupported")
    strides = tuple(s // obj.itemsize for s in obj.strides)
    return Tensor(obj, "numpy", obj.ctypes.data, obj.shape, strides, dtype, host=obj)


_NUMBA_TENSORS = weakref.WeakKeyDictionary()


def _numba_device_array(obj):
    """numba DeviceNDArray read directly. Reading one is slow (its pointer goes through several
    properties; NOTES, "Launch path"), and a numba array never changes pointer, shape or dtype, so
    its layout is remembered for as long as the array lives (the remembered value must not hold
    the array: a WeakKeyDictionary's value that does keeps its key alive for ever)."""
    try:
        return Tensor(obj, "numba", *_NUMBA_TENSORS[obj])
    except (KeyError, TypeError):
        pass
    dtype = _dtype_name(obj.dtype)
    if dtype is None:
        raise TypeError(f"unsupported dtype {obj.dtype}")
    itemsize = obj.dtype.itemsize
    ptr = obj.device_ctypes_pointer
    ptr = int(getattr(ptr, "value", ptr) or 0)
    layout = (ptr, tuple(obj.shape), tuple(s // itemsize for s in obj.strides), dtype)
    try:
        _NUMBA_TENSORS[obj] = layout
    except TypeError:  # not weak-referenceable: read it every time
        pass
    return Tensor(obj, "numba", *layout)


#: id(numba array) -> (weak reference to it, its ``replay_key``): read once while the array
#: lives (a numba array never changes pointer, shape or dtype). Keyed by id, checked through
#: the reference: cheaper than a WeakKeyDictionary on the replay path.
_REPLAY_KEYS: dict = {}


class _SameObject:
    """A key part that matches only the very same object (numba's ``Context`` is unhashable).
    It holds the object, so a plan keyed on a context keeps that context alive and no later
    context can match a closed one's compiled kernels."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _SameObject) and self.obj is other.obj

    def __hash__(self):
        return id(self.obj)


def _forget_replay_key(ident, ref):
    entry = _REPLAY_KEYS.get(ident)
    if entry is not None and entry[0] is ref:
        del _REPLAY_KEYS[ident]


def replay_key(x):
    """``(key part, data pointer)`` of a torch tensor or a numba device array, for an op's
    launch replay path (``_replay``), or None for any other kind (those take the checked path).
    The key part holds everything an op's validation depends on (kind, shape, strides, dtype,
    device, and the low five bits of the address: alignment picks vector widths) and no more of
    the pointer. A torch tensor's is ``(shape, stride(), dtype, get_device(), ptr & 31)`` (the
    replay loop reads it inline); a numba array's is read once and remembered while the array
    lives, with its context standing for the device."""
    entry = _REPLAY_KEYS.get(id(x))
    if entry is not None and entry[0]() is x:
        return entry[1]
    if SIMULATOR:
        return None
    cls = type(x)
    if cls is torch_tensor_type():
        p = x.data_ptr()
        return (x.shape, x.stride(), x.dtype, x.get_device(), p & 31), p
    if not cls.__module__.startswith("numba") or not hasattr(x, "device_ctypes_pointer"):
        return None
    try:
        t = _numba_device_array(x)
    except TypeError:  # unsupported dtype: the checked path raises, naming the argument
        return None
    context = _SameObject(getattr(getattr(x, "gpu_data", None), "context", None))
    found = (("numba", t.shape, t.strides, t.dtype, context, t.ptr & 31), t.ptr)
    try:
        ref = weakref.ref(x, lambda r, i=id(x): _forget_replay_key(i, r))
    except TypeError:  # not weak-referenceable: read every time
        return found
    _REPLAY_KEYS[id(x)] = (ref, found)
    return found


_READERS = {}  # type -> reader, filled on first sight of each array type


def _reader_for(obj):
    require_cuda()  # once per array type while it succeeds; every call while it raises
    cls = type(obj)
    module = cls.__module__
    if module.startswith("torch") and hasattr(obj, "data_ptr"):
        return _torch_tensor
    if SIMULATOR and isinstance(getattr(obj, "_ary", None), np.ndarray):
        return _simulator_array
    if isinstance(obj, np.ndarray):
        return _numpy_array if SIMULATOR else _host_array_rejected
    if not SIMULATOR and module.startswith("numba") and hasattr(obj, "device_ctypes_pointer"):
        return _numba_device_array
    if hasattr(obj, "__cuda_array_interface__"):
        kind = "cupy" if module.startswith("cupy") else "foreign"
        return lambda o: _from_interface(o, kind, o.__cuda_array_interface__)
    if hasattr(obj, "__dlpack__"):
        return _dlpack_array
    return None


def _simulator_array(obj):
    t = _numpy_array(obj._ary)  # the simulator's "device" arrays wrap numpy arrays
    t.obj, t.kind = obj, "numba"
    return t


def _host_array_rejected(obj):
    raise TypeError(
        "expected a device array, got a host numpy.ndarray; move it to the GPU first "
        "(numba.cuda.to_device, cupy.asarray, torch.as_tensor(...).cuda())")


def _dlpack_array(obj):
    from cuda.core.utils import StridedMemoryView

    view = StridedMemoryView(obj, stream_ptr=-1)
    dtype = _dtype_name(view.dtype)
    if dtype is None:
        raise TypeError(f"unsupported dtype {view.dtype}")
    strides = view.strides if view.strides is not None else _c_strides(view.shape)
    return Tensor(obj, "foreign", int(view.ptr), view.shape, strides, dtype)


def as_tensor(obj, name):
    """Read any supported array without copying; ``TypeError`` naming ``name`` otherwise."""
    reader = _READERS.get(type(obj))
    if reader is None:
        reader = _reader_for(obj)
        if reader is None:
            raise TypeError(
                f"{name}: expected a CUDA array (numba device array, CuPy array, torch CUDA "
                f"tensor, or an object with __cuda_array_interface__ / __dlpack__), got "
                f"{type(obj).__name__}")
        if type(obj) not in (list, tuple, dict):
            _READERS[type(obj)] = reader
    try:
        return reader(obj)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def kernel_buffer(t: Tensor):
    """The flat 1-D storage view a kernel indexes: a ``Buffer`` (GPU) or numpy view (simulator)."""
    if min(t.strides, default=0) < 0:
        raise ValueError(f"negative strides are unsupported, got {t.strides}")
    storage = STORAGE[t.dtype]
    n = t.extent() or 1
    if SIMULATOR:
        base = t.host
        if t.host is None:
            raise TypeError("simulator arrays must be numpy-backed")
        raw = base.view(np.uint16) if t.dtype in HALF_DTYPES else base
        return np.lib.stride_tricks.as_strided(raw, shape=(n,), strides=(storage.itemsize,))
    return Buffer(t.ptr, n, storage, t.obj)


class Buffer:
    """A device pointer with its element count and storage dtype: what a kernel's 1-D array
    parameter receives on the fast launch path."""

    __slots__ = ("ptr", "size", "dtype", "owner")

    def __init__(self, ptr, size, dtype, owner=None):
        self.ptr, self.size, self.dtype, self.owner = ptr, size, dtype, owner


def device_address(obj):
    """Device address of element 0 of a torch tensor or any CUDA-array-interface array, of any
    dtype (the library's own workspaces and allocations; callers' arrays go through
    ``as_tensor``)."""
    if hasattr(obj, "data_ptr"):
        return obj.data_ptr()
    return obj.__cuda_array_interface__["data"][0]


def host_ints(t: Tensor):
    """Host int64 copy of a small integer device array (cu_seqlens, tables), for a host check
    of its contents: synchronises, and makes the op's call not replayable (``_recording``)."""
    _recording.not_replayable("reads device data on the host")
    obj = t.obj
    if t.host is not None:
        values = t.host
    elif t.kind == "torch":
        values = obj.detach().cpu().numpy()
    elif t.kind == "cupy":
        values = obj.get()
    elif hasattr(obj, "copy_to_host"):
        values = obj.copy_to_host()
    else:
        values = cuda.as_cuda_array(obj).copy_to_host()
    return np.asarray(values).astype(np.int64)


def to_host(x):
    """Any supported array -> host numpy array (bf16 as ml_dtypes bfloat16): NumPy arrays as
    they are, torch tensors (any device), CuPy and numba device arrays copied."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    if mod.startswith("cupy"):
        return x.get()
    if hasattr(x, "copy_to_host"):
        if x.dtype == np.float16:
            return x.view(np.uint16).copy_to_host().view(np.float16)
        return x.copy_to_host()
    t = as_tensor(x, "x")
    if t.host is not None:
        return t.host
    raise TypeError(f"cannot bring {type(x).__name__} to the host")


# ---- outputs in the caller's kind -----------------------------------------------------------

def empty(like: Tensor, shape, dtype):
    """A new C-contiguous array of the same kind (and device) as ``like`` (noted for the replay
    of the op's call, ``_recording``)."""
    shape = tuple(int(s) for s in shape)
    obj = _empty(like, shape, dtype)
    if not SIMULATOR:
        _recording.note_alloc(obj, like.kind, shape, dtype)
    return obj


def _empty(like, shape, dtype):
    if like.kind == "torch":
        import torch

        tdtype = {v: k for k, v in _TORCH_DTYPES.items()}[dtype]
        return torch.empty(shape, dtype=tdtype, device=like.obj.device)
    if like.kind == "cupy":
        import cupy

        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16 dtype")
        return cupy.empty(shape, dtype=dtype)
    np_dtype = _numpy_dtype(dtype)
    if like.kind == "numpy":
        return np.empty(shape, dtype=np_dtype)
    if SIMULATOR:
        return cuda.device_array(shape, dtype=np_dtype)
    if dtype == "bfloat16":
        # numba device arrays cannot hold bfloat16: keep the bits, typed as ml_dtypes bfloat16
        # would be on the host; callers that use bf16 pass torch tensors in practice.
        raise TypeError("bfloat16 results need a torch (or ml_dtypes) array kind; pass out=")
    return cuda.device_array(shape, dtype=np_dtype)


def dtype_name(dtype, name):
    """Library name ("float16", "bfloat16", ...) of a dtype argument given as a name, a NumPy /
    ml_dtypes dtype or scalar type, or a torch dtype; ``TypeError`` naming ``name`` otherwise.
    Callers check the name against what they support. The one dtype parser of the package."""
    if isinstance(dtype, str):  # a name, or a NumPy spelling ("<f2", "half"); else kept as given
        if dtype in STORAGE:
            return dtype
        try:
            return np.dtype(dtype).name
        except TypeError:
            return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    if dtype is not None:
        try:
            return np.dtype(dtype).name
        except TypeError:
            pass
    raise TypeError(f"{name}: expected a dtype (a name such as 'float16', or a NumPy, ml_dtypes "
                    f"or torch dtype), got {dtype!r}")


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def numpy_dtype(dtype):
    """numpy dtype of a library dtype name (bfloat16 through ml_dtypes)."""
    return _numpy_dtype(dtype)


# ---- streams -------------------------------------------------------------------------------

def stream_handle(stream, tensors=()):
    """The raw CUstream handle (int) for ``stream``.

    Accepts None, a raw int handle, a numba stream, a torch or CuPy stream, or a cuda.core
    stream. None means the caller's framework's current stream when an input is a torch or CuPy
    array (so ops order correctly with the caller's work and can be captured in CUDA graphs),
    else the legacy default stream (0).
    """
    if stream is None:
        for t in tensors:
            if t.kind == "torch":
                return torch_current_stream(t.obj.get_device())
            if t.kind == "cupy":
                import cupy

                return cupy.cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    handle = getattr(stream, "handle", None)  # numba stream (CUstream / c_void_p), cuda.core
    if handle is not None:
        value = getattr(handle, "value", handle)
        try:
            return int(value or 0)
        except TypeError:
            pass
    if "cuda.core" in type(stream).__module__ and hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise TypeError(
        f"stream: expected None, an int handle, or a numba / torch / CuPy / cuda.core stream, "
        f"got {type(stream).__name__}")
