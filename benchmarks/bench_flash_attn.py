"""FlashAttention forward on the GPU, side by side with torch SDPA's FlashAttention-2 and cuDNN
backends (same process, same data, same stream).

    python benchmarks/bench_flash_attn.py [--quick] [--dtype float16|bfloat16] [--sweep]
        [--impls wgmma,tc] [--shapes "4,32,32,4096,128;4,32,32,4096,64"]

TFLOP/s = 4 * batch * nheads * seqlen_q * seqlen_k * headdim / time, halved for causal (per
sequence for varlen). SDPA gets (batch, heads, seq, dim) transposed views of our
(batch, seq, heads, dim) tensors. "ours" is the planned kernel (on an H200: the wgmma kernel for
headdims 64 and 128, mma.sync otherwise); ``--impls`` adds rows timing each listed kernel forced
("wgmma", "tc": mma.sync) against the planned one, in the same run (baseline ``ours-<impl>``).
Rows go to ``flash_attn.csv`` (``$OUT`` or ``benchmarks/results/``), with a PNG beside it;
``--sweep`` also times every configuration in ``SWEEP_CONFIGS`` (mma.sync) or
``WGMMA_SWEEP_CONFIGS`` (wgmma, with ``--sweep-impl wgmma``) on the headline shapes.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, plot_csv, time_gpu

from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.flash_attn import flash_attn, flash_attn_varlen

#: (batch, nheads, nheads_k, seqlen, headdim)
SHAPES = [(4, 32, 32, 4096, 128), (8, 32, 32, 2048, 64), (1, 32, 32, 16384, 128),
          (4, 32, 32, 4096, 256), (2, 32, 8, 8192, 128)]
GQA_SHAPE = (4, 32, 8, 4096, 128)
#: varlen: sequence lengths (mixed, ~32K tokens), heads, headdim
VARLEN_LENGTHS = [4096, 512, 3000, 1024, 2048, 8192, 333, 4000, 1500, 2700, 777, 3500]
VARLEN_HEADS, VARLEN_HEADDIM = 32, 128
#: Tensor Core configurations (warps, m16 tiles per warp, keys per block, min blocks per SM)
#: tried by --sweep (see TC_CONFIGS in llmspeed_numba/ops/flash_attn.py)
SWEEP_CONFIGS = [(4, 1, 64, 3), (4, 1, 64, 0), (4, 2, 64, 0), (4, 2, 32, 0), (8, 1, 64, 0),
                 (4, 1, 128, 0), (4, 1, 32, 4)]
#: wgmma configurations (consumer warpgroups, keys per block, stages, launch-bounds blocks,
#: producer warpgroup, ping-pong, tma) for --sweep (see WGMMA_CONFIGS in ops/flash_attn.py)
WGMMA_SWEEP_CONFIGS = [(2, 128, 3, 1, 1, 1, 1), (2, 128, 3, 1, 1, 0, 1), (2, 128, 3, 1, 1, 1),
                       (2, 128, 3, 1, 1, 0), (2, 128, 2, 1, 1, 1, 1), (2, 64, 3, 1, 1, 1),
                       (3, 64, 4, 1, 1, 1), (3, 64, 4, 1, 1, 1, 1), (2, 128, 2, 1, 0, 0),
                       (1, 128, 3, 2, 1, 0, 1), (1, 64, 4, 3, 1, 0, 1)]
BACKENDS = ("sdpa-flash2", "sdpa-cudnn")


def flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    return f / 2 if causal else f


def tflops(f, timing):
    return f / (timing["median"] * 1e-3) / 1e12


def _sdpa(backend, q, k, v, causal, gqa):
    """SDPA on (B, H, S, D) views with one backend; None when that backend refuses."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kwargs = {"is_causal": causal}
    note = ""
    if gqa:
        kwargs["enable_gqa"] = True

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, **kwargs)

    try:
        call()
    except RuntimeError:
        if not gqa:
            return None, ""
        group = q.shape[2] // k.shape[2]
        kt = kt.repeat_interleave(group, dim=1)
        vt = vt.repeat_interleave(group, dim=1)
        kwargs.pop("enable_gqa")
        note = "baseline with K/V repeated to all heads (no GQA support)"
        try:
            call()
        except RuntimeError:
            return None, ""
    torch.cuda.synchronize()
    return call, note


