"""Paged-KV decode attention and the paged append (``ops/paged_decode.py``,
``ops/paged_kv_append.py``) against the float64 reference on the gathered contiguous K/V.

Simulator: tiny head dims (16, 32), a few 16-key tiles, two warps of two stages. GPU (``-m gpu``):
real sizes, every block size 8..256, head dims 64 / 128 / 256, long sequences, many examples.
"""

import inspect
import math
import zlib

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from llmspeed_numba import _workspace
from llmspeed_numba._overrides import overrides
from llmspeed_numba.ops import _paged_decode_kernel as kernel
from llmspeed_numba.ops import _paged_decode_layout as layout
from llmspeed_numba.ops import _paged_decode_plan as plan_mod
from llmspeed_numba.ops.paged_decode import paged_decode_attention
from llmspeed_numba.ops.paged_kv_append import paged_kv_append
from llmspeed_numba.reference import paged_decode as ref
from llmspeed_numba.testing import (assert_close, derived_check, f64, random_array, to_device,
                                    to_host)

DTYPES = ("float16", "bfloat16")


# ---- cases ----------------------------------------------------------------------------------

class Case:
    """Random paged caches with shuffled, non-contiguous pages; positions past each sequence's
    length (and every unused page) hold NaN, so reading one shows in the output."""

    def __init__(self, rng, *, batch, seq_lens, block_size, nheads, nheads_k, headdim, dtype,
                 q_len=None, spare_pages=3, spare_slots=1, kind="numba"):
        self.seq_lens = np.asarray(seq_lens, np.int32)
        self.block_size = block_size
        self.dtype = dtype
        pages = [-(-int(n) // block_size) for n in self.seq_lens]
        self.num_blocks = sum(pages) + spare_pages
        width = max(pages + [1]) + spare_slots
        order = rng.permutation(self.num_blocks)
        self.block_table = np.full((batch, width), -1, np.int32)
        used = 0
        for b, n in enumerate(pages):
            self.block_table[b, :n] = order[used:used + n]
            used += n
        shape = (self.num_blocks, block_size, nheads_k, headdim)
        self.k_cache = random_array(shape, dtype, rng)
        self.v_cache = random_array(shape, dtype, rng)
        written = np.zeros((self.num_blocks, block_size), bool)
        for b, n in enumerate(self.seq_lens):
            for j in range(int(n)):
                written[self.block_table[b, j // block_size], j % block_size] = True
        self.k_cache[~written] = np.nan
        self.v_cache[~written] = np.nan
        qshape = (batch, nheads, headdim) if q_len is None else (batch, q_len, nheads, headdim)
        self.q = random_array(qshape, dtype, rng)
        self.kind = kind

    def device(self):
        return tuple(to_device(np.array(x, copy=True), self.kind)
                     for x in (self.q, self.k_cache, self.v_cache, self.block_table,
                               self.seq_lens))

    def reference(self, **kw):
        args = (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens)
        return ref.paged_decode_attention(*args, **kw), ref.paged_decode_attention(
            *args, dtype=self.dtype, **kw)

    def check(self, **kw):
        """Run the op (out poisoned first) and compare out and lse with the reference."""
        q, kc, vc, bt, sl = self.device()
        out = to_device(np.full(self.q.shape, np.nan, self.q.dtype), self.kind)  # poisoned
        result = paged_decode_attention(q, kc, vc, bt, sl, return_lse=True, out=out, **kw)
        assert result[0] is out
        ref_kw = {k: v for k, v in kw.items() if k in ("softmax_scale", "window_size")}
        (out64, lse64), (plain, _) = self.reference(**ref_kw)
        derived_check(f64(out), out64, plain, name="out")
        with np.errstate(invalid="ignore"):  # -inf - -inf for rows with nothing to attend
            assert_close(f64(result[1]), lse64, atol=2e-4, rtol=2e-5, name="lse")
        return to_host(out), to_host(result[1])


def seq_len_strategy(block_size, max_len):
    special = [1, block_size, block_size + 1, 2 * block_size - 1, 2 * block_size]
    return st.one_of(st.sampled_from([n for n in special if n <= max_len]),
                     st.integers(1, max_len))


@st.composite
def decode_cases(draw, block_sizes, headdims, max_batch, max_nheads_k, groups, max_len, q_lens):
    block_size = draw(st.sampled_from(block_sizes))
    batch = draw(st.integers(1, max_batch))
    return dict(
        batch=batch,
        seq_lens=draw(st.lists(seq_len_strategy(block_size, max_len), min_size=batch,
                               max_size=batch)),
        block_size=block_size,
        headdim=draw(st.sampled_from(headdims)),
        nheads_k=(nheads_k := draw(st.integers(1, max_nheads_k))),
        nheads=nheads_k * draw(st.sampled_from(groups)),
        dtype=draw(st.sampled_from(DTYPES)),
        q_len=draw(st.sampled_from(q_lens)),
    )


def _seed(case):
    return zlib.crc32(repr(sorted(case.items())).encode())


# ---- simulator (and GPU) tests ------------------------------------------------------------

@settings(max_examples=14)
@given(case=decode_cases(block_sizes=(8, 16, 32), headdims=(16, 16, 32), max_batch=2,
                         max_nheads_k=2, groups=(1, 2, 3), max_len=40, q_lens=(None, None, 2)),
       window=st.sampled_from([-1, -1, 3]))
def test_matches_reference(case, window):
    rng = np.random.default_rng(_seed(case))
    Case(rng, **case).check(window_size=(window, -1))


def _tickets_zero():
    tickets = [buf for key, buf in _workspace._WORKSPACE.items()
               if key[2] == "paged_decode_tickets"]
    tickets += [buf for name, buf in _workspace.captured_buffers()
                if name == "paged_decode_tickets"]
    return all(not np.asarray(to_host(t)).any() for t in tickets)


@settings(max_examples=2)
@given(shape=st.sampled_from([(1, 1), (1, 2), (2, 1)]), group=st.sampled_from([1, 3]),
       q_len=st.sampled_from([None, 2]), splits=st.sampled_from([2, 3]),
       seqs=st.tuples(st.integers(1, 40), st.integers(0, 40)),
       block_size=st.sampled_from([8, 16]), dtype=st.sampled_from(DTYPES))
@example(shape=(2, 1), group=2, q_len=2, splits=2, seqs=(37, 9), block_size=8, dtype="float16")
def test_split_merge_matches_single_pass(shape, group, q_len, splits, seqs, block_size, dtype):
    """Split partials merged in the decode kernel (last block, atomic ticket) match the
    reference and the single pass; a repeated call gives the same bits, so every ticket counter
    was set back to 0 (a stale count would leave ``out`` poisoned)."""
    batch, nheads_k = shape
    case_kw = {"batch": batch, "seq_lens": list(seqs[:batch]), "block_size": block_size,
               "nheads": nheads_k * group, "nheads_k": nheads_k, "headdim": 16, "dtype": dtype,
               "q_len": q_len}
    case = Case(np.random.default_rng(_seed(case_kw)), **case_kw)
    one, lse_one = case.check(num_splits=1)
    folded, lse_folded = case.check(num_splits=splits)
    assert _tickets_zero()
    scale = np.abs(f64(one)).max()
    assert np.abs(f64(one) - f64(folded)).max() <= 4e-3 * max(scale, 1.0)
    with np.errstate(invalid="ignore"):
        assert_close(lse_one, lse_folded, atol=1e-5, rtol=1e-5)
    again, lse_again = case.check(num_splits=splits)
    np.testing.assert_array_equal(f64(again), f64(folded))
    np.testing.assert_array_equal(lse_again, lse_folded)


def test_more_splits_than_tiles_and_empty_sequences(rng):
    """Splits with no keys, and a sequence of length 0 (output 0, lse -inf)."""
    case = Case(rng, batch=2, seq_lens=[0, 20], block_size=16, nheads=2, nheads_k=1,
                headdim=16, dtype="bfloat16")
    for splits in (1, 4):
        out, lse = case.check(num_splits=splits)
        assert np.all(f64(out)[0] == 0) and np.all(np.isneginf(lse[0]))


def test_page_ids_prefetched_in_batches_and_many_splits(rng):
    """One warp over 36 tiles: page ids come in per-lane batches of 32 tiles, so the second batch
    (loaded a batch ahead) is used; 8-key pages (two ids a tile). Then more splits than a lane
    of the split merge loads at once (``MERGE_UNROLL``), most of them empty."""
    case = Case(rng, batch=1, seq_lens=[16 * 35 + 5], block_size=8, nheads=2, nheads_k=1,
                headdim=16, dtype="bfloat16")
    q, kc, vc, bt, sl = case.device()
    (out64, _), (plain, _) = case.reference()
    with overrides(paged_decode={"tuning": (1, 2, False)}):
        out = paged_decode_attention(q, kc, vc, bt, sl, num_splits=1)
    derived_check(f64(out), out64, plain)
    case = Case(rng, batch=1, seq_lens=[40], block_size=16, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    case.check(num_splits=11)


def test_speculative_window_two_row_tiles(rng):
    """group x q_len = 3 x 4 = 12 rows (m16 tile), window cutting inside the first tile."""
    case = Case(rng, batch=1, seq_lens=[35], block_size=8, nheads=3, nheads_k=1,
                headdim=16, dtype="float16", q_len=4)
    case.check(window_size=(6, 0))
    # group x q_len = 3 x 6 = 18 rows: two row tiles; softmax_scale given
    case = Case(rng, batch=1, seq_lens=[21], block_size=16, nheads=3, nheads_k=1,
                headdim=16, dtype="bfloat16", q_len=6)
    case.check(softmax_scale=0.3, num_splits=2)


def test_query_tile_from_shared_memory(rng):
    """The Q-in-shared-memory variant (used from headdim 256) at a simulator size."""
    case = Case(rng, batch=1, seq_lens=[30], block_size=16, nheads=4, nheads_k=1,
                headdim=32, dtype="bfloat16", q_len=3)
    q, kc, vc, bt, sl = case.device()
    (out64, _), (plain, _) = case.reference()
    with overrides(paged_decode={"tuning": (2, 2, True)}):
        out = paged_decode_attention(q, kc, vc, bt, sl)
    derived_check(f64(out), out64, plain)


def test_swizzled_rings(rng):
    """Head dims in ``SWIZZLE_DIMS`` keep their K/V rows unpadded and XOR-swizzled in shared
    memory (the cp.async destinations and the ldmatrix rows must agree): the smallest such dim,
    a ragged last tile and 8-key pages (a tile from two pages)."""
    assert 64 in layout.SWIZZLE_DIMS
    case = Case(rng, batch=1, seq_lens=[27], block_size=8, nheads=2, nheads_k=1,
                headdim=64, dtype="bfloat16")
    case.check(num_splits=1)


def test_append_then_decode(rng):
    """paged_kv_append writes at seq_lens (pre-append), then decode with q_len new tokens
    equals attention over the concatenated original K/V."""
    batch, nheads_k, group, headdim, block_size, dtype = 2, 1, 2, 16, 8, "float16"
    old = [5, 14]
    new = 3
    case = Case(rng, batch=batch, seq_lens=[n + new for n in old], block_size=block_size,
                nheads=nheads_k * group, nheads_k=nheads_k, headdim=headdim, dtype=dtype,
                q_len=new)
    k_new = random_array((batch, new, nheads_k, headdim), dtype, rng)
    v_new = random_array((batch, new, nheads_k, headdim), dtype, rng)
    # the cache before the append: the new positions hold NaN
    for b, n in enumerate(old):
        for j in range(n, n + new):
            page = case.block_table[b, j // block_size]
            case.k_cache[page, j % block_size] = np.nan
            case.v_cache[page, j % block_size] = np.nan
    kc, vc = to_device(case.k_cache.copy()), to_device(case.v_cache.copy())
    bt = to_device(case.block_table)
    paged_kv_append(to_device(k_new), to_device(v_new), kc, vc, bt,
                    to_device(np.array(old, np.int32)))
    k_want, v_want = ref.paged_kv_append(k_new, v_new, case.k_cache, case.v_cache,
                                         case.block_table, old)
    np.testing.assert_array_equal(to_host(kc).view(np.uint16), k_want.view(np.uint16))
    np.testing.assert_array_equal(to_host(vc).view(np.uint16), v_want.view(np.uint16))
    case.k_cache, case.v_cache = k_want, v_want
    out = paged_decode_attention(to_device(case.q), kc, vc, bt,
                                 to_device(case.seq_lens))
    # attention over the original contiguous K/V: gathered old part + the new tokens
    ks, _ = ref.gather_kv(k_want, v_want, case.block_table, case.seq_lens)
    for b in range(batch):
        np.testing.assert_array_equal(ks[b][old[b]:], f64(k_new[b]))
    (out64, _), (plain, _) = case.reference()
    derived_check(f64(out), out64, plain)


def test_unchecked_bad_tables_stay_in_bounds(rng):
    """With checks off, out-of-range page ids and lengths are clamped: no out-of-bounds access
    (the simulator raises on one), whatever the result."""
    case = Case(rng, batch=2, seq_lens=[20, 9], block_size=8, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    q, kc, vc, _, _ = case.device()
    bad_bt = to_device(np.array([[0, 99, -5, 7], [-1, 1_000_000, 2, 3]], np.int32))
    bad_sl = to_device(np.array([10_000, -3], np.int32))
    paged_decode_attention(q, kc, vc, bad_bt, bad_sl, check_bounds=False)
    paged_kv_append(to_device(random_array((2, 1, 1, 16), "float16", rng)),
                    to_device(random_array((2, 1, 1, 16), "float16", rng)), kc, vc, bad_bt,
                    bad_sl, check_bounds=False)


def test_derived_check_rejects_wrong_results(rng):
    """The tolerance is tight enough to catch an off-by-one length (newest token dropped) and a
    missing causal mask among the new tokens."""
    case = Case(rng, batch=2, seq_lens=[30, 17], block_size=8, nheads=4, nheads_k=2,
                headdim=16, dtype="float16", q_len=3)
    (out64, _), (plain, _) = case.reference()
    args = (case.q, case.k_cache, case.v_cache, case.block_table)
    dropped, _ = ref.paged_decode_attention(*args, case.seq_lens - 1)
    with pytest.raises(AssertionError):
        derived_check(dropped, out64, plain)
    ks, vs = ref.gather_kv(case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    from llmspeed_numba.reference.attention import attention

    no_mask = np.concatenate([attention(case.q[b:b + 1], ks[b][None], vs[b][None])[0]
                              for b in range(2)])
    with pytest.raises(AssertionError):
        derived_check(no_mask, out64, plain)


def test_choose_num_splits():
    # batch 32 x 8 kv heads fills 132 SMs x 2 blocks in one wave: no split
    assert plan_mod.choose_num_splits(256, 8192, 4, 264) == 1
    assert plan_mod.choose_num_splits(1024, 8192, 4, 264) == 1
    # batch 1 at 32k: enough splits for every resident slot, in one wave
    s = plan_mod.choose_num_splits(8, 32768, 4, 264)
    assert 16 <= s and 8 * s <= 264
    s = plan_mod.choose_num_splits(32, 32768, 4, 264)
    assert 4 <= s and 32 * s <= 264
    # short sequences are not split below MIN_TILES_PER_WARP tiles a warp
    assert plan_mod.choose_num_splits(8, 64, 4, 264) == 1
    # batch 8 x 8 kv heads at 512 keys (one 8-warp block an SM): halving 512 keys saves less
    # than the folded merge costs (measured 13.2 us whole vs 15.2 split in two)
    assert plan_mod.choose_num_splits(64, 512, 8, 132) == 1
    assert plan_mod.choose_num_splits(1, 10**6, 4, 10**6) == plan_mod.MAX_SPLITS


def test_short_jobs_take_small_blocks():
    # B128 / B32 x 8 / 32 KV heads of 512 keys: 1024 jobs on 264 slots (3.9 waves) -> 2 warps
    assert plan_mod.short_jobs_take_small_blocks(1024, 512, 264)
    # one wave, 15.5 waves, or 4096 keys: the 4-warp blocks stay
    assert not plan_mod.short_jobs_take_small_blocks(256, 512, 264)
    assert not plan_mod.short_jobs_take_small_blocks(4096, 512, 264)
    assert not plan_mod.short_jobs_take_small_blocks(1024, 4096, 264)


def test_kernel_parameters_follow_one_list():
    """The kernel's parameters, its numba signature and its launch arguments all follow
    ``PARAMS``: a kernel whose Python parameters differ from it is refused when built."""
    fn = kernel._decode_kernel_fn(16, False, False, True, 2, 2, False, 0)
    assert tuple(inspect.signature(fn).parameters) == kernel.DecodeArgs._fields
    assert len(kernel.SIGNATURE) == len(kernel.PARAMS) == len(kernel.DecodeArgs._fields)

    def drifted(q, kc, vc):
        pass

    with pytest.raises(TypeError, match="differ from PARAMS"):
        kernel._check_params(drifted)


def test_lse_natural_log_scale(rng):
    """lse uses the natural log and the given softmax_scale (one sequence, one key)."""
    case = Case(rng, batch=1, seq_lens=[1], block_size=8, nheads=1, nheads_k=1, headdim=16,
                dtype="float16")
    q, kc, vc, bt, sl = case.device()
    _, lse = paged_decode_attention(q, kc, vc, bt, sl, return_lse=True, softmax_scale=0.5)
    score = 0.5 * float(f64(case.q)[0, 0] @ f64(case.k_cache)[case.block_table[0, 0], 0, 0])
    assert math.isclose(float(to_host(lse)[0, 0]), score, rel_tol=1e-5, abs_tol=1e-5)


# ---- bad input -----------------------------------------------------------------------------

def _good(rng, **kw):
    params = dict(batch=2, seq_lens=[9, 16], block_size=8, nheads=4, nheads_k=2, headdim=16,
                  dtype="float16")
    params.update(kw)
    return Case(rng, **params)


def test_bad_types_and_dtypes(rng):
    q, kc, vc, bt, sl = _good(rng).device()
    with pytest.raises(TypeError, match="q"):
        paged_decode_attention([1, 2], kc, vc, bt, sl)
    with pytest.raises(TypeError, match="q: expected dtype"):
        paged_decode_attention(to_device(to_host(q).astype(np.float32)), kc, vc, bt, sl)
    with pytest.raises(TypeError, match="k_cache: expected dtype"):
        paged_decode_attention(q, to_device(to_host(kc).astype(np.float32)), vc, bt, sl)
    with pytest.raises(TypeError, match="block_table: expected dtype int32"):
        paged_decode_attention(q, kc, vc, to_device(to_host(bt).astype(np.int64)), sl)
    with pytest.raises(TypeError, match="seq_lens: expected dtype int32"):
        paged_decode_attention(q, kc, vc, bt, to_device(to_host(sl).astype(np.int64)))
    with pytest.raises(TypeError, match="softmax_scale"):
        paged_decode_attention(q, kc, vc, bt, sl, softmax_scale="0.1")
    with pytest.raises(TypeError, match="window_size"):
        paged_decode_attention(q, kc, vc, bt, sl, window_size=3)
    with pytest.raises(TypeError, match="return_lse: expected a bool, got int"):
        paged_decode_attention(q, kc, vc, bt, sl, return_lse=1)
    with pytest.raises(TypeError, match="check_bounds: expected a bool, got str"):
        paged_decode_attention(q, kc, vc, bt, sl, check_bounds="no")
    with pytest.raises(TypeError, match="out: expected dtype"):
        paged_decode_attention(q, kc, vc, bt, sl,
                               out=to_device(np.zeros(q.shape, np.float32)))


def test_bad_shapes(rng):
    case = _good(rng)
    q, kc, vc, bt, sl = case.device()
    with pytest.raises(ValueError, match="q: expected 3 or 4 dimensions"):
        paged_decode_attention(q[0], kc, vc, bt, sl)
    with pytest.raises(ValueError, match="k_cache: expected shape .* headdim"):
        paged_decode_attention(to_device(np.zeros((2, 4, 32), np.float16)), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        paged_decode_attention(q, kc, vc[:, :4], bt, sl)
    with pytest.raises(ValueError, match="block_table: expected shape"):
        paged_decode_attention(q, kc, vc, bt[:1], sl)
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        paged_decode_attention(q, kc, vc, bt, sl[:1])
    with pytest.raises(ValueError, match="nheads_k dividing"):
        paged_decode_attention(to_device(np.zeros((2, 3, 16), np.float16)), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="out: expected shape"):
        paged_decode_attention(q, kc, vc, bt, sl, out=to_device(np.zeros((2, 4, 8), np.float16)))
    wide = to_device(np.zeros(case.k_cache.shape[:3] + (20,), np.float16))
    with pytest.raises(ValueError, match="16-byte aligned"):
        paged_decode_attention(q, wide[:, :, :, :16], wide[:, :, :, :16], bt, sl)


def test_bad_options_and_unsupported(rng):
    q, kc, vc, bt, sl = _good(rng).device()
    with pytest.raises(ValueError, match="window_size\\[0\\]"):
        paged_decode_attention(q, kc, vc, bt, sl, window_size=(-2, -1))
    with pytest.raises(NotImplementedError, match="causal"):
        paged_decode_attention(q, kc, vc, bt, sl, window_size=(-1, 2))
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, kc, vc, bt, sl, num_splits=0)
    with pytest.raises(ValueError, match="softmax_scale"):
        paged_decode_attention(q, kc, vc, bt, sl, softmax_scale=float("nan"))
    odd = _good(rng, headdim=24).device()
    with pytest.raises(NotImplementedError, match="headdim 24"):
        paged_decode_attention(*odd)
    small = _good(rng, block_size=4).device()
    with pytest.raises(NotImplementedError, match="block_size 4"):
        paged_decode_attention(*small)


def test_bad_table_contents_checked(rng):
    case = _good(rng)
    q, kc, vc, bt, sl = case.device()
    too_long = to_device(np.array([9, case.block_table.shape[1] * 8 + 1], np.int32))
    with pytest.raises(ValueError, match="seq_lens: expected lengths in"):
        paged_decode_attention(q, kc, vc, bt, too_long, check_bounds=True)
    with pytest.raises(ValueError, match="seq_lens: expected lengths in"):
        paged_decode_attention(q, kc, vc, bt, to_device(np.array([-1, 3], np.int32)),
                               check_bounds=True)
    table = case.block_table.copy()
    table[1, 1] = case.num_blocks
    with pytest.raises(ValueError, match="block_table: expected page ids"):
        paged_decode_attention(q, kc, vc, to_device(table), sl, check_bounds=True)
    # append: the new positions need pages
    k = to_device(random_array((2, 3, 2, 16), "float16", rng))
    capacity = case.block_table.shape[1] * 8
    table = (rf"the block_table's capacity of {capacity} tokens \(max_blocks_per_seq "
             rf"{case.block_table.shape[1]} x block_size 8\)")
    with pytest.raises(ValueError, match=rf"^seq_lens: appending 3 tokens needs seq_lens\[b\] "
                                         rf"\+ 3 <= {capacity}, {table}, got seq_lens\[1\] = "
                                         rf"{capacity - 2}$"):
        paged_kv_append(k, k, kc, vc, bt, to_device(np.array([0, capacity - 2], np.int32)),
                        check_bounds=True)
    with pytest.raises(ValueError, match=r"^seq_lens: expected lengths >= 0, got seq_lens\[0\] "
                                         r"= -1$"):
        paged_kv_append(k, k, kc, vc, bt, to_device(np.array([-1, 0], np.int32)),
                        check_bounds=True)
    many = to_device(random_array((2, capacity + 4, 2, 16), "float16", rng))
    with pytest.raises(ValueError, match=rf"^k: expected at most {capacity} new tokens, {table}, "
                                         rf"got {capacity + 4}$"):
        paged_kv_append(many, many, kc, vc, bt, to_device(np.array([0, 0], np.int32)),
                        check_bounds=True)
    with pytest.raises(ValueError, match="block_table: expected page ids"):
        paged_kv_append(k, k, kc, vc, bt, to_device(np.array([16, 2], np.int32)),
                        check_bounds=True)


def test_append_bad_input(rng):
    case = _good(rng)
    _, kc, vc, bt, sl = case.device()
    k = to_device(random_array((2, 1, 2, 16), "float16", rng))
    with pytest.raises(ValueError, match="v: expected shape"):
        paged_kv_append(k, to_device(random_array((2, 2, 2, 16), "float16", rng)), kc, vc, bt,
                        sl)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        paged_kv_append(to_device(random_array((2, 1, 3, 16), "float16", rng)),
                        to_device(random_array((2, 1, 3, 16), "float16", rng)), kc, vc, bt, sl)
    with pytest.raises(TypeError, match="k_cache: expected dtype"):
        paged_kv_append(to_device(random_array((2, 1, 2, 16), "bfloat16", rng)),
                        to_device(random_array((2, 1, 2, 16), "bfloat16", rng)), kc, vc, bt, sl)
    with pytest.raises(TypeError, match="seq_lens: expected dtype int32"):
        paged_kv_append(k, k, kc, vc, bt, to_device(np.array([1, 2], np.int64)))
    with pytest.raises(TypeError, match="check_bounds: expected a bool, got int"):
        paged_kv_append(k, k, kc, vc, bt, sl, check_bounds=1)
    with pytest.raises(TypeError, match="k: expected a CUDA array"):
        paged_kv_append([1.0], k, kc, vc, bt, sl)
    odd_pages = to_device(np.zeros((4, 12, 2, 16), np.float16))
    with pytest.raises(NotImplementedError, match="k_cache: block_size 12 is not supported"):
        paged_kv_append(k, k, odd_pages, odd_pages, bt, sl)


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=80)
@given(case=decode_cases(block_sizes=(8, 16, 32, 64, 128, 256), headdims=(64, 128, 128, 256),
                         max_batch=6, max_nheads_k=4, groups=(1, 2, 4, 5, 8), max_len=3000,
                         q_lens=(None, None, 1, 2, 4)),
       window=st.sampled_from([-1, -1, -1, 0, 100, 1000]),
       splits=st.sampled_from([None, None, 1, 3, 16]),
       kind=st.sampled_from(["numba", "torch"]))
def test_gpu_matches_reference(case, window, splits, kind):
    rng = np.random.default_rng(_seed(case))
    Case(rng, kind=kind, **case).check(window_size=(window, -1), num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_k", [8, 32])
def test_gpu_long_split_equals_single(dtype, nheads_k):
    rng = np.random.default_rng(nheads_k)
    case = Case(rng, batch=1, seq_lens=[32768], block_size=16, nheads=32, nheads_k=nheads_k,
                headdim=128, dtype=dtype, kind="torch")
    out_auto, lse_auto = case.check()
    out_one, lse_one = case.check(num_splits=1)
    assert np.abs(f64(out_auto) - f64(out_one)).max() <= 1e-2
    assert_close(lse_auto, lse_one, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_append_then_decode_torch_strided_out():
    import torch

    rng = np.random.default_rng(3)
    batch, nheads_k, group, headdim, block_size, new = 4, 8, 4, 128, 16, 3
    case = Case(rng, batch=batch, seq_lens=[1000, 17, 4096, 3], block_size=block_size,
                nheads=nheads_k * group, nheads_k=nheads_k, headdim=headdim, dtype="bfloat16",
                q_len=new, kind="torch")
    q, kc, vc, bt, sl = case.device()
    k_new = random_array((batch, new, nheads_k, headdim), "bfloat16", rng)
    v_new = random_array((batch, new, nheads_k, headdim), "bfloat16", rng)
    old = case.seq_lens - new
    paged_kv_append(to_device(k_new, "torch"), to_device(v_new, "torch"), kc, vc, bt,
                    to_device(old, "torch"))
    k_host, v_host = ref.paged_kv_append(k_new, v_new, case.k_cache, case.v_cache,
                                         case.block_table, old)
    case.k_cache, case.v_cache = k_host, v_host
    (out64, _), (plain, _) = case.reference()
    big = torch.full((batch, new, nheads_k * group, 2 * headdim), float("nan"),
                     dtype=torch.bfloat16, device="cuda")
    out = big[..., :headdim]
    paged_decode_attention(q, kc, vc, bt, sl, out=out)
    derived_check(f64(out), out64, plain)
    assert torch.isnan(big[..., headdim:]).all()


@pytest.mark.gpu
def test_gpu_every_output_written_large_batch():
    """batch x KV heads = 144 blocks >= the SMs: the planner takes ``BATCH_CONFIGS`` (two 4-warp
    blocks an SM) at D 128; then the 8-warp configuration split 5 ways; then 800 short jobs in
    ``SHORT_JOB_CONFIGS`` blocks."""
    rng = np.random.default_rng(5)
    batch = 72
    case = Case(rng, batch=batch, seq_lens=rng.integers(1, 600, batch), block_size=32,
                nheads=16, nheads_k=2, headdim=128, dtype="float16")
    plan = plan_mod.launch_plan(batch, 1, 16, 2, 128, 32, case.block_table.shape[1], "float16")
    assert plan["config"][4:6] == plan_mod.BATCH_CONFIGS[128]
    case.check()
    case.check(num_splits=5)
    # 100 x 8 = 800 jobs of at most 512 keys (3 waves of 4-warp blocks): 2-warp blocks
    batch = 100
    case = Case(rng, batch=batch, seq_lens=rng.integers(1, 481, batch), block_size=32,
                nheads=32, nheads_k=8, headdim=128, dtype="bfloat16", spare_slots=0)
    plan = plan_mod.launch_plan(batch, 1, 32, 8, 128, 32, case.block_table.shape[1], "bfloat16")
    assert plan["config"][4:6] == plan_mod.SHORT_JOB_CONFIGS[128]
    case.check()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_gpu_fast_path_repeat_calls(splits):
    """Calls repeating a signature take the recorded fast path (new pointers patched into the
    packed launch, shared split workspace): every call still matches, with and without out=."""
    import torch

    rng = np.random.default_rng(11)
    shapes = {"batch": 3, "seq_lens": [700, 33, 1500], "block_size": 16, "nheads": 8,
              "nheads_k": 2, "headdim": 128, "dtype": "bfloat16", "kind": "torch"}
    for _ in range(3):  # the first call records, the others replay
        Case(rng, **shapes).check(num_splits=splits)
    for _ in range(3):
        case = Case(rng, **shapes)
        q, kc, vc, bt, sl = case.device()
        (out64, lse64), (plain, _) = case.reference()
        out, lse = paged_decode_attention(q, kc, vc, bt, sl, return_lse=True,
                                          num_splits=splits)
        assert isinstance(out, torch.Tensor) and out.shape == q.shape
        derived_check(f64(out), out64, plain, name="out")
        assert_close(f64(lse), lse64, atol=2e-4, rtol=2e-5, name="lse")


@pytest.mark.gpu
def test_gpu_resident_blocks_from_the_device_limits():
    """The planner's blocks an SM (the driver's occupancy calculator) equal a count from the
    device's own limits: registers (allocated 256 a warp), shared memory (with the per-block
    reservation), threads and blocks an SM, for the configurations the planner takes."""
    from numba import cuda

    dev = cuda.get_current_device()
    configs = [(dim, m16, page8, bf16, *table[dim], dim >= layout.Q_IN_SHARED_FROM,
                plan_mod.L2_PREFETCH)
               for dim, m16, page8, bf16 in ((128, False, False, True), (128, True, False, True),
                                             (64, False, True, False), (256, False, False, True))
               for table in (plan_mod.CONFIGS, plan_mod.BATCH_CONFIGS, plan_mod.SHORT_JOB_CONFIGS)
               if dim in table]
    for config in configs:
        warps, stages, q_smem = config[4:7]
        regs = kernel._decode_kernel(*config).resources()["registers"]
        by_regs = dev.MAX_REGISTERS_PER_MULTIPROCESSOR // (-(-regs * 32 // 256) * 256 * warps)
        smem = layout.shared_bytes(config[0], warps, stages, q_smem)
        by_smem = dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR // (
            smem + dev.RESERVED_SHARED_MEMORY_PER_BLOCK)
        by_threads = dev.MAX_THREADS_PER_MULTIPROCESSOR // (32 * warps)
        expected = min(by_regs, by_smem, by_threads, dev.MAX_BLOCKS_PER_MULTIPROCESSOR)
        assert plan_mod.resident_blocks_per_sm(*config) == expected, (
            config, dict(registers=regs, by_registers=by_regs, shared=smem, by_shared=by_smem,
                         by_threads=by_threads))


@pytest.mark.gpu
def test_gpu_split_merge_and_graph_replay():
    """The split merge on the GPU; the kernel captured in a CUDA graph rewrites every output on
    each replay (its last blocks set the tickets back to 0)."""
    import torch

    rng = np.random.default_rng(13)
    case = Case(rng, batch=2, seq_lens=[2900, 1200], block_size=16, nheads=8, nheads_k=2,
                headdim=128, dtype="bfloat16", kind="torch")
    folded, _ = case.check(num_splits=7)
    q, kc, vc, bt, sl = case.device()
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (compile, fast-path record)
        paged_decode_attention(q, kc, vc, bt, sl, out=out, num_splits=7)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, bt, sl, out=out, num_splits=7)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(f64(out), f64(folded))
    eager = paged_decode_attention(q, kc, vc, bt, sl, num_splits=7)  # after capture
    np.testing.assert_array_equal(f64(eager), f64(folded))
    # a second graph captured on the same (default capture) stream has tickets of its own,
    # zeroed in the graph: replaying it first, then both in turn, gives the same bits
    out2 = torch.empty_like(q)
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        paged_decode_attention(q, kc, vc, bt, sl, out=out2, num_splits=7)
    for g, o in ((graph2, out2), (graph, out), (graph2, out2)):
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(f64(o), f64(folded))
    assert _tickets_zero()
