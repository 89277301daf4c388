"""FlashAttention forward against the float64 reference (``reference/attention.py``).

Tolerance (derived, never guessed): the kernel's max error against the float64 reference is at
most twice that of the plain same-precision attention (scores, probabilities and output rounded
to fp16 / bf16) plus half an ulp at 1, for the output; the log-sum-exp likewise with a 1e-5
relative allowance.

Under the simulator the SIMT kernel takes the broad hypothesis coverage, and the Tensor Core
kernel (the same code as on the GPU, at a tiny configuration: 1-2 warps, 16-key blocks) and the
Hopper wgmma kernel (1-2 warpgroups, 16-32-key blocks) a handful of named shapes each; the GPU
suite (``-m gpu``) runs the real configurations with many examples, and compute-sanitizer's
racecheck over the wgmma kernel's variants.
"""

import math
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba._checks import tensor
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops.flash_attn import (WGMMA_CONFIGS, _pick_impl, flash_attn,
                                           flash_attn_varlen)
from llmspeed_numba.reference.attention import attention, attention_mask, attention_varlen
from llmspeed_numba.testing import (derived_check, f64, poison, random_array,
                                    to_device, to_host)

DTYPES = ("float16", "bfloat16")
KIND = "numba" if SIMULATOR else "torch"

# Tiny Tensor Core configurations the simulator can afford: (warps, m16 tiles per warp, keys).
TC_ONE_WARP = (1, 1, 16)
TC_TWO_WARPS = (2, 1, 16)
TC_TWO_TILES = (1, 2, 16)
# ... and of the wgmma kernel: (consumer warpgroups, keys per block, ring stages, launch-bounds
# blocks, producer warpgroup, ping-pong, tma): the warp-specialised form (with the ping-pong
# schedule of its consumer groups; with its producer's whole key blocks copied by the Tensor
# Memory Accelerator, "TMA"), and the all-threads-copy ring ("RING")
WG_ONE = (1, 32, 2, 0, 1)
WG_SHORT_3 = (1, 16, 3, 0, 1)
WG_TWO_GROUPS = (2, 16, 2, 0, 1)
WG_PINGPONG = (2, 16, 2, 0, 1, 1)
WG_TMA = (1, 32, 2, 0, 1, 0, 1)
WG_TMA_PINGPONG = (2, 16, 3, 0, 1, 1, 1)
WG_RING = (1, 32, 2, 0, 0)
WG_RING_3 = (1, 16, 3, 0, 0)
WG_RING_TWO_GROUPS = (2, 16, 2, 0, 0)
# ... with lazy rescaling (eighth field): rows keep their maximum until a block raises it by more
# than 2 ** 8
WG_LAZY = (1, 16, 2, 0, 1, 0, 0, 1)
WG_RING_LAZY = (1, 16, 2, 0, 0, 0, 0, 1)
# ... with the softmax under P V (ninth field)
WG_OVERLAP = (1, 16, 3, 0, 1, 0, 0, 0, 1)
WG_OVERLAP_PINGPONG = (2, 16, 2, 0, 1, 1, 0, 1, 1)
# ... persistent (tenth field; with the TMA producer): tiles drawn from a counter, the ring and
# Q's buffer carried from tile to tile
WG_PERSISTENT = (1, 32, 2, 0, 1, 0, 1, 0, 0, 1)
WG_PERSISTENT_3 = (1, 16, 3, 0, 1, 0, 1, 0, 0, 1)
WG_PERSISTENT_TWO_GROUPS = (2, 16, 2, 0, 1, 0, 1, 0, 0, 1)


# ---- helpers --------------------------------------------------------------------------------

def _qkv(rng, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype):
    q = random_array((batch, seqlen_q, nheads, headdim), dtype, rng)
    k = random_array((batch, seqlen_k, nheads_k, headdim), dtype, rng)
    v = random_array((batch, seqlen_k, nheads_k, headdim), dtype, rng)
    return q, k, v


def _check(out, lse, q, k, v, dtype, reference=attention, lse_name="lse", **options):
    """``out`` / ``lse`` against the float64 reference, with the derived tolerance."""
    expected, expected_lse = reference(f64(q), f64(k), f64(v), **options)
    plain, plain_lse = reference(f64(q), f64(k), f64(v), dtype=dtype, **options)
    eps = float(np.finfo(np.float16).eps if dtype == "float16" else 2.0 ** -7)
    derived_check(f64(out), expected, plain, allowance=eps / 2, name="out")
    lse = f64(lse)
    empty = np.isneginf(expected_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"{lse_name}: -inf exactly at empty rows"
    derived_check(np.where(empty, 0.0, lse), np.where(empty, 0.0, expected_lse),
                  np.where(empty, 0.0, plain_lse), allowance=1e-5, name=lse_name)
    assert not np.isnan(f64(out)).any()


def _run(q, k, v, impl=None, config=None, poisoned=True, **options):
    qd, kd, vd = (to_device(x, KIND) for x in (q, k, v))
    out = poison(to_device(np.empty(q.shape, q.dtype), KIND)) if poisoned else None
    with overrides(flash_attn={"impl": impl, "config": config, "tma_min_work": 0}):
        got, lse = flash_attn(qd, kd, vd, return_lse=True, out=out, **options)
    return to_host(got), to_host(lse)


windows = st.one_of(st.just(-1), st.integers(0, 12), st.integers(13, 300))


@st.composite
def attention_problems(draw, max_seqlen=40, headdims=(8, 16, 24, 40, 64), max_batch=2):
    nheads_k = draw(st.integers(1, 2))
    return dict(
        batch=draw(st.integers(1, max_batch)),
        seqlen_q=draw(st.integers(1, max_seqlen)),
        seqlen_k=draw(st.integers(1, max_seqlen)),
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2, 3])),
        headdim=draw(st.sampled_from(headdims)),
        causal=draw(st.booleans()),
        window_size=(draw(windows), draw(windows)),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _solve(problem, impl=None, config=None):
    p = dict(problem)
    rng = np.random.default_rng(p.pop("seed"))
    dtype = p.pop("dtype")
    options = {"causal": p.pop("causal"), "window_size": p.pop("window_size")}
    q, k, v = _qkv(rng, p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads"], p["nheads_k"],
                   p["headdim"], dtype)
    out, lse = _run(q, k, v, impl=impl, config=config, **options)
    _check(out, lse, q, k, v, dtype, **options)


