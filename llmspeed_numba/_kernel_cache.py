"""Kernels cached on disk: numba's cache with keys that hold across processes, and a store of
machine code that a new process loads without numba's compile pipeline.

**Stable keys.** numba's on-disk cache must find a cached kernel again in a new process.

numba keys a cached kernel on a pickle of its closure variables. Our kernels are closures of
cached factories whose cells hold device functions; a device function pickles by value with the
numba types it refers to, and a numba type pickles its ``__dict__``, which gains a cached
``str()`` the first time anything prints it (compiling does). So the key computed before a
compile (looking the kernel up) and after it (saving it) differ, and every process compiled every
kernel again. ``StableKeyCache`` keys on a description of the closure built from names, code
bytes and values instead, which is the same before and after compiling and in every process, plus
a digest of this package's source (``kernel_source_digest``: all but the model, engine and
tooling layers, which no kernel reaches): the device functions a kernel calls through module
globals are not in its closure, and an edited package must not load kernels compiled from the old
one.

**Machine-code store.** Even when numba's cache hits, loading an entry goes through numba's
dispatcher, which loads its typing and lowering registries first (about a second, once a
process). ``load`` and ``save`` keep each kernel's cubin and entry name in one file,
``$LLMSPEED_NUMBA_CACHE/kernels/<key>.cubin``, keyed by ``function_digest``, the signature, the
compile options, the GPU's compute capability and numba-cuda's version; ``load`` hands it to the
driver through cuda-core's ``ObjectCode``. Files are written whole under a temporary name and
renamed into place, so concurrent writers race harmlessly; a file the driver rejects (truncated,
corrupt: each file carries its cubin's sha256, checked before the driver sees it) is removed
and written again by the next compile. ``LLMSPEED_NUMBA_KERNEL_STORE=0`` turns
the store off.
"""

import functools
import hashlib
import os
import pathlib
import tempfile
import types as pytypes

import numpy as np


#: Parts of the package that no kernel's code reaches (the model, engine and tooling layers on
#: top of the ops; ``tests/test_kernel_cache.py`` checks that nothing else imports them): left
#: out of ``kernel_source_digest``, so editing them keeps the cached kernels.
HOST_ONLY = ("models/", "engine/", "distributed/", "demos/", "__main__.py", "_demo.py",
             "_info.py", "_progress.py", "cli.py", "testing.py", "warm.py")


def source_digest(root, skip=()):
    """sha256 of the paths and contents of the ``.py`` files under ``root`` whose relative path
    does not start with an entry of ``skip``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(tuple(skip)):
            continue
        h.update(relative.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def package_digest():
    """sha256 of every ``.py`` file of the package (paths and contents)."""
    return source_digest(pathlib.Path(__file__).resolve().parent)


@functools.cache
def kernel_source_digest():
    """sha256 of the package's files that kernels may reach (all but ``HOST_ONLY``; the
    version is in ``__init__.py``)."""
    return source_digest(pathlib.Path(__file__).resolve().parent, HOST_ONLY)


def _code_description(code, seen):
    consts = [_code_description(c, seen) if isinstance(c, pytypes.CodeType) else _describe(c, seen)
              for c in code.co_consts]
    return ("code", code.co_qualname, code.co_code.hex(), tuple(code.co_names), tuple(consts))


def _function_description(fn, seen):
    if id(fn) in seen:  # a recursive reference: its name is enough
        return ("function-ref", fn.__module__, fn.__qualname__)
    seen.add(id(fn))
    cells = tuple(_describe(c.cell_contents, seen) for c in (fn.__closure__ or ()))
    return ("function", fn.__module__, fn.__qualname__, _code_description(fn.__code__, seen),
            tuple(fn.__code__.co_freevars), cells,
            _describe(fn.__defaults__, seen), _describe(fn.__kwdefaults__, seen))


def _describe(value, seen):
    """A nested tuple of strings and numbers that names ``value`` the same way in any process."""
    from numba.core import types
    from numba.cuda.dispatcher import CUDADispatcher
    from numba.cuda.extending import _Intrinsic

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_describe(v, seen) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, tuple(sorted(repr(_describe(v, seen)) for v in value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(_describe(k, seen)), _describe(v, seen))
                                     for k, v in value.items())))
    if isinstance(value, (np.dtype, np.generic)):
        return ("numpy", type(value).__name__, repr(value))
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape,
                hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest())
    if isinstance(value, types.Type):
        return ("numba-type", type(value).__name__, str(value))
    if isinstance(value, CUDADispatcher):
        return ("dispatcher", _function_description(value.py_func, seen),
                _describe(dict(value.targetoptions), seen))
    if isinstance(value, _Intrinsic):
        return ("intrinsic", value._name, _function_description(value._defn, seen))
    if isinstance(value, pytypes.FunctionType):
        return _function_description(value, seen)
    if isinstance(value, (type, pytypes.ModuleType, pytypes.BuiltinFunctionType)):
        return (type(value).__name__, getattr(value, "__module__", ""),
                getattr(value, "__qualname__", value.__name__))
    # anything else: numba's own pickle, as its cache would use (stable for plain values)
    from numba.core.serialize import dumps

    return ("pickle", hashlib.sha256(dumps(value)).hexdigest())


def function_digest(py_func):
    """sha256 of a kernel's stable description and of the package source kernels may reach."""
    description = repr(_function_description(py_func, set()))
    return hashlib.sha256((kernel_source_digest() + description).encode()).hexdigest()


