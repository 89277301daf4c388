"""``python -m llmspeed_numba info``: versions, target and device facts in one place."""

import os
import sys


def info():
    """A dict of what the library runs on."""
    import numba
    import numpy as np

    from . import __version__, ptx
    from ._env import NO_CUDA_MESSAGE, SIMULATOR, cuda, have_gpu

    facts = {
        "llmspeed_numba": __version__,
        "python": sys.version.split()[0],
        "numba": numba.__version__,
        "numba-cuda": _version("numba-cuda"),
        "numpy": np.__version__,
        "cuda-bindings": _version("cuda-bindings"),
        "target": "CUDA simulator" if SIMULATOR else ("GPU" if have_gpu() else NO_CUDA_MESSAGE),
        "ptx backend": ptx.BACKEND,
        "NVVM / nvJitLink": _toolchain(),
        "kernel cache dir": _cache_dir(),
        "kernel machine-code store": _store_dir(),
    }
    if have_gpu():
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        facts.update({
            "device": name,
            "compute capability": "%d.%d" % dev.compute_capability,
            "SM count": dev.MULTIPROCESSOR_COUNT,
            "shared memory per block (opt-in)": dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        })
    return facts


def _toolchain():
    """NVVM and nvJitLink versions: they decide the SASS (registers, spills) a kernel gets."""
    found = []
    try:
        from numba.cuda.cudadrv import nvvm

        found.append("NVVM %d.%d" % nvvm.NVVM().get_version())
    except Exception as exc:  # noqa: BLE001 - informational only
        found.append(f"NVVM unavailable ({type(exc).__name__})")
    try:
        from cuda.bindings import nvjitlink

        found.append("nvJitLink %d.%d" % nvjitlink.version())
    except Exception as exc:  # noqa: BLE001
        found.append(f"nvJitLink unavailable ({type(exc).__name__})")
    return ", ".join(found)


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _store_dir():
    from ._kernel_cache import store_dir, store_enabled

    return store_dir() if store_enabled() else "off (LLMSPEED_NUMBA_KERNEL_STORE=0)"


def _cache_dir():
    """Where numba's on-disk kernel cache goes for this package's kernels."""
    from numba.core.config import CACHE_DIR

    if CACHE_DIR:
        return CACHE_DIR
    package_dir = os.path.dirname(os.path.abspath(__file__))
    if os.access(package_dir, os.W_OK):
        return os.path.join(package_dir, "ops", "__pycache__") + " (beside each op module)"
    from numba.misc.appdirs import AppDirs

    return AppDirs(appname="numba", appauthor=False).user_cache_dir


def print_info():
    for key, value in info().items():
        print(f"{key + ':':<36} {value}")