# ---- the reference itself ---------------------------------------------------------------------

def test_reference_mask_semantics():
    # bottom-right causal: seqlen_q 2, seqlen_k 4 -> row 0 sees keys 0..2, row 1 sees 0..3
    assert attention_mask(2, 4, causal=True).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # seqlen_q > seqlen_k: the first rows see nothing
    assert attention_mask(3, 1, causal=True).tolist() == [[0], [0], [1]]
    # window (1, 0) on a square: the diagonal and one key to its left
    assert attention_mask(3, 3, window_size=(1, 0)).tolist() == [[1, 0, 0], [1, 1, 0],
                                                                 [0, 1, 1]]
    # causal overrides window_right only
    assert np.array_equal(attention_mask(5, 7, causal=True, window_size=(2, 3)),
                          attention_mask(5, 7, window_size=(2, 0)))


def test_reference_single_query_is_decode(rng):
    q, k, v = _qkv(rng, 1, 1, 9, 4, 2, 16, "float16")
    out, lse = attention(f64(q), f64(k), f64(v), causal=True)
    scores = np.einsum("hd,khd->hk", f64(q)[0, 0], np.repeat(f64(k)[0], 2, axis=1)) / 4.0
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("hk,khd->hd", probs, np.repeat(f64(v)[0], 2, axis=1))
    assert np.allclose(out[0, 0], expected)
    assert np.allclose(lse[0, :, 0], np.log(np.exp(scores).sum(-1)))


def test_check_rejects_a_wrong_mask(rng):
    """The derived check catches a top-left aligned causal mask (a classic off-by-offset)."""
    q, k, v = _qkv(rng, 1, 6, 11, 2, 2, 16, "float16")
    wrong = np.zeros((1, 6, 2, 16))
    mask = np.tril(np.ones((6, 11), bool))
    for h in range(2):
        s = np.where(mask, f64(q)[0, :, h] @ f64(k)[0, :, h].T / 4.0, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        wrong[0, :, h] = (p / p.sum(-1, keepdims=True)) @ f64(v)[0, :, h]
    expected, _ = attention(f64(q), f64(k), f64(v), causal=True)
    plain, _ = attention(f64(q), f64(k), f64(v), causal=True, dtype="float16")
    with pytest.raises(AssertionError):
        derived_check(wrong, expected, plain, allowance=2.0 ** -11)


# ---- SIMT kernel: broad coverage ---------------------------------------------------------------

# every head dimension is a separate compile (~5 s on the GPU host): the SIMT code does not
# depend on it, so the GPU suite samples two
SIMT_HEADDIMS = (8, 16, 24, 40, 64) if SIMULATOR else (8, 64)


@settings(max_examples=25 if SIMULATOR else 150)
@given(problem=attention_problems(headdims=SIMT_HEADDIMS))
def test_simt_matches_reference(problem):
    _solve(problem, impl="simt")


@pytest.mark.parametrize("headdim", [8, 256])
def test_simt_headdim_extremes(rng, headdim):
    q, k, v = _qkv(rng, 1, 3, 20, 2, 1, headdim, "bfloat16")
    out, lse = _run(q, k, v, impl="simt", causal=True)
    _check(out, lse, q, k, v, "bfloat16", causal=True)


# ---- Tensor Core kernel: the GPU code at tiny configurations -----------------------------------

TC_CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, window, config)
    (1, 5, 7, 2, 1, 16, "float16", False, (-1, -1), TC_ONE_WARP),          # GQA, ragged tile
    (1, 17, 33, 1, 1, 24, "bfloat16", True, (-1, -1), TC_ONE_WARP),        # headdim padded to 32
    (1, 9, 30, 1, 1, 32, "float16", False, (3, 2), TC_ONE_WARP),           # window
    (2, 40, 20, 2, 2, 16, "bfloat16", True, (-1, -1), TC_TWO_WARPS),       # empty rows, 2 warps
    (1, 20, 35, 3, 1, 16, "float16", True, (4, -1), TC_TWO_TILES),         # MQA, 2 m16 tiles
    (1, 12, 21, 1, 1, 40, "float16", False, (-1, 6), TC_ONE_WARP),         # 6 chunks a row
]


@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_tensor_core_kernel(case):
    batch, sq, sk, h, hk, d, dtype, causal, window, config = case
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = _qkv(rng, batch, sq, sk, h, hk, d, dtype)
    out, lse = _run(q, k, v, impl="tc", config=config, causal=causal, window_size=window)
    _check(out, lse, q, k, v, dtype, causal=causal, window_size=window)


# ---- Hopper wgmma kernel: the GPU code at tiny configurations ----------------------------------

