"""Paged decode variants side by side in one run (one H200 call): kernel configurations
(warps, stages, q_smem, L2 prefetch hint), a contiguous-page layout with the same bytes, SDPA and
the copy bandwidth, each variant's output checked against the default's.

    python benchmarks/probes/probe_decode.py [--variants NAME,...]

Prints one line a variant (us, GB/s of K/V, % of copy, x SDPA) and appends ``paged_decode_probe``
rows to ``decode.csv``.
"""

import argparse
import importlib
import os
import sys

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules

from _harness import Results, copy_bandwidth, time_gpu  # noqa: E402
from bench_decode import (  # noqa: E402
    HEADDIM,
    gbs,
    kv_bytes,
    make_inputs,
    sdpa_baselines,
    sequential_pages,
)

from llmspeed_numba._overrides import overrides  # noqa: E402
from llmspeed_numba.ops import paged_decode as pd  # noqa: E402

#: label -> (batch, seq_len, nheads, nheads_k). Hk1 B256 H8: the bytes of
#: B32 Hk8 in pages whose K (and V) rows are one 4 KB contiguous run (one KV head).
SHAPES = {
    "b32_hk8": (32, 8192, 32, 8),
    "b32_hk32": (32, 8192, 32, 32),
    "b1_hk8": (1, 32768, 32, 8),
    "b1_hk32": (1, 32768, 32, 32),
    "b256_hk1": (256, 8192, 8, 1),
    **{f"b{b}_s{n}_hk{h}": (b, n, 32, h) for b in (1, 8, 32, 128) for n in (512, 4096)
       for h in (8, 32)},
}
#: name -> (tuning (warps, stages, q_smem, l2_prefetch) or None: planned, num_splits or None:
#: planned)
VARIANTS = {
    "default": (None, None),
    "w8s2": ((8, 2, False, 0), None),
    "w8s2_pf128": ((8, 2, False, 128), None),
    "w8s3": ((8, 3, False, 0), None),
    "w8s3_pf128": ((8, 3, False, 128), None),
    "w4s2_pf128": ((4, 2, False, 128), None),
    "w4s2_pf256": ((4, 2, False, 256), None),
    "w4s3": ((4, 3, False, 128), None),
    "w2s2": ((2, 2, False, 128), None),
    "w2s3": ((2, 3, False, 128), None),
    "w2s4": ((2, 4, False, 128), None),
    "w2s2_x2": ((2, 2, False, 128), 2),
    "w2s3_x2": ((2, 3, False, 128), 2),
    **{f"splits{n}": (None, n) for n in (1, 2, 3, 4)},
    **{f"w{w}s2_x{n}": ((w, 2, False, 128), n) for w in (2, 4, 8) for n in (1, 2, 4, 8, 16)},
    **{f"w{w}s3_x1": ((w, 3, False, 128), 1) for w in (2, 4)},
}
PLAN = [
    ("b32_hk8", ["default"]),
    ("b1_hk8", ["default"]),
    ("b32_hk32", ["default"]),
]


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(s for s, _ in PLAN),
                    help="comma-separated SHAPES names (with --variants: any of them)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=None,
                    help="override every shape's sequence length (time-vs-length fits)")
    ap.add_argument("--sequential-pages", action="store_true",
                    help="each sequence's pages consecutive and in order (page locality)")
    ap.add_argument("--module", default=None,
                    help="time this copy of the op module instead (A/B against a revision, "
                         "e.g. git show REV:llmspeed_numba/ops/paged_decode.py saved as "
                         "llmspeed_numba/ops/_paged_decode_rev.py; from the module split on, "
                         "REV's other _paged_decode_*.py modules copied beside it too, and the "
                         "imports pointed at the copies)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants run on every shape instead of PLAN's")
    args = ap.parse_args(argv)
    op = pd if args.module is None else importlib.import_module(args.module)
    wanted = set(args.shapes.split(","))
    results = Results("decode")
    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s")
    dtype = torch.bfloat16
    plan = PLAN if args.variants is None else [(s, None) for s in args.shapes.split(",")]
    for shape_name, variants in plan:
        if shape_name not in wanted:
            continue
        batch, seq_len, nheads, nheads_k = SHAPES[shape_name]
        if args.seq_len is not None:
            seq_len = args.seq_len
        if args.variants is not None:
            variants = args.variants.split(",")
        q, kc, vc, bt, sl, k, v = make_inputs(batch, seq_len, nheads_k, dtype,
                                               args.block_size)
        q = torch.randn((batch, nheads, HEADDIM), device="cuda", dtype=dtype)
        if args.sequential_pages:
            kc, vc, bt = sequential_pages(kc, vc, bt)
        nbytes = kv_bytes(batch, seq_len, nheads_k, HEADDIM)
        shape = f"B{batch} H{nheads}/{nheads_k} S{seq_len} D{HEADDIM} page{args.block_size}"
        if args.sequential_pages:
            shape += " sequential pages"
        sdpa = sdpa_baselines(q, k, v)
        best = None
        for name, (call, _note) in sdpa.items():
            t = time_gpu(call, rep=args.reps)
            if best is None or t["median"] < best[1]["median"]:
                best = (name, t)
        print(f"{shape}: SDPA {best[0]} "
              f"{best[1]['median'] * 1e3:.1f} us "
              f"({gbs(nbytes, best[1]):.0f} GB/s)")
        want = None
        for vname in variants:
            tuning, splits = VARIANTS[vname]
            out = torch.empty_like(q)

            def call(out=out, tuning=tuning, splits=splits, args=(q, kc, vc, bt, sl)):
                if not hasattr(op, "TUNING"):  # a revision before _overrides: a keyword
                    return op.paged_decode_attention(*args, out=out, num_splits=splits,
                                                     _tuning=tuning)
                with overrides(paged_decode={"tuning": tuning}):
                    return op.paged_decode_attention(*args, out=out, num_splits=splits)

            call()
            torch.cuda.synchronize()
            if want is None:
                want = out.clone()
            err = (out.float() - want.float()).abs().max().item()
            t = time_gpu(call, rep=args.reps)
            plan = op.launch_plan(batch, 1, nheads, nheads_k, HEADDIM, args.block_size,
                                  bt.shape[1], "bfloat16", num_splits=splits, tuning=tuning)
            ours = gbs(nbytes, t)
            print(f"  {vname:12s} splits {plan['num_splits']:3d}: {t['median'] * 1e3:7.1f} us "
                  f"{ours:5.0f} GB/s {100 * ours / copy_gbs:5.1f}% of copy "
                  f"x{best[1]['median'] / t['median']:.3f} SDPA  max|diff| {err:.2g}")
            label = f"{vname} {shape_name} S{seq_len} page{args.block_size}" + (
                " seqpages" if args.sequential_pages else "")
            results.add("paged_decode_probe", label,
                        shape, "bfloat16", t, f"sdpa_{best[0]}", best[1], "GB/s", ours,
                        gbs(nbytes, best[1]),
                        note=f"tuning {tuning}; splits {plan['num_splits']}; copy "
                             f"{copy_gbs:.0f} GB/s; {100 * ours / copy_gbs:.1f}% of copy")
        del q, kc, vc, bt, sl, k, v, sdpa
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
