"""Host time of a repeated op call (issue 18): what the calling thread spends per call of each
public op when a decode step passes the same arrays again and again (``out=`` preallocated where
the op takes it; gemm, rms_norm and softmax also without it: "allocating").

Both array kinds: torch CUDA tensors (bf16) and numba device arrays (fp16: they cannot hold
bf16); fp32 logits for softmax / argmax / sample, as an lm head gives them. Small shapes
(SmolLM2-135M at decode batch 8): the GPU work is a few us, so the host is what is timed, by
``bench_launch.per_call_us`` (bursts of 200 calls between synchronisations, so the launch queue
never fills, median over bursts). Baseline, same run and shapes: the closest torch op (matmul,
SDPA, F.rms_norm, softmax...) timed the same way, written in the numba rows too; where torch has
none, one bare ctypes ``cuLaunchKernelEx`` with its arguments ready (bench_launch's floor).
Every case (ours, the baselines, the floor) is set up first and then timed in ``--rounds``
interleaved rounds (default 5); each number is the median of its rounds, the CSV's spread their
min-max (timed one after another, the host's drift made ops of equal work differ by +-2 us).
``--checked``: each op also timed with the repeated-call fast path off (``_replay.ENABLED``),
every call through its checked path (validation, planning, packing), in rows whose variant ends
in " checked": before and after, side by side in one CSV. ``--profile``: cProfile over 2000
calls of each op (torch kind), the top 15 functions by own time (us per op call) in
``<results dir>/host_profile.txt``: where the time goes.

    python benchmarks/bench_host.py [--ops gemm,rms_norm] [--quick] [--rounds 5] [--checked]
        [--profile]
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/bench_host.py --smoke   # each call once, untimed
"""

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
import types

import numpy as np
from numba import types as nb_types

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import llmspeed_numba as lsn  # noqa: E402
from llmspeed_numba import _recording, _replay  # noqa: E402
from llmspeed_numba._arrays import as_tensor, kernel_buffer, numpy_dtype  # noqa: E402
from llmspeed_numba._env import SIMULATOR, cuda  # noqa: E402
from llmspeed_numba._launch import Kernel, PreparedLaunch, array1d, jit  # noqa: E402

import bench_launch  # noqa: E402
from _harness import RESULTS_DIR, Results  # noqa: E402

torch = F = None  # imported in main() unless --smoke: only the torch kind and baselines use them

# SmolLM2-135M at decode batch 8 (prefill: 128 tokens, a 16-token chunk); --smoke: tiny, as the
# simulator runs every thread in Python
SHAPES = dict(tokens=8, hidden=576, inter=1536, heads=9, kv=3, dim=64, seq=128, vocab=49152,
              ctx=64, block=16, chunk=16)
SMOKE = dict(tokens=2, hidden=32, inter=64, heads=2, kv=1, dim=16, seq=4, vocab=64, ctx=12,
             block=8, chunk=4)
FLOOR = "cuLaunchKernelEx floor"
LOGITS = ("softmax", "argmax", "sample")  # fp32 in both kinds


class Arrays:
    """Arrays of one kind from host data: torch CUDA tensors, numba device arrays, or (under the
    simulator, which takes them as device arrays) NumPy arrays."""

    def __init__(self, kind):
        self.kind, self.torch = kind, kind == "torch"
        self.dtype = "bfloat16" if self.torch else "float16"
        self.rng = np.random.default_rng(0)

    def put(self, host, dtype):
        if self.torch:
            return torch.from_numpy(np.ascontiguousarray(host)).to("cuda", getattr(torch, dtype))
        host = np.ascontiguousarray(host, numpy_dtype(dtype))
        return host if SIMULATOR else cuda.to_device(host)

    def randn(self, *shape, dtype=None):  # outputs too: what they hold does not matter
        return self.put(self.rng.standard_normal(shape, np.float32), dtype or self.dtype)

    def ints(self, values, dtype="int32"):
        return self.put(np.asarray(values, np.int64), dtype)


# ---- the calls: (shape, [(variant, our call, baseline name, torch call or None: the floor)]);
# a torch call is built only for the torch kind (A.torch and ...)