WGMMA_CASES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, window, config)
    (1, 40, 50, 2, 1, 64, "float16", False, (-1, -1), WG_ONE),            # GQA, ragged blocks
    (1, 70, 45, 1, 1, 40, "bfloat16", True, (-1, -1), WG_SHORT_3),        # padded dim, 3 stages
    (1, 33, 70, 1, 1, 64, "float16", False, (9, 4), WG_SHORT_3),          # window, 5 blocks
    (2, 130, 20, 1, 1, 64, "bfloat16", True, (-1, -1), WG_TWO_GROUPS),    # empty rows, 2 groups
    (1, 20, 37, 3, 1, 128, "float16", True, (5, -1), WG_ONE),             # MQA, headdim 128
    (1, 130, 70, 1, 1, 64, "float16", False, (-1, -1), WG_PINGPONG),      # ping-pong, 5 blocks
    (1, 150, 20, 1, 1, 64, "bfloat16", True, (-1, -1), WG_PINGPONG),      # ... a block of none
    (2, 40, 70, 2, 1, 64, "float16", False, (-1, -1), WG_TMA),            # TMA: 2 sequences,
    (1, 70, 96, 2, 2, 64, "bfloat16", True, (-1, -1), WG_TMA),            # ... whole blocks only
    (1, 130, 45, 1, 1, 128, "float16", True, (20, -1), WG_TMA_PINGPONG),  # ... ping-pong, edge
    (1, 40, 50, 2, 1, 64, "bfloat16", False, (-1, -1), WG_RING),          # the ring form ...
    (1, 33, 70, 1, 1, 40, "float16", True, (9, -1), WG_RING_3),
    (1, 100, 40, 1, 1, 64, "float16", True, (-1, -1), WG_RING_TWO_GROUPS),
    (1, 33, 70, 2, 1, 64, "bfloat16", False, (9, 4), WG_OVERLAP),         # softmax under P V
    (1, 70, 70, 1, 1, 64, "float16", True, (-1, -1), WG_OVERLAP_PINGPONG),   # ... lazy, ping-pong
    (2, 40, 70, 2, 1, 64, "float16", False, (-1, -1), WG_PERSISTENT),     # persistent: 4 tiles,
    (1, 33, 70, 1, 1, 64, "float16", False, (9, 4), WG_PERSISTENT_3),     # ... window
    (1, 130, 20, 1, 1, 64, "bfloat16", True, (-1, -1), WG_PERSISTENT_TWO_GROUPS),  # ... 2 groups
    (1, 150, 20, 1, 1, 64, "float16", True, (-1, -1), WG_PERSISTENT),     # ... tiles of no key
]


@pytest.mark.parametrize("case", WGMMA_CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_wgmma_kernel(case):
    batch, sq, sk, h, hk, d, dtype, causal, window, config = case
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v = _qkv(rng, batch, sq, sk, h, hk, d, dtype)
    out, lse = _run(q, k, v, impl="wgmma", config=config, causal=causal, window_size=window)
    _check(out, lse, q, k, v, dtype, causal=causal, window_size=window)


@pytest.mark.parametrize("config, growth, options", [
    (WG_LAZY, 0.0, {"window_size": (30, 5)}), (WG_LAZY, 0.35, {"causal": True}),
    (WG_RING_LAZY, 0.35, {"window_size": (30, 5)})])
def test_wgmma_lazy_rescale(config, growth, options):
    """Lazy rescaling: on random scores (growth 0) the blocks after the first keep the rows'
    maxima and skip O's rescale; with keys whose scores rise by more than 2 ** 8 (scaled, log2)
    from one block to the next toward the sequence's start (the blocks are visited last to
    first), every block moves them. Both give the reference softmax."""
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 40, 70, 2, 1, 64, "float16")
    q = np.abs(q)
    k = (np.abs(k) * (1.0 + growth * np.arange(70, 0, -1))[None, :, None, None]).astype(
        np.float16)
    out, lse = _run(q, k, v, impl="wgmma", config=config, **options)
    _check(out, lse, q, k, v, "float16", **options)


def test_tma_maps_only_for_layouts_a_map_holds(rng):
    """K and V get tensor maps (the TMA producer's) when sequences are whole token rows apart
    and each token's heads fit in its row; other layouts copy with cp.async (no map)."""
    from llmspeed_numba.ops.flash_attn import _kv_tensor_maps

    k = tensor(to_device(random_array((2, 40, 3, 64), "float16", rng), KIND), "k")
    strides = k.strides[:3]
    assert _kv_tensor_maps(k, k, strides, strides, 2, 40, 3, 32, None) is not None
    varlen = (0,) + strides[1:]
    assert _kv_tensor_maps(k, k, varlen, varlen, 1, 80, 3, 32, None) is not None
    ragged = (strides[0] + 8,) + strides[1:]      # sequences not a whole number of rows apart
    assert _kv_tensor_maps(k, k, ragged, ragged, 2, 40, 3, 32, None) is None
    wide = (strides[0], strides[1], strides[1])   # a token's heads overrun its row
    assert _kv_tensor_maps(k, k, wide, wide, 2, 40, 3, 32, None) is None


class _Launched(Exception):
    """Raised by a stand-in kernel factory: which kernel the planner built, and how."""


@pytest.mark.parametrize("map_fits, forced, expected", [
    (True, False, ("wgmma", True)), (False, False, ("tc",)), (False, True, ("wgmma", False))])
def test_planned_d256_runs_wgmma_only_by_tma(monkeypatch, rng, map_fits, forced, expected):
    """The planner's head-dimension-256 wgmma kernel takes the TMA form at any size (the
    cp.async form spills), and a call whose K / V no tensor map holds runs mma.sync instead;
    a forced wgmma kernel stays wgmma (its cp.async form)."""
    from llmspeed_numba.ops import _flash_attn_tc, _flash_attn_wgmma
    from llmspeed_numba.ops import flash_attn as fa

    def factory(kind):
        def build(*args, **options):   # the wgmma factory's last argument: the TMA form
            raise _Launched(*((kind, args[-1]) if kind == "wgmma" else (kind,)))
        return build

    monkeypatch.setattr(fa, "SIMULATOR", False)  # the GPU's configurations (nothing launches)
    monkeypatch.setattr(fa, "_pick_impl", lambda tensors, headdim=None: "wgmma")
    monkeypatch.setattr(fa, "_kv_tensor_maps", lambda *a: ("k map", "v map") if map_fits else None)
    monkeypatch.setattr(_flash_attn_wgmma, "wgmma_kernel", factory("wgmma"))
    monkeypatch.setattr(_flash_attn_tc, "tc_kernel", factory("tc"))
    q, k, v = (to_device(x, KIND) for x in _qkv(rng, 1, 3, 5, 2, 2, 256, "bfloat16"))
    with overrides(flash_attn={"impl": "wgmma" if forced else None}):
        with pytest.raises(_Launched) as launched:
            flash_attn(q, k, v)
    assert launched.value.args == expected


