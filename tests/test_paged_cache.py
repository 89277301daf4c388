"""The host page allocator ``PagedKVCache`` (``llmspeed_numba/paged_cache.py``): bookkeeping,
OutOfPages, tables, and append-then-decode round trips against attention over the original
contiguous K/V."""

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR
from llmspeed_numba.ops.paged_decode import paged_decode_attention
from llmspeed_numba.paged_cache import NO_PAGE, OutOfPages, PageAllocator, PagedKVCache
from llmspeed_numba.reference.attention import attention
from llmspeed_numba.testing import derived_check, f64, random_array, to_device, to_host


def test_pages_handed_out_and_reused():
    cache = PagedKVCache(num_blocks=6, block_size=8, nheads_k=1, headdim=16)
    a = cache.add_sequence(9)          # 2 pages
    b = cache.add_sequence()           # 0 pages
    assert cache.pages(a) == [0, 1] and cache.pages(b) == []
    assert cache.num_free_pages == 4
    cache.extend(b, 8)                 # exactly one page
    cache.extend(a, 7)                 # 16 tokens: still 2 pages
    assert cache.pages(b) == [2] and cache.pages(a) == [0, 1] and cache.length(a) == 16
    cache.extend([a, b], 1)            # a: 17 -> 3 pages, b: 9 -> 2 pages
    assert cache.num_free_pages == 1 and cache.length(b) == 9
    cache.free(a)
    assert cache.num_free_pages == 4 and cache.sequences == [b]
    c = cache.add_sequence(24)         # reuses a's pages, first freed first
    assert sorted(cache.pages(c)) == [0, 1, 3]
    with pytest.raises(KeyError, match="no live sequence"):
        cache.length(a)
    with pytest.raises(KeyError):
        cache.free(a)


def test_out_of_pages_is_clear_and_atomic():
    cache = PagedKVCache(num_blocks=4, block_size=16, nheads_k=2, headdim=16)
    a = cache.add_sequence(30)
    b = cache.add_sequence(10)
    with pytest.raises(OutOfPages, match="need 3 more page.*1 of 4 are free.*free finished"):
        cache.extend([a, b], 20)       # a needs 2 pages, b 1: 3 > 1 free
    assert issubclass(OutOfPages, RuntimeError)
    assert cache.length(a) == 30 and cache.length(b) == 10 and cache.num_free_pages == 1
    with pytest.raises(OutOfPages):
        cache.add_sequence(100)
    assert cache.sequences == [a, b]
    cache.extend(b, 22)                # 32 tokens: the last free page
    assert cache.num_free_pages == 0


def test_max_blocks_per_seq_and_bad_arguments():
    cache = PagedKVCache(num_blocks=8, block_size=8, nheads_k=1, headdim=16,
                         max_blocks_per_seq=2)
    s = cache.add_sequence(16)
    with pytest.raises(ValueError, match="max_blocks_per_seq 2"):
        cache.extend(s, 1)
    with pytest.raises(ValueError, match="new_tokens"):
        cache.extend(s, -1)
    with pytest.raises(ValueError, match="distinct"):
        cache.extend([s, s], 0)
    with pytest.raises(ValueError, match="block_size: expected a power of two"):
        PagedKVCache(4, 12, 1, 16)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(0, 8, 1, 16)
    with pytest.raises(TypeError, match="headdim"):
        PagedKVCache(4, 8, 1, 16.0)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(4, 8, 1, 16, dtype="float32")
    with pytest.raises(ValueError, match="kind"):
        PagedKVCache(4, 8, 1, 16, kind="jax")
    with pytest.raises(TypeError, match="^dtype: expected float16 or bfloat16, got float32$"):
        PagedKVCache(4, 8, 1, 16, dtype=np.float32)
    with pytest.raises(TypeError, match="dtype: expected a dtype"):
        PagedKVCache(4, 8, 1, 16, dtype=None)
    with pytest.raises(TypeError, match="max_blocks_per_seq: expected an int or None, got float"):
        PagedKVCache(4, 8, 1, 16, max_blocks_per_seq=1.5)
    with pytest.raises(ValueError, match="max_blocks_per_seq: expected a positive int"):
        PagedKVCache(4, 8, 1, 16, max_blocks_per_seq=0)


