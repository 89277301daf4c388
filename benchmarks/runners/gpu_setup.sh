# Sourced by the gpu_*.sh runners on the device machine: the carried wheels on PYTHONPATH,
# numba's kernel cache from .gpu/numba_cache.tgz and both caches from .gpu/llm_cache.tgz (returned
# by the last call: ``save_caches`` below; kernels of an unchanged package load instead of
# compiling, keyed by the package's source digest), source files with
# content-derived mtimes (a cached kernel of changed source never matches), and the commit the
# CSV rows name from .gpu/commit (the device copy's git metadata can be stale): write it here
# first, `git rev-parse --short HEAD > .gpu/commit`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba_cache
# the library's cache (autotune winners, the kernel machine-code store) off $OUT
export LLMSPEED_NUMBA_CACHE=${LLMSPEED_NUMBA_CACHE:-/tmp/llmspeed_cache}
export LLMSPEED_TEST_GGUF=$PWD/.gpu/smollm2-8l.gguf
[ -f .gpu/commit ] && export LLMSPEED_COMMIT=$(cat .gpu/commit)
[ -f .gpu/numba_cache.tgz ] && tar xzf .gpu/numba_cache.tgz -C /tmp
[ -f .gpu/llm_cache.tgz ] && tar xzf .gpu/llm_cache.tgz -C /tmp
# both caches into $OUT/llm_cache.tgz (copy it to .gpu/ to carry it to the next call)
save_caches() { tar czf "$OUT/llm_cache.tgz" -C /tmp llmspeed_cache numba_cache 2>/dev/null; }
python3 - <<'PY'
import hashlib, os, pathlib
for p in pathlib.Path("llmspeed_numba").rglob("*.py"):
    h = int(hashlib.sha256(p.read_bytes()).hexdigest()[:7], 16)
    os.utime(p, (1_600_000_000 + h, 1_600_000_000 + h))
PY