@pytest.mark.parametrize("map_fits, tma_min_work, expected", [
    (True, 0, (1, 128, 3, 2, True)), (False, 0, (2, 128, 3, 1, False)),
    (True, 2**40, (2, 128, 3, 1, False))])
def test_planned_d64_takes_its_cp_async_config_without_tma(monkeypatch, rng, map_fits,
                                                           tma_min_work, expected):
    """At head dimension 64 the planned TMA configuration (one group, two blocks an SM) spills
    in its cp.async form, so a call that does not copy by TMA (a small one, or K / V no tensor
    map holds) takes ``WGMMA_CP_ASYNC_CONFIGS``: (groups, block_n, stages, min_blocks, TMA)."""
    from llmspeed_numba.ops import _flash_attn_wgmma
    from llmspeed_numba.ops import flash_attn as fa

    boxes = []

    def build(sig, headdim, dim, groups, block_n, stages, min_blocks, *rest, **options):
        if rest[-1]:   # the TMA form: its maps' boxes are its key blocks
            assert boxes == [block_n]
        raise _Launched(groups, block_n, stages, min_blocks, rest[-1])

    def maps(*args):
        boxes.append(args[-2])
        return ("k map", "v map") if map_fits else None

    monkeypatch.setattr(fa, "SIMULATOR", False)
    monkeypatch.setattr(fa, "_pick_impl", lambda tensors, headdim=None: "wgmma")
    monkeypatch.setattr(fa, "_kv_tensor_maps", maps)
    monkeypatch.setattr(_flash_attn_wgmma, "wgmma_kernel", build)
    q, k, v = (to_device(x, KIND) for x in _qkv(rng, 1, 3, 5, 2, 2, 64, "bfloat16"))
    with overrides(flash_attn={"tma_min_work": tma_min_work}):
        with pytest.raises(_Launched) as launched:
            flash_attn(q, k, v)
    assert launched.value.args == expected


def test_tma_never_mixes_in_the_next_sequence():
    """The TMA producer's boxes run past a sequence into the next one's keys: masked in S, and
    the rows of V zeroed before P V, so a next sequence holding huge keys and inf values leaves
    this one exact."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 2, 40, 70, 1, 1, 64, "float16")
    q = np.abs(q)
    k[1] = 60000.0     # a leaked key of the next sequence would outweigh all of this one's
    v[1] = np.inf
    out, lse = _run(q, k, v, impl="wgmma", config=WG_TMA)
    _check(out[:1], lse[:1], q[:1], k[:1], v[:1], "float16")


def test_persistent_blocks_share_the_tiles_and_leave_the_counter_zero():
    """A grid of two persistent blocks (two SM slots) draws every tile once between them and the
    last block out sets the tile counter back to 0: a second call (as a graph replay would)
    computes every tile again. A tile's first key block sits in whichever stage the previous
    tile left (4 key blocks a tile, 3 stages), and the next sequence's keys, read past a
    sequence's end by the TMA boxes, never leak in (V's rows there zeroed in that stage)."""
    from llmspeed_numba import _workspace

    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 2, 40, 50, 1, 1, 64, "float16")
    with overrides(device={"sm_count": 2}):
        for _ in range(2):
            out, lse = _run(q, k, v, impl="wgmma", config=WG_PERSISTENT_3, causal=True)
            _check(out, lse, q, k, v, "float16", causal=True)
        q = np.abs(q)
        k[1] = 60000.0     # a leaked key of the next sequence would outweigh all of this one's
        v[1] = np.inf
        out, lse = _run(q, k, v, impl="wgmma", config=WG_PERSISTENT_3)
        _check(out[:1], lse[:1], q[:1], k[:1], v[:1], "float16")
    if SIMULATOR:   # the per-stream counters themselves (on the GPU the second call shows it)
        counters = [buf for (_, _, name), buf in _workspace._WORKSPACE.items()
                    if name == "attention_tiles"]
        assert counters and all((c[:2] == 0).all() for c in counters)


@pytest.mark.parametrize("config,headdim", [((2, 16, 2, 0, 1, 1, 1, 0, 0, 1), 64),   # ping-pong
                                            ((1, 16, 2, 0, 1, 0, 0, 0, 0, 1), 64),   # no TMA
                                            ((1, 16, 2, 0, 1, 0, 1, 0, 0, 1), 256)])
def test_persistent_form_refuses_what_it_cannot_run(config, headdim):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 8, 8, 1, 1, headdim, "float16")
    with pytest.raises(ValueError, match="persistent"):
        _run(q, k, v, impl="wgmma", config=config)


def test_wgmma_register_split_fits_the_block():
    """setmaxnreg.inc only takes registers a dec gave back to the block: the split must fit the
    block's launch allocation (else the consumers wait forever), in multiples of 8."""
    from llmspeed_numba.ops._flash_attn_wgmma import PRODUCER_REGS, maxnreg_split, threads_for

    for groups, min_blocks in ((1, 1), (2, 1), (3, 1), (1, 2)):
        threads = threads_for(groups, True)
        at_launch = 65536 // (threads * min_blocks) // 8 * 8
        for dim in PRODUCER_REGS:
            for tma in (False, True):
                producer, consumer = maxnreg_split(groups, dim, tma, min_blocks)
                assert 128 * producer + 128 * groups * consumer <= threads * at_launch
                assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= consumer <= 256
                assert consumer >= at_launch, "the consumers should gain registers"


