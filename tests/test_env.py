"""``_env``'s deferral of numba-cuda's ml_dtypes import (half of a cold start): importing the
package leaves ml_dtypes unimported, and once anything imports it numba-cuda types NumPy
bfloat16 exactly as when it imported ml_dtypes itself. Each case runs in a fresh child process
(imports happen once a process), on the GPU target's numba-cuda (no GPU is needed to import it)
and under the simulator."""

import json
import os
import subprocess
import sys

import pytest

#: numba-cuda's mapping of NumPy's ml_dtypes bfloat16 (None where it has none), whether its
#: numpy_support module holds ml_dtypes, and what the child imported.
_REPORT = """
import json, sys
import numpy as np
numpy_support = sys.modules.get("numba.cuda.np.numpy_support")
if numpy_support is None:  # the simulator does not import it
    mapped = holds = None
else:
    bf16 = np.dtype(sys.modules["ml_dtypes"].bfloat16) if "ml_dtypes" in sys.modules else None
    mapped = None if bf16 is None else repr(numpy_support.FROM_DTYPE.get(bf16))
    holds = numpy_support.ml_dtypes is sys.modules.get("ml_dtypes")
print(json.dumps(dict(mapped=mapped, holds=holds, loaded="ml_dtypes" in sys.modules,
                      finders=[type(f).__name__ for f in sys.meta_path])))
"""


def _child(code, simulator):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    proc = subprocess.run([sys.executable, "-c", code + _REPORT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native():
    """numba-cuda's own mapping: ml_dtypes imported before numba."""
    report = _child("import ml_dtypes\nimport numba.cuda", simulator=False)
    assert report["mapped"] not in (None, "None") and report["holds"], report
    return report["mapped"]


@pytest.mark.parametrize("simulator", [False, True])
def test_import_leaves_ml_dtypes_unloaded(simulator):
    report = _child("import llmspeed_numba", simulator)
    assert not report["loaded"], report
    assert "_LateMlDtypes" in report["finders"], report


@pytest.mark.parametrize("first", ["", "import importlib.util; importlib.util.find_spec('ml_dtypes')\n"])
def test_a_later_import_gives_numba_its_bfloat16(native, first):
    """Also when something only looked for ml_dtypes first (a spec without an import)."""
    report = _child("import llmspeed_numba\n" + first + "import ml_dtypes", simulator=False)
    assert report["mapped"] == native and report["holds"], report
    assert "_LateMlDtypes" not in report["finders"], report


def test_loaded_first_is_left_alone(native):
    report = _child("import ml_dtypes\nimport llmspeed_numba", simulator=False)
    assert report["mapped"] == native and report["holds"], report
    assert "_LateMlDtypes" not in report["finders"], report


def test_library_paths_that_need_ml_dtypes_still_get_it():
    """The simulator's bfloat16 host arrays come through ml_dtypes, imported on first use."""
    report = _child("import numpy as np\nimport llmspeed_numba as lsn\n"
                    "from llmspeed_numba import testing\n"
                    "x = testing.random_array((4, 8), 'bfloat16', np.random.default_rng(0))\n"
                    "assert str(x.dtype) == 'bfloat16', x.dtype\n", simulator=True)
    assert report["loaded"], report