def _sdpa_varlen(backend, q, k, v, cu, causal):
    """SDPA on a jagged nested tensor (the backend's varlen path); None when refused."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    offsets = cu.to(torch.int64)
    try:
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)
                      for x in (q, k, v))

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)

        call()
        torch.cuda.synchronize()
        return call
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def _random(shape, dtype):
    import torch

    return torch.randn(shape, dtype=dtype, device="cuda")


def _max_diff(a, b):
    return float((a.float() - b.float()).abs().max())


def _backends(names):
    from torch.nn.attention import SDPBackend

    table = {"sdpa-flash2": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    return [(name, table[name]) for name in names]


def bench_batched(results, batch, nheads, nheads_k, seqlen, headdim, causal, dtype, reps,
                  config=None, label=None, backends=BACKENDS, impl=None, impls=()):
    q = _random((batch, seqlen, nheads, headdim), dtype)
    k = _random((batch, seqlen, nheads_k, headdim), dtype)
    v = _random((batch, seqlen, nheads_k, headdim), dtype)

    def ours():
        return flash_attn(q, k, v, causal=causal)

    # None: the planned kernel and configuration
    with overrides(flash_attn={"impl": impl, "config": config}):
        out = ours()
        ours_t = time_gpu(ours, rep=reps)
    f = flops(batch, nheads, seqlen, seqlen, headdim, causal)
    case = label or ("causal" if causal else "non-causal")
    shape = f"B{batch} H{nheads}/{nheads_k} S{seqlen} D{headdim}"
    dname = str(dtype).replace("torch.", "")
    for other in impls:   # our other kernels, same data, same run
        try:
            with overrides(flash_attn={"impl": other}):
                diff = _max_diff(out, ours())
                other_t = time_gpu(ours, rep=reps)
        except Exception as exc:  # noqa: BLE001  (a kernel that does not cover the shape)
            print(f"{other} {shape}: {type(exc).__name__}: {exc}")
            continue
        results.add("flash_attn", case, shape, dname, ours_t, f"ours-{other}", other_t,
                    "TFLOP/s", tflops(f, ours_t), tflops(f, other_t),
                    note=f"max |planned - {other}| {diff:.2e}")
    for name, backend in _backends(backends):
        call, note = _sdpa(backend, q, k, v, causal, nheads != nheads_k)
        if call is None:
            results.add("flash_attn", case, shape, dname, ours_t, name + " (unavailable)", None,
                        "TFLOP/s", tflops(f, ours_t), None, note=f"config {config}")
            continue
        diff = _max_diff(out, call().transpose(1, 2))
        base_t = time_gpu(call, rep=reps)
        results.add("flash_attn", case, shape, dname, ours_t, name, base_t, "TFLOP/s",
                    tflops(f, ours_t), tflops(f, base_t),
                    note=f"config {config}; max |ours - sdpa| {diff:.2e}" + (
                        f"; {note}" if note else ""))


def bench_varlen(results, lengths, nheads, headdim, causal, dtype, reps):
    import torch

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device="cuda")
    total, longest = int(sum(lengths)), int(max(lengths))
    q, k, v = (_random((total, nheads, headdim), dtype) for _ in range(3))

    def ours():
        return flash_attn_varlen(q, k, v, cu, cu, longest, longest, causal=causal)

    out = ours()
    ours_t = time_gpu(ours, rep=reps)
    f = sum(flops(1, nheads, n, n, headdim, causal) for n in lengths)
    case = f"varlen {'causal' if causal else 'non-causal'}"
    shape = f"{len(lengths)} seqs {total} tok H{nheads} D{headdim}"
    dname = str(dtype).replace("torch.", "")
    for name, backend in _backends(BACKENDS):
        call = _sdpa_varlen(backend, q, k, v, cu, causal)
        if call is None:
            results.add("flash_attn_varlen", case, shape, dname, ours_t,
                        name + " (unavailable)", None, "TFLOP/s", tflops(f, ours_t), None,
                        note="SDPA refused the jagged layout")
            continue
        ref = call().transpose(1, 2).values()
        diff = _max_diff(out, ref)
        base_t = time_gpu(call, rep=reps)
        results.add("flash_attn_varlen", case, shape, dname, ours_t, name, base_t, "TFLOP/s",
                    tflops(f, ours_t), tflops(f, base_t),
                    note=f"max |ours - sdpa| {diff:.2e}; offsets unchecked (the GPU default)")


def headline(results, sweep=False):
    """Markdown rows for the README table: ours vs FA2 and cuDNN, per case (``sweep``: the
    configuration sweep's rows instead)."""
    lines = ["| shape | case | ours TFLOP/s | vs SDPA FA2 | vs SDPA cuDNN | vs ours mma.sync |",
             "|---|---|---|---|---|---|"]
    by_case = {}
    for row in results.rows:
        if row["case"].startswith("sweep") != sweep:
            continue
        key = (row["shape"], row["case"])
        entry = by_case.setdefault(key, {"ours": row["ours_value"]})
        entry[row["baseline"]] = row["ratio"]
    def ratio(e, name):
        return f"{e[name]}x" if name in e else "-"

    for (shape, case), e in by_case.items():
        lines.append(f"| {shape} | {case} | {e['ours']} | {ratio(e, 'sdpa-flash2')} | "
                     f"{ratio(e, 'sdpa-cudnn')} | {ratio(e, 'ours-tc')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="headline shape only, fewer reps")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--sweep", action="store_true",
                        help="also time every SWEEP_CONFIGS entry on the headline shapes")
    parser.add_argument("--configs", default=None,
                        help="with --sweep: only these configurations, on the head-dim 128 shape "
                             "(e.g. '4,1,64,3;4,1,64,0')")
    parser.add_argument("--sweep-only", action="store_true",
                        help="with --sweep: skip the main cases")
    parser.add_argument("--sweep-impl", default="tc", choices=("tc", "wgmma"),
                        help="the kernel --sweep times (default: tc, the mma.sync kernel)")
    parser.add_argument("--impls", default="tc",
                        help="our kernels also timed, forced, against the planned one "
                             "(comma-separated: wgmma, tc, simt; '' for none)")
    parser.add_argument("--shapes", default=None,
                        help="batched shapes instead of the built-in list: "
                             "'batch,nheads,nheads_k,seqlen,headdim;...'")
    parser.add_argument("--no-varlen", action="store_true", help="skip the varlen cases")
    args = parser.parse_args(argv)
    impls = tuple(i for i in args.impls.split(",") if i)

    import torch

    dtype = getattr(torch, args.dtype)
    reps = 5 if args.quick else 20
    results = Results("flash_attn")
    shapes = [] if args.sweep_only else SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in c.split(",")) for c in args.shapes.split(";")]
    for batch, nheads, nheads_k, seqlen, headdim in shapes:
        for causal in (False, True):
            bench_batched(results, batch, nheads, nheads_k, seqlen, headdim, causal, dtype, reps,
                          label=("GQA " if nheads != nheads_k else "")
                          + ("causal" if causal else "non-causal"), impls=impls)
    batch, nheads, nheads_k, seqlen, headdim = GQA_SHAPE
    skip = args.sweep_only or args.shapes
    for causal in (() if skip else (True,) if args.quick else (False, True)):
        bench_batched(results, batch, nheads, nheads_k, seqlen, headdim, causal, dtype, reps,
                      label=f"GQA {'causal' if causal else 'non-causal'}", impls=impls)
    for causal in (() if skip or args.no_varlen else (True,) if args.quick else (False, True)):
        bench_varlen(results, VARLEN_LENGTHS, VARLEN_HEADS, VARLEN_HEADDIM, causal, dtype, reps)
    if args.sweep:
        default = WGMMA_SWEEP_CONFIGS if args.sweep_impl == "wgmma" else SWEEP_CONFIGS
        configs = default if args.configs is None else [
            tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
        for batch, nheads, nheads_k, seqlen, headdim in SHAPES[:2]:
            for config in configs:
                if args.configs is not None and headdim != 128:
                    continue
                for causal in (False, True):
                    try:
                        bench_batched(results, batch, nheads, nheads_k, seqlen, headdim, causal,
                                      dtype, reps, config=config, impl=args.sweep_impl,
                                      label=f"sweep {args.sweep_impl} {config}"
                                      f"{' causal' if causal else ''}",
                                      backends=("sdpa-flash2",))
                    except Exception as exc:  # a config that does not fit: report, go on
                        print(f"config {config} D{headdim}: {type(exc).__name__}: {exc}")
    path = results.write()
    print(f"rows appended to {path}")
    png = plot_csv(path)
    if png:
        print(f"plot: {png}")
    print(headline(results))
    if args.sweep:
        print(headline(results, sweep=True))


if __name__ == "__main__":
    main()
