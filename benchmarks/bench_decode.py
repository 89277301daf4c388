"""Paged-KV decode attention on the GPU, side by side with torch SDPA on the same K/V laid out
contiguously, and with the device-to-device copy bandwidth measured in the same run.

    python benchmarks/bench_decode.py [--quick] [--dtype bfloat16|float16] [--block-size 16]
                                      [--sweep]

Cases: batch in {1, 8, 32, 128} x seq_len in {512, 4096, 32768} x 32 query heads with 8 and 32
KV heads, headdim 128, one query token, plus the target shape batch 32 x seq_len 8192 (cases whose
K/V would not fit twice in memory are skipped). Our K/V live in shuffled (non-contiguous) pages;
SDPA gets (batch, heads, seq_len, headdim) contiguous copies, ``enable_gqa=True`` (or K/V
repeated to every head outside the timed region where a backend refuses GQA), and each SDPA
backend is timed (flash, efficient, cuDNN, default): the fastest is the baseline.

GB/s = K and V bytes of the cache read once = 2 * batch * seq_len * nheads_k * headdim * 2 / time
(both ours and SDPA; a baseline on repeated K/V physically reads more). Rows go to
``decode.csv`` (``$OUT`` or ``benchmarks/results/``): one per case against SDPA, one against the
copy bandwidth; a PNG is written beside it. Targets (printed at the end): batch 32, seq_len 8192
(8 and 32 KV heads) >= 85 % of copy bandwidth and no slower than SDPA; batch 1 at 32768 >= 70 %.
``--sweep`` also times (warps, stages) configurations and split counts on the target shapes.
``--quick``: the four target shapes against SDPA, then a few variants of each (the default, other
(warps, stages), half and double the split count), each with the flushed timing the targets use,
the host time of one call and the GPU time of back-to-back calls: when the flushed time is well
above the back-to-back time and the host time exceeds it, the launch overhead is what shows.
``--ab``: on the four target shapes, side by side, the chosen split count against a sweep of
forced split counts (``AB_SPLITS``; at batch 1 also (4 warps, 2 stages), which holds 2 blocks an
SM), with SDPA and the copy bandwidth of the same run; each variant's output is compared with the
default's, and the default is also replayed from a CUDA graph (twice: the tickets must be back at
0) and checked. Rows go to ``decode.csv`` as ``paged_decode_ab``; about 2 minutes with compiles.
(Until 61394a1 it also timed a two-kernel split merge, partials then a reduce kernel: see
NOTES.md.)

Configurations (warps, stages, q_smem) are forced through ``_overrides.overrides``
(``paged_decode={"tuning": ...}``), entered once around each variant's timing.
"""

import argparse
import contextlib
import io
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Results, back_to_back_ms, copy_bandwidth, plot_csv, time_gpu  # noqa: E402

from llmspeed_numba._overrides import overrides  # noqa: E402
from llmspeed_numba.ops import paged_decode as pd  # noqa: E402

NHEADS, HEADDIM = 32, 128
BATCHES = (1, 8, 32, 128)
SEQ_LENS = (512, 4096, 32768)
KV_HEADS = (8, 32)
TARGETS = [(32, 8192, 8), (32, 8192, 32)]
LONG_TARGETS = [(1, 32768, 8), (1, 32768, 32)]
#: K+V bytes above which a case is skipped (it is held twice: pages and SDPA's copy).
MAX_KV_BYTES = 40 << 30
SWEEP_CONFIGS = [(4, 3, False), (4, 2, False), (4, 4, False), (8, 2, False), (2, 4, False),
                 (8, 3, False)]
SWEEP_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]
#: (warps, stages, q_smem) timed by --quick besides the default (8, 3) at headdim 128.
QUICK_CONFIGS = [(4, 3, False), (8, 3, False), (8, 2, False), (4, 2, False)]
#: --ab: forced split counts by batch (the chosen count is timed too), and the other
#: (warps, stages, q_smem) swept at batch 1 with split counts by KV heads: it holds 2 blocks an SM
#: at D 128, so 33 x 8 and 8 x 32 blocks are one wave of 264.
AB_SPLITS = {1: (8, 16, 24, 32, 48, 64, 96, 128), 32: (1, 2, 4)}
AB_CONFIG = (4, 2, False)
AB_CONFIG_SPLITS = {8: (16, 32, 33, 64, 66), 32: (4, 8, 16)}


