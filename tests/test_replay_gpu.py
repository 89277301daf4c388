"""The repeated-call fast path of every public op on the GPU (GPU suite; skipped under the
simulator).

Each case calls the op on arrays A (the checked path runs and records the call), then on fresh
arrays B of the same layout (the recorded launches replay with B's pointers), and compares B's
results, and every array the call may have written, bit for bit with the checked path's on an
identical copy of B (``_replay.ENABLED`` off): the same kernels on the same data. The op's
checked function is spied on, so a fast path that silently never engages fails the test, as does
a replay that reads or writes A's arrays or returns the wrong object. Outputs start poisoned
(NaN, or -7 for integers). Checks that depend on the new arrays' addresses (out overlapping
residual) or contents (cu_seqlens modified in place) must still raise on a replayed signature.
"""

import sys

import numpy as np
import pytest

import llmspeed_numba as lsn
from llmspeed_numba import _replay
from llmspeed_numba._arrays import numpy_dtype
from llmspeed_numba.ops.warp_tile import warp_tile_matmul
from llmspeed_numba.testing import random_array, to_device, to_host

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fast_path(monkeypatch):
    monkeypatch.setattr(_replay, "ENABLED", True)         # whatever LLMSPEED_NUMBA_REPLAY says
    monkeypatch.setenv("LLMSPEED_NUMBA_AUTOTUNE", "0")    # gemm: an autotuning call is checked
    return monkeypatch


# ---- host data of one call: (args, kwargs) with NumPy arrays for the device arrays -----------

def rand(rng, dtype, *shape):
    return random_array(shape, dtype, rng)


def nan(dtype, *shape):
    return np.full(shape, np.nan, numpy_dtype(dtype))


def sentinel(*shape):
    return np.full(shape, -7, np.int64)


def ints(values, dtype=np.int32):
    return np.asarray(values, dtype)


def gemm_case(M, K, N, out=True, epilogue=False):
    def make(rng, dt):
        kwargs = {"out": nan(dt, M, N)} if out else {}
        if epilogue:
            kwargs.update(c=rand(rng, dt, M, N), beta=0.5, bias=rand(rng, dt, N),
                          activation="silu")
        return (rand(rng, dt, M, K), rand(rng, dt, K, N)), kwargs
    return make


def flash_attn_case(rng, dt):
    q = rand(rng, dt, 2, 16, 4, 64)
    k, v = rand(rng, dt, 2, 24, 2, 64), rand(rng, dt, 2, 24, 2, 64)
    return (q, k, v), {"causal": True, "out": nan(dt, 2, 16, 4, 64)}


def flash_attn_lse_case(rng, dt):
    q, k, v = (rand(rng, dt, 1, 32, 2, 128) for _ in range(3))
    return (q, k, v), {"return_lse": True}  # allocates out and lse


def varlen_case(shared_offsets=False, check_bounds=None):
    """Two sequences in 16 packed tokens each side (max_seqlen 12); offsets drawn per call."""
    def make(rng, dt):
        a, b = rng.integers(4, 13, size=2)
        cu_q, cu_k = ints([0, a, 16]), ints([0, b, 16])
        if shared_offsets:
            cu_k = cu_q
        q, out = rand(rng, dt, 16, 4, 64), nan(dt, 16, 4, 64)
        k, v = rand(rng, dt, 16, 2, 64), rand(rng, dt, 16, 2, 64)
        kwargs = {"causal": True, "out": out}
        if check_bounds is not None:
            kwargs["check_bounds"] = check_bounds
        return (q, k, v, cu_q, cu_k, 12, 12), kwargs
    return make


def norm_case(residual=False, out=True, bias=False):
    """rms_norm (x, weight) or, with ``bias``, layer_norm (x, weight, bias)."""
    def make(rng, dt):
        x, w = rand(rng, dt, 4, 256), rand(rng, dt, 256)
        args = (x, w, rand(rng, dt, 256)) if bias else (x, w)
        kwargs = {"residual": rand(rng, dt, 4, 256)} if residual else {}
        if out:
            kwargs["out"] = nan(dt, 4, 256)
        return args, kwargs
    return make


