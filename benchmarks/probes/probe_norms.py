"""rms_norm's two schedules of register-held rows, A/B in one run (issue 6: without the residual,
hidden 14336 went from 117 us at bd70184 to 124 (f16) / 141 (bf16) us at 06b1a55).

    python benchmarks/probes/probe_norms.py [--hiddens 4096,8192,14336] [--dtypes float16,bfloat16]
                                     [--rounds 2]
    python benchmarks/probes/probe_norms.py --sass    # no GPU needed: registers and memory-op order

On (8192 tokens, hidden), for each dtype: rms_norm without the residual under each schedule of
``rms_norm.SCHEDULES`` ("interleaved": bd70184's kernel, each weight chunk loaded beside its
store; "loads_first": 06b1a55's, every load of a pass before its stores, 64-register launch
bounds, less its bf16 defect: there the first chunk's squares were summed before the other
chunks' loads were issued), the two alternated over ``--rounds`` rounds so drift shows as a
round-to-round change; then rms_norm + residual (always "loads_first") at the widest hidden.
References: the 2 GiB copy and a same-size copy (moving the op's bytes, eager, L2 flushed), as
in bench_fused.

Each line: us per call in each round (median of 20 CUDA-graph replays, L2 flushed, through
``_harness.time_gpu``), GB/s of the best round (x and out once, the weight once), % of the 2 GiB
copy, % of the same-size copy, registers, blocks an SM, the memory-op order of the SASS (when
nvdisasm is there: L / l = 16-byte / 2-byte load, S / s = store, | = barrier, b = reconvergence,
X = exit) and whether the output matches the other schedule's bit for bit and torch (max |ours -
torch| / max |torch|). A table of the winner per row and the default's choice ends the run (also
``probe_norms.md`` in ``$OUT``). About 1-2 minutes with compiles.
"""

import argparse
import os
import re
import sys
import time

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules

from llmspeed_numba._overrides import overrides  # noqa: E402
from llmspeed_numba.ops import _rowwise as rw  # noqa: E402
from llmspeed_numba.ops import rms_norm as rn  # noqa: E402

TOKENS = 8192
EPS = 1e-6


def _letter(op):
    if op.startswith(("LDG", "STG")):
        letter = "L" if op.startswith("LDG") else "S"
        return letter if op.endswith(".128") else letter.lower()
    if op.startswith("BAR.SYNC"):
        return "|"
    return {"BSYNC": "b", "EXIT": "X"}.get(op, "")


def memory_order(sass):
    """The kernel's loads, stores, barriers, reconvergence points and exits in program order,
    one letter each (the runtime's slow-path helpers, in their own sections, left out)."""
    at = re.search(r"\.section\s+\.text\.\S*rms_norm_kernel", sass)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                     sass[at.start():] if at else sass)
    return "".join(_letter(op) for op in ops)