def kv_bytes(batch, seq_len, nheads_k, headdim, itemsize=2):
    return 2 * batch * seq_len * nheads_k * headdim * itemsize


def make_inputs(batch, seq_len, nheads_k, dtype, block_size, seed=0):
    """Paged caches with shuffled pages, the same K/V contiguous (B, Hk, S, D), and q."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-seq_len // block_size)
    num_blocks = batch * pages
    k = torch.randn((batch, nheads_k, seq_len, HEADDIM), generator=gen, device="cuda",
                    dtype=dtype)
    v = torch.randn((batch, nheads_k, seq_len, HEADDIM), generator=gen, device="cuda",
                    dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen, device="cuda").to(
        torch.int32).reshape(batch, pages)
    k_cache = torch.empty((num_blocks, block_size, nheads_k, HEADDIM), device="cuda",
                          dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    for b in range(batch):  # one sequence at a time: temporaries stay small
        idx = block_table[b].long()
        k_cache[idx] = k[b].transpose(0, 1).reshape(pages, block_size, nheads_k, HEADDIM)
        v_cache[idx] = v[b].transpose(0, 1).reshape(pages, block_size, nheads_k, HEADDIM)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, NHEADS, HEADDIM), generator=gen, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, block_table, seq_lens, k, v


def sequential_pages(k_cache, v_cache, block_table):
    """The same caches re-laid so each sequence's pages are consecutive blocks, in order (the
    block table an identity): shuffled pages against sequential ones isolates page locality
    (TLB reach, DRAM pages) from the paging itself."""
    import torch

    order = block_table.reshape(-1).long()
    table = torch.arange(order.numel(), device=block_table.device, dtype=torch.int32)
    return k_cache[order], v_cache[order], table.reshape(block_table.shape)


def _sdpa_call(qt, k, v, backend, gqa):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    kwargs = {"enable_gqa": True} if gqa else {}
    if backend is None:
        return lambda: F.scaled_dot_product_attention(qt, k, v, **kwargs)

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, k, v, **kwargs)

    return call


def sdpa_baselines(q, k, v):
    """{backend name: (callable, note)} for every SDPA backend that runs this decode on
    q (B, H, D) and contiguous k, v (B, Hk, S, D)."""
    import torch
    from torch.nn.attention import SDPBackend

    qt = q[:, :, None, :]                      # (B, H, 1, D)
    group = q.shape[1] // k.shape[1]
    repeated = None
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("default", None)):
        call, note = _sdpa_call(qt, k, v, backend, group > 1), ""
        try:
            call()
        except (RuntimeError, TypeError):
            if group == 1:
                continue
            try:
                if repeated is None:
                    repeated = (k.repeat_interleave(group, dim=1),
                                v.repeat_interleave(group, dim=1))
                call = _sdpa_call(qt, repeated[0], repeated[1], backend, False)
                call()
                note = "K/V repeated to every head (backend refuses GQA)"
            except (RuntimeError, TypeError):  # torch.OutOfMemoryError is a RuntimeError
                continue
        out[name] = (call, note)
    torch.cuda.synchronize()
    return out


def gbs(nbytes, timing):
    return nbytes / (timing["median"] * 1e-3) / 1e9


def forcing(kw):
    """``(op keywords, context)`` of a variant's keywords: its ``tuning`` (warps, stages, q_smem)
    forced through ``overrides`` while the context is entered, the rest passed to the op."""
    kw = dict(kw)
    return kw, overrides(paged_decode={"tuning": kw.pop("tuning", None)})


def bench_case(results, copy_gbs, batch, seq_len, nheads_k, dtype, block_size, reps, label=None,
               with_sdpa=True, check=True):
    import torch

    nbytes = kv_bytes(batch, seq_len, nheads_k, HEADDIM)
    shape = f"B{batch} H{NHEADS}/{nheads_k} S{seq_len} D{HEADDIM} page{block_size}"
    label = label or f"B{batch} S{seq_len} Hk{nheads_k}"
    if 2 * nbytes > MAX_KV_BYTES:
        print(f"skip {shape}: {2 * nbytes / 2**30:.0f} GiB of K/V + copies")
        return None
    q, kc, vc, bt, sl, k, v = make_inputs(batch, seq_len, nheads_k, dtype, block_size)
    out = torch.empty_like(q)
    plan = pd.launch_plan(batch, 1, NHEADS, nheads_k, HEADDIM, block_size, bt.shape[1],
                          "bfloat16" if dtype == torch.bfloat16 else "float16")

    def ours():
        return pd.paged_decode_attention(q, kc, vc, bt, sl, out=out)

    ours()
    ours_t = time_gpu(ours, rep=reps)
    ours_gbs = gbs(nbytes, ours_t)
    best = None
    if with_sdpa:
        for name, (call, note) in sdpa_baselines(q, k, v).items():
            if check and name == "default":
                ref = call()[:, :, 0].float()
                err = (out.float() - ref).abs().max().item()
                if not err < 0.05:
                    print(f"  WARNING: max |ours - sdpa| = {err:.3g} on {shape}")
            t = time_gpu(call, rep=reps)
            if best is None or t["median"] < best[1]["median"]:
                best = (name, t, note)
    dt = "bfloat16" if dtype == torch.bfloat16 else "float16"
    split_note = f"splits {plan['num_splits']}; copy {copy_gbs:.0f} GB/s"
    if best is not None:
        name, t, note = best
        results.add("paged_decode", label, shape, dt, ours_t, f"sdpa_{name}", t, "GB/s",
                    ours_gbs, gbs(nbytes, t), note="; ".join(x for x in (split_note, note) if x))
    results.add("paged_decode_vs_copy", label, shape, dt, ours_t, "d2d_copy", None, "GB/s",
                ours_gbs, copy_gbs, note=split_note)
    return {"ours_gbs": ours_gbs, "ours_ms": ours_t["median"],
            "sdpa_ms": best[1]["median"] if best else float("nan"),
            "sdpa": best[0] if best else None}


def sweep(results, copy_gbs, dtype, block_size, reps):
    """Time other (warps, stages, q_smem) configurations and forced split counts."""
    import torch

    dt = "bfloat16" if dtype == torch.bfloat16 else "float16"
    for batch, seq_len, nheads_k in TARGETS + LONG_TARGETS:
        q, kc, vc, bt, sl, _, _ = make_inputs(batch, seq_len, nheads_k, dtype, block_size)
        nbytes = kv_bytes(batch, seq_len, nheads_k, HEADDIM)
        out = torch.empty_like(q)
        shape = f"B{batch} H{NHEADS}/{nheads_k} S{seq_len} D{HEADDIM} page{block_size}"
        variants = [(f"cfg {c}", {"tuning": c}) for c in SWEEP_CONFIGS]
        variants += [(f"splits {s}", {"num_splits": s}) for s in SWEEP_SPLITS
                     if s <= pd.MAX_SPLITS]
        for name, kw in variants:
            args = (q, kc, vc, bt, sl)
            kw, forced = forcing(kw)
            try:
                with forced:
                    t = time_gpu(lambda args=args, out=out, kw=kw: pd.paged_decode_attention(
                        *args, out=out, **kw), rep=reps)
            except Exception as exc:  # a configuration that does not fit: report, go on
                print(f"  {shape} {name}: {type(exc).__name__}: {exc}")
                continue
            results.add("paged_decode_sweep", f"{name} B{batch} S{seq_len} Hk{nheads_k}", shape,
                        dt, t, "d2d_copy", None, "GB/s", gbs(nbytes, t), copy_gbs)
        del q, kc, vc, bt, sl, out, args
        torch.cuda.empty_cache()


def host_and_back_to_back(fn, calls=30):
    """(host us per call without waiting for the GPU, GPU us per call of back-to-back calls
    without L2 flushes): a flushed timing far above both means launch overhead shows."""
    import time

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host, back_to_back_ms(fn, calls, rounds=1)[0] * 1e3


def quick_variants(plan):
    """The few variants worth timing on a target shape: the default, the other QUICK_CONFIGS,
    and half / double the chosen split count."""
    s = plan["num_splits"]
    out = [("default", {})]
    out += [(f"cfg {c[:2]}", {"tuning": c}) for c in QUICK_CONFIGS if c != plan["config"][4:7]]
    if s > 1:
        out.append((f"splits {max(1, s // 2)}", {"num_splits": max(1, s // 2)}))
    out.append((f"splits {min(pd.MAX_SPLITS, 2 * s)}", {"num_splits": min(pd.MAX_SPLITS, 2 * s)}))
    return out


def quick_sweep(results, copy_gbs, dtype, block_size, reps):
    """Variants on the four target shapes, one line each: flushed timing (what the targets
    use), host time per call, back-to-back GPU time."""
    import torch

    dt = "bfloat16" if dtype == torch.bfloat16 else "float16"
    print(f"{'variant':>28} {'GB/s':>7} {'%copy':>6} {'us':>8} {'host us':>8} {'b2b us':>8}  plan")
    for batch, seq_len, nheads_k in TARGETS + LONG_TARGETS:
        q, kc, vc, bt, sl, _, _ = make_inputs(batch, seq_len, nheads_k, dtype, block_size)
        nbytes = kv_bytes(batch, seq_len, nheads_k, HEADDIM)
        out = torch.empty_like(q)
        shape = f"B{batch} H{NHEADS}/{nheads_k} S{seq_len} D{HEADDIM} page{block_size}"
        plan = pd.launch_plan(batch, 1, NHEADS, nheads_k, HEADDIM, block_size, bt.shape[1], dt)
        for name, kw in quick_variants(plan):
            args = (q, kc, vc, bt, sl)
            tuning = kw.get("tuning")
            kw, forced = forcing(kw)

            def call(args=args, out=out, kw=kw):
                return pd.paged_decode_attention(*args, out=out, **kw)

            try:
                with forced:
                    call()
                    t = time_gpu(call, rep=reps)
                    host, b2b = host_and_back_to_back(call)
            except Exception as exc:  # a configuration that does not fit: report, go on
                print(f"  {shape} {name}: {type(exc).__name__}: {exc}")
                continue
            p = pd.launch_plan(batch, 1, NHEADS, nheads_k, HEADDIM, block_size, bt.shape[1], dt,
                               kw.get("num_splits"), tuning)
            g = gbs(nbytes, t)
            label = f"{name} B{batch} S{seq_len} Hk{nheads_k}"
            print(f"{label:>28} {g:7.0f} {g / copy_gbs:6.1%} {t['median'] * 1e3:8.1f} "
                  f"{host:8.1f} {b2b:8.1f}  splits {p['num_splits']} warps,stages "
                  f"{p['config'][4:6]}")
            results.add("paged_decode_quick", label, shape, dt, t, "d2d_copy", None, "GB/s", g,
                        copy_gbs, note=f"host {host:.1f} us/call; back-to-back {b2b:.1f} us")
        del q, kc, vc, bt, sl, out, args
        torch.cuda.empty_cache()


def ab_variants(batch, nheads_k, plan):
    """(name, kwargs) of --ab on one shape: the chosen split count, then the forced counts,
    then AB_CONFIG at batch 1. A name's first word is its family ("splits", "cfg")."""
    chosen = plan["num_splits"]
    out = [(f"splits {chosen} (chosen)", {})]
    out += [(f"splits {s}", {"num_splits": s}) for s in AB_SPLITS.get(batch, ())
            if s != chosen and s <= pd.MAX_SPLITS]
    if batch == 1:
        cfg = f"cfg {AB_CONFIG[:2]}"
        out += [(f"{cfg} splits {s}", {"num_splits": s, "tuning": AB_CONFIG})
                for s in AB_CONFIG_SPLITS.get(nheads_k, ()) if s <= pd.MAX_SPLITS]
    return out