# ---- masks, layouts, options ---------------------------------------------------------------

@pytest.mark.parametrize("impl,config", [("simt", None), ("tc", TC_ONE_WARP),
                                         ("wgmma", WG_SHORT_3)])
def test_fully_masked_rows_are_zero_with_minus_inf_lse(rng, impl, config):
    # causal with seqlen_q 21 > seqlen_k 4: rows 0..16 attend nothing (the first 16-row block has
    # no key block at all); window (0, 0) leaves exactly one key for each remaining row
    q, k, v = _qkv(rng, 1, 21, 4, 1, 1, 16, "float16")
    out, lse = _run(q, k, v, impl=impl, config=config, causal=True, window_size=(0, 0))
    assert np.all(f64(out)[0, :17] == 0.0)
    assert np.all(np.isneginf(f64(lse)[0, :, :17]))
    assert np.allclose(f64(out)[0, 17:], f64(v)[0], atol=1e-3)
    _check(out, lse, q, k, v, "float16", causal=True, window_size=(0, 0))


def test_window_excluding_everything(rng):
    # seqlen_q 1 (decode), window left 0 right 0 with 5 keys: only the last key
    q, k, v = _qkv(rng, 1, 1, 5, 2, 2, 8, "float16")
    out, _ = _run(q, k, v, impl="simt", window_size=(0, 0))
    assert np.array_equal(f64(out)[0, 0], f64(v)[0, 4])


@pytest.mark.parametrize("impl,config", [("simt", None), ("tc", TC_ONE_WARP),
                                         ("wgmma", WG_ONE)])
def test_packed_qkv_strides_without_copies(rng, impl, config):
    dim = 64 if impl == "wgmma" else 16
    qkv = random_array((2, 11, 3, 2, dim), "float16", rng)      # (batch, seq, 3, heads, dim)
    q, k, v = (qkv[:, :, i] for i in range(3))
    out, lse = _run(q, k, v, impl=impl, config=config, causal=True)
    _check(out, lse, q, k, v, "float16", causal=True)


def test_defaults_scale_and_output_kind(rng):
    q, k, v = _qkv(rng, 1, 4, 6, 1, 1, 16, "float16")
    qd, kd, vd = (to_device(x, KIND) for x in (q, k, v))
    out = to_host(flash_attn(qd, kd, vd, softmax_scale=0.3))
    assert out.shape == q.shape and out.dtype == q.dtype
    expected, _ = attention(f64(q), f64(k), f64(v), softmax_scale=0.3)
    plain, _ = attention(f64(q), f64(k), f64(v), softmax_scale=0.3, dtype="float16")
    derived_check(f64(out), expected, plain, allowance=2.0 ** -11)


def test_zero_length_inputs(rng):
    q, k, v = _qkv(rng, 1, 3, 0, 1, 1, 8, "float16")
    out, lse = flash_attn(*(to_device(x, KIND) for x in (q, k, v)), return_lse=True)
    assert np.all(f64(out) == 0.0) and np.all(np.isneginf(f64(lse)))
    q, k, v = _qkv(rng, 1, 0, 3, 1, 1, 8, "float16")
    out = flash_attn(*(to_device(x, KIND) for x in (q, k, v)))
    assert to_host(out).shape == (1, 0, 1, 8)


# ---- varlen ---------------------------------------------------------------------------------

def _varlen_problem(rng, lengths_q, lengths_k, nheads, nheads_k, headdim, dtype):
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = random_array((int(cu_q[-1]), nheads, headdim), dtype, rng)
    k = random_array((int(cu_k[-1]), nheads_k, headdim), dtype, rng)
    v = random_array((int(cu_k[-1]), nheads_k, headdim), dtype, rng)
    return q, k, v, cu_q, cu_k


def _run_varlen(q, k, v, cu_q, cu_k, impl=None, config=None, **options):
    args = [to_device(x, KIND) for x in (q, k, v, cu_q, cu_k)]
    out = poison(to_device(np.empty(q.shape, q.dtype), KIND))
    max_q = int(np.diff(cu_q).max()) if len(cu_q) > 1 else 0
    max_k = int(np.diff(cu_k).max()) if len(cu_k) > 1 else 0
    with overrides(flash_attn={"impl": impl, "config": config, "tma_min_work": 0}):
        got, lse = flash_attn_varlen(*args, max_q, max_k, return_lse=True, out=out, **options)
    return to_host(got), to_host(lse)


@settings(max_examples=10 if SIMULATOR else 100)
@given(lengths=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 23)), min_size=1,
                        max_size=4),
       group=st.sampled_from([1, 2]), headdim=st.sampled_from(SIMT_HEADDIMS[:3]),
       causal=st.booleans(), window=st.tuples(windows, windows),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_varlen_simt_matches_reference(lengths, group, headdim, causal, window, dtype, seed):
    _check_varlen_case(lengths, group, headdim, causal, window, dtype, seed, impl="simt")


def _check_varlen_case(lengths, group, headdim, causal, window, dtype, seed, **run_options):
    """A drawn varlen problem ((q, k) length pairs; at least one query) against the reference."""
    rng = np.random.default_rng(seed)
    lengths_q = [a for a, _ in lengths]
    if sum(lengths_q) == 0:
        lengths_q[0] = 1
    q, k, v, cu_q, cu_k = _varlen_problem(rng, lengths_q, [b for _, b in lengths], 2 * group,
                                          2, headdim, dtype)
    options = {"causal": causal, "window_size": window}
    out, lse = _run_varlen(q, k, v, cu_q, cu_k, **run_options, **options)
    _check(out, lse, q, k, v, dtype, reference=lambda *a, **o: attention_varlen(
        *a, cu_q, cu_k, **o), **options)


@pytest.mark.parametrize("impl,config,headdim", [("tc", TC_ONE_WARP, 16),
                                                ("wgmma", WG_SHORT_3, 64), ("wgmma", WG_TMA, 64),
                                                ("wgmma", WG_PERSISTENT, 64)])