def _sdpa(q, k, v, causal):
    """SDPA on (batch, tokens, heads, dim) arrays, transposed here, not in the timed call."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)


def gemm(A, s):
    a, b, out = A.randn(s.tokens, s.hidden), A.randn(s.hidden, s.inter), A.randn(s.tokens, s.inter)
    return f"M{s.tokens} K{s.hidden} N{s.inter}", [
        ("out=", lambda: lsn.gemm(a, b, out=out), "torch.matmul out=",
         A.torch and (lambda: torch.matmul(a, b, out=out))),
        ("allocating", lambda: lsn.gemm(a, b), "torch.matmul",
         A.torch and (lambda: torch.matmul(a, b)))]


def gemm_tma(A, s):
    """gemm's 64 x 128 TMA tile forced (Hopper; both operands K-major): replayed with its
    operands' tensor maps, on the checked path with ``LLMSPEED_NUMBA_REPLAY_MAPS=0``."""
    a, w = A.randn(s.tokens, s.hidden), A.randn(s.inter, s.hidden)
    b, out = w.T, A.randn(s.tokens, s.inter)
    return f"M{s.tokens} K{s.hidden} N{s.inter} TMA tile", [
        ("out=", lambda: lsn.gemm(a, b, out=out, config="wg_64x128x64_s8_p_tma_k1"),
         "torch.matmul out=", A.torch and (lambda: torch.matmul(a, b, out=out)))]


def flash_attn(A, s):
    q, out = A.randn(1, s.seq, s.heads, s.dim), A.randn(1, s.seq, s.heads, s.dim)
    k, v = A.randn(1, s.seq, s.kv, s.dim), A.randn(1, s.seq, s.kv, s.dim)
    return f"1x{s.seq} h{s.heads}/{s.kv} d{s.dim} causal", [
        ("out=", lambda: lsn.flash_attn(q, k, v, causal=True, out=out), "SDPA",
         A.torch and _sdpa(q, k, v, True))]


def flash_attn_varlen(A, s):
    q, out = A.randn(s.seq, s.heads, s.dim), A.randn(s.seq, s.heads, s.dim)
    k, v, cu = A.randn(s.seq, s.kv, s.dim), A.randn(s.seq, s.kv, s.dim), A.ints([0, s.seq])
    return f"1 seq x{s.seq} h{s.heads}/{s.kv} d{s.dim} causal", [
        ("out=", lambda: lsn.flash_attn_varlen(q, k, v, cu, cu, s.seq, s.seq, causal=True,
                                               out=out),
         "SDPA (1 seq)", A.torch and _sdpa(q[None], k[None], v[None], True))]


def rms_norm(A, s):
    x, r, w = A.randn(s.tokens, s.hidden), A.randn(s.tokens, s.hidden), A.randn(s.hidden)
    out = A.randn(s.tokens, s.hidden)
    base = A.torch and (lambda: F.rms_norm(x, (s.hidden,), w, 1e-6))  # torch >= 2.4
    return f"{s.tokens}x{s.hidden}", [
        ("out=", lambda: lsn.rms_norm(x, w, 1e-6, out=out), "F.rms_norm", base),
        ("allocating", lambda: lsn.rms_norm(x, w, 1e-6), "F.rms_norm", base),
        # r grows by x each call: harmless for host time (a bf16 random walk stays finite)
        ("residual= out=", lambda: lsn.rms_norm(x, w, 1e-6, residual=r, out=out),
         "add_ + F.rms_norm", A.torch and (lambda: F.rms_norm(r.add_(x), (s.hidden,), w, 1e-6)))]


def layer_norm(A, s):
    x, w, b = A.randn(s.tokens, s.hidden), A.randn(s.hidden), A.randn(s.hidden)
    out = A.randn(s.tokens, s.hidden)
    return f"{s.tokens}x{s.hidden}", [
        ("out=", lambda: lsn.layer_norm(x, w, b, 1e-5, out=out), "F.layer_norm",
         A.torch and (lambda: F.layer_norm(x, (s.hidden,), w, b, 1e-5)))]


def rotary_embedding(A, s):
    q, k = A.randn(s.tokens, s.heads, s.dim), A.randn(s.tokens, s.kv, s.dim)
    pos, cos_sin = A.ints(np.arange(s.tokens) + s.ctx - s.tokens), A.randn(2 * s.ctx, s.dim)
    # check_bounds=False as the model calls it: the check reads positions back (a sync)
    return f"{s.tokens} tok h{s.heads}/{s.kv} d{s.dim} cache", [
        ("in place", lambda: lsn.rotary_embedding(q, k, pos, cos_sin_cache=cos_sin,
                                                  check_bounds=False), FLOOR, None)]


