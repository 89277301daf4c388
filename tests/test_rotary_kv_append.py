"""rotary_kv_append against the two ops it fuses, bit for bit: ``rotary_embedding`` of q and k,
then ``paged_kv_append`` of the rotated k and of v (each token a one-token sequence at its
position). Both are checked against float64 references in their own tests. q, k and v are
slices of one packed qkv buffer (aligned or not: the 16-byte and the scalar forms); the caches
are poisoned, so a slot written that the pair would not write (or one not written) shows; a
token without a page in range is rotated and not appended; bad input fails with clear errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmspeed_numba import SIMULATOR
from llmspeed_numba.ops.paged_kv_append import paged_kv_append
from llmspeed_numba.ops.rotary import rotary_embedding
from llmspeed_numba.ops.rotary_kv_append import rotary_kv_append
from llmspeed_numba.reference import fused as ref
from llmspeed_numba.testing import random_array
from rowwise_testing import dev, host
from test_rotary import small_blocks

NUM_BLOCKS = 12


def _case(rng, tokens, nh_q, nh_k, headdim, dtype, *, block_size=4, width=3, max_pos=12,
          pos_dtype="int32", unpaged=(), one_sequence=False, strided_tables=False):
    """Host arrays of a call: packed qkv, poisoned caches, page rows, positions. Each token has
    a page row of its own (distinct pages: no two tokens write one slot), or, ``one_sequence``,
    the tokens are positions 0, 1, ... of one sequence (a prefill: tokens share pages); tokens
    in ``unpaged`` get a page id out of range at their position; ``strided_tables``: the rows
    are every other column of a wider table."""
    qkv = random_array((tokens, nh_q + 2 * nh_k, headdim), dtype, rng)
    cache_shape = (NUM_BLOCKS, block_size, nh_k, headdim)
    poison = np.full(cache_shape, np.nan, qkv.dtype)
    if one_sequence:
        positions = np.arange(tokens).astype(pos_dtype)
        width = -(-tokens // block_size)
        tables = np.tile(rng.permutation(NUM_BLOCKS)[:width], (tokens, 1)).astype(np.int32)
    else:
        positions = rng.integers(0, min(max_pos, width * block_size),
                                 size=tokens).astype(pos_dtype)
        pages = rng.permutation(NUM_BLOCKS)[:tokens * width].reshape(tokens, width)
        tables = pages.astype(np.int32)
    for t in unpaged:
        tables[t, positions[t] // block_size] = NUM_BLOCKS + t
    if strided_tables:
        wide = np.full((tokens, 2 * tables.shape[1]), -7, np.int32)
        wide[:, ::2] = tables
        tables = wide[:, ::2]
    return qkv, poison, tables, positions


def _run_both(case, nh_q, nh_k, *, offset=0, **rotary):
    """(fused, pair): the host (qkv, k_cache, v_cache) after rotary_kv_append, and after
    rotary_embedding + paged_kv_append, from the same inputs."""
    qkv_h, poison, tables_h, positions_h = case
    results = []
    for fused in (True, False):
        qkv = dev(qkv_h, offset)
        q, k, v = qkv[:, :nh_q], qkv[:, nh_q:nh_q + nh_k], qkv[:, nh_q + nh_k:]
        kc, vc, positions = dev(poison), dev(poison), dev(positions_h)
        tables = dev(tables_h.base)[:, ::2] if tables_h.base is not None else dev(tables_h)
        if fused:
            got = rotary_kv_append(q, k, v, kc, vc, tables, positions, check_bounds=False,
                                   **rotary)
            assert got[0] is q and got[1] is k
        else:
            rotary_embedding(q, k, positions, check_bounds=False, **rotary)
            paged = [t for t in range(tables_h.shape[0])
                     if 0 <= tables_h[t, positions_h[t] // poison.shape[1]] < NUM_BLOCKS]
            if paged:   # paged_kv_append's own bounds check stops at a page out of range
                sel = np.array(paged)
                k_rows = dev(host(k)[sel][:, None])
                v_rows = dev(host(v)[sel][:, None])
                paged_kv_append(k_rows, v_rows, kc, vc, dev(tables_h[sel]),
                                dev(positions_h[sel].astype(np.int32)))
        results.append([host(a) for a in (qkv, kc, vc)])
    return results


def _assert_same(fused, pair):
    for name, a, b in zip(("qkv", "k_cache", "v_cache"), fused, pair):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), name


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("offset", [0, 1])
def test_equals_rotary_then_append(style, offset, rng):
    """Cached cos / sin (bf16) and computed ones; aligned (16-byte form) and misaligned."""
    with small_blocks():
        for cache in (None, "bfloat16"):
            rotary = dict(style=style)
            if cache is not None:
                rotary["cos_sin_cache"] = dev(ref.rotary_cache(12, 16, 10000.0, cache))
            case = _case(rng, 3, 4, 2, 16, "bfloat16")
            _assert_same(*_run_both(case, 4, 2, offset=offset, **rotary))


@pytest.mark.parametrize("style,headdim,rotary_dim,dtype", [
    ("neox", 24, 8, "float16"),      # scalar form (half a rotary part is 4 elements)
    ("neox", 32, 16, "bfloat16"),    # 16-byte form: k's tail copied in chunks
    ("gptj", 16, 8, "float16")])
def test_partial_rotary_and_unpaged_tokens(style, headdim, rotary_dim, dtype, rng):
    """rotary_dim < headdim (k's last elements copied unrotated into the cache), int64
    positions; token 1 has no page in range: rotated, not appended."""
    with small_blocks():
        case = _case(rng, 3, 2, 1, headdim, dtype, pos_dtype="int64", unpaged=(1,))
        _assert_same(*_run_both(case, 2, 1, rotary_dim=rotary_dim, style=style))


def test_one_sequence_and_strided_tables(rng):
    """A prefill's layout (consecutive positions of one sequence sharing pages), its page rows
    a column-strided view of a wider table."""
    with small_blocks():
        case = _case(rng, 6, 2, 2, 16, "bfloat16", block_size=2, one_sequence=True,
                     strided_tables=True)
        _assert_same(*_run_both(case, 2, 2, style="neox"))


def test_position_outside_the_cos_sin_cache(rng):
    """Unchecked, a token past the cache's rows is neither rotated nor appended (the pair would
    append its unrotated k); the other tokens are as the pair leaves them."""
    with small_blocks():
        qkv_h, poison, tables_h, positions_h = _case(rng, 3, 2, 1, 16, "bfloat16")
        positions_h[1] = 12                   # the cache below has 12 rows
        tables_h = np.concatenate([tables_h, np.zeros((3, 1), np.int32)], 1)  # a page there
        tables_h[1, 3] = 11
        cos_sin = dev(ref.rotary_cache(12, 16, 10000.0, "bfloat16"))
        qkv = dev(qkv_h)
        kc, vc = dev(poison), dev(poison)
        rotary_kv_append(qkv[:, :2], qkv[:, 2:3], qkv[:, 3:], kc, vc, dev(tables_h),
                         dev(positions_h), cos_sin_cache=cos_sin, check_bounds=False)
        got, k_cache = host(qkv), host(kc)
        assert np.array_equal(got[1].view(np.uint16), qkv_h[1].view(np.uint16))
        assert np.isnan(k_cache[11].astype(np.float32)).all()
        for t in (0, 2):
            page, slot = tables_h[t, positions_h[t] // 4], positions_h[t] % 4
            assert np.array_equal(k_cache[page, slot].view(np.uint16),
                                  got[t, 2:3].view(np.uint16))


@settings(max_examples=8 if SIMULATOR else 50, deadline=None)
@given(tokens=st.integers(1, 4), nh_q=st.integers(1, 4), nh_k=st.integers(1, 2),
       headdim=st.sampled_from((8, 16, 32)), partial=st.booleans(),
       style=st.sampled_from(("neox", "gptj")), dtype=st.sampled_from(("float16", "bfloat16")),
       block_size=st.sampled_from((1, 2, 4)), offset=st.sampled_from((0, 1)),
       cached=st.booleans(), pos_dtype=st.sampled_from(("int32", "int64")),
       strided=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_hypothesis(tokens, nh_q, nh_k, headdim, partial, style, dtype, block_size, offset,
                    cached, pos_dtype, strided, seed):
    rng = np.random.default_rng(seed)
    rotary_dim = headdim // 2 if partial else headdim
    rotary = dict(style=style, rotary_dim=rotary_dim)
    if cached:
        rotary["cos_sin_cache"] = dev(ref.rotary_cache(12, rotary_dim, 10000.0, dtype))
    with small_blocks():
        case = _case(rng, tokens, nh_q, nh_k, headdim, dtype, block_size=block_size,
                     pos_dtype=pos_dtype, strided_tables=strided)
        _assert_same(*_run_both(case, nh_q, nh_k, offset=offset, **rotary))


def test_bad_inputs(rng):
    qkv_h, poison, tables_h, positions_h = _case(rng, 2, 2, 1, 16, "float16")
    qkv = dev(qkv_h)
    q, k, v = qkv[:, :2], qkv[:, 2:3], qkv[:, 3:]
    kc, vc, tables, positions = dev(poison), dev(poison), dev(tables_h), dev(positions_h)
    with pytest.raises(TypeError, match="k: expected an array"):
        rotary_kv_append(q, None, v, kc, vc, tables, positions)
    with pytest.raises(ValueError, match=r"v: expected shape \(2, 1, 16\) to match k"):
        rotary_kv_append(q, k, qkv[:, 2:4], kc, vc, tables, positions)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        rotary_kv_append(q, k, v, dev(poison[:, :, :, :8]), vc, tables, positions)
    with pytest.raises(TypeError, match="token_tables: expected dtype int32"):
        rotary_kv_append(q, k, v, kc, vc, dev(tables_h.astype(np.int64)), positions)
    with pytest.raises(ValueError, match=r"token_tables: expected shape \(2, \*\)"):
        rotary_kv_append(q, k, v, kc, vc, dev(tables_h[:1]), positions)
    with pytest.raises(TypeError, match="check_bounds: expected a bool"):
        rotary_kv_append(q, k, v, kc, vc, tables, positions, check_bounds=1)
    bad = tables_h.copy()
    bad[0, positions_h[0] // 4] = -1
    with pytest.raises(ValueError, match=r"token_tables: expected page ids in \[0, 12\)"):
        rotary_kv_append(q, k, v, kc, vc, dev(bad), positions, check_bounds=True)
    far = positions_h.copy()
    far[1] = 12
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 12\)"):
        rotary_kv_append(q, k, v, kc, vc, tables, dev(far), check_bounds=True)
    with pytest.raises(ValueError, match="style: expected one of"):
        rotary_kv_append(q, k, v, kc, vc, tables, positions, style="half")
    with pytest.raises(TypeError, match="v: expected dtype float16"):
        rotary_kv_append(q, k, dev(qkv_h[:, 3:].astype(np.float32)), kc, vc, tables, positions)
    with pytest.raises(TypeError, match="k: expected dtype in"):
        rotary_kv_append(dev(qkv_h[:, :2].astype(np.float32)),
                         dev(qkv_h[:, 2:3].astype(np.float32)),
                         dev(qkv_h[:, 3:].astype(np.float32)), kc, vc, tables, positions)
    odd = np.full((NUM_BLOCKS, 3, 1, 16), np.nan, np.float16)
    with pytest.raises(NotImplementedError, match="block_size 3 is not supported"):
        rotary_kv_append(q, k, v, dev(odd), dev(odd), tables, positions)
