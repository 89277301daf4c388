"""Is paged decode's remaining gap to cuDNN in its DRAM access pattern? (issue 5)

Three copy-only kernels read the same K/V bytes (B32 S8192 Hk8 D128 bf16: 1.07 GB) into shared
memory with decode's pipeline (4 warps a block, 2 blocks an SM, each warp a 2-stage ring of
cp.async ``.L2::128B`` steps of 4 KB of K and 4 KB of V) and no math:

- ``per_head_paged``: a block per (sequence, KV head), as ``paged_decode``: a step is 16 keys of
  one head, 256-byte rows 2 KB apart in 16-key pages (consecutive pages, identity table);
- ``whole_pages``: a block per (sequence, eighth of its keys): a step is 2 keys of every head,
  4 KB contiguous - what a kernel computing all of a sequence's KV heads in one block reads;
- ``contiguous``: a block per (sequence, KV head) over (B, Hk, S, D): a step is 16 keys, 4 KB
  contiguous - the layout torch SDPA reads.
- ``stream_k``: ``per_head_paged``'s steps, but a grid of exactly the resident blocks (2 an SM),
  each taking an equal contiguous run of the (sequence, KV head, step) sequence, which crosses
  (sequence, head) boundaries: no wave tail (256 equal blocks on 264 slots leave 8 SMs with one).
- ``heads_lockstep``: a block per (sequence, ``lock`` adjacent KV heads, 1/``lock`` of the keys),
  warp ``w`` streaming heads ``w, w + 4, ..`` in turn, 16 keys a step: the block reads runs of
  ``lock`` heads' rows (1 KB at 4) instead of one head's 256-byte rows - what a block owning
  several KV heads would read.

Then the ``per_head_paged`` copy with decode's per-tile work added level by level (``WORK_LEVELS``).

    python benchmarks/probes/probe_kv_read.py [--seq-len S] [--kv-heads H] [--levels-only | --quick]

Prints us and GB/s per pattern and level next to paged_decode and SDPA on the same data.
"""

import os
import sys

import numpy as np

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(_BENCHMARKS))  # the repository root
sys.path.insert(0, _BENCHMARKS)  # _harness and the bench_*.py modules

from _harness import copy_bandwidth, time_gpu  # noqa: E402

BATCH, SEQ, HK, D, PAGE = 32, 8192, 8, 128, 16
WARPS, STAGES = 4, 2
ROUNDS = 8                      # 16-byte chunks a lane copies per step, for K and for V each
STEP_ELEMS = 32 * 16 * ROUNDS // 2   # 4 KB of bf16
PATTERNS = ("per_head_paged", "whole_pages", "contiguous", "stream_k", "heads_lockstep")


WORK_LEVELS = ("copy", "ldmatrix", "ldmatrix+mma", "ldmatrix+mma+softmax")


