"""The command line (``llmspeed_numba/cli.py``): help for every command, usage errors, ``info``
reports the target, ``demo`` runs and checks ops and on a machine without a GPU restarts itself
in the simulator (so the README's first command works anywhere); and without a GPU or the
simulator, the library says how to run in the simulator."""

import os
import re
import subprocess
import sys

import pytest

from llmspeed_numba import _env
from llmspeed_numba.cli import main

COMMANDS = ("info", "demo", "compile-check", "help")


def _run(*args, simulator_env, code=None):
    """``simulator_env``: True keeps this process's environment, False removes the simulator's
    switch, "force" sets it (a child in the simulator on any machine)."""
    env = dict(os.environ)
    if not simulator_env:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    elif simulator_env == "force":
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    command = ["-c", code] if code else ["-m", "llmspeed_numba", *args]
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                          timeout=600)


def _main(capsys, *argv):
    """Exit status and (stdout, stderr) of ``main(argv)`` in this process."""
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse: --help, usage errors
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv", [(), ("-h",), ("--help",), ("help",)])
def test_overall_help(argv, capsys):
    status, out, _ = _main(capsys, *argv)
    assert status == 0
    assert out.startswith("usage: python -m llmspeed_numba")
    for command in COMMANDS:
        assert f"\n    {command} " in out or f"\n    {command}\n" in out, out


@pytest.mark.parametrize("command, described", [
    ("info", ["compute capability", "kernel cache"]),
    ("demo", ["FILTER", "--list", "simulator", "exit status"]),
    ("compile-check", ["KERNEL", "--list", "--json PATH", "sm_90a", "exit status"]),
    ("help", ["command"]),
])
def test_command_help_describes_it_and_runs_nothing(command, described, capsys):
    status, out, err = _main(capsys, command, "--help")
    assert status == 0 and not err
    assert out.startswith(f"usage: python -m llmspeed_numba {command}")
    for text in described:
        assert text in out, out
    assert "failure(s)" not in out and "llmspeed_numba demo on" not in out   # no demo table
    assert _main(capsys, "help", command)[1] == out   # `help COMMAND` prints the same


@pytest.mark.parametrize("argv, complaint", [
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("--frobnicate",), "unrecognized arguments: --frobnicate"),
    (("info", "--bogus"), "unrecognized arguments: --bogus"),
    (("info", "extra"), "unrecognized arguments: extra"),
    (("compile-check", "--json"), "expected one argument"),
    (("help", "frobnicate"), "unknown command 'frobnicate'"),
])
def test_usage_errors_exit_2_with_the_usage(argv, complaint, capsys):
    status, out, err = _main(capsys, *argv)
    assert status == 2 and not out
    assert err.startswith("usage: python -m llmspeed_numba") and complaint in err, err
    if argv[0] in ("info", "help") and len(argv) > 1:   # the command's own usage
        assert err.startswith(f"usage: python -m llmspeed_numba {argv[0]}"), err


def test_generate_quantization_option(capsys):
    status, out, _ = _main(capsys, "generate", "--help")
    assert status == 0 and "--quantization {int4,int8,fp8,gguf}" in out, out
    status, _, err = _main(capsys, "generate", "Hi", "--quantization", "int3")
    assert status == 2 and "invalid choice: 'int3'" in err, err
    if _env.SIMULATOR:
        status, _, err = _main(capsys, "generate", "Hi", "--quantization", "gguf")
        assert status == 2 and "--quantization gguf needs a .gguf model and a GPU" in err, err


def test_demo_lists_and_filters_cases_without_running_them(capsys):
    status, out, _ = _main(capsys, "demo", "--list")
    assert status == 0
    ops = [line.split("  ")[0] for line in out.splitlines()]
    assert len(ops) >= 10 and any(op.startswith("gemm") for op in ops)
    status, out, _ = _main(capsys, "demo", "--list", "warp_tile", "gelu")
    listed = out.splitlines()
    assert status == 0 and listed and all("warp_tile" in s or "gelu" in s for s in listed)
    assert "llmspeed_numba demo on" not in out   # no demo table: nothing ran
    status, _, err = _main(capsys, "demo", "no_such_op")
    assert status == 2 and "no demo case matches ['no_such_op']" in err


def test_compile_check_refuses_the_simulator_and_unknown_kernels():
    # in a child: on a GPU machine this process is not the simulator, and an in-process
    # compile-check would compile every registered kernel
    proc = _run("compile-check", simulator_env="force")
    assert proc.returncode == 2 and "unset NUMBA_ENABLE_CUDASIM" in proc.stderr, proc.stderr[-2000:]
    proc = _run("compile-check", "no_such_kernel", simulator_env=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "usage: python -m llmspeed_numba compile-check" in proc.stderr
    assert "['no_such_kernel'] are not registered" in proc.stderr
    proc = _run("compile-check", "--list", simulator_env=False)
    assert proc.returncode == 0 and "warp_tile_f16" in proc.stdout.split(), proc.stderr[-2000:]


def test_info_names_the_target():
    proc = _run("info", simulator_env=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "numba-cuda:" in proc.stdout and "target:" in proc.stdout
    target = "CUDA simulator" if _env.SIMULATOR else "GPU"
    assert re.search(rf"^target: +{target}$", proc.stdout, re.M), proc.stdout


def test_demo_checks_ops_on_whatever_target_exists():
    proc = _run("demo", "warp_tile", simulator_env=False)  # no GPU: it must re-run itself
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "warp_tile_matmul float16" in proc.stdout
    assert "2 case(s), 0 failure(s)" in proc.stdout


_NO_SIMULATOR = """
import numpy as np
import llmspeed_numba as lsn
print("gpu", lsn.have_gpu())
try:
    lsn.rms_norm(np.ones((2, 8), np.float16), np.ones(8, np.float16))
except Exception as exc:
    print("op", type(exc).__name__, exc)
try:
    lsn.PagedKVCache(4, 8, 1, 16)
    print("cache ok")
except Exception as exc:
    print("cache", type(exc).__name__, exc)
"""


def test_without_gpu_or_simulator_ops_say_how_to_use_the_simulator():
    """Without the simulator flag the import succeeds; on a machine without a GPU (CI) the
    first op and ``PagedKVCache`` raise ``NoCudaError`` and ``info`` says the same; with a GPU
    the op rejects the host array instead and the cache is created."""
    proc = _run(simulator_env=False, code=_NO_SIMULATOR)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    info = _run("info", simulator_env=False)
    assert info.returncode == 0, info.stderr[-2000:]
    if lines[0] == "gpu False":
        message = _env.NO_CUDA_MESSAGE
        assert lines[1] == f"op NoCudaError {message}"
        assert lines[2] == f"cache NoCudaError {message}"
        assert f"target: {message}" in " ".join(info.stdout.split())
    else:
        assert lines[1].startswith("op TypeError x: expected a device array")
        assert lines[2] == "cache ok"
        assert "target: GPU" in " ".join(info.stdout.split())
    assert issubclass(_env.NoCudaError, RuntimeError)