def rotary_case(cache=False, with_k=True):
    def make(rng, dt):
        q = rand(rng, dt, 4, 4, 64)
        k = rand(rng, dt, 4, 2, 64) if with_k else None
        if cache:  # vLLM's cos | sin table; the bounds check would read positions back
            positions = ints(rng.integers(0, 32, 4))
            return (q, k, positions), {"cos_sin_cache": rand(rng, dt, 32, 64),
                                       "check_bounds": False}
        return (q, k, ints(rng.integers(0, 1000, 4), np.int64)), {}  # the persistent table
    return make


def activation_case(cols, out_cols, out=True, **options):
    """silu_and_mul / gelu_and_mul (x with both halves) and gelu."""
    def make(rng, dt):
        kwargs = dict(options, out=nan(dt, 4, out_cols)) if out else dict(options)
        return (rand(rng, dt, 4, cols),), kwargs
    return make


def rows_case(rows, cols, out=None, x_dtype="float32", **options):
    """softmax / argmax of logits (rows, cols); ``out``: "float" (fp32) or "int" (int64)."""
    def make(rng, dt):
        kwargs = dict(options)
        if out == "float":
            kwargs["out"] = nan("float32", rows, cols)
        elif out == "int":
            kwargs["out"] = sentinel(rows)
        return (rand(rng, x_dtype, rows, cols),), kwargs
    return make


def embedding_case(id_dtype, out=True):
    def make(rng, dt):
        ids = ints(rng.integers(0, 100, 6), id_dtype)
        return (ids, rand(rng, dt, 100, 64)), ({"out": nan(dt, 6, 64)} if out else {})
    return make


def paged_tables(rng, new_tokens):
    """Two sequences of up to 64 tokens, 4 pages of 16 each, in shuffled pages 1..8 of 9."""
    table = (1 + rng.permutation(8)).reshape(2, 4).astype(np.int32)
    return table, ints(rng.integers(0, 64 - new_tokens + 1, 2))


def paged_kv_append_case(rng, dt):
    table, seq_lens = paged_tables(rng, 3)
    k, v = rand(rng, dt, 2, 3, 2, 64), rand(rng, dt, 2, 3, 2, 64)
    k_cache, v_cache = rand(rng, dt, 9, 16, 2, 64), rand(rng, dt, 9, 16, 2, 64)
    return (k, v, k_cache, v_cache, table, seq_lens), {}  # returns None; writes the caches


def paged_prefill_case(rng, dt):
    table, _ = paged_tables(rng, 0)
    first = int(rng.integers(3, 6))                   # chunks of 3..5 new tokens, 8 in all
    cu = ints([0, first, 8])
    seq_lens = ints([first + rng.integers(0, 40), 8 - first + rng.integers(0, 40)])
    q, out = rand(rng, dt, 8, 4, 64), nan(dt, 8, 4, 64)
    k_cache, v_cache = rand(rng, dt, 9, 16, 2, 64), rand(rng, dt, 9, 16, 2, 64)
    return (q, k_cache, v_cache, table, cu, seq_lens, 5), {"causal": True, "out": out}


def paged_decode_case(num_splits=None, return_lse=False, out=True):
    def make(rng, dt):
        table, _ = paged_tables(rng, 0)
        seq_lens = ints(rng.integers(1, 65, 2))
        q = rand(rng, dt, 2, 4, 64)
        k_cache, v_cache = rand(rng, dt, 9, 16, 2, 64), rand(rng, dt, 9, 16, 2, 64)
        kwargs = {"num_splits": num_splits, "return_lse": return_lse}
        if out:
            kwargs["out"] = nan(dt, 2, 4, 64)
        return (q, k_cache, v_cache, table, seq_lens), kwargs
    return make


