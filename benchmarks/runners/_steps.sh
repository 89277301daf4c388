# Sourced by the step-wise GPU runners (gpu_fa_wgmma.sh, gpu_fp8.sh): ``step name seconds
# command...`` runs the command under its own time limit (a hang costs only that step) with its
# log in $OUT/<name>.log, and appends its status, time and last ${TAIL:-4} lines to
# $OUT/summary.txt.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-4}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