def test_varlen_tensor_core_kernels(rng, impl, config, headdim):
    q, k, v, cu_q, cu_k = _varlen_problem(rng, [3, 0, 18], [20, 4, 17], 2, 1, headdim,
                                          "bfloat16")
    out, lse = _run_varlen(q, k, v, cu_q, cu_k, impl=impl, config=config, causal=True)
    _check(out, lse, q, k, v, "bfloat16", causal=True, reference=lambda *a, **o:
           attention_varlen(*a, cu_q, cu_k, **o))


# ---- bad input --------------------------------------------------------------------------------

def _dev(shape, dtype, rng):
    return to_device(random_array(shape, dtype, rng), KIND)


def test_bad_inputs(rng):
    q = _dev((1, 4, 4, 16), "float16", rng)
    k = _dev((1, 6, 2, 16), "float16", rng)
    v = _dev((1, 6, 2, 16), "float16", rng)
    cases = [
        (TypeError, "q: expected a CUDA array", ([[1.0]], k, v), {}),
        (ValueError, "q: expected 4 dimensions", (_dev((4, 4, 16), "float16", rng), k, v), {}),
        (ValueError, r"k: expected shape \(1, '?\*'?, '?\*'?, 16\)",
         (q, _dev((2, 6, 2, 16), "float16", rng), v), {}),
        (ValueError, r"k: expected shape \(1, '?\*'?, '?\*'?, 16\)",
         (q, _dev((1, 6, 2, 8), "float16", rng), v), {}),
        (ValueError, r"v: expected shape \(1, 6, 2, 16\)",
         (q, k, _dev((1, 5, 2, 16), "float16", rng)), {}),
        (ValueError, "nheads_k dividing", (q, _dev((1, 6, 3, 16), "float16", rng),
                                           _dev((1, 6, 3, 16), "float16", rng)), {}),
        (ValueError, "headdim a multiple of 8",
         tuple(_dev((1, 4, 2, 12), "float16", rng) for _ in range(3)), {}),
        (ValueError, "headdim a multiple of 8",
         tuple(_dev((1, 2, 1, 264), "float16", rng) for _ in range(3)), {}),
        (TypeError, "k: expected dtype float16", (q, _dev((1, 6, 2, 16), "bfloat16", rng), v),
         {}),
        (TypeError, "q: expected dtype in", (_dev((1, 4, 4, 16), "float32", rng), k, v), {}),
        (ValueError, "window_size\\[0\\]: expected -1", (q, k, v), {"window_size": (-2, 0)}),
        (ValueError, "window_size\\[1\\]: expected -1", (q, k, v), {"window_size": (0, -5)}),
        (TypeError, "window_size: expected a pair", (q, k, v), {"window_size": 3}),
        (TypeError, "window_size\\[0\\]: expected an int", (q, k, v), {"window_size": (1.5, 0)}),
        (TypeError, "softmax_scale: expected a float", (q, k, v), {"softmax_scale": "0.1"}),
        (ValueError, "softmax_scale: expected a finite number > 0", (q, k, v),
         {"softmax_scale": 0.0}),
        (ValueError, "softmax_scale: expected a finite number > 0", (q, k, v),
         {"softmax_scale": float("inf")}),
        (TypeError, "causal: expected a bool", (q, k, v), {"causal": 1}),
        (TypeError, "return_lse: expected a bool, got int", (q, k, v), {"return_lse": 1}),
        (ValueError, r"out: expected shape \(1, 4, 4, 16\)", (q, k, v),
         {"out": _dev((1, 4, 4, 8), "float16", rng)}),
        (TypeError, "out: expected dtype float16", (q, k, v),
         {"out": _dev((1, 4, 4, 16), "bfloat16", rng)}),
    ]
    for error, match, args, kwargs in cases:
        with pytest.raises(error, match=match):
            flash_attn(*args, **kwargs)
    # the last dimension must be contiguous (strides elsewhere are free)
    host = random_array((1, 4, 4, 32), "float16", rng)
    with pytest.raises(ValueError, match="q: expected the last dimension to be contiguous"):
        flash_attn(to_device(host, KIND)[..., ::2], k, v)


def test_bad_varlen_inputs(rng):
    q = _dev((10, 2, 16), "float16", rng)
    k = _dev((12, 1, 16), "float16", rng)
    v = _dev((12, 1, 16), "float16", rng)
    cu_q = to_device(np.array([0, 4, 10], np.int32), KIND)
    cu_k = to_device(np.array([0, 5, 12], np.int32), KIND)
    flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7)   # valid
    # the offsets' contents are checked on request (by default only in the simulator)
    cases = [
        (TypeError, "cu_seqlens_q: expected dtype int32",
         (q, k, v, to_device(np.array([0, 4, 10], np.int64), KIND), cu_k, 6, 7)),
        (ValueError, "cu_seqlens_k: expected non-decreasing",
         (q, k, v, cu_q, to_device(np.array([0, 7, 5], np.int32), KIND), 6, 7)),
        (ValueError, r"cu_seqlens_k: expected shape \(3,\)",
         (q, k, v, cu_q, to_device(np.array([0, 12], np.int32), KIND), 6, 7)),
        (ValueError, "max_seqlen_q: expected at least the longest sequence",
         (q, k, v, cu_q, cu_k, 5, 7)),
        (ValueError, "cu_seqlens_q: last offset 11 exceeds",
         (q, k, v, to_device(np.array([0, 4, 11], np.int32), KIND), cu_k, 7, 7)),
        (ValueError, "q: expected 3 dimensions",
         (_dev((1, 10, 2, 16), "float16", rng), k, v, cu_q, cu_k, 6, 7)),
        (ValueError, "nheads_k dividing",
         (_dev((10, 3, 16), "float16", rng), _dev((12, 2, 16), "float16", rng),
          _dev((12, 2, 16), "float16", rng), cu_q, cu_k, 6, 7)),
        (TypeError, "v: expected dtype float16",
         (q, k, _dev((12, 1, 16), "bfloat16", rng), cu_q, cu_k, 6, 7)),
        (TypeError, "max_seqlen_k: expected an int", (q, k, v, cu_q, cu_k, 6, 7.0)),
    ]
    with pytest.raises(TypeError, match="return_lse: expected a bool, got str"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7, return_lse="yes")
    for error, match, args in cases:
        with pytest.raises(error, match=match):
            flash_attn_varlen(*args, check_bounds=True)
    with pytest.raises(ValueError, match="window_size\\[0\\]"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7, window_size=(-3, 2))
    with pytest.raises(TypeError, match="check_bounds: expected a bool, got int"):
        flash_attn_varlen(q, k, v, cu_q, cu_k, 6, 7, check_bounds=1)


