"""The decode step's host inputs (issue 19): ``PageAllocator.host_tables`` (a gather from the
allocator's NumPy page rows) and ``ModelRunner._params`` (cached per-request sampling rows) equal
the straightforward loops they replaced, bit for bit and dtype for dtype, on random page lists,
widths and sampling parameters, with sequences that grow, are freed and have their pages and rows
reused, and requests whose parameters or seeds change."""

import random

import numpy as np
import pytest

from llmspeed_numba.engine.runner import ModelRunner, row_seed
from llmspeed_numba.engine.sampling_params import SamplingParams
from llmspeed_numba.engine.scheduler import BatchEntry, Request
from llmspeed_numba.models.decode_graph import SAMPLING_PARAMS
from llmspeed_numba.paged_cache import NO_PAGE, OutOfPages, PageAllocator


def _reference_tables(alloc, seq_ids, lengths=None, width=None):
    """``host_tables`` as it was: the block table filled row by row from the page lists."""
    ids = list(seq_ids)
    most = max([len(alloc.pages(i)) for i in ids] + [1, alloc.max_blocks_per_seq or 1])
    width = most if width is None else int(width)
    table = np.full((len(ids), width), NO_PAGE, np.int32)
    for row, i in enumerate(ids):
        table[row, :len(alloc.pages(i))] = alloc.pages(i)
    lens = np.array([alloc.length(i) for i in ids] if lengths is None else lengths, np.int32)
    return table, lens


def _reference_params(entries):
    """``ModelRunner._params`` as it was: each row's tuple and seed built every step."""
    rows = []
    for e in entries:
        p = e.request.params
        position = e.start_position + e.num_new_tokens
        rows.append((p.temperature, p.top_k, p.top_p, p.min_p,
                     row_seed(e.request.sampling_seed, position)))
    cols = list(zip(*rows)) if rows else [()] * len(SAMPLING_PARAMS)
    return tuple(np.array(col, dtype) for col, (_, dtype) in zip(cols, SAMPLING_PARAMS))


def _same(got, want):
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.c_contiguous and got.flags.writeable
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("block_size, max_blocks", [(1, None), (4, None), (2, 40), (8, 3)])
def test_host_tables_equal_the_row_loop(block_size, max_blocks):
    rng = random.Random(block_size * 100 + (max_blocks or 0))
    alloc = PageAllocator(700, block_size, max_blocks_per_seq=max_blocks)
    live = []
    for step in range(400):
        op = rng.random()
        try:
            if op < 0.25 or not live:
                live.append(alloc.add_sequence(rng.randrange(0, 5 * block_size)))
            elif op < 0.5:
                alloc.extend(rng.sample(live, rng.randint(1, len(live))), rng.randrange(0, 40))
            elif op < 0.8:
                alloc.try_extend(rng.choice(live), rng.randrange(0, 3 * block_size))
            else:
                seq = rng.choice(live)
                alloc.free(seq)
                live.remove(seq)
        except (OutOfPages, ValueError):
            pass
        if not live:
            continue
        seqs = [rng.choice(live) for _ in range(rng.randint(1, min(len(live) + 3, 80)))]
        most = max([alloc.num_pages(s) for s in seqs] + [1, max_blocks or 1])
        assert most == max([len(alloc.pages(s)) for s in seqs] + [1, max_blocks or 1])
        for width in (None, most, most + rng.randrange(1, 300)):
            lengths = None if rng.random() < 0.7 else [rng.randrange(0, 99) for _ in seqs]
            got = alloc.host_tables(iter(seqs) if step % 2 else seqs, lengths=lengths,
                                    width=width)
            want = _reference_tables(alloc, seqs, lengths, width)
            for g, w in zip(got, want):
                _same(g, w)
            got[0][:] = 12345  # the result is a copy: the allocator's rows are untouched
    # many sequences over many pages: the allocator's table grew in both directions
    assert alloc._rows.shape[0] > 16 or alloc._rows.shape[1] > 16
    _same(alloc.host_tables([])[0], _reference_tables(alloc, [])[0])
    freed = alloc.add_sequence(1)
    alloc.free(freed)
    with pytest.raises(KeyError, match="no live sequence"):
        alloc.host_tables(live + [freed])
    with pytest.raises(ValueError, match="width: expected at least"):
        alloc.host_tables(live, width=0)


def _random_params(rng):
    return SamplingParams(
        temperature=rng.choice([0.0, 0, 1, 0.7, rng.uniform(0, 3), 1e-7]),
        top_k=rng.choice([0, 1, 50, rng.randrange(0, 2**31)]),
        top_p=rng.choice([1.0, 1, 0.9, rng.uniform(1e-6, 1)]),
        min_p=rng.choice([0.0, 0, 0.05, rng.uniform(0, 1)]),
        seed=rng.choice([None, 0, rng.randrange(2**62), rng.randrange(2**64)]))


def test_params_equal_the_row_loop():
    rng = random.Random(19)
    requests = []
    for i in range(40):
        params = _random_params(rng)
        request = Request(i, [1, 2, 3], params)
        request.sampling_seed = (params.seed if params.seed is not None
                                 else rng.choice([0, rng.randrange(2**62), rng.randrange(2**64)]))
        requests.append(request)
    positions = {id(r): rng.randrange(0, 5000) for r in requests}
    for step in range(60):
        batch = rng.sample(requests, rng.randint(0, len(requests)))
        entries = []
        for r in batch:
            new = rng.choice([1, 1, 1, rng.randrange(1, 64)])
            entries.append(BatchEntry(r, 0, new, positions[id(r)]))
            positions[id(r)] += new
        if step % 7 == 3:   # a request's parameters or seed change: its cached row follows
            r = rng.choice(requests)
            if rng.random() < 0.5:
                r.params = _random_params(rng)
            else:
                r.sampling_seed = rng.randrange(2**62)
        if step % 11 == 5:  # a preempted request recomputes from an earlier position
            positions[id(rng.choice(requests))] = 0
        got, want = ModelRunner._params(entries), _reference_params(entries)
        assert len(got) == len(want) == len(SAMPLING_PARAMS)
        for g, w in zip(got, want):
            _same(g, w)
    assert all(r.sampling_row is not None for r in requests)
    assert "sampling_row" not in repr(requests[0])
