#!/usr/bin/env bash
# Where a cached cold start's time goes (issue 18): rms_norm and flash_attn first results in
# fresh processes (first run compiles into an empty cache, second should load it), then a
# cProfile of a third run and `-X importtime` of the package. Logs under $OUT. About 40 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD NUMBA_CACHE_DIR=/tmp/cold_probe_cache
rm -rf "$NUMBA_CACHE_DIR"
cat > /tmp/cold_rms_norm.py <<'PY'
import numpy as np
from numba import cuda
import llmspeed_numba as ln
x = cuda.to_device(np.ones((8, 4096), np.float16))
out = ln.rms_norm(x, cuda.to_device(np.ones(4096, np.float16))); cuda.synchronize()
PY
cat > /tmp/cold_flash_attn.py <<'PY'
import numpy as np
from numba import cuda
import llmspeed_numba as ln
q = cuda.to_device(np.ones((1, 512, 8, 128), np.float16))
out = ln.flash_attn(q, q, q, causal=True); cuda.synchronize()
PY
for op in rms_norm flash_attn; do
    /usr/bin/time -f "$op first %e s" python3 /tmp/cold_$op.py
    /usr/bin/time -f "$op second %e s" python3 /tmp/cold_$op.py
    NUMBA_DEBUG_CACHE=1 python3 -m cProfile -s cumtime /tmp/cold_$op.py > "$OUT/cold_$op.prof.txt" 2>&1
done
/usr/bin/time -f "import llmspeed_numba %e s" python3 -c "import llmspeed_numba"
/usr/bin/time -f "numba.cuda + one allocation %e s" python3 -c "from numba import cuda; cuda.to_device([1.0])"
python3 -X importtime -c "import llmspeed_numba" 2> "$OUT/importtime.txt"
sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -12
