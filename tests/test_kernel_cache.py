"""The disk cache's key for a kernel (``_kernel_cache.function_digest``) is the same before and
after the kernel compiles and in every process, and differs between specialisations.

numba's own key (a pickle of the closure) changed when compiling stringified the numba types
held by the closure's device functions, so a kernel saved after compiling was never found by the
next process's lookup. The check compiles real kernels for sm_90a offline, so it runs in child
processes without the simulator (no GPU needed), each with its own hash seed.
"""

import json
import os
import subprocess
import sys

import pytest

#: rms_norm's closure holds device functions (the case numba's key got wrong); gemm's holds
#: intrinsics and constants.
KERNELS = ("rms_norm_f16_4096", "rms_norm_f16_scalar_4099", "gemm_tc_f16_nt_64x128")

_CHILD = r"""
import json, sys
from numba import cuda
from llmspeed_numba import compile_check
from llmspeed_numba._kernel_cache import function_digest

checks = {c.name: c for c in compile_check.checks()}
result = {}
for name in sys.argv[1:]:
    fn, sig, *rest = checks[name].build()
    before = function_digest(fn)
    cuda.compile_ptx(fn, sig, cc=(9, 0), **(rest[0] if rest else {}))
    result[name] = [before, function_digest(fn)]
print(json.dumps(result))
"""


