"""Compile kernels for ``sm_90a`` without a GPU and read what the compiler made of them.

A kernel that silently fell off the Tensor Core path, or started spilling, is still correct, so
only its machine code shows it. Ops register their performance-critical kernels here with
``register``; ``python -m llmspeed_numba compile-check`` (run by the CI test
``tests/test_compile_check.py``, in a process without the simulator) compiles each one to PTX with
NVVM, links it to a cubin with nvJitLink, disassembles it with nvdisasm and checks:

- the PTX holds the instructions asked for (``mma.sync``, ``ldmatrix``, ``cp.async``...);
- the SASS holds their machine forms (``HMMA``, ``LDSM``, ``LDGSTS``...);
- no local memory: no ``STL``/``LDL`` in the SASS and no spill bytes or stack frame in ptxas'
  report.

Needs ``numba-cuda[cu13]`` (NVVM, nvJitLink) and ``nvidia-cuda-nvdisasm``; no driver.
"""

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

TARGET_CC = (9, 0, "a")
_TARGET_ARCH = "sm_90a"


@dataclasses.dataclass
class KernelCheck:
    """One kernel to compile: ``build()`` returns ``(python_function, signature)`` of a kernel, or
    ``(python_function, signature, options)`` with ``cuda.compile_ptx`` options such as
    ``launch_bounds`` (so the check sees the register cap the kernel runs with), plus
    ``lto=True`` to link the kernel as LTO-IR, whole-program, as numba does on a GPU with
    nvJitLink, instead of as relocatable PTX (ptxas drops ``setmaxnreg`` from the latter)."""
    name: str
    build: object
    ptx_must_have: tuple = ()
    sass_must_have: tuple = ()
    #: local memory (spill / stack bytes, each) tolerated, for a measured reason (``why``)
    allowed_local_bytes: int = 0
    why: str = ""
    #: ``(start, inside, end)`` SASS text: after some ``start``, an ``inside`` before the next
    #: ``end`` (e.g. the softmax's exponentials between S's wgmma wait and P V's)
    sass_between: tuple = ()
    #: most registers a thread may use (0: any): the resident blocks an SM a planner counts on
    max_registers: int = 0


@dataclasses.dataclass
class CompileReport:
    name: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    ptx_found: dict
    sass_found: dict
    local_memory_instructions: int
    problems: list


_REGISTRY = {}


def register(name, build, ptx_must_have=(), sass_must_have=(), allowed_local_bytes=0, why="",
             sass_between=(), max_registers=0):
    """Add a kernel to the compile-only check (called at import by each op module).
    ``allowed_local_bytes`` > 0 tolerates that much spill / stack (each figure) and needs ``why``:
    the measurement that shows the spilling variant is still the faster one. ``sass_between``,
    ``max_registers``: see ``KernelCheck``."""
    if allowed_local_bytes and not why:
        raise ValueError(f"{name}: allowed_local_bytes needs a reason (why=)")
    _REGISTRY[name] = KernelCheck(name, build, tuple(ptx_must_have), tuple(sass_must_have),
                                  allowed_local_bytes, why, tuple(sass_between), max_registers)


def sass_between(sass, start, inside, end):
    """Whether, in ``sass``'s text, some line holding ``start`` is followed by one holding
    ``inside`` before the next holding ``end``."""
    armed = False
    for line in sass.splitlines():
        if start in line:
            armed = True
        elif armed and inside in line:
            return True
        elif end in line:
            armed = False
    return False