@pytest.mark.parametrize("impl,config", [("simt", None), ("tc", TC_ONE_WARP),
                                         ("wgmma", WG_SHORT_3)])
def test_varlen_any_offsets_are_memory_safe(rng, impl, config):
    """With the checks off, negative, decreasing and out-of-range query offsets are clamped to
    the packed rows and a sequence with such key offsets writes nothing: the kernel runs without
    reading or writing out of bounds (the simulator raises on an index past an array's end; on
    the GPU, runners/gpu_sanitize.sh's memcheck) and what it writes is finite."""
    dim = 64 if impl == "wgmma" else 16
    q = _dev((10, 2, dim), "float16", rng)
    k = _dev((12, 1, dim), "float16", rng)
    v = _dev((12, 1, dim), "float16", rng)
    # (cu_q, cu_k, query rows that must be written: those of sequences with valid keys)
    cases = (([-4, 6, 2], [0, 30, 5], []), ([3, 99, 100], [-9, -2, 12], []),
             ([0, 10, 10], [12, 0, 12], []), ([-4, 6, 2], [0, 5, 12], range(0, 6)),
             ([3, 99, 100], [0, 12, 12], range(3, 10)))
    with overrides(flash_attn={"impl": impl, "config": config, "tma_min_work": 0}):
        for cu_q, cu_k, rows in cases:
            out = to_device(np.full((10, 2, dim), np.nan, np.float16), KIND)
            flash_attn_varlen(q, k, v, to_device(np.array(cu_q, np.int32), KIND),
                              to_device(np.array(cu_k, np.int32), KIND), 10, 12, causal=True,
                              out=out, check_bounds=False)
            written = ~np.isnan(f64(out))
            assert np.isfinite(f64(out)[written]).all()
            expected = np.zeros(10, bool)
            expected[list(rows)] = True
            np.testing.assert_array_equal(written.all(axis=(1, 2)), expected)
            np.testing.assert_array_equal(written.any(axis=(1, 2)), expected)


# ---- GPU suite: real configurations, many examples ---------------------------------------------

@pytest.mark.gpu
@settings(max_examples=80)
@given(problem=attention_problems(max_seqlen=257, headdims=(40, 64, 128, 256),
                                  max_batch=3))
def test_gpu_matches_reference(problem):
    _solve(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_fast_headdims(headdim, causal, dtype):
    rng = np.random.default_rng(headdim + causal)
    q, k, v = _qkv(rng, 2, 513, 1031, 4, 2, headdim, dtype)
    out, lse = _run(q, k, v, causal=causal)
    _check(out, lse, q, k, v, dtype, causal=causal)


@pytest.mark.gpu
def test_gpu_misaligned_input_takes_the_simt_fallback():
    """A head stride that is not a multiple of 8 elements takes the SIMT fallback."""
    import torch

    headdim = 64
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 70, 90, 2, 2, headdim, "float16")
    base = torch.zeros((1, 70, 2, headdim + 4), dtype=torch.float16, device="cuda")
    base[..., :headdim] = to_device(q, "torch")
    qm = base[..., :headdim]
    assert _pick_impl({"q": tensor(qm, "q")}) == "simt"
    options = {"causal": True, "window_size": (33, 5)}
    got, lse = flash_attn(qm, to_device(k, "torch"), to_device(v, "torch"), return_lse=True,
                          **options)
    _check(to_host(got), to_host(lse), q, k, v, "float16", **options)


@pytest.mark.gpu
@settings(max_examples=40)
@given(lengths=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400)), min_size=1,
                        max_size=5),
       group=st.sampled_from([1, 4]), headdim=st.sampled_from([64, 128]),
       causal=st.booleans(), window=st.tuples(windows, windows),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_gpu_varlen_matches_reference(lengths, group, headdim, causal, window, dtype, seed):
    _check_varlen_case(lengths, group, headdim, causal, window, dtype, seed)


@pytest.mark.gpu
def test_gpu_packed_qkv_tensor_core(rng):
    import torch

    qkv = to_device(random_array((2, 300, 3, 8, 128), "bfloat16", rng), "torch")
    q, k, v = qkv.unbind(2)
    got, lse = flash_attn(q, k, v, causal=True, return_lse=True)
    _check(to_host(got), to_host(lse), to_host(q.contiguous()), to_host(k.contiguous()),
           to_host(v.contiguous()), "bfloat16", causal=True)
    assert isinstance(got, torch.Tensor)


@pytest.mark.gpu
def test_gpu_matches_torch_sdpa(rng):
    import torch.nn.functional as F

    q, k, v = (to_device(x, "torch") for x in _qkv(rng, 2, 1024, 1024, 8, 8, 128, "float16"))
    got = flash_attn(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                              is_causal=True).transpose(1, 2)
    err = (got.float() - expected.float()).abs().max().item()
    assert err < 4e-3, err
    assert math.isfinite(err)