def test_dtype_given_as_numpy_ml_dtypes_or_torch():
    import ml_dtypes

    dtypes = [np.float16, np.dtype(np.float16), ml_dtypes.bfloat16, "bfloat16"]
    try:
        import torch
    except ImportError:  # torch is optional: the NumPy forms still run
        torch = None
    if torch is not None:
        dtypes += [torch.float16, torch.bfloat16]
    for dtype in dtypes:
        kind = "torch" if not SIMULATOR and "bfloat16" in str(dtype) else "numba"
        cache = PagedKVCache(2, 8, 1, 16, dtype=dtype, kind=kind)
        assert cache.dtype == ("bfloat16" if "bfloat16" in str(dtype) else "float16")
        assert to_host(cache.k_cache).dtype.name == cache.dtype


def test_tables():
    cache = PagedKVCache(num_blocks=10, block_size=8, nheads_k=1, headdim=16)
    a = cache.add_sequence(3)
    b = cache.add_sequence(20)
    table, lens = cache.host_tables([b, a])
    assert table.dtype == np.int32 and lens.dtype == np.int32
    np.testing.assert_array_equal(table, [[1, 2, 3], [0, NO_PAGE, NO_PAGE]])
    np.testing.assert_array_equal(lens, [20, 3])
    table, _ = cache.host_tables([a], width=4)
    assert table.shape == (1, 4)
    with pytest.raises(ValueError, match="width: expected at least 3"):
        cache.host_tables([a, b], width=2)
    bt, sl = cache.tables([a, b])
    np.testing.assert_array_equal(to_host(sl), [3, 20])
    assert to_host(bt).shape == (2, 3)


def _attention_over_history(q, history_k, history_v, dtype):
    """Reference decode of q (batch, q_len, h, d) over the full contiguous K/V history."""
    outs, plains = [], []
    for b in range(q.shape[0]):
        k = np.concatenate(history_k[b])[None]
        v = np.concatenate(history_v[b])[None]
        outs.append(attention(q[b:b + 1], k, v, causal=True)[0])
        plains.append(attention(q[b:b + 1], k, v, causal=True, dtype=dtype)[0])
    return np.concatenate(outs), np.concatenate(plains)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_append_decode_free_reuse(rng, dtype):
    """Prefill two sequences of different lengths, decode a step for both, free one, start a
    new sequence in its pages, decode again: each time equal to attention over the history."""
    nheads_k, group, headdim, block_size = 1, 2, 16, 8
    # on a GPU numba device arrays cannot hold bfloat16 (the cache refuses them): torch there
    kind = "torch" if dtype == "bfloat16" and not SIMULATOR else "numba"
    cache = PagedKVCache(num_blocks=8, block_size=block_size, nheads_k=nheads_k,
                         headdim=headdim, dtype=dtype, kind=kind)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    hist_k = {s: [] for s in seqs}
    hist_v = {s: [] for s in seqs}

    def step(ids, n):
        k = random_array((len(ids), n, nheads_k, headdim), dtype, rng)
        v = random_array((len(ids), n, nheads_k, headdim), dtype, rng)
        for row, s in enumerate(ids):
            hist_k[s].append(f64(k[row]))
            hist_v[s].append(f64(v[row]))
        bt, sl = cache.append(ids, to_device(k, kind), to_device(v, kind))
        q = random_array((len(ids), n, nheads_k * group, headdim), dtype, rng)
        out = paged_decode_attention(to_device(q, kind), cache.k_cache, cache.v_cache, bt, sl)
        want, plain = _attention_over_history(f64(q), [hist_k[s] for s in ids],
                                              [hist_v[s] for s in ids], dtype)
        derived_check(f64(out), want, plain)

    # prefill: both sequences take 11 tokens (the lengths differ from the next step on)
    step(seqs, 11)
    step(seqs, 2)
    assert [cache.length(s) for s in seqs] == [13, 13]
    cache.free(seqs[0])
    new = cache.add_sequence()
    hist_k[new], hist_v[new] = [], []
    step([seqs[1], new], 1)
    assert cache.length(new) == 1 and cache.length(seqs[1]) == 14
    with pytest.raises(OutOfPages):
        cache.append([seqs[1], new], to_device(random_array((2, 40, 1, 16), dtype, rng), kind),
                      to_device(random_array((2, 40, 1, 16), dtype, rng), kind))
    assert cache.length(new) == 1 and cache.length(seqs[1]) == 14


def test_append_shape_mismatch():
    cache = PagedKVCache(num_blocks=4, block_size=8, nheads_k=1, headdim=16)
    s = cache.add_sequence()
    k = to_device(np.zeros((2, 1, 1, 16), np.float16))
    with pytest.raises(ValueError, match="k: expected shape \\(1, new_tokens, 1, 16\\)"):
        cache.append([s], k, k)
    assert cache.length(s) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind,dtype", [("numba", "float16"), ("torch", "bfloat16"),
                                        ("torch", "float16"), ("cupy", "float16")])
