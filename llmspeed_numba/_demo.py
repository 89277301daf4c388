"""``python -m llmspeed_numba demo``: run every op on random inputs, check it against its
float64 reference and print a table (op, shape, max error, tolerance, time).

Each op adds a module to ``llmspeed_numba/demos/`` defining ``cases(on_gpu)``, which returns a list
of ``DemoCase`` (``demos/_case.py``): a label, a shape string and ``run()`` returning
``(max_abs_error, tolerance, seconds_per_call)``. On a GPU the cases use real sizes and time the
op; under the simulator tiny sizes, and the time is the simulator's.
"""

import importlib
import pkgutil
import sys
import time
import traceback


def all_cases(on_gpu):
    from . import demos

    cases = []
    for info in sorted(pkgutil.iter_modules(demos.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # not a demo: _case.py
            continue
        module = importlib.import_module(f"{demos.__name__}.{info.name}")
        cases.extend(module.cases(on_gpu))
    return cases


def selected_cases(on_gpu, filters=()):
    """The cases whose op label contains one of ``filters`` (all when empty)."""
    return [c for c in all_cases(on_gpu) if not filters or any(f in c.op for f in filters)]


def list_cases(filters=()):
    from ._env import have_gpu

    cases = selected_cases(have_gpu(), filters)
    for case in cases:
        print(f"{case.op:<26} {case.shape}")
    return 0 if cases else _no_case(filters)


def _no_case(filters):
    print(f"no demo case matches {list(filters)}; 'demo --list' shows them", file=sys.stderr)
    return 2


def run_demo(filters=()):
    from ._env import have_gpu

    on_gpu = have_gpu()
    cases = selected_cases(on_gpu, filters)
    if not cases:
        return _no_case(filters)
    print(f"llmspeed_numba demo on {'GPU' if on_gpu else 'the CUDA simulator'}")
    print(f"{'op':<26} {'shape':<34} {'max err':>10} {'tolerance':>10} {'time':>12}  status")
    failures = 0
    start = time.perf_counter()
    for case in cases:
        try:
            err, tol, seconds = case.run()
            ok = err <= tol
            status = "ok" if ok else "FAIL"
            failures += not ok
            unit = f"{seconds * 1e3:9.3f} ms" if on_gpu else f"{seconds:9.2f} s "
            print(f"{case.op:<26} {case.shape:<34} {err:10.3g} {tol:10.3g} {unit}  {status}",
                  flush=True)
        except Exception:  # report and go on: the table should show every op
            failures += 1
            print(f"{case.op:<26} {case.shape:<34} {'':>10} {'':>10} {'':>12}  ERROR")
            traceback.print_exc(file=sys.stdout)
    print(f"{len(cases)} case(s), {failures} failure(s), {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0
