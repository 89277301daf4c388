"""Compiling, caching and launching kernels with little Python overhead.

Every op launches through ``Kernel``: a ``@cuda.jit`` function compiled once per signature
(cached on disk, ``cache=True``), whose function handle is kept and launched by one ctypes call of
the driver's ``cuLaunchKernelEx`` (four pointer arguments: a per-thread ``CUlaunchConfig`` holds
grid, block, shared bytes and stream) on a parameter block packed with one ``struct.pack_into``.
numba's own dispatch (typing the arguments, wrapping foreign arrays) costs several times the bare
driver call from Python (benchmarks/NOTES.md, "Launch path").

Kernel parameters follow numba's ABI: a 1-D C-contiguous array parameter is seven 8-byte words
(meminfo, parent, nitems, itemsize, data, shape[0], strides[0] in bytes); integers and floats are
their own size. Kernels therefore take only 1-D arrays (``kernel_buffer``) and scalars.

Under the simulator ``Kernel`` launches through numba's simulated dispatcher instead.
"""

import contextlib
import ctypes
import os
import struct
import sys
import threading

import numpy as np
from numba import types

from . import _kernel_cache, _recording
from ._arrays import Buffer
from ._env import SIMULATOR, cuda

#: The simulator runs each CUDA thread of a block as a Python thread while its launcher polls
#: them all, holding the GIL for the interpreter's switch interval (5 ms by default) at a time,
#: so every ``__syncthreads`` costs milliseconds. A simulated launch runs with this interval
#: instead (seconds: about 5x faster launches of the barrier-heavy kernels).
SIMULATOR_SWITCH_INTERVAL = 2e-4
from ._overrides import Knobs

#: Dynamic shared memory a block may use without opting in.
DEFAULT_SHARED_LIMIT = 48 * 1024


def jit(fn=None, **options):
    """``cuda.jit`` for library kernels: on-disk cache on the GPU (stable keys: see
    ``_kernel_cache``), plain under the simulator.

    The linked PTX backend's kernels carry linked CUDA C, which numba cannot pickle into its
    cache, so they are compiled in each process."""
    def wrap(f):
        if SIMULATOR:
            return cuda.jit(f)
        from . import ptx

        if ptx.BACKEND == "linked":
            return cuda.jit(f, **options)
        return _kernel_cache.use_stable_keys(cuda.jit(f, cache=True, **options))

    return wrap if fn is None else wrap(fn)


def array1d(dtype):
    """Numba type of a kernel's flat 1-D buffer parameter of numpy dtype ``dtype``."""
    from numba.np import numpy_support

    return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 1, "C")


class _ParamBlock:
    """One launch's parameters: 8-byte slots and the array of pointers to them that
    cuLaunchKernel reads (it copies the values at the call, so a block is reused)."""

    __slots__ = ("values", "pointers", "address")

    def __init__(self, words):
        self.values = (ctypes.c_uint64 * words)()
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * words)(*[base + 8 * i for i in range(words)])
        self.address = ctypes.addressof(self.pointers)


_LIBCUDA = {}


def _libcuda():
    """ctypes ``cuLaunchKernel`` (argument conversions set once)."""
    fn = _LIBCUDA.get("cuLaunchKernel")
    if fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        u = ctypes.c_uint
        fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _LIBCUDA["cuLaunchKernel"] = fn
    return fn


def _libcuda_ex():
    """ctypes ``cuLaunchKernelEx``: four pointer arguments instead of eleven, the grid, block,
    shared bytes and stream living in a ``CUlaunchConfig`` written once per launch site, so a
    replay converts fewer Python objects."""
    fn = _LIBCUDA.get("cuLaunchKernelEx")
    if fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        p = ctypes.c_void_p
        fn.argtypes = [p, p, p, p]
        fn.restype = ctypes.c_int
        _LIBCUDA["cuLaunchKernelEx"] = fn
    return fn


