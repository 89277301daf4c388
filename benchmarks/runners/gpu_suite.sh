#!/usr/bin/env bash
# The whole test suite on the GPU machine, in two phases.
#   warm:  the suite's node ids spread over $BUCKETS (14) pytest processes run in parallel, so
#          every kernel the suite needs is compiled into numba's disk cache at once (a bare
#          machine has none, and one process compiles one kernel at a time). Buckets hold
#          tests, not files (test_gemm alone outlasted the phase's limit), balanced by rough
#          weights in seconds (weight() below), a test function's cases kept together where
#          they fit (one process compiles their shared kernels once), heaviest first, each to the
#          lightest bucket.
#          test_compile_check is a bucket of its own, started first: its child compiles every
#          registered kernel (3-4 min alone) and warms nothing; the test buckets run at nice 5
#          (at 21ee941, beside 15 buckets at equal priority, it did not finish in 540 s). One summary line per bucket (logs:
#          suite/bucket_NN.log; each bucket's node ids: suite/buckets/bucket_NN.txt).
#          Every finished test's outcome is appended under $SUITE_STATE (/tmp/suite_state) as
#          it ends, so a warm phase cut off at a call's limit resumes: run `warm` again on the
#          same (still held) machine and it runs only the tests without a pass or skip there
#          yet, and the compile check until it passed once. suite/summary.txt: the totals.
#          $OUT/suite_outcomes.txt: every test's last outcome so far, headed by the commit
#          (.gpu/commit); carried to a fresh machine as SUITE_RESUME=FILE it counts there too
#          when its commit is the one under test (ignored, with a line saying so, otherwise).
#   whole: the documented command, `python -m pytest -q tests`, in one process, on that cache.
#   bash benchmarks/runners/gpu_suite.sh [warm|whole|both]       logs under $OUT
#   TESTS="tests/test_gemm.py tests/test_softmax.py" limits the warm phase to those files (no
#   compile-check bucket then); DESELECT="node_id ..." leaves those tests out of it (exact ids:
#   pytest's own --deselect also drops every id that merely starts with one).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps gpu_setup.sh's wheels
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/suite"
phase=${1:-both}
if [ "$phase" != whole ]; then
    start=$(date +%s)
    list="$OUT/suite/buckets"; rm -rf "$list"; mkdir -p "$list"
    tests=${TESTS:-tests}
    state=${SUITE_STATE:-/tmp/suite_state}; mkdir -p "$state"
    commit=${LLMSPEED_COMMIT:-unknown}
    if [ -n "${SUITE_RESUME:-}" ]; then
        from=$(head -n 1 "$SUITE_RESUME" | sed -n 's/^# commit //p')
        if [ "$from" = "$commit" ] && [ "$commit" != unknown ]; then
            tail -n +2 "$SUITE_RESUME" > "$state/outcomes_0_resumed.txt"
        else
            echo "SUITE_RESUME: outcomes of commit '$from', this is '$commit': not used"
        fi
    fi
    if [ "$tests" = tests ] && [ ! -f "$state/compile_check.passed" ]; then
        LLMSPEED_COMPILE_CHECK=all timeout "${WARM_LIMIT:-420}" python -m pytest -q \
            tests/test_compile_check.py --durations=8 -p no:cacheprovider > "$OUT/suite/compile_check.log" 2>&1 &
    fi
    # node ids, and which are hypothesis tests (the hypothesis plugin marks them); the compile
    # check module is left out: importing it starts its child
    collect="python -m pytest --collect-only -q -p no:cacheprovider $tests"
    collect="$collect --ignore=tests/test_compile_check.py"
    $collect > "$list/all.txt" 2>&1
    $collect -m hypothesis > "$list/hypothesis.txt" 2>&1
    python - "$list" "${BUCKETS:-14}" "${DESELECT:-}" "$state" <<'EOF'
import glob
import sys

folder, n, state = sys.argv[1], int(sys.argv[2]), sys.argv[4]
deselected = set(sys.argv[3].split())
# tests that passed or were skipped in an earlier warm phase on this machine (a test's last
# line wins, files in the order written) are not run again
last = {}
for path in sorted(glob.glob(f"{state}/outcomes_*.txt")):
    for line in open(path):
        outcome, _, node = line.strip().partition(" ")
        last[node] = outcome
done = {node for node, outcome in last.items() if outcome in ("passed", "skipped")}
deselected |= done
if done:
    print(f"{len(done)} tests passed or skipped in an earlier warm phase: not run again")


def node_ids(name):
    return [line.strip() for line in open(f"{folder}/{name}") if "::" in line]


hypothesis = set(node_ids("hypothesis.txt"))