def _stable_cache_class():
    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class StableKeyCache(CUDACache):
        """numba's CUDA cache with ``function_digest`` in place of the closure's pickle."""

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__,
                   function_digest(self._py_func))
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key

    return StableKeyCache


@functools.cache
def stable_cache_class():
    return _stable_cache_class()


def use_stable_keys(dispatcher):
    """Replace a caching dispatcher's cache by ``StableKeyCache`` (same files, stable keys)."""
    dispatcher._cache = stable_cache_class()(dispatcher.py_func)
    dispatcher.stable_keys = True  # its kernels may be kept in the machine-code store
    return dispatcher


# ---- machine-code store ----------------------------------------------------------------------

_MAGIC = b"llmspeed_numba cubin 2\n"


def store_enabled():
    return os.environ.get("LLMSPEED_NUMBA_KERNEL_STORE", "1") not in ("", "0")


def store_dir():
    from ._tuning_cache import cache_dir

    return os.path.join(cache_dir(), "kernels")


def store_key(dispatcher, signature, cc):
    """The store's name for one compiled kernel (hex sha256)."""
    import numba_cuda

    options = _describe(dict(dispatcher.targetoptions), set())
    text = repr((function_digest(dispatcher.py_func), repr(tuple(signature)), options,
                 tuple(cc), numba_cuda.__version__))
    return hashlib.sha256(text.encode()).hexdigest()


def store_path(key):
    return os.path.join(store_dir(), key + ".cubin")


def save(key, entry_name, cubin):
    """Write ``cubin`` (bytes, or the cuda-core ``ObjectCode`` numba's linker returns) with its
    entry point's name under ``key``, atomically. The store is an optimisation: a failure to
    write leaves it without the kernel, nothing else."""
    code = getattr(cubin, "code", cubin)
    if not isinstance(code, (bytes, bytearray, memoryview)):
        raise TypeError(f"cubin: expected bytes or an ObjectCode holding bytes, got "
                        f"{type(code).__name__}")
    folder = store_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            code = bytes(code)
            digest = hashlib.sha256(code).hexdigest().encode()
            f.write(_MAGIC + entry_name.encode() + b"\n" + digest + b"\n" + code)
        os.replace(tmp, store_path(key))
    except OSError:
        pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read(key):
    """``(entry_name, cubin)`` stored under ``key``, or None when absent or malformed."""
    try:
        with open(store_path(key), "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(_MAGIC):
        return None
    entry, _, rest = data[len(_MAGIC):].partition(b"\n")
    digest, _, cubin = rest.partition(b"\n")
    # checked here: the driver crashes the process on a truncated cubin instead of failing
    if not entry or not cubin or hashlib.sha256(cubin).hexdigest().encode() != digest:
        return None
    return entry.decode(errors="replace"), cubin


def load(key):
    """``(object_code, kernel_handle)`` of the kernel stored under ``key`` (a cuda.core
    ``ObjectCode``, which must live as long as the kernel is used, and its ``CUkernel``), or None
    when it is absent, malformed or rejected by the driver (a bad file is removed, so the next
    compile writes it again)."""
    from cuda.core import ObjectCode

    path = store_path(key)
    if not os.path.exists(path):
        return None
    found = read(key)
    if found is not None:
        entry, cubin = found
        try:
            code = ObjectCode.from_cubin(cubin, name=key)
            return code, code.get_kernel(entry).handle
        except Exception:  # noqa: BLE001  (any driver or format error: recompile)
            pass
    try:
        os.unlink(path)
    except OSError:
        pass
    return None