class _LaunchConfig(ctypes.Structure):
    """The driver's ``CUlaunchConfig``."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttribute(ctypes.Structure):
    """The driver's ``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union
    (here its first int)."""
    _fields_ = [("id", ctypes.c_uint), ("_pad", ctypes.c_uint), ("value", ctypes.c_int),
                ("_rest", ctypes.c_byte * 60)]


#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` set to 1: the kernel may launch
#: before the previous kernel on its stream has completed (once that kernel's blocks have all
#: run ``griddepcontrol.launch_dependents`` or exited), and waits for it at its own
#: ``griddepcontrol.wait``. Read by the driver at each launch; shared, never written.
_PROGRAMMATIC = (_LaunchAttribute * 1)(_LaunchAttribute(6, 0, 1))

#: ``programmatic``: kernels written for programmatic dependent launch (a ``griddep_wait``
#: before their first dependent access) are built with it and launched with the attribute
#: (``programmatic_launch``), and the small kernels before them release the launch early; off
#: (the default): built without, launched plainly. Off because it measured within the noise of
#: a decode step (benchmarks/NOTES.md, session 27).
LAUNCH = Knobs("launch", programmatic=False)


def programmatic_launch():
    """Whether an op builds its programmatic kernel variants: the ``launch`` knob, on a GPU of
    compute capability 9.0 or later (``griddepcontrol`` is sm_90 PTX) or the simulator."""
    if not LAUNCH.programmatic:
        return False
    return SIMULATOR or cuda.get_current_device().compute_capability >= (9, 0)


def _launch_config(programmatic, *fields):
    config = _LaunchConfig(*fields)
    if programmatic:
        config.attrs = ctypes.addressof(_PROGRAMMATIC)
        config.num_attrs = 1
    return config


_COLLECT = threading.local()


@contextlib.contextmanager
def collecting_kernels():
    """Inside, a ``Kernel`` launch is noted in the yielded list instead of compiled and run:
    the kernels a workload needs, for compiling them ahead (``llmspeed_numba.warm``). Outputs of
    op calls inside are left unwritten."""
    found: list = []
    _COLLECT.kernels = found
    try:
        yield found
    finally:
        _COLLECT.kernels = None


def collecting():
    """True inside ``collecting_kernels`` (ops skip work that would compile a kernel)."""
    return getattr(_COLLECT, "kernels", None) is not None


def _origin(frame):
    """``(module, function, args)`` of the module-level factory that made a kernel (the caller
    of ``Kernel``), when calling ``module.function(*args)`` again gives the same kernel
    (an ``lru_cache``d factory), else None."""
    code = frame.f_code
    module = frame.f_globals.get("__name__")
    factory = frame.f_globals.get(code.co_name)
    wrapped = getattr(factory, "__wrapped__", None)
    if module is None or getattr(wrapped, "__code__", None) is not code:
        return None
    names = code.co_varnames[:code.co_argcount]
    return module, code.co_name, tuple(frame.f_locals[n] for n in names)


class Kernel:
    """A compiled kernel for one signature, launched from raw pointers.

    ``signature`` is a tuple of numba types: ``array1d(...)`` for buffers, integer or float types
    for scalars. ``__call__(grid, block, args, stream=0, shared_bytes=0)`` takes ``Buffer``s (or
    numpy views under the simulator) and Python numbers in signature order. ``programmatic``:
    launched with the programmatic stream-serialization attribute; only for a kernel that runs
    ``ptx.griddep_wait`` before its first access to memory an earlier kernel may still use.
    """

    def __init__(self, dispatcher, signature, name=None, programmatic=False):
        self.origin = _origin(sys._getframe(1))
        self.dispatcher = dispatcher
        self.signature = tuple(signature)
        self.name = name or getattr(dispatcher, "__name__", "kernel")
        self.programmatic = bool(programmatic)
        self._handle = None
        self._raw_handle = None
        self._library = None  # cuda-core ObjectCode of a kernel loaded from the store
        self._key = None
        self._core = None
        self._shared_optin = DEFAULT_SHARED_LIMIT
        self._lock = threading.Lock()
        self._local = threading.local()
        # Every parameter gets 8-byte slots; an array is numba's 7-word struct. Scalars narrower
        # than 8 bytes sit in the low bytes of their slot (little-endian), where the driver reads
        # them, since it copies each parameter's own size from its pointer.
        fmt = "<"
        self._array_params = []
        for i, ty in enumerate(self.signature):
            if isinstance(ty, types.Array):
                if ty.ndim != 1 or ty.layout != "C":
                    raise TypeError(f"{self.name}: kernel array parameters must be 1-D C arrays")
                fmt += "QQqqQqq"
                self._array_params.append((i, ty.dtype.bitwidth // 8))
            elif isinstance(ty, types.Integer) or ty == types.boolean:
                fmt += "Q" if (isinstance(ty, types.Integer) and not ty.signed) else "q"
            elif ty == types.float32:
                fmt += "f4x"
            elif ty == types.float64:
                fmt += "d"
            else:
                raise TypeError(f"{self.name}: unsupported kernel parameter type {ty}")
        self._struct = struct.Struct(fmt)
        self._words = self._struct.size // 8
        self._itemsizes = {i: w for i, w in self._array_params}

    # -- compile ----------------------------------------------------------------------------
    def compiled(self):
        """The numba ``_Kernel`` of this signature (compiles or loads from numba's disk cache),
        its machine code written to the kernel store (``_kernel_cache``) if not there yet."""
        if SIMULATOR:
            return None
        self.dispatcher.compile(self.signature)
        kernel = self.dispatcher.overloads[self.signature]
        key = self._store_key()
        if key is not None and not os.path.exists(_kernel_cache.store_path(key)):
            library = kernel._codelibrary
            _kernel_cache.save(key, library._entry_name, library.get_cubin())
        return kernel

    def _store_key(self):
        """This kernel's name in the machine-code store, or None when it is not stored."""
        if not (getattr(self.dispatcher, "stable_keys", False) and _kernel_cache.store_enabled()):
            return None
        if self._key is None:
            cc = cuda.get_current_device().compute_capability
            self._key = _kernel_cache.store_key(self.dispatcher, self.signature, cc)
        return self._key

    def resolvable(self):
        """True when ``handle()`` needs no compile: resolved already, or in the machine-code
        store (a kernel outside the store may still sit in numba's cache: False)."""
        if self._handle is not None:
            return True
        key = self._store_key()
        return key is not None and os.path.exists(_kernel_cache.store_path(key))

    def handle(self):
        """The driver handle (a ``CUkernel`` or ``CUfunction`` of cuda.bindings): from the
        machine-code store when it has the kernel (no numba compile or cache load), else
        compiled (or loaded from numba's cache) by numba."""
        if self._handle is None:
            with self._lock:
                if self._handle is None:
                    key = self._store_key()
                    stored = _kernel_cache.load(key) if key is not None else None
                    if stored is not None:
                        self._library, handle = stored
                    else:
                        handle = self.compiled()._codelibrary.get_cufunc().handle
                    self._raw_handle = int(handle)
                    self._handle = handle
        return self._handle

    def _core_kernel(self):
        """This kernel as a cuda-core ``Kernel`` (attributes, occupancy)."""
        if self._core is None:
            from cuda.core import Kernel as CoreKernel

            self._core = CoreKernel.from_handle(int(self.handle()), self._library)
        return self._core

    def resources(self):
        """Registers per thread, local bytes per thread, static shared bytes per block."""
        attributes = self._core_kernel().attributes
        return {"registers": attributes.num_regs, "local_bytes": attributes.local_size_bytes,
                "static_shared_bytes": attributes.shared_size_bytes}

    def blocks_per_sm(self, threads, shared_bytes=0):
        """Blocks of ``threads`` threads (and ``shared_bytes`` dynamic shared memory) one SM
        holds at once: the driver's occupancy calculator, on this kernel's registers and the
        device's own limits (registers, shared memory, threads, blocks an SM). The one
        occupancy model of the package; 1 under the simulator."""
        if SIMULATOR:
            return 1
        if shared_bytes > self._shared_optin:  # above the default limit the query needs it too
            self._opt_in_shared(shared_bytes)
        occupancy = self._core_kernel().occupancy
        return occupancy.max_active_blocks_per_multiprocessor(threads, shared_bytes)

    def _opt_in_shared(self, nbytes):
        from cuda.bindings import driver

        limit = max_shared_per_block_optin()
        if nbytes > limit:
            raise ValueError(f"{self.name}: needs {nbytes} bytes of shared memory per block, "
                             f"the device allows {limit}")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = self.handle()
        if isinstance(handle, driver.CUkernel):  # numba-cuda loads modules as libraries
            (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle,
                                                 cuda.get_current_device().id)
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
        _check(err, "set MAX_DYNAMIC_SHARED_SIZE_BYTES")
        self._shared_optin = nbytes

    # -- launch ------------------------------------------------------------------------------
    def __call__(self, grid, block, args, stream=0, shared_bytes=0):
        found = getattr(_COLLECT, "kernels", None)
        if found is not None:
            found.append(self)
            return
        grid = _dim3(grid)
        block = _dim3(block)
        if SIMULATOR:
            # The simulator copies plain numpy arguments in and back out after the launch, so
            # a buffer passed twice (in-place out=, a placeholder for an absent operand) would
            # be overwritten by its stale copy; its device-array wrapper shares the memory.
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            args = [FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args]
            previous = sys.getswitchinterval()
            sys.setswitchinterval(min(previous, SIMULATOR_SWITCH_INTERVAL))
            try:
                self.dispatcher[grid, block, 0, shared_bytes](*args)
            finally:
                sys.setswitchinterval(previous)
            return
        if shared_bytes > self._shared_optin:
            self._opt_in_shared(shared_bytes)
        if _recording.recording() is not None:
            _recording.note_launch(self, grid, block, args, stream, shared_bytes)
        try:
            values, config, config_address, params_address, shape = self._local.site
        except AttributeError:
            params = _ParamBlock(self._words)
            config = _launch_config(self.programmatic)
            self._local.params = params  # keeps the pointer array alive
            values, config_address, params_address, shape = (
                params.values, ctypes.addressof(config), params.address, None)
        flat = []
        for i, arg in enumerate(args):
            width = self._itemsizes.get(i)
            if width is None:
                flat.append(arg)
            else:
                if not isinstance(arg, Buffer):
                    raise TypeError(f"{self.name}: parameter {i}: expected a Buffer, got "
                                    f"{type(arg).__name__}")
                n = arg.size
                flat += (0, 0, n, width, arg.ptr, n, width)
        self._struct.pack_into(values, 0, *flat)
        if self._raw_handle is None:
            self.handle()
        launch_shape = (grid, block, shared_bytes)
        if launch_shape != shape:  # most call sites repeat their grid: skip the field writes
            config.grid[:] = grid
            config.block[:] = block
            config.shared_bytes = shared_bytes
        self._local.site = (values, config, config_address, params_address, launch_shape)
        config.stream = stream
        err = _libcuda_ex()(config_address, self._raw_handle, params_address, None)
        if err:
            _check_code(err, f"launch of {self.name}")


class PreparedLaunch:
    """One launch of ``kernel`` with every parameter packed once: later calls patch only the
    buffers' data pointers and the stream, and call the driver (``cuLaunchKernelEx``, its launch
    configuration prepared too). For hot ops, whose Python work (reading arrays, validating,
    packing) otherwise costs more than their kernels: an op keys these on its call signature
    (shapes, strides, dtypes, options) and replays them."""

    def __init__(self, kernel, grid, block, args, shared_bytes=0):
        if SIMULATOR:
            raise RuntimeError("PreparedLaunch needs a GPU")
        kernel.handle()
        if shared_bytes > kernel._shared_optin:
            kernel._opt_in_shared(shared_bytes)
        self.name = kernel.name
        self.programmatic = kernel.programmatic
        self.handle = kernel._raw_handle
        self.grid, self.block, self.shared = _dim3(grid), _dim3(block), int(shared_bytes)
        flat, self.pointer_words, word = [], [], 0
        for i, arg in enumerate(args):
            width = kernel._itemsizes.get(i)
            if width is None:
                flat.append(arg)
                word += 1
            else:
                flat += (0, 0, arg.size, width, arg.ptr, arg.size, width)
                self.pointer_words.append(word + 4)
                word += 7
        self.words = kernel._words
        self.template = (ctypes.c_uint64 * self.words)()
        kernel._struct.pack_into(self.template, 0, *flat)
        self._local = threading.local()
        self._launch = _libcuda_ex()

    def _site(self):
        """This thread's parameter block and launch configuration: the driver reads both during
        the call, with the GIL released, so threads must not share them."""
        params = _ParamBlock(self.words)
        ctypes.memmove(params.values, self.template, 8 * self.words)
        config = _launch_config(self.programmatic, self.grid, self.block, self.shared)
        site = self._local.site = (params.values, config, ctypes.addressof(config),
                                   params.address, params)
        return site

    def __call__(self, pointers, stream):
        """Launch with the buffers' new data pointers (in parameter order) on ``stream``."""
        try:
            values, config, config_address, params_address, _ = self._local.site
        except AttributeError:
            values, config, config_address, params_address, _ = self._site()
        for word, ptr in zip(self.pointer_words, pointers):
            values[word] = ptr
        config.stream = stream
        err = self._launch(config_address, self.handle, params_address, None)
        if err:
            _check_code(err, f"launch of {self.name}")

    def bind(self, sources):
        """This launch as a function ``launch(bases, stream)`` whose buffer pointers are
        ``bases[i] + offset``: ``sources`` holds one ``(i, offset)`` per buffer parameter, in
        order (``i < 0``: the recorded pointer, kept). See ``pointer_patch``."""
        targets = [(word, i, offset) for word, (i, offset) in zip(self.pointer_words, sources)
                   if i >= 0]
        return _bound_launch(targets, self._local, self._site, self._launch, self.handle,
                             self.name)


def _patch_source(targets):
    """``values[word] = bases[i] + offset`` for each ``(word, i, offset)``, as one tuple
    assignment (a Python loop over a zip costs about twice as much for a few pointers)."""
    if not targets:
        return "pass"
    lhs = ", ".join(f"values[{int(word)}]" for word, _, _ in targets)
    rhs = ", ".join(f"bases[{int(i)}] + {int(offset)}" if offset else f"bases[{int(i)}]"
                    for _, i, offset in targets)
    return f"{lhs} = {rhs}"


def pointer_patch(targets):
    """A function ``patch(values, bases)`` doing ``values[word] = bases[i] + offset`` for each
    ``(word, i, offset)`` of ``targets`` (ints), generated as straight-line code."""
    namespace: dict = {}
    exec(f"def patch(values, bases):\n    {_patch_source(targets)}\n", namespace)  # noqa: S102
    return namespace["patch"]


# A replayed launch: the site lookup, the pointer writes and the driver call in one function
# (generated per launch site: each Python call or loop step here costs a replay ~0.1 us).
_BOUND_LAUNCH = """
def launch(bases, stream):
    try:
        values, config, config_address, params_address, _ = local.site
    except AttributeError:
        values, config, config_address, params_address, _ = new_site()
    {patch}
    config.stream = stream
    err = driver(config_address, handle, params_address, None)
    if err:
        _check_code(err, what)
"""


def _bound_launch(targets, local, new_site, driver, handle, name):
    namespace = {"local": local, "new_site": new_site, "driver": driver, "handle": handle,
                 "what": f"launch of {name}", "_check_code": _check_code}
    exec(_BOUND_LAUNCH.format(patch=_patch_source(targets)), namespace)  # noqa: S102
    return namespace["launch"]


def _dim3(d):
    if type(d) is int:
        return (d, 1, 1)
    if type(d) is tuple and len(d) == 3:
        return d
    d = tuple(int(x) for x in d)
    return d + (1,) * (3 - len(d))


def _check_code(code, what):
    from cuda.bindings import driver

    _check(driver.CUresult(code), what)


def _check(err, what):
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name}: {msg.decode() if msg else ''}")


