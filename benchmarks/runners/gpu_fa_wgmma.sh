#!/usr/bin/env bash
# First GPU run of the Hopper wgmma FlashAttention kernel (issue 22), in under 10 minutes:
#   1. correctness: the new PTX op (wgmma with A from registers), the wgmma kernel at fixed shapes
#      (the planner's default on sm_90); each form of it (warp-specialised, with ping-pong, the
#      all-threads ring) against SDPA and timed (which should be the default);
#   2. the quick benchmark: planned kernel (wgmma) vs our mma.sync kernel vs SDPA FA2 / cuDNN,
#      B4 H32 S4096 headdim 128 and 64, causal and not, bf16;
#   3. hypothesis shapes against the float64 reference (the wgmma kernel forced);
#   4. with RACECHECK=1 instead of 1-3: compute-sanitizer racecheck over every wgmma variant
#      (slow: a run of its own).
# Every step has its own time limit (a hang, e.g. an mbarrier wait that never completes, costs
# only that step; the limits add up to 570 s) and its own log under $OUT; summary.txt collects
# the last lines.
#   bash benchmarks/runners/gpu_fa_wgmma.sh; RACECHECK=1 bash benchmarks/runners/gpu_fa_wgmma.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
. benchmarks/runners/_steps.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/summary.txt" 2>&1
if [ "${RACECHECK:-0}" = 1 ]; then
    step racecheck 590 python -m pytest -q -p no:cacheprovider tests/test_flash_attn.py \
        -k "gpu_wgmma_racecheck"
    exit
fi
step op 50 python -m pytest -q -x -p no:cacheprovider tests/test_wgmma.py -k register_a
step fixed 150 python -m pytest -q -p no:cacheprovider tests/test_flash_attn.py \
    -k "gpu_fast_headdims or planner or gpu_packed or gpu_matches_torch"
step configs 90 python - <<'EOF'
# each wgmma form: error against SDPA (causal, ragged), then TFLOP/s at B4 H32 S4096 d128 bf16
import torch
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.flash_attn import flash_attn
sdpa = torch.nn.functional.scaled_dot_product_attention
q, k, v = (torch.randn(2, 700, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
ref = sdpa(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
big = [torch.randn(4, 4096, 32, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
for config in ((2, 128, 3, 1, 1, 0), (2, 128, 3, 1, 1, 1), (2, 128, 2, 1, 0, 0)):
    with overrides(flash_attn={"impl": "wgmma", "config": config}):
        err = (flash_attn(q, k, v, causal=True).float() - ref.float()).abs().max().item()
        line = f"{config} max |out - sdpa| {err:.2e}"
        for causal in (False, True):
            flash_attn(*big, causal=causal)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                flash_attn(*big, causal=causal)
            e1.record()
            torch.cuda.synchronize()
            flops = 4 * 4 * 32 * 4096 * 4096 * 128 / (2 if causal else 1)
            line += f"; {'causal' if causal else 'non-causal'} "
            line += f"{flops / (e0.elapsed_time(e1) / 10 * 1e-3) / 1e12:.0f} TFLOP/s"
    print(line, flush=True)
EOF
TAIL=12 step bench 170 python benchmarks/bench_flash_attn.py --quick --dtype bfloat16 \
    --shapes "4,32,32,4096,128;4,32,32,4096,64" --impls tc --no-varlen
step hypothesis 110 python -m pytest -q -p no:cacheprovider tests/test_flash_attn.py \
    -k "gpu_wgmma_matches"