#: measured on a bare H200 machine (dae4347, 14 buckets, seconds per test, mostly compiles)
MEASURED = {
    "tests/test_gemm.py::test_hypothesis_simt": 340,
    "tests/test_gemm.py::test_hypothesis_tensor_core": 280,
    "tests/test_gemm.py::test_gpu_simt_vector_loads": 190,
    "tests/test_gemm.py::test_gpu_hypothesis_small_tiles_on_hardware": 120,
    "tests/test_gemm.py::test_gpu_simt_configs": 80,
    "tests/test_softmax.py::test_softmax_gpu_hypothesis": 50,
    "tests/test_argmax.py::test_argmax_gpu_hypothesis": 40,
    "tests/test_softmax.py::test_softmax_hypothesis_small": 35,
    "tests/test_argmax.py::test_argmax_hypothesis_small": 30,
    "tests/test_gemm.py::test_gpu_simt_layouts": 55,
    "tests/test_gemm.py::test_layouts_simt": 28,
    "tests/test_gemm.py::test_epilogue_simt": 27,
    "tests/test_gemm_gated.py::test_hypothesis_gated": 360,  # > 250 s at 5a80462 (unfinished)
    "tests/test_models_gpu.py::test_smollm2_gguf_matches_transformers": 130,
    "tests/test_models_gpu.py::test_llama3_shapes_safetensors_matches_transformers": 130,
    "tests/test_models_gpu.py::test_cuda_graph_decode_equals_eager": 95,
    "tests/test_kernel_cache.py::test_store_serves_a_new_process_and_survives_races_and_corruption": 40,
}


def weight(node):
    """Rough seconds on a bare machine: the measured ones by name (parameters stripped), else
    a hypothesis test compiles many kernel specialisations, GEMM's the most (each example a
    new epilogue); another test a kernel or two, a GEMM test one configuration (~15 s)."""
    name = node.split("[")[0]
    if name in MEASURED:
        return MEASURED[name]
    gemm = node.startswith(("tests/test_gemm.py", "tests/test_gemm_gated.py"))
    if node in hypothesis:
        return 60 if gemm else 30
    return 15 if gemm else 2


# A test function's cases stay together in pieces of at most half a bucket's share: they mostly
# share kernel specialisations, which one process then compiles once (spread over the buckets,
# each of the processes starting at once compiled them). Pieces heaviest first, each to the
# least loaded bucket.
todo = [node for node in node_ids("all.txt") if node not in deselected]
share = sum(map(weight, todo)) / max(n, 1)
functions = {}
for node in todo:
    functions.setdefault(node.split("[")[0], []).append(node)
pieces = []
for nodes in functions.values():
    piece, piece_weight = [], 0
    for node in nodes:
        if piece and piece_weight + weight(node) > share / 2:
            pieces.append((piece_weight, piece))
            piece, piece_weight = [], 0
        piece.append(node)
        piece_weight += weight(node)
    pieces.append((piece_weight, piece))
buckets = [[] for _ in range(n)]
load = [0] * n
for piece_weight, piece in sorted(pieces, key=lambda p: p[0], reverse=True):
    b = load.index(min(load))
    buckets[b].extend(piece)
    load[b] += piece_weight
for b, nodes in enumerate(buckets):
    with open(f"{folder}/bucket_{b:02d}.txt", "w") as f:
        f.write("".join(node + "\n" for node in nodes))
print(f"{sum(map(len, buckets))} tests ({len(hypothesis)} hypothesis) in {n} buckets")
EOF
    for f in "$list"/bucket_*.txt; do
        name=$(basename "$f" .txt)
        mapfile -t ids < "$f"
        [ "${#ids[@]}" -gt 0 ] || continue
        LLMSPEED_TEST_OUTCOMES="$state/outcomes_${start}_$name.txt" \
            timeout "${WARM_LIMIT:-420}" nice -n 5 python -m pytest -q "${ids[@]}" --durations=0 \
            -p no:cacheprovider > "$OUT/suite/$name.log" 2>&1 &
    done
    wait
    echo "warm phase: $(( $(date +%s) - start )) s"
    for f in "$OUT"/suite/*.log; do [ -e "$f" ] && echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
    check=$(tail -n 1 "$OUT/suite/compile_check.log" 2>/dev/null)
    if [[ "$check" == *" passed"* && "$check" != *failed* ]]; then
        touch "$state/compile_check.passed"
    fi
    python - "$list/all.txt" "$state" "$commit" "$OUT/suite_outcomes.txt" <<'EOF' | tee "$OUT/suite/summary.txt"
import collections
import glob
import os
import sys

every = [line.strip() for line in open(sys.argv[1]) if "::" in line]
last = {}
for path in sorted(glob.glob(f"{sys.argv[2]}/outcomes_*.txt")):
    for line in open(path):
        outcome, _, node = line.strip().partition(" ")
        last[node] = outcome
counts = collections.Counter(last.get(node, "not run yet") for node in every)
with open(sys.argv[4], "w") as f:  # for SUITE_RESUME on another machine
    f.write(f"# commit {sys.argv[3]}\n")
    f.writelines(f"{outcome} {node}\n" for node, outcome in last.items())
check = "passed" if os.path.exists(f"{sys.argv[2]}/compile_check.passed") else "not passed yet"
print(f"suite on this machine so far: {len(every)} tests: "
      + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f"; compile check {check}")
for node in every:
    if last.get(node) == "failed":
        print(f"FAILED {node}")
EOF
fi
if [ "$phase" != warm ]; then
    timeout "${WHOLE_LIMIT:-560}" python -m pytest -q tests --durations=20 -p no:cacheprovider \
        2>&1 | tee "$OUT/suite/whole.log" | tail -n 45
fi
tar -czf "$OUT/suite_logs.tgz" -C "$OUT" suite