def _import_ops():
    """Import every ops module: each registers its kernels at import (the package imports the
    exported ones only; warp_tile, a PTX self-test, is not exported)."""
    import importlib
    import pkgutil

    from . import ops

    for info in pkgutil.iter_modules(ops.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{ops.__name__}.{info.name}")


def registered():
    """Every registered check by name (every ops module imported first)."""
    _import_ops()
    return dict(_REGISTRY)


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia.cu13 as cu13
        for folder in cu13.__path__:  # a namespace package: no __file__
            candidate = os.path.join(folder, "bin", "nvdisasm")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")


def _link(data, input_type, options):
    """nvJitLink one input with ``options``; returns (cubin bytes, ptxas info log)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(len(options), options)
    try:
        nvjitlink.add_data(handle, input_type, data, len(data), "kernel")
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin), log.decode(errors="replace")


def ptx_to_cubin(ptx_text, arch=_TARGET_ARCH):
    """Link PTX to a cubin with nvJitLink (compiled as relocatable code); returns (cubin bytes,
    ptxas info log)."""
    from cuda.bindings import nvjitlink

    return _link(ptx_text.encode(), nvjitlink.InputType.PTX,
                 [f"-arch={arch}", "-O3", "-Xptxas=-v"])


def ltoir_to_cubin(ltoir, arch=_TARGET_ARCH):
    """Link LTO-IR to a cubin with nvJitLink ``-lto`` (optimised and compiled as one whole
    program, as numba links kernels on a GPU with nvJitLink); returns (cubin bytes, log)."""
    from cuda.bindings import nvjitlink

    return _link(ltoir, nvjitlink.InputType.LTOIR, [f"-arch={arch}", "-lto", "-O3", "-Xptxas=-v"])


def disassemble(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvdisasm(), "-c", f.name], check=True, capture_output=True,
                              text=True).stdout


def _first_int(pattern, text):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else 0


def compile_kernel(check: KernelCheck) -> CompileReport:
    from numba import cuda

    pyfunc, sig, *rest = check.build()
    options = dict(rest[0]) if rest else {}
    lto = options.pop("lto", False)
    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=TARGET_CC, **options)
    if lto:
        ltoir, _ = cuda.compile(pyfunc, sig, cc=TARGET_CC, output="ltoir", device=False,
                                abi="numba", **options)
        cubin, log = ltoir_to_cubin(ltoir)
    else:
        cubin, log = ptx_to_cubin(ptx)
    sass = disassemble(cubin)
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ptx_found = {s: ptx.count(s) for s in check.ptx_must_have}
    sass_found = {s: sum(op.startswith(s) for op in opcodes) for s in check.sass_must_have}
    local = sum(op.startswith(("STL", "LDL")) for op in opcodes)
    report = CompileReport(
        name=check.name,
        registers=_first_int(r"Used (\d+) registers", log),
        stack_frame_bytes=_first_int(r"(\d+) bytes stack frame", log),
        spill_store_bytes=_first_int(r"(\d+) bytes spill stores", log),
        spill_load_bytes=_first_int(r"(\d+) bytes spill loads", log),
        ptx_found=ptx_found, sass_found=sass_found, local_memory_instructions=local,
        problems=[])
    for s, n in ptx_found.items():
        if n == 0:
            report.problems.append(f"PTX lacks {s}")
    for s, n in sass_found.items():
        if n == 0:
            report.problems.append(f"SASS lacks {s}")
    if check.sass_between and not sass_between(sass, *check.sass_between):
        start, inside, end = check.sass_between
        report.problems.append(f"SASS has no {inside} between {start} and the next {end}")
    # e.g. C7515 "wgmma ... serialized": the kernel would run, several times slower (C7509
    # "Extern calls" and C7511 "insufficient register resources" say it in info lines)
    # ... and C7504 / C7508 (info lines): setmaxnreg dropped, the register split silently lost
    for line in log.splitlines():
        if ("warning" in line.lower() or "'setmaxnreg' ignored" in line
                or "instructions are serialized" in line):
            report.problems.append(f"ptxas: {line.strip()}")
    if check.max_registers and report.registers > check.max_registers:
        report.problems.append(f"{report.registers} registers, more than {check.max_registers}: "
                               f"fewer blocks an SM than its planner counts on")
    worst = max(report.spill_store_bytes, report.spill_load_bytes, report.stack_frame_bytes)
    tolerated = 0 < check.allowed_local_bytes and worst <= check.allowed_local_bytes
    if (local or worst) and not tolerated:
        report.problems.append(
            f"local memory: {local} STL/LDL, {report.spill_store_bytes} B spill stores, "
            f"{report.spill_load_bytes} B spill loads, {report.stack_frame_bytes} B stack")
    return report


def checks(names=None):
    """The registered checks (all, or those named), sorted by name; ``ValueError`` for a name
    that is not registered."""
    _import_ops()

    unknown = sorted(set(names or ()) - set(_REGISTRY))
    if unknown:
        raise ValueError(f"kernel names: {unknown} are not registered; 'compile-check --list' "
                         f"shows the {len(_REGISTRY)} that are")
    return [c for n, c in sorted(_REGISTRY.items()) if not names or n in names]


def check_kernel(check: KernelCheck) -> CompileReport:
    """``compile_kernel``, with a failure to compile reported as a problem of that kernel (so
    one broken kernel does not hide the others' reports)."""
    try:
        return compile_kernel(check)
    except Exception as exc:  # noqa: BLE001 - reported, and the check fails
        return CompileReport(check.name, 0, 0, 0, 0, {}, {}, 0,
                             [f"compile failed: {type(exc).__name__}: {exc}"])


def run_all(names=None):
    return [check_kernel(c) for c in checks(names)]
