"""Where paged decode's fixed cost goes: per-block timestamps (``%globaltimer``) of an
instrumented copy of the decode kernel (issue 5).

``probe_kv_read.py`` found paged_decode ~5-7 us slower than a copy of its own K/V stream carrying
all of its per-tile math, at every length (S 512 .. 16384): a fixed cost, not a per-key one. This
probe loads ``llmspeed_numba/ops/paged_decode.py`` a second time with four timestamps added to
the kernel (block start, main loop start, main loop end in warp 0, block end after the merge and
the output stores; thread 0 writes them into the ``lse`` buffer, whose own writes are dropped),
runs B32 H32/8 D128 with 16-key pages, and prints their distribution relative to the first
block's start. The shipped module is untouched.

    python benchmarks/probe_decode_timeline.py [--seq-len 8192]
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODULE = "llmspeed_numba.ops._paged_decode_timeline"
PATCHES = (  # (anchor, text inserted before it, or replacing it when the third item is True)
    ("        t4 = lane % 4\n", "        t4 = lane % 4\n        _t0 = _gt()\n", True),
    ("        for i in range(my_count + stages - 1):\n", "        _t1 = _gt()\n", False),
    ("        # ---- merge the warps' partial results", "        _t2 = _gt()\n", False),
    # the decode kernel's LSE store (the reduce kernel's is indented less)
    (" " * 24 + "lse[b * slb + head * slh + tq * slt] = _row_lse2(big, total) * ln2",
     " " * 24 + "pass", True),
    ("        if num_splits == 1 or folded == 0:\n",
     ("        cuda.syncthreads()\n"
      "        if tid == 0:\n"
      "            _t3 = _gt()\n"
      "            lse[bid * 4] = ptx.f32_from_bits(np.uint32(_t0 & _LOW))\n"
      "            lse[bid * 4 + 1] = ptx.f32_from_bits(np.uint32(_t1 & _LOW))\n"
      "            lse[bid * 4 + 2] = ptx.f32_from_bits(np.uint32(_t2 & _LOW))\n"
      "            lse[bid * 4 + 3] = ptx.f32_from_bits(np.uint32(_t3 & _LOW))\n"), False),
)


def _globaltimer():
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def globaltimer(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []),
                               "mov.u64 $0, %globaltimer;", "=l", side_effect=True)
            return builder.call(asm, [])

        return types.uint64(), codegen

    return globaltimer


def instrumented_module():
    """paged_decode loaded again under MODULE with the timestamps patched in."""
    import importlib.util
    import types as pytypes

    import llmspeed_numba.ops.paged_decode as shipped

    with open(shipped.__file__) as f:
        src = f.read()
    for anchor, text, replace in PATCHES:
        if src.count(anchor) != 1:
            raise RuntimeError(f"anchor not unique in paged_decode.py: {anchor!r}")
        src = src.replace(anchor, text if replace else text + anchor)
    # a real file: numba's kernel cache locates the source by its path
    path = os.path.join(tempfile.mkdtemp(prefix="decode_timeline_"), "paged_decode_timeline.py")
    with open(path, "w") as f:
        f.write(src)
    mod = pytypes.ModuleType(MODULE)
    mod.__package__ = "llmspeed_numba.ops"
    mod.__file__ = path
    mod.__spec__ = importlib.util.spec_from_loader(MODULE, loader=None)
    mod._gt = _globaltimer()
    mod._LOW = np.uint64(0xFFFFFFFF)
    sys.modules[MODULE] = mod
    exec(compile(src, path, "exec"), mod.__dict__)  # noqa: S102
    return mod


def main(argv=None):
    import torch
    from _harness import time_gpu
    from bench_decode import make_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--nheads-k", type=int, default=8)
    args = ap.parse_args(argv)
    pd = instrumented_module()
    q, kc, vc, bt, sl, _k, _v = make_inputs(args.batch, args.seq_len, args.nheads_k,
                                            torch.bfloat16, 16)
    blocks = pd.launch_plan(args.batch, 1, q.shape[1], args.nheads_k, q.shape[2], 16,
                            bt.shape[1], "bfloat16")
    n_blocks = blocks["blocks"] * blocks["num_splits"]
    if n_blocks * 4 > q.shape[0] * q.shape[1]:
        raise SystemExit(f"{n_blocks} blocks need {4 * n_blocks} lse slots, have "
                         f"{q.shape[0] * q.shape[1]}")
    out = torch.empty_like(q)

    def call():
        pd.paged_decode_attention(q, kc, vc, bt, sl, out=out, return_lse=True)

    t = time_gpu(call)
    print(f"B{args.batch} S{args.seq_len} Hk{args.nheads_k}: {n_blocks} blocks, "
          f"{t['median'] * 1e3:.1f} us (instrumented, timed)")
    for rep in range(3):
        _, lse = pd.paged_decode_attention(q, kc, vc, bt, sl, out=out, return_lse=True)
        torch.cuda.synchronize()
        raw = lse.reshape(-1)[: 4 * n_blocks].view(torch.int32).cpu().numpy().astype(np.int64)
        raw = (raw & 0xFFFFFFFF).reshape(n_blocks, 4)
        base = raw[:, 0].min()
        rel = ((raw - base) % (1 << 32)) / 1e3   # us after the first block's start
        start, loop, loop_end, end = rel.T
        def pct(a):
            return " / ".join(f"{np.percentile(a, p):7.2f}" for p in (0, 50, 90, 100))

        print(f" run {rep}: percentiles 0/50/90/100 (us)")
        print(f"   block start               {pct(start)}")
        print(f"   prologue (loop - start)   {pct(loop - start)}")
        print(f"   loop (warp 0)             {pct(loop_end - loop)}")
        print(f"   epilogue (end - loop end) {pct(end - loop_end)}")
        print(f"   block end                 {pct(end)}")
        print(f"   last end - last loop end of warp 0: {end.max() - loop_end.max():.2f}; "
              f"kernel span {end.max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