def sample_case(arrays=False):
    def make(rng, dt):
        logits = rand(rng, "float32", 4, 1000)
        if arrays:  # per-row parameters
            params = {"temperature": np.float32(0.5) + rng.random(4, np.float32),
                      "top_k": ints(rng.integers(1, 100, 4)),
                      "seed": ints(rng.integers(0, 2**40, 4), np.int64)}
        else:
            params = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "seed": 1234}
        return (logits,), dict(params, out=sentinel(4))
    return make


def warp_tile_case(out=True):
    return lambda rng, dt: ((rand(rng, dt, 16, 32), rand(rng, dt, 32, 8)),
                            {"out": nan("float32", 16, 8)} if out else {})


BF16, F16 = "bfloat16", "float16"
CASES = [  # (id, op, make, kind, dtype of the half-precision arrays)
    ("gemm out=", lsn.gemm, gemm_case(8, 128, 64), "torch", BF16),
    ("gemm split-K out=", lsn.gemm, gemm_case(8, 4096, 1024), "torch", BF16),
    ("gemm split-K allocating", lsn.gemm, gemm_case(8, 4096, 1024, out=False), "torch", BF16),
    ("gemm allocating", lsn.gemm, gemm_case(64, 256, 128, out=False), "torch", F16),
    ("gemm epilogue", lsn.gemm, gemm_case(16, 128, 64, epilogue=True), "torch", F16),
    ("gemm numba out=", lsn.gemm, gemm_case(8, 256, 64), "numba", F16),
    ("gemm numba split-K allocating", lsn.gemm, gemm_case(8, 4096, 1024, out=False), "numba",
     F16),
    ("flash_attn", lsn.flash_attn, flash_attn_case, "torch", BF16),
    ("flash_attn lse allocating", lsn.flash_attn, flash_attn_lse_case, "torch", F16),
    ("flash_attn numba", lsn.flash_attn, flash_attn_case, "numba", F16),
    ("rms_norm out=", lsn.rms_norm, norm_case(), "torch", BF16),
    ("rms_norm residual", lsn.rms_norm, norm_case(residual=True), "torch", BF16),
    ("rms_norm allocating", lsn.rms_norm, norm_case(out=False), "torch", F16),
    ("rms_norm numba residual", lsn.rms_norm, norm_case(residual=True), "numba", F16),
    ("layer_norm", lsn.layer_norm, norm_case(bias=True), "torch", BF16),
    ("layer_norm residual", lsn.layer_norm, norm_case(residual=True, bias=True), "torch", F16),
    ("rotary", lsn.rotary_embedding, rotary_case(), "torch", BF16),
    ("rotary cache no k", lsn.rotary_embedding, rotary_case(cache=True, with_k=False), "torch",
     F16),
    ("rotary numba", lsn.rotary_embedding, rotary_case(), "numba", F16),
    ("silu_and_mul", lsn.silu_and_mul, activation_case(256, 128), "torch", BF16),
    ("silu_and_mul numba", lsn.silu_and_mul, activation_case(256, 128), "numba", F16),
    ("gelu_and_mul tanh", lsn.gelu_and_mul, activation_case(256, 128, approximate="tanh"),
     "torch", BF16),
    ("gelu out=", lsn.gelu, activation_case(256, 256), "torch", BF16),
    ("gelu allocating", lsn.gelu, activation_case(256, 256, out=False), "torch", F16),
    ("softmax", lsn.softmax, rows_case(4, 1000, "float"), "torch", BF16),
    ("softmax split allocating", lsn.softmax, rows_case(2, 49152), "torch", BF16),
    ("softmax bf16 to fp32", lsn.softmax,
     rows_case(4, 1000, "float", x_dtype=BF16, dtype="float32"), "torch", BF16),
    ("softmax numba", lsn.softmax, rows_case(4, 1000, "float", temperature=0.7), "numba", F16),
    ("argmax", lsn.argmax, rows_case(4, 5000, "int"), "torch", BF16),
    ("argmax split", lsn.argmax, rows_case(2, 49152, "int"), "torch", BF16),
    ("argmax numba allocating", lsn.argmax, rows_case(4, 5000), "numba", F16),
    ("embedding", lsn.embedding, embedding_case(np.int64), "torch", BF16),
    ("embedding allocating", lsn.embedding, embedding_case(np.int32, out=False), "torch", F16),
    ("paged_kv_append", lsn.paged_kv_append, paged_kv_append_case, "torch", BF16),
    ("paged_prefill_attention", lsn.paged_prefill_attention, paged_prefill_case, "torch", BF16),
    ("paged_decode_attention", lsn.paged_decode_attention, paged_decode_case(), "torch", BF16),
    ("paged_decode_attention split lse allocating", lsn.paged_decode_attention,
     paged_decode_case(num_splits=3, return_lse=True, out=False), "torch", F16),
    ("paged_decode_attention numba split", lsn.paged_decode_attention,
     paged_decode_case(num_splits=2), "numba", F16),  # numba has no bf16: torch q would mix
    ("sample", lsn.sample, sample_case(), "torch", BF16),
    ("sample per-row arrays", lsn.sample, sample_case(arrays=True), "torch", BF16),
    ("warp_tile_matmul", warp_tile_matmul, warp_tile_case(), "torch", F16),
    ("warp_tile_matmul numba allocating", warp_tile_matmul, warp_tile_case(out=False), "numba",
     F16),
]


