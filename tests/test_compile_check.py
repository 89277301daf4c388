"""Compile-only check, no GPU: every registered kernel is compiled for sm_90a offline and must
keep its Tensor Core / vector instructions in SASS with no local memory (see compile_check.py).

Runs ``python -m llmspeed_numba compile-check`` in child processes without the simulator (this
process has ``NUMBA_ENABLE_CUDASIM=1``), each on half of the registered kernels. They start when
this module is collected, so their minutes of NVVM/ptxas work run beside the simulator tests.
Under pytest-xdist (``-n 2``) only the first worker starts them; they write their reports to a
folder named by the run's id, where the worker that runs these tests (any) reads them.
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

#: Child processes: with two cores, two children and the simulator tests share them, so the
#: NVVM/ptxas minutes end about when the tests do instead of a single child running on alone.
CHILDREN = 2
#: Each child's command: the compile check, then its exit status in ``<part>.rc`` (the marker
#: that its ``<part>.json`` and ``<part>.log`` are complete).
_CHILD = ('"$1" -m llmspeed_numba compile-check --json "$0.json" "${@:2}" > "$0.log" 2>&1; '
          'echo $? > "$0.rc.tmp"; mv "$0.rc.tmp" "$0.rc"')
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_FOLDER = os.path.join(tempfile.gettempdir(), "llmspeed-compile-check-" + os.environ.get(
    "PYTEST_XDIST_TESTRUNUID", str(os.getpid())))


def _registered():
    from llmspeed_numba import compile_check  # registered() imports every op module

    return sorted(compile_check.registered())


def _start_compile_check(names):
    os.makedirs(_FOLDER, exist_ok=True)
    for name in os.listdir(_FOLDER):  # a previous run's, if the id repeats
        os.remove(os.path.join(_FOLDER, name))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.pop("LLMSPEED_NUMBA_PTX_BACKEND", None)
    children = []
    for i in range(CHILDREN):
        part = os.path.join(_FOLDER, f"part{i}")
        children.append(subprocess.Popen(
            ["bash", "-c", _CHILD, part, sys.executable, *names[i::CHILDREN]], env=env))

    def finish():
        # the children's reports may be read by another worker: wait for them when these tests
        # are selected in this run (conftest.py says), else stop them
        for proc in children:
            if os.environ.get("LLMSPEED_COMPILE_CHECK_SELECTED") == "1":
                proc.wait()
            elif proc.poll() is None:
                proc.kill()

    atexit.register(finish)


#: Left out of the simulator suite's run (CI has two cores; a GEMM kernel takes 15-45 s of NVVM and
#: ptxas): each is its sibling's tile, layouts and dtypes without the sibling's epilogue or split,
#: which the sibling's compile covers. ``LLMSPEED_COMPILE_CHECK=all`` (the GPU suite) and
#: ``python -m llmspeed_numba compile-check`` compile every registered kernel.
COVERED_BY_SIBLING = {
    "gemm_tc_f16_nt_64x128": "gemm_tc_f16_nt_64x128_gelu_and_mul",
    "gemm_tc_bf16_decode_nt_split": "gemm_tc_bf16_decode_nt_silu_and_mul_split",
    "gemm_wgmma_f16_nt": "gemm_wgmma_f16_nt_silu_and_mul",
    "gemm_wgmma_bf16_nt_64x128": "gemm_wgmma_bf16_nt_64x128_split",
    "gemm_wgmma_bf16_nt_64x256_split": "gemm_wgmma_bf16_nt_64x256_silu_and_mul_split",
    "flash_attn_wgmma_d64_varlen_bf16_persistent": "flash_attn_wgmma_d64_bf16_persistent",
    "quant_stream_int4_g128_bf16_m16_norm": "quant_stream_int4_g128_bf16_m1_splitk_norm",
    # the opt-in forms: the programmatic launch's two instructions, the gated epilogue with x
    # normed (its sibling: x normed with the accumulating epilogue)
    "quant_stream_int4_g128_bf16_m1_programmatic": "quant_stream_int4_g128_bf16_m1",
    "quant_stream_int4_g128_bf16_m1_gated_xnorm":
        "quant_stream_int4_g128_bf16_m1_splitk_xnorm_accumulate",
    # head dim 256's varlen form: d256's tiles, with the varlen indexing of the d64 / d128 forms
    "flash_attn_wgmma_d256_bf16_varlen": "flash_attn_wgmma_d256_bf16",
}
#: Also left out of the simulator suite's run: the slowest compiles (each several minutes of the
#: two cores, measured in the suite), with a lighter kernel of the same family checked there.
GPU_SUITE_ONLY = {
    "gemm_simt_f32_nn": "gemm_simt_f32_nn_64x64",                 # the SIMT mainloop
    "gemm_tc_bf16_nt_silu_and_mul": "gemm_tc_f16_nt_64x128_gelu_and_mul",  # mma.sync gated
    "gemm_tc_f16_nt_default_gelu_and_mul": "gemm_tc_f16_nt_64x128_gelu_and_mul",  # ~80 s
    # the opt-in persistent attention at d128 (two groups, no ping-pong): the d64 form's code
    "flash_attn_wgmma_d128_bf16_persistent": "flash_attn_wgmma_d64_bf16_persistent",
}
_ALL_NAMES = _registered()
_NAMES = (_ALL_NAMES if os.environ.get("LLMSPEED_COMPILE_CHECK") == "all"
          else [n for n in _ALL_NAMES if n not in COVERED_BY_SIBLING and n not in GPU_SUITE_ONLY])
if _WORKER in (None, "gw0"):
    _start_compile_check(_NAMES)


@pytest.fixture(scope="module")
def reports():
    found = {}
    deadline = time.monotonic() + 1800
    for i in range(CHILDREN):
        part = os.path.join(_FOLDER, f"part{i}")
        while not os.path.exists(part + ".rc"):
            if time.monotonic() > deadline:
                pytest.fail("compile-check children did not finish in 30 minutes")
            time.sleep(1)
        with open(part + ".rc") as f:
            returncode = int(f.read())
        with open(part + ".log") as f:
            log = f.read()
        if returncode not in (0, 1):
            pytest.fail(f"compile-check crashed:\n{log[-4000:]}")
        with open(part + ".json") as f:
            part_reports = json.load(f)
        found.update((r["name"], r) for r in part_reports)
        # progress (one line per kernel: stderr is not a terminal) and the summary
        failed = sum(bool(r["problems"]) for r in part_reports)
        assert all(f"] {r['name']} " in log for r in part_reports), log[-2000:]
        assert (f"compile-check: {len(part_reports)} kernels, {len(part_reports) - failed} ok, "
                f"{failed} failed" in log), log[-2000:]
    assert sorted(found) == _NAMES, "a registered kernel was not compiled"
    return found


def test_warp_tile_kernel_is_registered(reports):
    assert {"warp_tile_f16", "warp_tile_bf16"} <= set(reports)
    assert reports["warp_tile_f16"]["sass_found"]["HMMA"] > 0


def test_setmaxnreg_kernel_keeps_its_register_split(reports):
    """The warp-specialised staging kernel, linked as numba links on a GPU (LTO), keeps both
    setmaxnreg instructions (ptxas drops them silently otherwise: benchmarks/NOTES.md)."""
    found = reports["bulk_stage_setmaxnreg"]["sass_found"]
    assert found["USETMAXREG.DEALLOC"] > 0 and found["USETMAXREG.TRY_ALLOC"] > 0, found
    assert reports["bulk_stage"]["sass_found"]["UBLKCP"] > 0


def test_each_op_registers_its_kernels(reports):
    prefixes = ("gemm_tc", "gemm_simt", "flash_attn_tc", "paged_decode", "paged_prefill",
                "rms_norm", "layer_norm", "softmax", "argmax", "rotary", "silu_and_mul",
                "quant_decode", "quant_tc")
    missing = [p for p in prefixes if not any(name.startswith(p) for name in reports)]
    assert not missing, f"no compile-check registered for {missing}; have {sorted(reports)}"


def test_every_registered_kernel_is_clean(reports):
    problems = {name: r["problems"] for name, r in reports.items() if r["problems"]}
    assert not problems, json.dumps(problems, indent=1)


def test_kernels_left_out_have_their_siblings_checked():
    """Every kernel the quick run leaves out is registered, and so is its sibling, which runs."""
    for name, sibling in {**COVERED_BY_SIBLING, **GPU_SUITE_ONLY}.items():
        assert name in _ALL_NAMES and sibling in _NAMES and sibling not in COVERED_BY_SIBLING


def test_sass_between_needs_the_instruction_after_start_and_before_end():
    """The ordering check of ``sass_between`` (the softmax under P V: an exponential between
    S's wgmma wait and P V's), on text."""
    from llmspeed_numba.compile_check import sass_between

    assert sass_between("DEPBAR 1\nFMNMX\nEX2\nDEPBAR 0\n", "DEPBAR 1", "EX2", "DEPBAR 0")
    assert not sass_between("DEPBAR 1\nDEPBAR 0\nEX2\n", "DEPBAR 1", "EX2", "DEPBAR 0")
    assert not sass_between("EX2\nDEPBAR 1\nDEPBAR 0\n", "DEPBAR 1", "EX2", "DEPBAR 0")
    assert sass_between("DEPBAR 1\nDEPBAR 0\nDEPBAR 1\nEX2\n", "DEPBAR 1", "EX2", "DEPBAR 0")
