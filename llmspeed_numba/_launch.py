"""Compiling, caching and launching kernels with little Python overhead.

Every op launches through ``Kernel``: a ``@cuda.jit`` function compiled once per signature
(cached on disk, ``cache=True``), whose CUfunction handle is kept and launched with
``cuLaunchKernel`` on a parameter block packed here from raw pointers. numba's own dispatch
(typing the arguments, wrapping foreign arrays) costs 28-80 us a call; this path a few.

Kernel parameters follow numba's ABI: a 1-D C-contiguous array parameter is seven 8-byte words
(meminfo, parent, nitems, itemsize, data, shape[0], strides[0] in bytes); integers and floats are
their own size. Kernels therefore take only 1-D arrays (``kernel_buffer``) and scalars.

Under the simulator ``Kernel`` launches through numba's simulated dispatcher instead.
"""

import ctypes
import threading

import numpy as np
from numba import types

from ._arrays import Buffer
from ._env import SIMULATOR, cuda

#: Dynamic shared memory a block may use without opting in.
DEFAULT_SHARED_LIMIT = 48 * 1024


def jit(fn=None, **options):
    """``cuda.jit`` for library kernels: on-disk cache on the GPU, plain under the simulator."""
    def wrap(f):
        if SIMULATOR:
            return cuda.jit(f)
        return cuda.jit(f, cache=True, **options)

    return wrap if fn is None else wrap(fn)


def array1d(dtype):
    """Numba type of a kernel's flat 1-D buffer parameter of numpy dtype ``dtype``."""
    from numba.np import numpy_support

    return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 1, "C")


class _Param:
    """Packs one launch's parameters into a C array of pointers for cuLaunchKernel."""

    __slots__ = ("values", "pointers", "slots")

    def __init__(self, words):
        self.values = (ctypes.c_uint64 * words)()
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * words)(*[base + 8 * i for i in range(words)])
        self.slots = words


def _pack_float32(x):
    return int(np.float32(x).view(np.uint32))


def _pack_float64(x):
    return int(np.float64(x).view(np.uint64))


class Kernel:
    """A compiled kernel for one signature, launched from raw pointers.

    ``signature`` is a tuple of numba types: ``array1d(...)`` for buffers, integer or float types
    for scalars. ``__call__(grid, block, args, stream=0, shared_bytes=0)`` takes ``Buffer``s (or
    numpy views under the simulator) and Python numbers in signature order.
    """

    def __init__(self, dispatcher, signature, name=None):
        self.dispatcher = dispatcher
        self.signature = tuple(signature)
        self.name = name or getattr(dispatcher, "__name__", "kernel")
        self._handle = None
        self._shared_optin = DEFAULT_SHARED_LIMIT
        self._lock = threading.Lock()
        self._local = threading.local()
        self._packers = []
        for ty in self.signature:
            if isinstance(ty, types.Array):
                if ty.ndim != 1 or ty.layout != "C":
                    raise TypeError(f"{self.name}: kernel array parameters must be 1-D C arrays")
                self._packers.append(("array", ty.dtype.bitwidth // 8))
            elif isinstance(ty, types.Integer):
                self._packers.append(("int", ty.bitwidth))
            elif ty == types.float32:
                self._packers.append(("f32", 32))
            elif ty == types.float64:
                self._packers.append(("f64", 64))
            elif ty == types.boolean:
                self._packers.append(("int", 8))
            else:
                raise TypeError(f"{self.name}: unsupported kernel parameter type {ty}")
        self._words = sum(7 if kind == "array" else 1 for kind, _ in self._packers)

    # -- compile ----------------------------------------------------------------------------
    def compiled(self):
        """The numba ``_Kernel`` of this signature (compiles or loads from the disk cache)."""
        if SIMULATOR:
            return None
        self.dispatcher.compile(self.signature)
        return self.dispatcher.overloads[self.signature]

    def handle(self):
        if self._handle is None:
            with self._lock:
                if self._handle is None:
                    self._handle = self.compiled()._codelibrary.get_cufunc().handle
        return self._handle

    def resources(self):
        """Registers per thread, local bytes per thread, static shared bytes per block."""
        k = self.compiled()
        return {"registers": k.regs_per_thread, "local_bytes": k.local_mem_per_thread,
                "static_shared_bytes": k.shared_mem_per_block}

    def _opt_in_shared(self, nbytes):
        from cuda.bindings import driver

        limit = max_shared_per_block_optin()
        if nbytes > limit:
            raise ValueError(f"{self.name}: needs {nbytes} bytes of shared memory per block, "
                             f"the device allows {limit}")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuFuncSetAttribute(self.handle(), attr, nbytes)
        _check(err, "cuFuncSetAttribute")
        self._shared_optin = nbytes

    # -- launch ------------------------------------------------------------------------------
    def __call__(self, grid, block, args, stream=0, shared_bytes=0):
        grid = _dim3(grid)
        block = _dim3(block)
        if SIMULATOR:
            self.dispatcher[grid, block, 0, shared_bytes](*args)
            return
        if shared_bytes > self._shared_optin:
            self._opt_in_shared(shared_bytes)
        params = getattr(self._local, "params", None)
        if params is None:
            params = self._local.params = _Param(self._words)
        values = params.values
        i = 0
        for (kind, width), arg in zip(self._packers, args):
            if kind == "array":
                if not isinstance(arg, Buffer):
                    raise TypeError(f"{self.name}: expected a Buffer, got {type(arg).__name__}")
                size = arg.size
                values[i] = 0
                values[i + 1] = 0
                values[i + 2] = size
                values[i + 3] = width
                values[i + 4] = arg.ptr
                values[i + 5] = size
                values[i + 6] = width
                i += 7
            else:
                if kind == "int":
                    values[i] = int(arg) & ((1 << width) - 1)
                elif kind == "f32":
                    values[i] = _pack_float32(arg)
                else:
                    values[i] = _pack_float64(arg)
                i += 1
        from cuda.bindings import driver

        (err,) = driver.cuLaunchKernel(
            self.handle(), grid[0], grid[1], grid[2], block[0], block[1], block[2],
            shared_bytes, _stream(stream), ctypes.addressof(params.pointers), 0)
        _check(err, f"launch of {self.name}")


def _dim3(d):
    if isinstance(d, int):
        return (d, 1, 1)
    d = tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


_STREAMS = {}


def _stream(handle):
    s = _STREAMS.get(handle)
    if s is None:
        from cuda.bindings import driver

        s = _STREAMS[handle] = driver.CUstream(handle)
    return s


def _check(err, what):
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name}: {msg.decode() if msg else ''}")


_DEVICE_ATTRS = {}


def device_attribute(name):
    """An attribute of the current device (cached), e.g. ``MULTIPROCESSOR_COUNT``."""
    if name not in _DEVICE_ATTRS:
        if SIMULATOR:
            _DEVICE_ATTRS[name] = {"MULTIPROCESSOR_COUNT": 1,
                                   "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448}.get(name, 0)
        else:
            _DEVICE_ATTRS[name] = getattr(cuda.get_current_device(), name)
    return _DEVICE_ATTRS[name]


def sm_count():
    return device_attribute("MULTIPROCESSOR_COUNT")


def max_shared_per_block_optin():
    return device_attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