# ---- helpers -------------------------------------------------------------------------------

def place(host, kind):
    """(args, kwargs) on the device as ``kind``; one host array, one device array (aliasing
    kept)."""
    made = {}

    def put(x):
        if isinstance(x, np.ndarray):
            if id(x) not in made:
                made[id(x)] = to_device(np.array(x, copy=True), kind)
            return made[id(x)]
        if isinstance(x, tuple):
            return tuple(put(v) for v in x)
        if isinstance(x, dict):
            return {k: put(v) for k, v in x.items()}
        return x

    return put(host)


def spy_checked(monkeypatch, op):
    """The op's ``OpCalls`` (plans cleared) and a list that grows by one per run of its checked
    path (``_<op>_checked``, which the op looks up at each call)."""
    module = sys.modules[op.__module__]
    calls = next(v for v in vars(module).values()
                 if isinstance(v, _replay.OpCalls) and v.name == op.__name__)
    name = f"_{op.__name__}_checked"
    checked = getattr(module, name)
    runs = []

    def spy(*args):
        runs.append(args)
        return checked(*args)

    monkeypatch.setattr(module, name, spy)
    calls.plans.clear()
    return calls, runs


def arrays_of(tree):
    """The device arrays in a call's (args, kwargs) or an op's result, in order."""
    if tree is None or isinstance(tree, (bool, int, float, str, np.generic)):
        return []
    if isinstance(tree, (tuple, list)):
        return [a for x in tree for a in arrays_of(x)]
    if isinstance(tree, dict):
        return [a for x in tree.values() for a in arrays_of(x)]
    return [tree]


def bits(x):
    return np.ascontiguousarray(to_host(x)).view(np.uint8)


def assert_same(name, call, result, reference_call, reference):
    """``call`` (args, kwargs) and its ``result`` match the checked path's ``reference_call``
    and ``reference`` bit for bit: every array (inputs, outputs, results), and which argument,
    if any, each result is."""
    got, want = arrays_of(call), arrays_of(reference_call)

    def position(x, arrays):
        return next((i for i, a in enumerate(arrays) if a is x), None)

    got_results, want_results = arrays_of(result), arrays_of(reference)
    assert [position(x, got) for x in got_results] == [
        position(x, want) for x in want_results], f"{name}: the result is not the right array"
    assert (result is None) == (reference is None)
    for i, (g, w) in enumerate(zip(got + got_results, want + want_results)):
        gb, wb = bits(g), bits(w)
        assert gb.shape == wb.shape and np.array_equal(gb, wb), (
            f"{name}: array {i} ({'argument' if i < len(got) else 'result'}) differs from the "
            f"checked path's in {int((gb != wb).sum()) if gb.shape == wb.shape else 'shape'}"
            f" bytes")


