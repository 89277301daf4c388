"""Prefill attention over a paged KV cache (``ops/paged_prefill.py``) against the float64
reference (``reference.attention.paged_prefill_attention``: the pages gathered into contiguous
K/V, masked bottom-right).

Tolerance (derived, as ``test_flash_attn.py``): the output's max error is at most twice that of
the plain same-precision attention plus half an ulp at 1; the lse likewise with a 1e-5 allowance,
``-inf`` exactly at the rows with nothing to attend.

Simulator: the Tensor Core kernel at tiny configurations (one or two warps, 16-key tiles), head
dims 16-40, a few tiles. GPU (``-m gpu``): the real configurations at head dims 64 / 128 with long
prior contexts and many examples.
"""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmspeed_numba import SIMULATOR, paged_decode_attention, paged_prefill_attention
from llmspeed_numba._overrides import overrides
from llmspeed_numba.reference.attention import attention, attention_varlen
from llmspeed_numba.reference.paged_decode import gather_kv
from llmspeed_numba.reference.paged_decode import paged_prefill_attention as reference
from llmspeed_numba.testing import derived_check, f64, random_array, to_device, to_host

DTYPES = ("float16", "bfloat16")
KIND = "numba" if SIMULATOR else "torch"

# Tiny Tensor Core configurations the simulator can afford: (warps, m16 tiles per warp, keys).
TC_ONE_WARP = (1, 1, 16)
TC_TWO_WARPS = (2, 1, 16)
TC_TWO_TILES = (1, 2, 16)


# ---- cases ----------------------------------------------------------------------------------