def test_gpu_cache_kinds_round_trip(kind, dtype):
    pytest.importorskip("cupy" if kind == "cupy" else "torch")
    rng = np.random.default_rng(11)
    nheads_k, group, headdim = 8, 4, 128
    cache = PagedKVCache(num_blocks=512, block_size=16, nheads_k=nheads_k, headdim=headdim,
                         dtype=dtype, kind=kind)
    seqs = [cache.add_sequence() for _ in range(3)]
    hist_k = {s: [] for s in seqs}
    hist_v = {s: [] for s in seqs}
    for n in (700, 1, 3):
        k = random_array((3, n, nheads_k, headdim), dtype, rng)
        v = random_array((3, n, nheads_k, headdim), dtype, rng)
        for row, s in enumerate(seqs):
            hist_k[s].append(f64(k[row]))
            hist_v[s].append(f64(v[row]))
        bt, sl = cache.append(seqs, to_device(k, kind), to_device(v, kind))
        q = random_array((3, n, nheads_k * group, headdim), dtype, rng)
        if n > 8:
            q = q[:, -2:]  # decode the last two tokens of the prefill chunk
        out = paged_decode_attention(to_device(q, kind), cache.k_cache, cache.v_cache, bt, sl)
        want, plain = _attention_over_history(f64(q), [hist_k[s] for s in seqs],
                                              [hist_v[s] for s in seqs], dtype)
        derived_check(f64(out), want, plain)


def test_room_pages_needed_max_seq_len():
    alloc = PageAllocator(num_blocks=5, block_size=4)
    assert alloc.max_seq_len == 20 and alloc.room() == 20
    a = alloc.add_sequence(5)                        # 2 pages, 3 free slots in the last
    assert alloc.pages_needed(a, 3) == 0 and alloc.pages_needed(a, 4) == 1
    assert alloc.room(a) == 3 + 3 * 4 and alloc.room() == 12
    alloc.extend(a, alloc.room(a))                   # exactly fills the cache
    assert alloc.num_free_pages == 0 and alloc.room(a) == 0 and alloc.room() == 0
    with pytest.raises(OutOfPages):
        alloc.extend(a, 1)
    capped = PageAllocator(num_blocks=8, block_size=4, max_blocks_per_seq=3)
    b = capped.add_sequence(1)
    assert capped.max_seq_len == 12 and capped.room(b) == 11 and capped.room() == 12
    capped.extend(b, 11)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        capped.extend(b, capped.room(b) + 1)
    with pytest.raises(KeyError):
        capped.room(99)
    assert not capped.try_extend(b, 1) and capped.length(b) == 12     # max_blocks_per_seq
    c = alloc.add_sequence(0)
    assert not alloc.try_extend(c, 1) and alloc.length(c) == 0         # no free page
    alloc.free(a)
    assert alloc.try_extend(c, 3) and alloc.pages(c) == [0] and alloc.length(c) == 3
    assert alloc.try_extend(c, 1) and alloc.num_free_pages == 4


def test_extend_while_fits_is_try_extend_in_order_until_one_does_not_fit():
    alloc = PageAllocator(num_blocks=5, block_size=4)
    a, b, c, d = (alloc.add_sequence(n) for n in (3, 4, 4, 2))
    assert alloc.num_free_pages == 1
    # a fills its last page (no page taken), b crosses into the free page, c needs one more:
    # it and d (whose last page has room) stay as they were.
    assert alloc.extend_while_fits([a, b, c, d], 1) == 2
    assert [alloc.length(s) for s in (a, b, c, d)] == [4, 5, 4, 2]
    assert alloc.pages(b) == [1, 4] and alloc.num_free_pages == 0
    table, lens = alloc.host_tables([b])
    assert table.tolist() == [[1, 4]] and lens.tolist() == [5]
    assert alloc.extend_while_fits([d, a], 1) == 1 and alloc.length(d) == 3  # a is full
    assert alloc.extend_while_fits([], 1) == 0 and alloc.extend_while_fits([a], 0) == 1
    capped = PageAllocator(num_blocks=8, block_size=4, max_blocks_per_seq=1)
    e, f = capped.add_sequence(4), capped.add_sequence(1)
    assert capped.extend_while_fits([f, e, f], 1) == 1 and capped.length(f) == 2
    with pytest.raises(ValueError, match="new_tokens"):
        alloc.extend_while_fits([a], -1)
    with pytest.raises(KeyError, match="no live sequence"):
        alloc.extend_while_fits([99], 1)