@pytest.mark.gpu
@settings(max_examples=40)
@given(problem=attention_problems(max_seqlen=300, headdims=(64, 128), max_batch=3))
def test_gpu_wgmma_matches_reference(problem):
    """The wgmma kernel forced (on sm_90 the planner gives it these head dimensions anyway; the
    simulator tests cover its padding of others)."""
    _solve(problem, impl="wgmma")


@pytest.mark.gpu
@settings(max_examples=20)
@given(problem=attention_problems(max_seqlen=200, headdims=(200, 256), max_batch=2))
@pytest.mark.parametrize("config", [WGMMA_CONFIGS[256], WGMMA_CONFIGS[256][:6] + (0,),
                                    (1, 64, 2, 1, 1, 0)])
def test_gpu_wgmma_d256_two_accumulators(config, problem):
    """The wgmma kernel at head dimension 256 (200 padded to it, which copies by cp.async), O in
    two accumulators of 128 columns: the planner's TMA form, its cp.async fallback, one group."""
    _solve(problem, impl="wgmma", config=config)


@pytest.mark.gpu
@settings(max_examples=25)
@given(problem=attention_problems(max_seqlen=300, headdims=(64, 128), max_batch=3))
@pytest.mark.parametrize("config", [(2, 128, 3, 1, 1, 1, 1), (2, 128, 3, 1, 1, 0, 1),
                                    WGMMA_CONFIGS[64], (2, 128, 3, 1, 1, 1, 1, 1, 1),
                                    WGMMA_CONFIGS[64] + (0, 1), WGMMA_CONFIGS[64] + (0, 0, 1),
                                    (2, 128, 3, 1, 1, 0, 1, 0, 0, 1)])
def test_gpu_wgmma_tma_matches_reference(config, problem):
    """The TMA producer forced, with and without ping-pong, and one group two blocks an SM
    (whole key blocks by TMA, the sequence's last partial block by cp.async); the opt-in forms
    (lazy rescaling, the softmax under P V, persistent at one and two groups)."""
    _solve(problem, impl="wgmma", config=config)


@pytest.mark.gpu
def test_gpu_planner_takes_wgmma_on_hopper():
    from llmspeed_numba.ops.gemm_configs import wgmma_supported

    q = tensor(to_device(np.zeros((1, 8, 2, 128), np.float16), "torch"), "q")
    expected = "wgmma" if wgmma_supported() else "tc"
    assert _pick_impl({"q": q}, 128) == expected
    assert _pick_impl({"q": q}, 256) == expected
    assert _pick_impl({"q": q}, 96) == "tc"
    assert set(WGMMA_CONFIGS) == {64, 128, 256}


# every compiled variant of the wgmma kernel (causal and windows are run-time arguments)
_RACECHECK_SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from llmspeed_numba._overrides import overrides
    from llmspeed_numba.ops.flash_attn import flash_attn, flash_attn_varlen
    torch.manual_seed(0)
    with overrides(flash_attn={"impl": "wgmma"}):
        for d in (64, 128, 256):
            for dtype in (torch.float16, torch.bfloat16):
                q, k, v = (torch.randn(1, 200, 2, d, dtype=dtype, device="cuda")
                           for _ in range(3))
                for causal in (False, True):
                    flash_attn(q, k, v, causal=causal)
                flash_attn(q, k, v, window_size=(70, 3))
        cu = torch.tensor([0, 130, 300], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(300, 2, 128, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        flash_attn_varlen(q, k, v, cu, cu, 170, 170, causal=True)
    with overrides(flash_attn={"impl": "wgmma", "config": (2, 128, 3, 1, 1, 1, 1),
                               "tma_min_work": 0}):  # TMA
        for d in (64, 128):
            q, k, v = (torch.randn(2, 300, 2, d, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            flash_attn(q, k, v, causal=True)
    with overrides(flash_attn={"impl": "wgmma", "config": (2, 128, 3, 1, 1, 1, 1, 1, 1),
                               "tma_min_work": 0}):  # lazy, the softmax under P V
        for d in (64, 128):
            q, k, v = (torch.randn(2, 300, 2, d, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            flash_attn(q, k, v, causal=True)
    for config in ((1, 128, 3, 2, 1, 0, 1, 0, 0, 1), (2, 128, 3, 1, 1, 0, 1, 0, 0, 1)):
        with overrides(flash_attn={"impl": "wgmma", "config": config,
                                   "tma_min_work": 0}):  # persistent
            q, k, v = (torch.randn(2, 300, 2, config[0] * 64, dtype=torch.bfloat16,
                                   device="cuda") for _ in range(3))
            flash_attn(q, k, v, causal=True)
            flash_attn(q, k, v, window_size=(70, 3))
    with overrides(flash_attn={"impl": "wgmma", "tma_min_work": 0}):  # planned TMA forms
        for d in (64, 256):
            q, k, v = (torch.randn(2, 300, 2, d, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            flash_attn(q, k, v, causal=True)
    with overrides(flash_attn={"impl": "wgmma", "config": (2, 128, 2, 1, 0)}):  # ring form
        q, k, v = (torch.randn(1, 200, 2, 128, dtype=torch.float16, device="cuda")
                   for _ in range(3))
        flash_attn(q, k, v, causal=True)
    torch.cuda.synchronize()
    print("launched")
""")


@pytest.mark.gpu
def test_gpu_wgmma_racecheck():
    """compute-sanitizer racecheck (shared-memory hazards) over small cases of every wgmma
    variant; skipped where the tool is absent."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer not found")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([tool, "--tool", "racecheck", "--report-api-errors", "no",
                          "--error-exitcode", "9", sys.executable, "-c", _RACECHECK_SCRIPT],
                         capture_output=True, text=True, timeout=900, env=env)
    report = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0 and "launched" in run.stdout, report
    assert "RACECHECK SUMMARY: 0 hazards" in report, report
