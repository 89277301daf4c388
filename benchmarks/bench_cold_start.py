"""Time to the first result of an op in a fresh process: cold (empty kernel caches: NVVM compile +
link), cached (the machine-code store written by the cold run; see llmspeed_numba/_kernel_cache)
and cached without the store (numba's own disk cache only).

Each case runs in a child process and gives two numbers:
- "process": from starting the interpreter to the synchronised first result (what a script
  costs end to end, the user's own imports included: torch alone takes about a second);
- "library": from ``import llmspeed_numba`` to that result, after the child has imported its
  array library and made its inputs (what the library adds to a program that already has them;
  with torch tensors this includes importing numba-cuda, which only the library needs).
Inputs as numba device arrays (the user imported numba-cuda) or as torch tensors. The cached
cases take the best of two processes. The baseline of every row: importing numba-cuda and
initialising CUDA alone, in its own process.

    python benchmarks/bench_cold_start.py [--ops gemm,rms_norm,flash_attn] [--kinds numba,torch]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _harness import Results  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the user's side of a script, by array kind: imports, an input maker ``dev`` and ``sync``
SETUP = {
    "numba": ("import numpy as np\nfrom numba import cuda\n"
              "def dev(shape): return cuda.to_device(np.ones(shape, np.float16))\n"
              "sync = cuda.synchronize\n"),
    "torch": ("import torch\n"
              "def dev(shape): return torch.ones(shape, dtype=torch.float16, device='cuda')\n"
              "sync = torch.cuda.synchronize\n"),
}
#: op -> (shape label, inputs, first call). gemm's 128x128 Tensor Core kernel is a large one,
#: whose NVVM + ptxas compile the cache saves.
OPS = {
    "gemm": ("1024x1024x1024 tc", "a = dev((1024, 1024))", "ln.gemm(a, a, backend='tensor_core')"),
    "rms_norm": ("8x4096", "x = dev((8, 4096)); w = dev((4096,))", "ln.rms_norm(x, w)"),
    "flash_attn": ("1x512 h8 d128 causal", "q = dev((1, 512, 8, 128))",
                   "ln.flash_attn(q, q, q, causal=True)"),
}
SPLIT = "COLD_START_SPLIT"


def script(op, kind):
    _, inputs, call = OPS[op]
    return (f"import time\n{SETUP[kind]}{inputs}\nsync()\nt_user = time.perf_counter()\n"
            f"import llmspeed_numba as ln\nout = {call}\nsync()\n"
            f"print('{SPLIT}', time.perf_counter() - t_user)\n")


def first_result_s(code, cache_dir, store=True):
    """(process seconds, library seconds) of one child running ``code``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, LLMSPEED_NUMBA_CACHE=cache_dir,
               LLMSPEED_NUMBA_KERNEL_STORE="1" if store else "0", PYTHONPATH=REPO)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                          capture_output=True, text=True)
    total = time.perf_counter() - start
    library = next(float(line.split()[1]) for line in proc.stdout.splitlines()
                   if line.startswith(SPLIT))
    return total, library


def best_of_two(code, cache_dir, store=True):
    return min((first_result_s(code, cache_dir, store) for _ in range(2)), key=lambda r: r[0])


def import_numba_and_init_s():
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from numba import cuda; cuda.to_device([1.0]); "
                    "cuda.synchronize()"], check=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--kinds", default=",".join(SETUP))
    args = parser.parse_args()
    ops, kinds = args.ops.split(","), args.kinds.split(",")
    bad = sorted(set(ops) - set(OPS)) + sorted(set(kinds) - set(SETUP))
    if bad:
        parser.error(f"unknown ops or kinds {bad}; ops: {','.join(OPS)}; kinds: "
                     f"{','.join(SETUP)}")
    results = Results("cold_start")
    baseline = import_numba_and_init_s()
    print(f"import numba-cuda + CUDA init alone: {baseline:.2f} s")
    for op in ops:
        shape = OPS[op][0]
        with tempfile.TemporaryDirectory() as cache:   # one cache an op: the kinds share kernels
            cases = []
            for kind in kinds:
                code = script(op, kind)
                if kind == kinds[0]:
                    cases.append((kind, "cold (empty cache)", first_result_s(code, cache)))
                cases.append((kind, "cached", best_of_two(code, cache)))
                if kind == "numba":
                    cases.append((kind, "cached, numba's cache only",
                                  best_of_two(code, cache, store=False)))
        for kind, case, (total, library) in cases:
            print(f"{op:<11} {kind:<6} {case:<28} process {total:6.2f} s, library "
                  f"{library:6.2f} s")
            for part, s in (("process", total), ("library", library)):
                results.add("first_result", f"{op} {kind} {case}: {part}", shape, "float16",
                            {"median": s * 1e3, "p20": s * 1e3, "p80": s * 1e3},
                            "import numba + cuda init", {"median": baseline * 1e3}, "ms",
                            s * 1e3, baseline * 1e3)
    print("path written:", results.write())


if __name__ == "__main__":
    main()