def _glu(op, act_name):
    def setup(A, s):
        x, out = A.randn(s.tokens, 2 * s.inter), A.randn(s.tokens, s.inter)
        x1, x2 = x[:, :s.inter], x[:, s.inter:]  # sliced once: our op takes the whole x
        act = A.torch and getattr(F, act_name)
        return f"{s.tokens}x{2 * s.inter}", [
            ("out=", lambda: op(x, out=out), f"mul(F.{act_name}) out=",
             A.torch and (lambda: torch.mul(act(x1), x2, out=out)))]
    return setup


silu_and_mul, gelu_and_mul = _glu(lsn.silu_and_mul, "silu"), _glu(lsn.gelu_and_mul, "gelu")


def gelu(A, s):
    x, out = A.randn(s.tokens, s.inter), A.randn(s.tokens, s.inter)
    return f"{s.tokens}x{s.inter}", [
        ("out=", lambda: lsn.gelu(x, out=out), "F.gelu", A.torch and (lambda: F.gelu(x)))]


def softmax(A, s):
    x, out = (A.randn(s.tokens, s.vocab, dtype="float32"),
              A.randn(s.tokens, s.vocab, dtype="float32"))
    base = A.torch and (lambda: torch.softmax(x, -1))
    return f"{s.tokens}x{s.vocab}", [
        ("out=", lambda: lsn.softmax(x, out=out), "torch.softmax", base),
        ("allocating", lambda: lsn.softmax(x), "torch.softmax", base)]


def argmax(A, s):
    x, out = A.randn(s.tokens, s.vocab, dtype="float32"), A.randn(s.tokens, dtype="int64")
    return f"{s.tokens}x{s.vocab}", [("out=", lambda: lsn.argmax(x, out=out), "torch.argmax",
                                      A.torch and (lambda: torch.argmax(x, -1)))]


def sample(A, s):
    x, out = A.randn(s.tokens, s.vocab, dtype="float32"), A.randn(s.tokens, dtype="int64")
    return f"{s.tokens}x{s.vocab} t0.8", [
        ("out=", lambda: lsn.sample(x, temperature=0.8, out=out), "softmax+multinomial",
         A.torch and (lambda: torch.multinomial(torch.softmax(x / 0.8, -1), 1)))]


def embedding(A, s):
    ids, weight = A.ints(np.arange(s.tokens) * 7, "int64"), A.randn(s.vocab, s.hidden)
    out = A.randn(s.tokens, s.hidden)
    return f"{s.tokens} of {s.vocab}x{s.hidden}", [
        ("out=", lambda: lsn.embedding(ids, weight, out=out), "F.embedding",
         A.torch and (lambda: F.embedding(ids, weight)))]