def plan(hidden, dtype):
    """``(vec, (threads_per_row, rows_per_block, chunks_per_thread))`` of a torch-allocated
    (16-byte aligned) (TOKENS, hidden) array."""
    vec = rw.vector_width(dtype)
    return vec, rw.row_plan(hidden // vec)


def kernel_args(hidden, dtype, residual, schedule):
    kind = rw.kind(dtype)
    vec, (tpr, rpb, cpt) = plan(hidden, dtype)
    interleaved = schedule == "interleaved"
    return kind, vec, tpr, rpb, cpt, residual, interleaved


def offline(args):
    """Registers and memory-op order of each schedule, compiled for sm_90a without a GPU."""
    from numba import cuda

    from llmspeed_numba import compile_check as cc

    print(f"{'hidden':>6} {'dtype':9} {'case':24} {'regs':>4} {'instrs':>6}  memory-op order")
    for hidden in args.hiddens:
        for dtype in args.dtypes:
            cases = [(False, s) for s in rn.SCHEDULES]
            if hidden == max(args.hiddens):
                cases.append((True, "loads_first"))
            for residual, schedule in cases:
                kind, vec, tpr, rpb, cpt, res, inter = kernel_args(hidden, dtype, residual,
                                                                   schedule)
                fn = rn._rms_norm_kernel_fn(kind, kind, vec, tpr, rpb, cpt, res, inter)
                ptx, _ = cuda.compile_ptx(fn, rn._signature(kind, kind), cc=cc.TARGET_CC,
                                          **rn._options(tpr, rpb, cpt, vec, inter))
                cubin, log = cc.ptx_to_cubin(ptx)
                sass = cc.disassemble(cubin)
                n = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
                label = ("+residual " if residual else "") + schedule
                regs = cc._first_int(r"Used (\d+) registers", log)
                print(f"{hidden:6} {dtype:9} {label:24} {regs:4} {n:6}  {memory_order(sass)}",
                      flush=True)
    return 0


def resident(kernel, threads):
    from llmspeed_numba._launch import sm_count

    try:
        return kernel.compiled().max_cooperative_grid_blocks(threads) // sm_count()
    except Exception:  # noqa: BLE001  occupancy query unavailable: count registers (sm_90)
        regs = -(-max(kernel.resources()["registers"], 1) // 8) * 8
        return min(32, 2048 // threads, 65536 // (regs * threads))


class Reporter:
    """Prints one line a measurement beside the copies; collects the summary rows."""

    def __init__(self):
        from _harness import copy_bandwidth

        self.copy_bandwidth = copy_bandwidth
        self.copy = copy_bandwidth()
        self.same = {}
        self.summary = []

    def same_size(self, nbytes):
        """GB/s of a copy moving ``nbytes`` (eager, L2 flushed, as bench_fused), cached."""
        if nbytes not in self.same:
            self.same[nbytes] = self.copy_bandwidth(nbytes // 2, flush_l2=True)
        return self.same[nbytes]

    def line(self, hidden, dtype, label, rounds, nbytes, kernel, threads, note):
        """Prints a line; returns (best us, % of the 2 GiB copy)."""
        best = min(rounds)
        gbs = nbytes / (best * 1e-6) / 1e9
        try:
            order = memory_order(kernel.compiled().inspect_sass())
        except Exception as exc:  # noqa: BLE001  no nvdisasm on this machine
            order = f"(SASS n/a: {type(exc).__name__})"
        us = " ".join(f"{r:7.1f}" for r in rounds)
        print(f"{hidden:6} {dtype:9} {label:24} {us:>17} {gbs:6.0f} "
              f"{100 * gbs / self.copy:5.1f}% {100 * gbs / self.same_size(nbytes):5.1f}% "
              f"{kernel.resources()['registers']:4} {resident(kernel, threads):6}  {note}; "
              f"{order}", flush=True)
        return best, 100 * gbs / self.copy


def _reference(x, w):
    import torch

    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _forced(x, w, out, schedule):
    """A call of rms_norm(x, w, out=out) under ``schedule`` (set only while it runs)."""
    def call():
        with overrides(rms_norm={"schedule": schedule}):
            rn.rms_norm(x, w, EPS, out=out)

    return call


def probe_no_residual(report, hidden, dtype, rounds):
    """Both schedules without the residual, alternated over ``rounds`` rounds."""
    import torch
    from _harness import graphed, time_gpu

    tdt = getattr(torch, dtype)
    x = torch.randn(TOKENS, hidden, device="cuda").to(tdt)
    w = torch.randn(hidden, device="cuda").to(tdt)
    want = _reference(x, w)
    nbytes = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
    outs = {s: torch.empty_like(x) for s in rn.SCHEDULES}
    calls = {}
    for schedule in rn.SCHEDULES:
        call = _forced(x, w, outs[schedule], schedule)
        call()  # compiles outside the capture
        calls[schedule] = graphed(call) or call
    torch.cuda.synchronize()
    times = {s: [] for s in rn.SCHEDULES}
    for _ in range(rounds):
        for schedule in rn.SCHEDULES:
            times[schedule].append(time_gpu(calls[schedule])["median"] * 1e3)
    first, second = (outs[s] for s in rn.SCHEDULES)
    agree = torch.equal(first.view(torch.int16), second.view(torch.int16))
    results = {}
    for schedule in rn.SCHEDULES:
        kind, vec, tpr, rpb, cpt, res, inter = kernel_args(hidden, dtype, False, schedule)
        kernel = rn._rms_norm_kernel(kind, kind, vec, tpr, rpb, cpt, res, inter)
        note = (f"{'bit-equal to' if agree else 'DIFFERS from'} the other schedule, torch err "
                f"{_rel_err(outs[schedule], want):.1e}")
        results[schedule] = report.line(hidden, dtype, schedule, times[schedule], nbytes, kernel,
                                        tpr * rpb, note)
    _, (tpr, _, cpt) = plan(hidden, dtype)
    default = "interleaved" if rn._schedule(tpr, cpt, False) else "loads_first"
    report.summary.append(("rms_norm", hidden, dtype, results, default))


def probe_residual(report, hidden, dtype, rounds):
    """rms_norm + residual (the "loads_first" kernel): the row that 06b1a55 improved most."""
    import torch
    from _harness import graphed, time_gpu

    tdt = getattr(torch, dtype)
    x = torch.randn(TOKENS, hidden, device="cuda").to(tdt)
    w = torch.randn(hidden, device="cuda").to(tdt)
    r = torch.randn(TOKENS, hidden, device="cuda").to(tdt)
    r0 = r.clone()
    out = torch.empty_like(x)
    rn.rms_norm(x, w, EPS, residual=r, out=out)
    torch.cuda.synchronize()
    exact = torch.equal(r.view(torch.int16), (x.float() + r0.float()).to(tdt).view(torch.int16))
    note = (f"residual {'exact' if exact else 'WRONG'}, torch err "
            f"{_rel_err(out, _reference(r, w)):.1e}")

    def call():
        rn.rms_norm(x, w, EPS, residual=r, out=out)

    replay = graphed(call) or call
    times = [time_gpu(replay)["median"] * 1e3 for _ in range(rounds)]
    kind, vec, tpr, rpb, cpt, res, inter = kernel_args(hidden, dtype, True, "loads_first")
    kernel = rn._rms_norm_kernel(kind, kind, vec, tpr, rpb, cpt, res, inter)
    nbytes = 4 * x.numel() * x.element_size() + w.numel() * w.element_size()
    best = report.line(hidden, dtype, "+residual loads_first", times, nbytes, kernel, tpr * rpb,
                       note)
    report.summary.append(("rms_norm+residual", hidden, dtype, {"loads_first": best},
                           "loads_first"))


def gpu(args):
    import torch

    t_start = time.perf_counter()
    report = Reporter()
    print(f"{torch.cuda.get_device_name()}: 2 GiB copy {report.copy:.0f} GB/s; default: "
          f"schedule {rn.TUNING.schedule!r}, interleaved from "
          f"{rn.INTERLEAVED_MIN_THREADS} threads a row\n")
    print(f"{'hidden':>6} {'dtype':9} {'case':24} {'us by round':>17} {'GB/s':>6} {'%copy':>6} "
          f"{'%same':>6} {'regs':>4} {'blk/SM':>6}  check; memory-op order")
    for hidden in args.hiddens:
        for dtype in args.dtypes:
            probe_no_residual(report, hidden, dtype, args.rounds)
            if hidden == max(args.hiddens):
                probe_residual(report, hidden, dtype, args.rounds)
            torch.cuda.empty_cache()
        print()

    rows = [("| op | hidden | dtype | interleaved us (% copy) | loads_first us (% copy) | "
             "faster | default |"), "|---|---|---|---|---|---|---|"]
    for op, hidden, dtype, res, default in report.summary:
        cell = {s: (f"{res[s][0]:.1f} ({res[s][1]:.1f}%)" if s in res else "-")
                for s in rn.SCHEDULES}
        faster = min(res, key=lambda s: res[s][0]) if len(res) > 1 else "-"
        mark = "" if faster in ("-", default) else " (slower one)"
        rows.append(f"| {op} | {hidden} | {dtype} | {cell['interleaved']} | "
                    f"{cell['loads_first']} | {faster} | {default}{mark} |")
    table = "\n".join(rows)
    print(f"2 GiB copy {report.copy:.0f} GB/s; target >= 85% of it\n\n{table}\n\n"
          f"{time.perf_counter() - t_start:.0f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "probe_norms.md"), "w") as f:
            f.write(f"2 GiB copy {report.copy:.0f} GB/s\n\n{table}\n")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hiddens", default="4096,8192,14336")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sass", action="store_true", help="offline: registers, SASS order")
    args = parser.parse_args(argv)
    args.hiddens = [int(h) for h in args.hiddens.split(",")]
    args.dtypes = args.dtypes.split(",")
    for h in args.hiddens:
        if h <= 0 or h % 8:  # whole 16-byte chunks: no scalar tail
            parser.error(f"--hiddens: expected positive multiples of 8, got {h}")
    for d in args.dtypes:
        if d not in rn.FLOAT_DTYPES:
            parser.error(f"--dtypes: expected names from {rn.FLOAT_DTYPES}, got {d}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")
    return offline(args) if args.sass else gpu(args)


if __name__ == "__main__":
    sys.exit(main())