_DEVICE_ATTRS = {}
#: ``sm_count``: the SM count planners see (None: the device's); planner tests use an H200's
#: 132 under the simulator (scope ``device`` of ``_overrides.overrides``).
DEVICE = Knobs("device", sm_count=None)


def device_attribute(name):
    """An attribute of the current device (cached), e.g. ``MULTIPROCESSOR_COUNT``."""
    if name not in _DEVICE_ATTRS:
        if SIMULATOR:
            _DEVICE_ATTRS[name] = {"MULTIPROCESSOR_COUNT": 1,
                                   "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
                                   "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
                                   "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024}.get(name, 0)
        else:
            _DEVICE_ATTRS[name] = getattr(cuda.get_current_device(), name)
    return _DEVICE_ATTRS[name]


def sm_count():
    forced = DEVICE.sm_count
    return device_attribute("MULTIPROCESSOR_COUNT") if forced is None else forced


def max_shared_per_block_optin():
    return device_attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


def blocks_by_shared_memory(dynamic_bytes):
    """Blocks of ``dynamic_bytes`` of shared memory each (plus the driver's reserve) that one SM
    holds at once."""
    per_block = dynamic_bytes + device_attribute("RESERVED_SHARED_MEMORY_PER_BLOCK")
    return device_attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR") // max(per_block, 1)