def _kernel(pattern, level="copy", stages=STAGES, grid=None, lock=4):
    """``(Kernel, shared bytes)`` reading K/V in ``pattern`` (PATTERNS) into decode's swizzled
    ring, with decode's per-tile work added up to ``level`` (WORK_LEVELS: K and V fragment
    loads, the 32 mma of Q K^T and P V, the online softmax). Which addition slows the stream is
    where paged_decode's time over the copy goes."""
    from llmspeed_numba import ptx
    from llmspeed_numba._env import cuda
    from llmspeed_numba._launch import Kernel, array1d, jit
    from llmspeed_numba.ops._attention_common import softmax_step as _softmax_step

    mode = PATTERNS.index(pattern)
    lvl = WORK_LEVELS.index(level)
    warp_elems = stages * 2 * STEP_ELEMS
    grid = BATCH * HK if grid is None else grid
    turns = lock // WARPS            # heads_lockstep: heads a warp takes in turn
    steps_per_block = SEQ // 16      # 4 KB steps of K a (sequence, head) has (every pattern)
    total_steps = BATCH * HK * steps_per_block
    # stream_k: steps a block, a multiple of WARPS
    per_block = -(-total_steps // (grid * WARPS)) * WARPS
    WAIT = stages - 1  # noqa: N806 (a literal for cp.async.wait_group)
    zero = np.uint32(0)
    f0 = np.float32(0.0)

    def kv_read(kc, vc, out):
        smem = cuda.shared.array(0, np.uint16)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        bid = cuda.blockIdx.x
        b = bid // HK
        # KV head (per_head_paged, contiguous), key eighth (whole_pages), or head group x key
        # part (heads_lockstep); stream_k recomputes b and part per step
        part = bid - b * HK
        r_lane = lane // 16
        chunk = lane % 16
        wbase = warp * warp_elems
        my_steps = steps_per_block // WARPS
        first = 0
        if mode == 3:
            first = bid * per_block
            span = min(first + per_block, total_steps) - first
            my_steps = 0
            if span > warp:
                my_steps = (span - warp + WARPS - 1) // WARPS
        k_row = ((lane >> 4) << 3) + (lane & 7)
        v_row = (((lane >> 3) & 1) << 3) + (lane & 7)
        k_sw = cuda.local.array(4, np.int32)
        v_sw = cuda.local.array(4, np.int32)
        for j in range(4):
            k_sw[j] = k_row * D + (((((lane >> 3) & 1) + 2 * j) ^ (k_row & 7)) << 3)
            v_sw[j] = v_row * D + ((((lane >> 4) + 2 * j) ^ (v_row & 7)) << 3)
        o = cuda.local.array((16, 2), np.float32)
        for n in range(16):
            o[n, 0] = f0
            o[n, 1] = f0
        qa = np.uint32(0x3C003C00 + lane)
        m = np.float32(-np.inf)
        lsum = f0
        acc = np.uint32(0)
        for i in range(my_steps + stages - 1):
            ptx.syncwarp()
            if i < my_steps:
                step = warp + i * WARPS
                if mode == 3:
                    gs = first + step
                    pair = gs // steps_per_block
                    step = gs - pair * steps_per_block
                    b = pair // HK
                    part = pair - b * HK
                stage = i % stages
                for j in range(ROUNDS):
                    r = 2 * j + r_lane   # the step's 256-byte row this lane copies from
                    if mode == 4:
                        key_part = part % lock
                        turn = i // turns
                        key = (key_part * (steps_per_block // lock) + turn) * 16 + r
                        head = (part - key_part) + warp + WARPS * (i - turn * turns)
                        src = (((b * (SEQ // PAGE) + key // PAGE) * PAGE + key % PAGE) * HK
                               + head) * D
                    elif mode == 0 or mode == 3:
                        key = step * 16 + r
                        src = (((b * (SEQ // PAGE) + key // PAGE) * PAGE + key % PAGE) * HK
                               + part) * D
                    elif mode == 1:
                        key = part * (SEQ // HK) + step * 2 + r // HK
                        src = (((b * (SEQ // PAGE) + key // PAGE) * PAGE + key % PAGE) * HK
                               + r % HK) * D
                    else:
                        src = ((b * HK + part) * SEQ + step * 16 + r) * D
                    src += chunk * 8
                    dst = wbase + stage * 2 * STEP_ELEMS + r * D + ((chunk ^ (r & 7)) << 3)
                    ptx.cp_async_16_l2(smem, dst, kc, src, 16, 128)
                    ptx.cp_async_16_l2(smem, dst + STEP_ELEMS, vc, src, 16, 128)
            ptx.cp_async_commit()
            if i >= stages - 1:
                ptx.cp_async_wait(WAIT)
                ptx.syncwarp()
                kbase = wbase + ((i + 1) % stages) * 2 * STEP_ELEMS
                vbase = kbase + STEP_ELEMS
                if lvl == 0:
                    acc ^= np.uint32(smem[kbase + lane])
                else:
                    sa0 = f0
                    sa1 = f0
                    sb0 = f0
                    sb1 = f0
                    for ks in range(8):
                        b0, b1, b2, b3 = ptx.ldmatrix_x4(
                            smem, kbase + k_sw[ks % 4] + (ks // 4) * 64)
                        if lvl == 1:
                            acc ^= b0 ^ b1 ^ b2 ^ b3
                        else:
                            sa0, sa1, _, _ = ptx.mma_bf16(qa, zero, qa, zero, b0, b1, sa0, sa1,
                                                          f0, f0)
                            sb0, sb1, _, _ = ptx.mma_bf16(qa, zero, qa, zero, b2, b3, sb0, sb1,
                                                          f0, f0)
                    alpha = np.float32(1.0)
                    if lvl == 3:
                        m, lsum, alpha, sa0, sa1, sb0, sb1 = _softmax_step(m, lsum, sa0, sa1,
                                                                           sb0, sb1)
                    p0 = ptx.pack_bf16x2(sa0, sa1)
                    p2 = ptx.pack_bf16x2(sb0, sb1)
                    for pair in range(8):
                        b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(
                            smem, vbase + v_sw[pair % 4] + (pair // 4) * 64)
                        if lvl == 1:
                            acc ^= b0 ^ b1 ^ b2 ^ b3
                        else:
                            n0 = 2 * pair
                            o[n0, 0], o[n0, 1], _, _ = ptx.mma_bf16(
                                p0, zero, p2, zero, b0, b1, o[n0, 0] * alpha, o[n0, 1] * alpha,
                                f0, f0)
                            o[n0 + 1, 0], o[n0 + 1, 1], _, _ = ptx.mma_bf16(
                                p0, zero, p2, zero, b2, b3, o[n0 + 1, 0] * alpha,
                                o[n0 + 1, 1] * alpha, f0, f0)
        total = lsum
        for n in range(16):
            total += o[n, 0] + o[n, 1]
        out[bid * 32 * WARPS + tid] = np.int32(acc) + np.int32(total)   # keeps the work live

    u16 = array1d(np.uint16)
    # at least 80 KB of shared memory a block: 2 blocks an SM, as paged_decode (whose limit is
    # its registers)
    return (Kernel(jit(kv_read), (u16, u16, array1d(np.int32)),
                   f"kv_read_{pattern}_{lvl}_{stages}_{grid}_{lock}"),
            max(WARPS * warp_elems * 2, 80 << 10))


def main(argv=None):
    import argparse

    import torch

    global SEQ, HK
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=SEQ)
    ap.add_argument("--kv-heads", type=int, default=HK)
    ap.add_argument("--levels-only", action="store_true",
                    help="skip the whole-page / contiguous patterns and the slower SDPA kernels")
    ap.add_argument("--quick", action="store_true",
                    help="per-head, heads-lockstep and contiguous copies, the full work level")
    args = ap.parse_args(argv)
    SEQ = args.seq_len
    HK = args.kv_heads

    from bench_decode import make_inputs, sdpa_baselines, sequential_pages

    from llmspeed_numba._arrays import kernel_buffer, stream_handle
    from llmspeed_numba._checks import tensor
    from llmspeed_numba._launch import sm_count
    from llmspeed_numba.ops import paged_decode as pd

    copy = copy_bandwidth()
    q, kc, vc, bt, sl, k, v = make_inputs(BATCH, SEQ, HK, torch.bfloat16, PAGE)
    kc, vc, bt = sequential_pages(kc, vc, bt)
    nbytes = 2 * k.numel() * k.element_size()
    blocks = BATCH * HK
    out = torch.empty(4 * sm_count() * 32 * WARPS, dtype=torch.int32, device="cuda")
    print(f"copy {copy:.0f} GB/s; K/V {nbytes / 1e9:.2f} GB; {blocks} blocks of {32 * WARPS}")

    def line(name, t):
        gbs = nbytes / (t["median"] * 1e-3) / 1e9
        print(f"  {name:40s} {t['median'] * 1e3:7.1f} us {gbs:6.0f} GB/s {100 * gbs / copy:5.1f}%"
              " of copy", flush=True)

    def time_kernel(label, kernel, smem_bytes, src_k, src_v, grid=blocks):
        bufs = (kernel_buffer(tensor(src_k, "k")), kernel_buffer(tensor(src_v, "v")),
                kernel_buffer(tensor(out, "out")))

        def call():
            kernel(grid, 32 * WARPS, bufs, stream_handle(None, (tensor(out, "out"),)),
                   smem_bytes)

        call()
        torch.cuda.synchronize()
        line(label, time_gpu(call))

    if args.levels_only:
        patterns = ("per_head_paged",)
    elif args.quick:
        patterns = ("per_head_paged", "heads_lockstep", "contiguous")
    else:
        patterns = PATTERNS
    locks = [n for n in (4, 8, 16, 32) if n <= HK]
    resident = 2 * sm_count()
    for pattern in patterns:
        src = (k, v) if pattern == "contiguous" else (kc, vc)
        if pattern == "heads_lockstep":
            for lock in locks if args.quick else (4,):
                time_kernel(f"heads_lockstep {lock}", *_kernel(pattern, lock=lock), *src)
            continue
        if pattern != "stream_k":
            time_kernel(pattern, *_kernel(pattern), *src)   # level "copy"
            continue
        for grid in (resident, 2 * resident):
            for level in (WORK_LEVELS[0], WORK_LEVELS[-1]):
                time_kernel(f"stream_k {grid} blocks, {level}",
                            *_kernel("stream_k", level, STAGES, grid), kc, vc, grid=grid)
    levels = [(lv, STAGES) for lv in WORK_LEVELS[1:]] + [(WORK_LEVELS[-1], 3)]
    if args.quick:
        levels = [(WORK_LEVELS[-1], STAGES)]
    for level, stages in levels:
        label = f"paged + {level}" + ("" if stages == STAGES else f", {stages} stages")
        time_kernel(label, *_kernel("per_head_paged", level, stages), kc, vc)
    if args.quick:
        for lock in locks[:2]:
            time_kernel(f"heads_lockstep {lock} + {WORK_LEVELS[-1]}",
                        *_kernel("heads_lockstep", WORK_LEVELS[-1], lock=lock), kc, vc)
    o = torch.empty_like(q)
    line("paged_decode", time_gpu(lambda: pd.paged_decode_attention(q, kc, vc, bt, sl, out=o)))
    for name, (fn, _note) in sdpa_baselines(q, k, v).items():
        if not (args.levels_only or args.quick) or name in ("cudnn", "default"):
            line(f"sdpa {name}", time_gpu(fn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