def _paged(A, s, batch):
    """A PagedKVCache holding ``batch`` sequences of ctx tokens; its host and device tables."""
    cache = lsn.PagedKVCache(batch * -(-s.ctx // s.block) + 1, s.block, s.kv, s.dim, A.dtype,
                             kind="torch" if A.torch else "numba")
    seqs = [cache.add_sequence(s.ctx) for _ in range(batch)]
    return (cache, cache.host_tables(seqs)[0]) + cache.tables(seqs)


def paged_kv_append(A, s):
    cache, host_table, table, _ = _paged(A, s, s.tokens)
    k, v = A.randn(s.tokens, 1, s.kv, s.dim), A.randn(s.tokens, 1, s.kv, s.dim)
    before, base = A.ints(np.full(s.tokens, s.ctx - 1)), None  # the same last slot each call
    if A.torch:  # vLLM's reshape_and_cache in torch: one index_copy_ per cache
        p = s.ctx - 1
        slots = A.ints(host_table[:, p // s.block] * s.block + p % s.block, "int64")
        kc, vc = (c.view(-1, s.kv, s.dim) for c in (cache.k_cache, cache.v_cache))
        k2, v2 = k.view(s.tokens, s.kv, s.dim), v.view(s.tokens, s.kv, s.dim)
        base = lambda: (kc.index_copy_(0, slots, k2), vc.index_copy_(0, slots, v2))  # noqa: E731
    return f"{s.tokens} seq x1 tok kv{s.kv} d{s.dim} blk{s.block}", [
        ("in place", lambda: lsn.paged_kv_append(k, v, cache.k_cache, cache.v_cache, table,
                                                 before), "index_copy_ x2", base)]


def rotary_kv_append(A, s):
    cache, _, table, _ = _paged(A, s, s.tokens)
    q, k, v = (A.randn(s.tokens, s.heads, s.dim), A.randn(s.tokens, s.kv, s.dim),
               A.randn(s.tokens, s.kv, s.dim))
    pos, cos_sin = A.ints(np.full(s.tokens, s.ctx - 1)), A.randn(2 * s.ctx, s.dim)
    k_rows, v_rows = k.reshape(s.tokens, 1, s.kv, s.dim), v.reshape(s.tokens, 1, s.kv, s.dim)

    def pair():  # the two calls it replaces (ours), as the model made them
        lsn.rotary_embedding(q, k, pos, cos_sin_cache=cos_sin, check_bounds=False)
        lsn.paged_kv_append(k_rows, v_rows, cache.k_cache, cache.v_cache, table, pos)

    return f"{s.tokens} tok h{s.heads}/{s.kv} d{s.dim} blk{s.block} cache", [
        ("in place", lambda: lsn.rotary_kv_append(q, k, v, cache.k_cache, cache.v_cache, table,
                                                  pos, cos_sin_cache=cos_sin), "rotary + append",
         pair)]


def paged_decode_attention(A, s):
    cache, _, table, lens = _paged(A, s, s.tokens)
    q, out = A.randn(s.tokens, s.heads, s.dim), A.randn(s.tokens, s.heads, s.dim)
    base = A.torch and _sdpa(q[:, None], A.randn(s.tokens, s.ctx, s.kv, s.dim),
                             A.randn(s.tokens, s.ctx, s.kv, s.dim), False)
    return f"{s.tokens} seq x{s.ctx} h{s.heads}/{s.kv} d{s.dim} blk{s.block}", [
        ("out=", lambda: lsn.paged_decode_attention(q, cache.k_cache, cache.v_cache, table, lens,
                                                    out=out), "SDPA contiguous K/V", base)]


def paged_prefill_attention(A, s):
    cache, host_table, _, _ = _paged(A, s, 1)
    table, cu, lens = A.ints(host_table), A.ints([0, s.chunk]), A.ints([s.ctx])
    q, out = A.randn(s.chunk, s.heads, s.dim), A.randn(s.chunk, s.heads, s.dim)
    return f"1 seq {s.chunk} new of {s.ctx} h{s.heads}/{s.kv} d{s.dim}", [
        ("out=", lambda: lsn.paged_prefill_attention(q, cache.k_cache, cache.v_cache, table, cu,
                                                     lens, s.chunk, causal=True, out=out),
         FLOOR, None)]


OPS = ["gemm", "flash_attn", "flash_attn_varlen", "rms_norm", "layer_norm", "rotary_embedding",
       "silu_and_mul", "gelu_and_mul", "gelu", "softmax", "argmax", "sample", "embedding",
       "paged_kv_append", "rotary_kv_append", "paged_decode_attention",
       "paged_prefill_attention"]
#: ... and cases run only when named (``--ops``)
EXTRA_OPS = ["gemm_tma"]


# ---- measuring -------------------------------------------------------------------------------

def launch_floor():
    """A timer of bench_launch's floor: one ctypes cuLaunchKernelEx of a near-empty kernel,
    arguments ready."""
    kernel = Kernel(jit(bench_launch._touch), (array1d(np.float32), nb_types.int32), "touch")
    x = cuda.to_device(np.ones(16, np.float32))
    prepared = PreparedLaunch(kernel, 1, 32, (kernel_buffer(as_tensor(x, "x")), 16))
    _, _, config, params, _ = prepared._site()
    launch, handle = prepared._launch, prepared.handle
    def floor():
        launch(config, handle, params, None)
    # the addresses stay valid only while the kernel's module, the array and the launch's
    # parameter block live: the timed function holds them (no work added to the call)
    floor.keep = (kernel, x, prepared)
    return _timer(floor)


#: (op, variant) -> the name of its torch baseline
BASE_NAMES: dict = {}


def _timer(fn, checked=False):
    """A function timing ``fn`` once (us per call, ``bench_launch.per_call_us``); ``checked``:
    with the fast path off."""
    def time_it():
        if not checked:
            return bench_launch.per_call_us(fn)
        with checked_path():
            return bench_launch.per_call_us(fn)
    return time_it


def time_rounds(timers, rounds, failed):
    """key -> one number a round for each ``(key, timer)``, all timed in turn ``rounds`` times
    (a line a round shows the progress). A timer that raises is dropped (reported in
    ``failed``): a baseline's row falls back to the floor."""
    samples, broken = {}, set()
    for r in range(rounds):
        start = time.perf_counter()
        for key, timer in timers:
            if key in broken:
                continue
            try:
                samples.setdefault(key, []).append(timer())
            except Exception as exc:  # noqa: BLE001
                cuda.synchronize()
                broken.add(key)
                samples.pop(key, None)
                failed.append(f"{key}: {type(exc).__name__}: {exc}")
                print("FAILED", failed[-1])
        print(f"round {r + 1}/{rounds}: {len(timers) - len(broken)} cases timed in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return samples


@contextlib.contextmanager
def checked_path():
    """Every op call inside takes its checked path: the fast path's "before"."""
    enabled, _replay.ENABLED = _replay.ENABLED, False
    try:
        yield
    finally:
        _replay.ENABLED = enabled


def replayed_ops():
    """Names of the ops on ``_replay``'s fast path (those ``--checked`` times both ways); every
    op's module imported first (the package imports them at first use)."""
    for op in OPS:
        getattr(lsn, op)
    return {calls.name for calls in _recording._ALL}


def profile(fn, calls, burst):
    """Top 15 functions by own time over ``calls`` calls, per op call (pstats' own table rounds
    to ms), synchronising (unprofiled) every ``burst`` so the launch queue never fills."""
    prof = cProfile.Profile()
    for _ in range(max(1, calls // burst)):
        cuda.synchronize()
        prof.enable()
        for _ in range(burst):
            fn()
        prof.disable()
    cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, name): (prim calls, calls, own s, cum s, _)
    total = sum(v[2] for v in stats.values()) / calls * 1e6
    lines = [f"{total:.1f} us per call (profiled); top 15 by own time:",
             f"{'calls':>6} {'own us':>7} {'cum us':>7}  function (per op call)"]
    for (file, line, name), (_, n, own, cum, _) in sorted(
            stats.items(), key=lambda kv: -kv[1][2])[:15]:
        lines.append(f"{n / calls:6.1f} {own / calls * 1e6:7.2f} {cum / calls * 1e6:7.2f}  "
                     f"{os.path.basename(file)}:{line}({name})")
    return "\n".join(lines)


def main():
    global torch, F
    parser = argparse.ArgumentParser(
        description="Host time of a repeated call of every public op (issue 18).")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list (default: all)")
    parser.add_argument("--quick", action="store_true", help="5 bursts per number, not 15")
    parser.add_argument("--checked", action="store_true",
                        help="also time each op with the fast path off (rows '... checked')")
    parser.add_argument("--profile", action="store_true", help="write host_profile.txt")
    parser.add_argument("--smoke", action="store_true", help="each call once (the simulator)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds over every case; each number is their median")
    args = parser.parse_args()
    ops = args.ops.split(",")
    known = OPS + EXTRA_OPS
    if set(ops) - set(known):
        parser.error(f"unknown ops {sorted(set(ops) - set(known))}; known: {','.join(known)}")
    s = types.SimpleNamespace(**(SMOKE if args.smoke else SHAPES))
    kinds, results, floor = ["torch", "numba"], None, None
    if args.smoke:
        print("skipped: every torch row and baseline (--smoke: no CUDA torch under the "
              "simulator; the numba rows run on NumPy fp16 arrays)")
        kinds = ["numba"]
    else:
        import torch
        import torch.nn.functional as F
        bench_launch.BURSTS = 5 if args.quick else bench_launch.BURSTS
        results = Results("host")
    table, profiles, failed, timers = [], [], [], []
    checked_ops = replayed_ops() if args.checked else set()
    # set up every case first, then time them all in interleaved rounds (the host's speed
    # drifts: timed one after another, ops of equal work differed by +-2 us)
    for kind in kinds:
        A = Arrays(kind)
        for op in ops:
            try:  # a failing op (setup or call) is reported; the others still run
                shape, rows = globals()[op](A, s)
                for variant, fn, base_name, base_fn in rows:
                    case = f"{op} {kind} {variant}"
                    if args.smoke:  # checks the call's arguments, nothing timed
                        fn()
                        if op in checked_ops:
                            with checked_path():
                                fn()
                        cuda.synchronize()
                        print(f"ok {case} ({shape}){' and checked' * (op in checked_ops)}")
                        continue
                    fn()  # the first call records the plan; an error surfaces here
                    row = dict(op=op, kind=kind, variant=variant, shape=shape, case=case,
                               dtype="float32" if op in LOGITS else A.dtype,
                               base=(op, variant))
                    table.append(row)
                    timers.append((case, _timer(fn)))
                    if op in checked_ops:
                        timers.append((f"{case} checked", _timer(fn, checked=True)))
                    if kind == "torch" and base_fn:  # timed once, written in the numba row too
                        timers.append((("base", op, variant), _timer(base_fn)))
                        BASE_NAMES[op, variant] = base_name
                if args.profile and kind == kinds[0]:
                    calls, burst = (2, 1) if args.smoke else (2000, bench_launch.BURST)
                    profiles.append(f"==== {op} {kind} {rows[0][0]} ({shape}): {calls} calls\n"
                                    + profile(rows[0][1], calls, burst))
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{op} {kind}: {type(exc).__name__}: {exc}")
                print("FAILED", failed[-1])
    if timers:
        timers.append(("floor", launch_floor()))
    samples = time_rounds(timers, args.rounds, failed) if timers else {}
    if "floor" in samples:
        floor = statistics.median(samples["floor"])
        print(f"{FLOOR}: {floor:.2f} us (median of {args.rounds} rounds)")
    table = [row for row in table if row["case"] in samples]
    for row in table:
        row["us"] = statistics.median(samples[row["case"]])
        row["range"] = (min(samples[row["case"]]), max(samples[row["case"]]))
        checked = samples.get(f"{row['case']} checked")
        row["checked"] = statistics.median(checked) if checked else None
        base = samples.get(("base",) + row["base"])
        row["bname"], row["bus"], row["note"] = ((BASE_NAMES[row["base"]],
                                                  statistics.median(base), "")
                                                 if base else (FLOOR, floor, "no torch baseline"))
        for suffix, values in (("", samples[row["case"]]), (" checked", checked)):
            if values:
                ms = [v / 1e3 for v in values]
                results.add("host", row["case"] + suffix, row["shape"], row["dtype"],
                            {"median": statistics.median(ms), "p20": min(ms), "p80": max(ms)},
                            row["bname"], {"median": row["bus"] / 1e3}, "us",
                            statistics.median(values), row["bus"],
                            f"{row['note']}; median of {args.rounds} interleaved rounds, spread "
                            f"= min-max".lstrip("; "))
    if table:
        print(f"\n{'op':<24} {'kind':<6} {'variant':<15} {'ours us':>8} {'rounds':>13} "
              f"{'checked':>8}  {'baseline':<22} {'us':>7}")
        for row in table:
            checked = "" if row["checked"] is None else f"{row['checked']:.2f}"
            spread = f"{row['range'][0]:.2f}-{row['range'][1]:.2f}"
            print(f"{row['op']:<24} {row['kind']:<6} {row['variant']:<15} {row['us']:8.2f} "
                  f"{spread:>13} {checked:>8}  {row['bname']:<22} {row['bus']:7.2f}")
        print("rows written:", results.write())
    if profiles:
        directory = results.directory if results else os.environ.get("OUT") or RESULTS_DIR
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "host_profile.txt")
        head = f"{results.gpu}, commit {results.commit}" if results else "simulator smoke"
        with open(path, "w") as f:
            f.write(f"bench_host.py --profile ({head}). cProfile adds a cost to every Python "
                    f"call: read the shares, not the us.\n\n" + "\n\n".join(profiles) + "\n")
        print("profile written:", path)
    if failed:
        sys.exit("failed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