class Case:
    """Chunks of ``q_lens`` new tokens of sequences of ``seq_lens`` tokens (new ones included) in
    a paged cache with shuffled, non-contiguous pages. Cache slots no sequence uses hold NaN, so
    reading one shows in the output; ``lead`` rows of q before the first sequence belong to
    none (they must stay unwritten)."""

    def __init__(self, rng, *, q_lens, seq_lens, block_size, nheads, nheads_k, headdim, dtype,
                 spare_pages=2, spare_slots=1, lead=0):
        self.q_lens = list(q_lens)
        self.seq_lens = np.asarray(seq_lens, np.int32)
        self.dtype = dtype
        batch = len(self.q_lens)
        pages = [-(-int(n) // block_size) for n in self.seq_lens]
        num_blocks = sum(pages) + spare_pages
        order = rng.permutation(num_blocks)
        self.block_table = np.full((batch, max(pages + [1]) + spare_slots), -1, np.int32)
        used = 0
        for b, n in enumerate(pages):
            self.block_table[b, :n] = order[used:used + n]
            used += n
        shape = (num_blocks, block_size, nheads_k, headdim)
        self.k_cache = random_array(shape, dtype, rng)
        self.v_cache = random_array(shape, dtype, rng)
        written = np.zeros((num_blocks, block_size), bool)
        for b, n in enumerate(self.seq_lens):
            for j in range(int(n)):
                written[self.block_table[b, j // block_size], j % block_size] = True
        self.k_cache[~written] = np.nan
        self.v_cache[~written] = np.nan
        self.cu_seqlens_q = (lead + np.concatenate([[0], np.cumsum(self.q_lens)])).astype(
            np.int32)
        self.q = random_array((int(self.cu_seqlens_q[-1]), nheads, headdim), dtype, rng)
        self.lead = lead

    @property
    def max_seqlen_q(self):
        return max(self.q_lens + [0])

    def device(self):
        return tuple(to_device(np.array(x, copy=True), KIND)
                     for x in (self.q, self.k_cache, self.v_cache, self.block_table,
                               self.cu_seqlens_q, self.seq_lens))

    def run(self, q=None, **kw):
        """The op with ``out`` poisoned (NaN) first: (out, lse) on the host."""
        dq, kc, vc, bt, cu, sl = self.device()
        out = to_device(np.full(self.q.shape, np.nan, self.q.dtype), KIND)
        got, lse = paged_prefill_attention(dq if q is None else q, kc, vc, bt, cu, sl,
                                           self.max_seqlen_q, return_lse=True, out=out, **kw)
        assert got is out
        return to_host(out), to_host(lse)

    def check(self, **kw):
        out, lse = self.run(**kw)
        options = {k: v for k, v in kw.items() if k in ("causal", "softmax_scale", "window_size")}
        args = (self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q,
                self.seq_lens)
        expected, expected_lse = reference(*args, **options)
        plain, plain_lse = reference(*args, dtype=self.dtype, **options)
        rows = slice(self.lead, None)   # rows before the first sequence: never written
        assert np.isnan(f64(out)[:self.lead]).all(), "rows outside every sequence written"
        eps = float(np.finfo(np.float16).eps if self.dtype == "float16" else 2.0 ** -7)
        derived_check(f64(out)[rows], expected[rows], plain[rows], allowance=eps / 2,
                      name="out")
        lse, expected_lse, plain_lse = (x[:, rows] for x in (f64(lse), expected_lse,
                                                             plain_lse))
        empty = np.isneginf(expected_lse)
        assert np.array_equal(np.isneginf(lse), empty), "lse: -inf exactly at empty rows"
        derived_check(np.where(empty, 0.0, lse), np.where(empty, 0.0, expected_lse),
                      np.where(empty, 0.0, plain_lse), allowance=1e-5, name="lse")
        return out, lse


def _seed(case):
    return zlib.crc32(repr(sorted(case.items())).encode())


@st.composite
def prefill_cases(draw, block_sizes, headdims, max_batch, max_nheads_k, groups, max_prior,
                  max_q):
    batch = draw(st.integers(1, max_batch))
    q_lens = draw(st.lists(st.integers(1, max_q), min_size=batch, max_size=batch))
    priors = draw(st.lists(st.integers(0, max_prior), min_size=batch, max_size=batch))
    nheads_k = draw(st.integers(1, max_nheads_k))
    return dict(
        q_lens=q_lens, seq_lens=[p + n for p, n in zip(priors, q_lens)],
        block_size=draw(st.sampled_from(block_sizes)),
        headdim=draw(st.sampled_from(headdims)),
        nheads_k=nheads_k, nheads=nheads_k * draw(st.sampled_from(groups)),
        dtype=draw(st.sampled_from(DTYPES)),
    )


# ---- the check itself -----------------------------------------------------------------------

def test_check_rejects_ignoring_the_prior_context(rng):
    """The derived check catches the classic bug of attending the chunk's own keys only (the
    query lengths taken for the key lengths), and a top-left aligned causal mask."""
    case = Case(rng, q_lens=[6, 4], seq_lens=[14, 9], block_size=8, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q)
    expected, _ = reference(*args, case.seq_lens)
    plain, _ = reference(*args, case.seq_lens, dtype="float16")
    ks, vs = gather_kv(case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    own = [(k[-n:], v[-n:]) for k, v, n in zip(ks, vs, case.q_lens)]
    chunk_only, _ = attention_varlen(
        case.q, np.concatenate([k for k, _ in own]), np.concatenate([v for _, v in own]),
        case.cu_seqlens_q, case.cu_seqlens_q, causal=True)
    top_left = np.concatenate([
        attention(case.q[None, a:b], k[None], v[None], window_size=(-1, b - a - k.shape[0]))[0][0]
        for a, b, k, v in zip(case.cu_seqlens_q[:-1], case.cu_seqlens_q[1:], ks, vs)])
    for wrong in (chunk_only, top_left):
        with pytest.raises(AssertionError, match="differ by more than the tolerance"):
            derived_check(wrong, expected, plain, allowance=2.0 ** -11)


# ---- simulator (and GPU) tests ------------------------------------------------------------

@settings(max_examples=12)
@given(case=prefill_cases(block_sizes=(4, 8, 16, 32), headdims=(16, 16, 32), max_batch=2,
                          max_nheads_k=2, groups=(1, 2), max_prior=30, max_q=20),
       window=st.sampled_from([-1, -1, 5]))
def test_matches_reference(case, window):
    Case(np.random.default_rng(_seed(case)), **case).check(window_size=(window, -1))


def test_prior_context_two_warps_gqa_short_pages(rng):
    """Chunks after earlier tokens (pages of 8 keys: a 16-key tile spans two, read through the
    table row by row), GQA 3, two warps of query rows, bf16."""
    case = Case(rng, q_lens=[19, 6], seq_lens=[40, 23], block_size=8, nheads=3, nheads_k=1,
                headdim=16, dtype="bfloat16")
    with overrides(paged_prefill={"config": TC_TWO_WARPS}):
        case.check()


def test_two_m_tiles_padded_headdim_window(rng):
    """Two m16 tiles a warp, headdim 24 (padded to 32 in shared memory: columns zero-filled,
    never written), a window cutting inside the chunk, softmax_scale given."""
    case = Case(rng, q_lens=[21], seq_lens=[37], block_size=16, nheads=2, nheads_k=2,
                headdim=24, dtype="float16")
    with overrides(paged_prefill={"config": TC_TWO_TILES}):
        case.check(window_size=(7, 0), softmax_scale=0.3)


def test_whole_sequence_is_causal_prefill(rng):
    """No earlier tokens (q_len == seq_len): ordinary causal prefill; a sequence of 1, ragged
    lengths, and rows before the first sequence left unwritten."""
    case = Case(rng, q_lens=[13, 1, 18], seq_lens=[13, 1, 18], block_size=16, nheads=2,
                nheads_k=1, headdim=16, dtype="float16", lead=3)
    case.check()


def test_one_query_equals_decode(rng):
    """q_len 1 over a long prior context is a decode step: the same result as
    paged_decode_attention on the same cache (both within the derived tolerance of the
    reference, and within a bf16 ulp of the largest output of each other)."""
    case = Case(rng, q_lens=[1, 1], seq_lens=[45, 9], block_size=16, nheads=4, nheads_k=2,
                headdim=32, dtype="bfloat16")
    out, lse = case.check()
    q, kc, vc, bt, _, sl = case.device()
    decode, decode_lse = paged_decode_attention(q, kc, vc, bt, sl, return_lse=True)
    a, b = f64(out), f64(to_host(decode))
    assert np.abs(a - b).max() <= 2.0 ** -7 * np.abs(b).max()   # a bf16 ulp at the largest
    np.testing.assert_allclose(lse, f64(to_host(decode_lse)).T, rtol=1e-5, atol=1e-5)


def test_non_causal_and_empty_rows(rng):
    """causal=False (every key of the sequence, the chunk's later tokens too); a sequence
    shorter than its chunk (its first queries attend nothing: 0 and lse -inf) and an empty
    chunk."""
    case = Case(rng, q_lens=[6, 0, 5], seq_lens=[20, 4, 3], block_size=8, nheads=1, nheads_k=1,
                headdim=16, dtype="bfloat16")
    case.check(causal=False)
    out, lse = case.check()
    assert np.all(f64(out)[6:8] == 0) and np.all(np.isneginf(lse[:, 6:8]))


def test_packed_qkv_strides(rng):
    """q sliced out of a packed qkv (strided rows) reaches the kernel without a copy."""
    case = Case(rng, q_lens=[7, 5], seq_lens=[7, 30], block_size=16, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    qkv = random_array((case.q.shape[0], 4, 16), "float16", rng)
    qkv[:, :2] = case.q
    case.q = qkv[:, :2]
    q = to_device(qkv, KIND)[:, :2]
    out, _ = case.run(q=q)
    expected, _ = reference(case.q, case.k_cache, case.v_cache, case.block_table,
                            case.cu_seqlens_q, case.seq_lens)
    plain, _ = reference(case.q, case.k_cache, case.v_cache, case.block_table,
                         case.cu_seqlens_q, case.seq_lens, dtype="float16")
    derived_check(f64(out), expected, plain, allowance=2.0 ** -11)


def test_any_table_contents_are_memory_safe(rng):
    """With the checks off, page ids, lengths and query offsets out of range are clamped:
    the kernel runs without reading out of bounds (the simulator raises on any bad index) and
    writes finite values where the clamped rows land."""
    case = Case(rng, q_lens=[5, 4], seq_lens=[9, 20], block_size=8, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    case.k_cache[np.isnan(case.k_cache)] = 1.0
    case.v_cache[np.isnan(case.v_cache)] = 1.0
    q, kc, vc, _, _, _ = case.device()
    bt = to_device(np.array([[-7, 99, 2**31 - 1, 0], [3, -1, 1000, 5]], np.int32), KIND)
    cu = to_device(np.array([-4, 6, 2], np.int32), KIND)       # below 0, decreasing
    sl = to_device(np.array([10**6, -3], np.int32), KIND)      # past the capacity, negative
    out = paged_prefill_attention(q, kc, vc, bt, cu, sl, 5, check_bounds=False)
    assert np.isfinite(f64(out)[:6]).all()


def test_zero_sizes(rng):
    """No sequences, or no query rows at all: nothing to launch."""
    case = Case(rng, q_lens=[0], seq_lens=[5], block_size=8, nheads=1, nheads_k=1, headdim=16,
                dtype="float16")
    q, kc, vc, bt, cu, sl = case.device()
    out, lse = paged_prefill_attention(q, kc, vc, bt, cu, sl, 0, return_lse=True)
    assert to_host(out).shape == (0, 1, 16) and to_host(lse).shape == (1, 0)
    empty = to_device(np.zeros((0, 4), np.int32), KIND)
    out = paged_prefill_attention(q, kc, vc, empty, to_device(np.zeros(1, np.int32), KIND),
                                  to_device(np.zeros(0, np.int32), KIND), 0)
    assert to_host(out).shape == (0, 1, 16)


def test_bad_inputs(rng):
    case = Case(rng, q_lens=[3, 2], seq_lens=[10, 6], block_size=8, nheads=2, nheads_k=1,
                headdim=16, dtype="float16")
    q, kc, vc, bt, cu, sl = case.device()

    def dev(x):
        return to_device(np.asarray(x), KIND)

    half = dict(dtype="float16")
    cases = [
        (TypeError, "q: expected dtype in", (dev(case.q.astype(np.float32)),), {}),
        (ValueError, "q: expected 3 dimensions", (dev(case.q[None]),), {}),
        (ValueError, "k_cache: expected 4 dimensions", (q, dev(case.k_cache[0])), {}),
        (ValueError, "k_cache: expected shape .* to match q's headdim",
         (q, dev(np.ones((4, 8, 1, 32), **half))), {}),
        (ValueError, "v_cache: expected shape .* to match k_cache",
         (q, kc, dev(np.ones((6, 8, 1, 16), **half))), {}),
        (TypeError, "v_cache: expected dtype float16 to match q",
         (q, kc, dev(case.v_cache.astype(np.float32))), {}),
        (ValueError, "k_cache: expected nheads_k dividing",
         (q, dev(np.ones((4, 8, 3, 16), **half)), dev(np.ones((4, 8, 3, 16), **half))), {}),
        (ValueError, "seq_lens: expected shape \\(2,\\) to match block_table's batch",
         (q, kc, vc, bt, cu, dev(np.array([1, 2, 3], np.int32))), {}),
        (ValueError, "cu_seqlens_q: expected shape \\(3,\\)",
         (q, kc, vc, bt, dev(np.array([0, 3], np.int32))), {}),
        (TypeError, "block_table: expected dtype int32, got int64",
         (q, kc, vc, dev(case.block_table.astype(np.int64))), {}),
        (TypeError, "cu_seqlens_q: expected dtype int32",
         (q, kc, vc, bt, dev(case.cu_seqlens_q.astype(np.int64))), {}),
        (NotImplementedError, "k_cache: block_size 12 is not supported",
         (q, dev(np.ones((4, 12, 1, 16), **half)), dev(np.ones((4, 12, 1, 16), **half))), {}),
        (NotImplementedError, "q: headdim 264 is not supported",
         (dev(np.ones((5, 2, 264), **half)), dev(np.ones((4, 8, 1, 264), **half)),
          dev(np.ones((4, 8, 1, 264), **half))), {}),
        (TypeError, "max_seqlen_q: expected an int", (), {"max_seqlen_q": 3.0}),
        (ValueError, "max_seqlen_q: expected at least the longest sequence \\(3\\)", (),
         {"max_seqlen_q": 2}),
        (TypeError, "causal: expected a bool", (), {"causal": 1}),
        (TypeError, "return_lse: expected a bool", (), {"return_lse": "yes"}),
        (TypeError, "check_bounds: expected a bool", (), {"check_bounds": 1}),
        (ValueError, "softmax_scale: expected a finite number > 0", (), {"softmax_scale": 0.0}),
        (ValueError, "window_size\\[0\\]: expected -1", (), {"window_size": (-2, 0)}),
        (ValueError, "out: expected shape", (), {"out": dev(np.ones((5, 2, 8), **half))}),
        (TypeError, "out: expected dtype float16", (),
         {"out": dev(np.ones((5, 2, 16), np.float32))}),
        (ValueError, "seq_lens: expected lengths in \\[0, 24\\]", (),
         {"seq_lens": dev(np.array([10, 25], np.int32))}),
        (ValueError, "block_table: expected page ids in \\[0, 5\\)", (),
         {"block_table": dev(np.array([[0, 1], [9, 2]], np.int32))}),
        (ValueError, "cu_seqlens_q: expected non-decreasing offsets", (),
         {"cu_seqlens_q": dev(np.array([0, 4, 3], np.int32))}),
        (ValueError, "cu_seqlens_q: last offset 6 exceeds the 5 packed tokens", (),
         {"cu_seqlens_q": dev(np.array([0, 3, 6], np.int32)), "max_seqlen_q": 3}),
    ]
    names = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens")
    # contents (lengths, page ids, offsets) are checked by default only under the simulator
    # (host memory); on a GPU the caller asks for the host read-back
    defaults = dict(zip(names, (q, kc, vc, bt, cu, sl)), max_seqlen_q=3, check_bounds=True)
    for error, match, args, kwargs in cases:
        call = dict(defaults, **dict(zip(names, args)))
        call.update(kwargs)
        with pytest.raises(error, match=match):
            paged_prefill_attention(**call)
    strided = to_device(np.ones((5, 2, 32), np.float16), KIND)[:, :, ::2]
    with pytest.raises(ValueError, match="q: expected the last dimension to be contiguous"):
        paged_prefill_attention(strided, kc, vc, bt, cu, sl, 3)
    misaligned = to_device(np.ones((5, 2, 20), np.float16), KIND)[:, :, 4:]
    with pytest.raises(ValueError, match="q: expected a 16-byte aligned pointer"):
        paged_prefill_attention(misaligned, kc, vc, bt, cu, sl, 3)


# ---- GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=30)
@given(case=prefill_cases(block_sizes=(8, 16, 32, 64, 128), headdims=(64, 128), max_batch=4,
                          max_nheads_k=4, groups=(1, 2, 4), max_prior=700, max_q=300),
       window=st.sampled_from([-1, -1, 100]))
def test_gpu_matches_reference(case, window):
    Case(np.random.default_rng(_seed(case)), **case).check(window_size=(window, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_long_context_chunks(headdim, dtype):
    """Engine-like shapes: a 512-token chunk after 1500 tokens beside a fresh 300-token prompt
    and a decode-like single query, 16-token pages, GQA 4."""
    rng = np.random.default_rng(headdim + len(dtype))
    case = Case(rng, q_lens=[512, 300, 1], seq_lens=[2012, 300, 777], block_size=16,
                nheads=8, nheads_k=2, headdim=headdim, dtype=dtype)
    case.check()