def _start(seed):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONHASHSEED"] = str(seed)
    return subprocess.Popen([sys.executable, "-c", _CHILD, *KERNELS], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _digests(child):
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_kernel_cache_key_is_stable_across_compiles_and_processes():
    children = [_start(seed) for seed in (1, 2)]  # two processes, two hash seeds, side by side
    first, second = (_digests(c) for c in children)
    for name in KERNELS:
        before, after = first[name]
        assert before == after, f"{name}: the key changed when the kernel compiled"
        assert first[name] == second[name], f"{name}: the key differs between processes"
    keys = {first[name][0] for name in KERNELS}
    assert len(keys) == len(KERNELS), "two different kernels share a cache key"


# ---- the machine-code store --------------------------------------------------------------------

def test_store_round_trip_and_malformed_files(tmp_path, monkeypatch):
    from llmspeed_numba import _kernel_cache as kc

    monkeypatch.setenv("LLMSPEED_NUMBA_CACHE", str(tmp_path))
    key = "ab" * 32
    assert kc.read(key) is None  # absent
    kc.save(key, "_Z6kernelPf", b"\x7fELF cubin bytes\n with newlines")
    assert kc.read(key) == ("_Z6kernelPf", b"\x7fELF cubin bytes\n with newlines")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [key + ".cubin"]  # no temp left

    class LinkerOutput:  # numba's linker returns a cuda-core ObjectCode, its bytes in .code
        code = b"\x7fELF linked"

    kc.save(key, "entry", LinkerOutput())
    assert kc.read(key) == ("entry", b"\x7fELF linked")
    with pytest.raises(TypeError, match="cubin"):
        kc.save(key, "entry", object())
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [key + ".cubin"]
    path = kc.store_path(key)
    with open(path, "rb") as f:
        whole = f.read()
    for bad in (b"", b"not ours", kc._MAGIC, kc._MAGIC + b"entry-without-cubin\n",
                whole[:-3], whole[:-1] + b"X"):  # truncated, one byte changed
        with open(path, "wb") as f:
            f.write(bad)
        assert kc.read(key) is None, bad


# A child process: rms_norm's first result, its error against float64, and where its kernel
# came from (the store's driver library, or numba's compile / cache load).
_STORE_CHILD = r"""
import json
import numpy as np
from numba import cuda
import llmspeed_numba as ln
from llmspeed_numba import _launch

x = np.random.default_rng(0).standard_normal((8, 4096)).astype(np.float16)
w = np.random.default_rng(1).standard_normal(4096).astype(np.float16)
dx, dw = cuda.to_device(x), cuda.to_device(w)
out = ln.rms_norm(dx, dw).copy_to_host()
with _launch.collecting_kernels() as kernels:
    ln.rms_norm(dx, dw)
xf = x.astype(np.float64)
ref = xf / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + 1e-6) * w.astype(np.float64)
print(json.dumps({"error": float(np.abs(out - ref).max()),
                  "from_store": [k._library is not None for k in kernels],
                  "numba_overloads": sum(len(k.dispatcher.overloads) for k in kernels)}))
"""


def _run_children(n, cache):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    # replay off: a replayed call launches without going through Kernel, so collecting_kernels
    # would see none
    env.update(LLMSPEED_NUMBA_CACHE=str(cache), NUMBA_CACHE_DIR=str(cache / "numba"),
               LLMSPEED_NUMBA_KERNEL_STORE="1", LLMSPEED_NUMBA_REPLAY="0")
    children = [subprocess.Popen([sys.executable, "-c", _STORE_CHILD], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(n)]
    return [_digests(c) for c in children]


@pytest.mark.gpu
def test_store_serves_a_new_process_and_survives_races_and_corruption(tmp_path):
    """Two processes compile the same kernel at once into an empty store (both write it); the
    next loads it from the store without numba compiling or loading anything, with the same
    result; a truncated file is dropped, the kernel compiled again and the file rewritten."""
    first = _run_children(2, tmp_path)
    for r in first:
        assert r["error"] < 2e-2 and r["from_store"] == [False] and r["numba_overloads"] == 1
    stored = list((tmp_path / "kernels").glob("*.cubin"))
    assert len(stored) == 1 and not list((tmp_path / "kernels").glob("*.tmp"))
    (hit,) = _run_children(1, tmp_path)
    assert hit == {"error": first[0]["error"], "from_store": [True], "numba_overloads": 0}
    size = stored[0].stat().st_size
    with open(stored[0], "r+b") as f:
        f.truncate(size // 2)
    (again,) = _run_children(1, tmp_path)
    assert again["error"] == first[0]["error"] and again["from_store"] == [False]
    assert stored[0].stat().st_size == size
    (hit,) = _run_children(1, tmp_path)
    assert hit["from_store"] == [True]


_DESCRIBE_ALL = r"""
from llmspeed_numba import compile_check
from llmspeed_numba._kernel_cache import function_digest

for check in compile_check.checks():
    fn = check.build()[0]
    try:
        function_digest(fn)
    except Exception as exc:
        raise SystemExit(f"{check.name}: {type(exc).__name__}: {exc}")
print("ok")
"""


def test_every_registered_kernel_has_a_cache_key():
    """The key describes every closure cell of a kernel; a factory that leaves a cell unbound
    (a name assigned on one branch only) fails here rather than at the first GPU launch."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    child = subprocess.run([sys.executable, "-c", _DESCRIBE_ALL], env=env, capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, (child.stdout + child.stderr)[-3000:]


def test_store_key_misses_on_any_changed_input(monkeypatch):
    """The store's key changes with the kernel's source, its signature, its options, the compute
    capability, numba-cuda's version and the package's source that kernels may reach (which
    holds its version): a cached kernel is never loaded for another build."""
    import types as pytypes

    import numba_cuda
    from numba.core import types

    from llmspeed_numba import _kernel_cache

    def kernel_a(x):
        x[0] = 1

    def kernel_b(x):
        x[0] = 2

    def dispatcher(fn, **options):
        return pytypes.SimpleNamespace(py_func=fn, targetoptions=options)

    sig = (types.float32[::1],)
    base = _kernel_cache.store_key(dispatcher(kernel_a), sig, (9, 0))
    assert base == _kernel_cache.store_key(dispatcher(kernel_a), sig, (9, 0))
    changed = {
        "source": _kernel_cache.store_key(dispatcher(kernel_b), sig, (9, 0)),
        "signature": _kernel_cache.store_key(dispatcher(kernel_a), (types.float64[::1],), (9, 0)),
        "options": _kernel_cache.store_key(dispatcher(kernel_a, max_registers=64), sig, (9, 0)),
        "compute capability": _kernel_cache.store_key(dispatcher(kernel_a), sig, (8, 0)),
    }
    monkeypatch.setattr(numba_cuda, "__version__", numba_cuda.__version__ + ".other")
    changed["numba-cuda version"] = _kernel_cache.store_key(dispatcher(kernel_a), sig, (9, 0))
    monkeypatch.undo()
    monkeypatch.setattr(_kernel_cache, "kernel_source_digest", lambda: "another package source")
    changed["package source"] = _kernel_cache.store_key(dispatcher(kernel_a), sig, (9, 0))
    for what, key in changed.items():
        assert key != base, f"the key ignores a changed {what}"
    assert len(set(changed.values())) == len(changed)


def test_kernel_source_digest_skips_only_the_host_only_parts(tmp_path):
    """An edit under a ``HOST_ONLY`` part keeps the digest; an edit anywhere else changes it."""
    from llmspeed_numba import _kernel_cache

    for name in ("__init__.py", "ops/gemm.py", "models/llama.py", "warm.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    base = _kernel_cache.source_digest(tmp_path, _kernel_cache.HOST_ONLY)
    for name in ("models/llama.py", "warm.py"):
        (tmp_path / name).write_text("x = 2\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "llm.py").write_text("y = 1\n")
    assert _kernel_cache.source_digest(tmp_path, _kernel_cache.HOST_ONLY) == base
    (tmp_path / "ops" / "gemm.py").write_text("x = 2\n")
    assert _kernel_cache.source_digest(tmp_path, _kernel_cache.HOST_ONLY) != base
    assert _kernel_cache.source_digest(tmp_path) != _kernel_cache.source_digest(
        tmp_path, _kernel_cache.HOST_ONLY)


def test_no_kernel_module_imports_a_host_only_part():
    """What ``kernel_source_digest`` leaves out must stay out of every kernel's reach: no module
    outside ``HOST_ONLY`` imports one inside it (a device function reached through such an
    import would be compiled from a source the cache key does not see), except the package's
    ``__init__.py``, whose imports name the public API (``LLM``...), no kernel's code."""
    import ast
    import pathlib

    from llmspeed_numba import _kernel_cache

    root = pathlib.Path(_kernel_cache.__file__).resolve().parent
    host_only = _kernel_cache.HOST_ONLY

    def part(relative):
        return next((h for h in host_only if relative.startswith(h)), None)

    def module_path(package, level, name):
        """The package-relative path prefix an import resolves to ("" for the package)."""
        parts = list(package)[:len(package) - level + 1] if level else []
        parts += [p for p in (name or "").split(".") if p]
        if not level and parts[:1] == ["llmspeed_numba"]:
            parts = parts[1:]
        elif not level:
            return None   # not ours
        return "/".join(parts)

    offenders = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if part(relative) or relative == "__init__.py":
            continue
        package = relative.split("/")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = module_path(package, node.level, node.module)
                targets = [base] if base is None else [
                    f"{base}/{alias.name}" if base else alias.name for alias in node.names]
                targets.append(base)
            elif isinstance(node, ast.Import):
                targets = [module_path(package, 0, alias.name) for alias in node.names]
            else:
                continue
            for target in targets:
                if target is None:
                    continue
                for candidate in (target + "/", target + ".py"):
                    if part(candidate):
                        offenders.append(f"{relative} imports {target}")
    assert not offenders, offenders
