"""FlashAttention kernel variants side by side: source trees and forced configurations, one
process each, against SDPA's cuDNN / FlashAttention-2 backends in the same run (issue 22).

    python benchmarks/probes/probe_fa_variants.py --variants FILE [--shapes SPEC] [--rounds 2]

FILE has a variant a line, ``name tree impl config shapes [knob=value ...]``: ``tree`` the
directory holding the ``llmspeed_numba`` to import (``.`` this one; e.g. ``.gpu/base``, an older
commit's copy from ``git archive``); ``impl`` ``wgmma`` / ``tc`` / ``planned`` (the planner's
choice) or ``cudnn`` / ``fa2`` (SDPA); ``config`` a comma-separated tuple or ``-``; ``shapes``
the comma-separated shape names it runs (``--shapes``:
``name=batch,heads,heads_k,seqlen,headdim;...``); then integer ``flash_attn`` knobs, e.g.
``tma_min_work=0``.

Every variant first compiles in its own process, all at once (each with its own numba and kernel
caches); then, one process at a time, each checks its output against SDPA (a ragged causal case
at seqlen 700 and the timed shape, max |ours - sdpa|) and times every shape, causal and not:
CUDA events over 20 calls, best of 3, per round; rounds alternate the variants so drift shows.
Lines: ``variant shape TFLOP/s non-causal / causal`` per round.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_SHAPES = ("d128=4,32,32,4096,128;d64=8,32,32,2048,64;d256=4,32,32,4096,256;"
                  "gqa=2,32,8,8192,128;long=1,32,32,16384,128")


def parse_shapes(spec):
    shapes = {}
    for item in filter(None, spec.split(";")):
        name, dims = item.split("=")
        shapes[name] = tuple(int(x) for x in dims.split(","))
    return shapes


def parse_variants(path):
    variants = []
    for line in open(path):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, tree, impl, config, shapes, *knobs = line.split()
        variants.append({"name": name, "tree": tree, "impl": impl,
                         "config": None if config == "-" else [int(x) for x in config.split(",")],
                         "shapes": shapes.split(","),
                         "knobs": {k: int(v) for k, v in (kv.split("=") for kv in knobs)}})
    return variants


def worker(spec):
    """One variant in this process: compile (``spec["compile_only"]``) or check and time."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impl, config = spec["impl"], spec["config"]
    torch.manual_seed(0)

    def sdpa(q, k, v, causal, backend=None):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kwargs = {"is_causal": causal, "enable_gqa": k.shape[2] != q.shape[2]}
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, **kwargs).transpose(1, 2)

    if impl in ("cudnn", "fa2"):
        backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION

        def call(q, k, v, causal):
            return sdpa(q, k, v, causal, backend)
    else:
        from llmspeed_numba._overrides import overrides
        from llmspeed_numba.ops.flash_attn import flash_attn
        knobs = dict(spec["knobs"]) if impl == "planned" else dict(spec["knobs"], impl=impl)
        if config is not None:
            knobs["config"] = tuple(config)

        # entered once, not each call: entering and leaving clears the recorded (replayed)
        # calls; never left (this worker process runs one variant)
        overrides(flash_attn=knobs).__enter__()

        def call(q, k, v, causal):
            return flash_attn(q, k, v, causal=causal)

    out = {}
    for shape_name in spec["shapes"]:
        batch, heads, heads_k, seqlen, dim = spec["all_shapes"][shape_name]
        dtype = torch.bfloat16
        q = torch.randn(batch, seqlen, heads, dim, dtype=dtype, device="cuda")
        k, v = (torch.randn(batch, seqlen, heads_k, dim, dtype=dtype, device="cuda")
                for _ in range(2))
        small = [torch.randn(2, 700, n, dim, dtype=dtype, device="cuda")
                 for n in (4, 4 * heads_k // heads or 1, 4 * heads_k // heads or 1)]
        if spec["compile_only"]:
            for causal in (False, True):
                call(q, k, v, causal)
                call(*small, causal)
            torch.cuda.synchronize()
            continue
        errs = [(call(*small, True).float() - sdpa(*small, True).float()).abs().max().item()]
        row = {"err": errs}
        for causal in (False, True):
            errs.append((call(q, k, v, causal).float()
                         - sdpa(q, k, v, causal).float()).abs().max().item())
            best = float("inf")
            for _ in range(3):
                e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                e0.record()
                for _ in range(20):
                    call(q, k, v, causal)
                e1.record()
                torch.cuda.synchronize()
                best = min(best, e0.elapsed_time(e1) / 20)
            flops = 4.0 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
            row["causal" if causal else "noncausal"] = flops / (best * 1e-3) / 1e12
        out[shape_name] = row
    print("RESULT " + json.dumps(out), flush=True)


def run_variant(variant, shapes, compile_only, cache_root):
    cache = os.path.join(cache_root, variant["name"])
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"),
               LLMSPEED_NUMBA_CACHE=os.path.join(cache, "lib"))
    tree = os.path.abspath(variant["tree"])
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    spec = dict(variant, all_shapes=shapes, compile_only=compile_only)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                             json.dumps(spec)], env=env, cwd=tree, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--cache-root", default=os.path.join(tempfile.gettempdir(), "fa_variants"))
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if not args.variants:
        parser.error("--variants FILE is required")
    shapes = parse_shapes(args.shapes)
    variants = parse_variants(args.variants)
    pending = list(variants)
    running = []
    while pending or running:  # compile, at most --jobs processes at a time
        while pending and len(running) < args.jobs:
            variant = pending.pop(0)
            running.append((variant, run_variant(variant, shapes, True, args.cache_root)))
        variant, proc = running.pop(0)
        log = proc.communicate()[0]
        status = "compiled" if proc.returncode == 0 else f"FAILED rc {proc.returncode}"
        print(f"# {variant['name']}: {status}", flush=True)
        if proc.returncode:
            print(log[-3000:], flush=True)
            variant["failed"] = True
    for rnd in range(args.rounds):
        for variant in variants:
            if variant.get("failed"):
                continue
            proc = run_variant(variant, shapes, False, args.cache_root)
            log = proc.communicate()[0]
            lines = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{variant['name']} round {rnd}: FAILED\n{log[-3000:]}", flush=True)
                continue
            for shape_name, row in json.loads(lines[-1][7:]).items():
                errs = "/".join(f"{e:.1e}" for e in row["err"])
                print(f"{variant['name']:<22} {shape_name:<6} round {rnd}  "
                      f"{row['noncausal']:6.1f} / {row['causal']:6.1f} TFLOP/s   err {errs}",
                      flush=True)


if __name__ == "__main__":
    main()