def assert_replay_matches_checked(monkeypatch, rng, name, op, make, kind, dtype, first_calls=1):
    """Record on A (``first_calls`` calls), replay on B, compare with the checked path on B."""
    calls, runs = spy_checked(monkeypatch, op)
    args, kwargs = place(make(rng, dtype), kind)
    for _ in range(first_calls):
        op(*args, **kwargs)
    assert calls.plans, f"{name}: the first call recorded no plan"
    assert len(runs) == first_calls

    host = make(rng, dtype)
    call, reference_call = place(host, kind), place(host, kind)
    result = op(*call[0], **call[1])
    assert len(runs) == first_calls, f"{name}: the repeated call took the checked path"
    with monkeypatch.context() as m:
        m.setattr(_replay, "ENABLED", False)
        reference = op(*reference_call[0], **reference_call[1])
    assert len(runs) == first_calls + 1
    assert_same(name, call, result, reference_call, reference)


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, op, make, kind, dtype", CASES, ids=[c[0] for c in CASES])
def test_replay_matches_the_checked_path(fast_path, rng, name, op, make, kind, dtype):
    assert_replay_matches_checked(fast_path, rng, name, op, make, kind, dtype)


@pytest.mark.parametrize("check_bounds, first_calls", [(None, 1), (True, 2)],
                         ids=["unchecked", "checked"])
def test_flash_attn_varlen_replays_with_new_offsets(fast_path, rng, check_bounds, first_calls):
    # unchecked (the GPU default): the offsets are never read back, so the first call records.
    # checked: the first call reads the new offsets back to check them (not recorded); the
    # second, on the same offsets, finds them checked and records; B's are checked on replay
    assert_replay_matches_checked(fast_path, rng, "flash_attn_varlen", lsn.flash_attn_varlen,
                                  varlen_case(check_bounds=check_bounds), "torch", BF16,
                                  first_calls=first_calls)


def test_flash_attn_varlen_offsets_modified_in_place_raise_on_a_replay(fast_path, rng):
    calls, runs = spy_checked(fast_path, lsn.flash_attn_varlen)
    make = varlen_case(check_bounds=True)
    args, kwargs = place(make(rng, BF16), "torch")
    lsn.flash_attn_varlen(*args, **kwargs)
    lsn.flash_attn_varlen(*args, **kwargs)
    assert calls.plans and len(runs) == 2
    args, kwargs = place(make(rng, BF16), "torch")
    lsn.flash_attn_varlen(*args, **kwargs)              # replayed: B's offsets checked
    assert len(runs) == 2
    cu_q = args[3]
    cu_q.copy_(to_device(ints([0, 9, 4]), "torch"))     # decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing"):
        lsn.flash_attn_varlen(*args, **kwargs)
    assert len(runs) == 2                               # raised by the replay's recheck