def ab_graph_check(call, out, want):
    """Replays of ``call`` from a CUDA graph captured on the stream it was warmed up on (so its
    workspace exists: the graph holds the decode kernel only): each replay must rewrite ``out``
    to ``want`` (a ticket left non-zero by one replay would leave the next one's rows
    unwritten). Returns the max error and the timing of a replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        call()
    err = 0.0
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        err = max(err, (out.float() - want.float()).abs().max().item())
    return err, time_gpu(graph.replay, rep=20)


def _add_quietly(results, *args, **kwargs):
    """``results.add`` without its console line (--ab prints its own table)."""
    with contextlib.redirect_stdout(io.StringIO()):
        results.add(*args, **kwargs)


def ab_compare(results, copy_gbs, dtype, block_size, reps):
    """--ab: the chosen against forced split counts on the target shapes."""
    import torch

    dt = "bfloat16" if dtype == torch.bfloat16 else "float16"
    summary = []
    print(f"{'variant':>44} {'us':>8} {'GB/s':>7} {'%copy':>6} {'sdpa/ours':>9}  max|d|")
    for batch, seq_len, nheads_k in LONG_TARGETS + TARGETS:
        q, kc, vc, bt, sl, k, v = make_inputs(batch, seq_len, nheads_k, dtype, block_size)
        nbytes = kv_bytes(batch, seq_len, nheads_k, HEADDIM)
        shape = f"B{batch} H{NHEADS}/{nheads_k} S{seq_len} D{HEADDIM} page{block_size}"
        tag = f"B{batch} S{seq_len} Hk{nheads_k}"
        sdpa = None
        for name, (call, _) in sdpa_baselines(q, k, v).items():
            t = time_gpu(call, rep=reps)
            if sdpa is None or t["median"] < sdpa[1]["median"]:
                sdpa = (name, t)
        del k, v
        torch.cuda.empty_cache()
        plan = pd.launch_plan(batch, 1, NHEADS, nheads_k, HEADDIM, block_size, bt.shape[1], dt)
        want = pd.paged_decode_attention(q, kc, vc, bt, sl)
        torch.cuda.synchronize()
        out = torch.empty_like(q)
        print(f"{tag} (SDPA {sdpa[0]} {sdpa[1]['median'] * 1e3:.1f} us, copy "
              f"{copy_gbs:.0f} GB/s)")
        best = {}
        for name, kw in ab_variants(batch, nheads_k, plan):
            args = (q, kc, vc, bt, sl)
            kw, forced = forcing(kw)

            def call(args=args, out=out, kw=kw):
                return pd.paged_decode_attention(*args, out=out, **kw)

            try:
                with forced:
                    out.fill_(float("nan"))
                    call()
                    err = (out.float() - want.float()).abs().max().item()
                    t = time_gpu(call, rep=reps)
            except Exception as exc:  # noqa: BLE001  (a configuration that does not fit)
                print(f"  {shape} {name}: {type(exc).__name__}: {exc}")
                continue
            g = gbs(nbytes, t)
            ratio = sdpa[1]["median"] / t["median"]
            print(f"{name:>44} {t['median'] * 1e3:8.1f} {g:7.0f} {g / copy_gbs:6.1%} "
                  f"{ratio:9.3f}  {err:.2g}" + ("  MISMATCH" if not err < 0.05 else ""))
            _add_quietly(results, "paged_decode_ab", f"{name} {tag}", shape, dt, t,
                         f"sdpa_{sdpa[0]}", sdpa[1], "GB/s", g, gbs(nbytes, sdpa[1]),
                         note=f"{g / copy_gbs:.1%} of copy {copy_gbs:.0f} GB/s; "
                              f"max|d| {err:.2g}")
            family = name.split()[0]
            if family not in best or t["median"] < best[family][1]:
                best[family] = (name, t["median"], g / copy_gbs)

        def default(args=(q, kc, vc, bt, sl), out=out):
            return pd.paged_decode_attention(*args, out=out)

        try:
            err, t = ab_graph_check(default, out, want)
        except Exception as exc:  # noqa: BLE001  (reported; the other shapes still run)
            print(f"  {shape} CUDA graph: {type(exc).__name__}: {exc}")
        else:
            g = gbs(nbytes, t)
            print(f"{'default from a CUDA graph (2 replays)':>44} {t['median'] * 1e3:8.1f} "
                  f"{g:7.0f} {g / copy_gbs:6.1%} {sdpa[1]['median'] / t['median']:9.3f}  "
                  f"{err:.2g}" + ("  MISMATCH" if not err < 0.05 else ""))
            _add_quietly(results, "paged_decode_ab", f"graph replay {tag}", shape, dt, t,
                         f"sdpa_{sdpa[0]}", sdpa[1], "GB/s", g, gbs(nbytes, sdpa[1]),
                         note=f"{g / copy_gbs:.1%} of copy; max|d| {err:.2g}")
        summary.append((tag, plan["num_splits"], best))
        del q, kc, vc, bt, sl, out, want
        torch.cuda.empty_cache()
    print("--ab best per variant family (flushed median):")
    for tag, chosen, best in summary:
        parts = [f"{family}: {name} {ms * 1e3:.1f} us ({frac:.1%} of copy)"
                 for family, (name, ms, frac) in sorted(best.items())]
        print(f"  {tag} (chosen {chosen} splits): " + "; ".join(parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="target shapes only, fewer reps, then a few variants of each")
    parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true",
                        help="also time SWEEP_CONFIGS and SWEEP_SPLITS on the target shapes")
    parser.add_argument("--no-main", action="store_true", help="with --sweep: only the sweep")
    parser.add_argument("--ab", action="store_true",
                        help="only the split-count comparison on the target shapes")
    args = parser.parse_args(argv)

    import torch

    dtype = getattr(torch, args.dtype)
    reps = 10 if args.quick else 20
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    results = Results("decode")
    summary = {}
    if args.ab:
        ab_compare(results, copy_gbs, dtype, args.block_size, reps)
        print(f"rows appended to {results.write()}")
        return
    if not args.no_main:
        cases = TARGETS + LONG_TARGETS
        if not args.quick:
            cases = TARGETS + [(b, s, h) for b in BATCHES for s in SEQ_LENS for h in KV_HEADS]
        for batch, seq_len, nheads_k in cases:
            summary[(batch, seq_len, nheads_k)] = bench_case(
                results, copy_gbs, batch, seq_len, nheads_k, dtype, args.block_size, reps)
            torch.cuda.empty_cache()
    if args.quick and not args.sweep:
        quick_sweep(results, copy_gbs, dtype, args.block_size, reps)
    if args.sweep:
        sweep(results, copy_gbs, dtype, args.block_size, reps)
    path = results.write()
    print(f"rows appended to {path}")
    png = plot_csv(path)
    if png:
        print(f"plot: {png}")
    print(targets_report(summary, copy_gbs))


def targets_report(summary, copy_gbs):
    lines = [f"targets (copy bandwidth {copy_gbs:.0f} GB/s):"]
    for key in TARGETS:
        r = summary.get(key)
        if r is None:
            continue
        frac = r["ours_gbs"] / copy_gbs
        ok = frac >= 0.85 and r["ours_ms"] <= r["sdpa_ms"] * 1.0 + 1e-9
        lines.append(f"  B{key[0]} S{key[1]} Hk{key[2]}: {r['ours_gbs']:.0f} GB/s = {frac:.1%} "
                     f"of copy (>= 85%), {r['ours_ms'] * 1e3:.1f} us vs SDPA {r['sdpa']} "
                     f"{r['sdpa_ms'] * 1e3:.1f} us: {'PASS' if ok else 'FAIL'}")
    for key in LONG_TARGETS:
        r = summary.get(key)
        if r is None:
            continue
        frac = r["ours_gbs"] / copy_gbs
        lines.append(f"  B{key[0]} S{key[1]} Hk{key[2]}: {r['ours_gbs']:.0f} GB/s = {frac:.1%} "
                     f"of copy (>= 70%): {'PASS' if frac >= 0.70 else 'FAIL'}"
                     + ("" if math.isnan(r["sdpa_ms"]) else
                        f" (SDPA {r['sdpa']} {r['sdpa_ms'] * 1e3:.1f} us, ours "
                        f"{r['ours_ms'] * 1e3:.1f} us)"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