def test_flash_attn_varlen_recorded_with_shared_offsets_serves_distinct_ones(fast_path, rng):
    """A plan recorded with cu_seqlens_q *is* cu_seqlens_k places both in that one array; a call
    with distinct offsets must not run it (it would read cu_seqlens_q twice)."""
    calls, _ = spy_checked(fast_path, lsn.flash_attn_varlen)
    args, kwargs = place(varlen_case(shared_offsets=True)(rng, BF16), "torch")
    lsn.flash_attn_varlen(*args, **kwargs)
    lsn.flash_attn_varlen(*args, **kwargs)
    assert calls.plans
    host = varlen_case()(rng, BF16)
    while host[0][3][1] == host[0][4][1]:               # offsets that differ
        host = varlen_case()(rng, BF16)
    call, reference_call = place(host, "torch"), place(host, "torch")
    result = lsn.flash_attn_varlen(*call[0], **call[1])
    with fast_path.context() as m:
        m.setattr(_replay, "ENABLED", False)
        reference = lsn.flash_attn_varlen(*reference_call[0], **reference_call[1])
    assert_same("flash_attn_varlen", call, result, reference_call, reference)


@pytest.mark.parametrize("kind", ["torch", "numba"])
def test_rms_norm_out_overlapping_residual_raises_on_a_repeated_call(fast_path, rng, kind):
    calls, runs = spy_checked(fast_path, lsn.rms_norm)
    make = norm_case(residual=True)
    args, kwargs = place(make(rng, F16), kind)
    lsn.rms_norm(*args, **kwargs)
    assert calls.plans
    (x, w), kwargs = place(make(rng, F16), kind)
    residual = kwargs["residual"]
    before = bits(residual)
    overlapping = [residual, residual[:]]  # the very array, and another view of its memory
    for out in overlapping:
        with pytest.raises(ValueError, match="out: expected an array that does not overlap"):
            lsn.rms_norm(x, w, residual=residual, out=out)
    assert len(runs) == 1 + len(overlapping)  # each sent to the checked path, which raised
    assert np.array_equal(bits(residual), before)  # nothing launched


@pytest.mark.parametrize("op", [lsn.gemm, lsn.flash_attn], ids=["gemm", "flash_attn"])
def test_tensor_map_calls_replay_with_the_maps_of_their_own_operands(fast_path, rng, op):
    """With ``_tensor_map.REPLAY_MAPS``, a call whose kernel reads tensor maps (gemm's TMA tile,
    the wgmma attention kernel's TMA producer) records, and a call on new operands replays with
    their own maps: bit for bit the checked path's result on the same data."""
    import torch

    from llmspeed_numba import _tensor_map
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops.gemm_configs import wgmma_supported

    if not wgmma_supported():
        pytest.skip("tensor maps need sm_90")
    fast_path.setattr(_tensor_map, "REPLAY_MAPS", True)
    calls, runs = spy_checked(fast_path, op)

    def operands():
        if op is lsn.gemm:   # both operands K-major, as the TMA tile needs
            a = to_device(rand(rng, BF16, 72, 1032), "torch")
            w = to_device(rand(rng, BF16, 392, 1032), "torch")
            return (a, w.T), {"config": "wg_64x128x64_s8_p_tma_k1",
                              "out": torch.full((72, 392), float("nan"), device="cuda")}
        q, k, v = (to_device(rand(rng, BF16, 2, 150, 2, 128), "torch") for _ in range(3))
        return (q, k, v), {"causal": True}

    with overrides(flash_attn={"impl": "wgmma", "config": (2, 128, 3, 1, 1, 1, 1),
                               "tma_min_work": 0}):
        args, kwargs = operands()
        op(*args, **kwargs)
        assert calls.plans and len(runs) == 1, "the call with maps was not recorded"
        args, kwargs = operands()
        maps_before = len(_tensor_map._DEVICE_MAPS)
        result = op(*args, **kwargs)
        assert len(runs) == 1, "the call on new operands took the checked path"
        assert len(_tensor_map._DEVICE_MAPS) == maps_before + 2, "the replay made no maps"
        reference_kwargs = dict(kwargs, out=torch.full_like(kwargs["out"], float("nan"))) \
            if "out" in kwargs else kwargs
        with fast_path.context() as m:
            m.setattr(_replay, "ENABLED", False)
            reference = op(*args, **reference_kwargs)
    assert len(runs) == 2
    assert np.array_equal(bits(result), bits(reference))
