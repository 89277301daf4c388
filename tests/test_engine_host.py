"""The decode step's host inputs (issue 19): ``PageAllocator.host_tables`` (a gather from the
allocator's NumPy page rows) and ``ModelRunner._params`` (cached per-request sampling rows) equal
the straightforward loops they replaced, bit for bit and dtype for dtype, on random page lists,
widths and sampling parameters, with sequences that grow, are freed and have their pages and rows
reused, and requests whose parameters or seeds change; written into given arrays (``out=``) they
write the same bits there and nothing else. The CUDA-graph decode's staged inputs
(``StagedInputs``: one host buffer, one copy) hold, step after step as the batch grows and
shrinks, exactly the padded arrays the runner used to copy one by one, on the host and, after the
copy, on the device; and the engine decoding through them (``DecodeGraph`` without capture, off
the GPU), with its inputs written in place or arriving as other arrays (a tensor-parallel
worker's), samples the same tokens as the eager decode."""

import random
import types

import numpy as np
import pytest

from llmspeed_numba import SIMULATOR

from llmspeed_numba.engine.runner import BATCH_BUCKETS, ModelRunner, _bucket, row_seed
from llmspeed_numba.engine.sampling_params import SamplingParams
from llmspeed_numba.engine.scheduler import BatchEntry, Request
from llmspeed_numba.models.decode_graph import SAMPLING_PARAMS, StagedInputs
from llmspeed_numba.paged_cache import NO_PAGE, OutOfPages, PageAllocator

torch = pytest.importorskip("torch")


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
        assert alloc.most_pages(seqs) == max(len(alloc.pages(s)) for s in seqs)
        for width in (None, most, most + rng.randrange(1, 300)):
            lengths = None if rng.random() < 0.7 else [rng.randrange(0, 99) for _ in seqs]
            got = alloc.host_tables(iter(seqs) if step % 2 else seqs, lengths=lengths,
                                    width=width)
            want = _reference_tables(alloc, seqs, lengths, width)
            for g, w in zip(got, want):
                _same(g, w)
            got[0][:] = 12345  # the result is a copy: the allocator's rows are untouched
            # into given arrays: the same bits in their first rows, the others untouched
            extra = rng.randrange(0, 4)
            out = (np.full((len(seqs) + extra, want[0].shape[1]), -7, np.int32),
                   np.full(len(seqs) + extra, -7, np.int32))
            written = alloc.host_tables(seqs, lengths=lengths,
                                        width=None if width is None and rng.random() < 0.5
                                        else want[0].shape[1], out=out)
            for g, w, o in zip(written, want, out):
                assert g.base is o or g is o
                assert g.tobytes() == w.tobytes() and g.shape == w.shape
                assert (o[len(seqs):] == -7).all()
    # many sequences over many pages: the allocator's table grew in both directions
    assert alloc._rows.shape[0] > 16 or alloc._rows.shape[1] > 16
    _same(alloc.host_tables([])[0], _reference_tables(alloc, [])[0])
    freed = alloc.add_sequence(1)
    alloc.free(freed)
    with pytest.raises(KeyError, match="no live sequence"):
        alloc.host_tables(live + [freed])
    with pytest.raises(KeyError, match="no live sequence"):
        alloc.most_pages(live + [freed])
    assert alloc.most_pages([]) == 0
    with pytest.raises(ValueError, match="width: expected at least"):
        alloc.host_tables(live, width=0)
    width = max(alloc.num_pages(s) for s in live) + 1
    for bad, match in [((np.zeros((len(live) - 1, width), np.int32), np.zeros(99, np.int32)),
                        r"out\[0\]: expected an int32 NumPy array of shape \(rows, \d+\)"),
                       ((np.zeros((99, width), np.int64), np.zeros(99, np.int32)), r"out\[0\]"),
                       ((np.zeros((99, width), np.int32), [0] * 99), r"out\[1\].*got list")]:
        with pytest.raises(ValueError, match=match):
            alloc.host_tables(live, width=width, out=bad)


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
        out = tuple(np.full(len(entries) + 3, 99, dtype) for _, dtype in SAMPLING_PARAMS)
        assert ModelRunner._params(entries, out=out) is out
        for o, w in zip(out, want):
            assert o[:len(entries)].tobytes() == w.tobytes() and (o[len(entries):] == 99).all()
    assert all(r.sampling_row is not None for r in requests)
    assert "sampling_row" not in repr(requests[0])


# ---- the CUDA-graph decode's staged inputs --------------------------------------------------

class _Runner(ModelRunner):
    """``ModelRunner``'s host side over ``alloc`` (no model)."""

    def __init__(self, alloc, scratch_page):
        self.cache, self.scratch_page, self.max_width = alloc, scratch_page, 1 << 20


def _reference_decode_inputs(runner, entries):
    """The graph decode's inputs as the runner built them before staging: each array made,
    padded to the batch bucket by concatenation, then copied to the device one by one."""
    alloc = runner.cache
    seqs = [e.seq_id for e in entries]
    longest = max(alloc.num_pages(s) for s in seqs)
    table, seq_lens = _reference_tables(alloc, seqs, width=runner._width(longest))
    tokens = np.array([e.token_ids[0] for e in entries], np.int64)
    positions = np.array([e.start_position for e in entries], np.int32)
    params = _reference_params(entries)
    pad = _bucket(len(entries), BATCH_BUCKETS) - len(entries)
    tokens = np.concatenate([tokens, np.zeros(pad, np.int64)])
    positions = np.concatenate([positions, np.zeros(pad, np.int32)])
    table = np.concatenate([table, np.full((pad, table.shape[1]), runner.scratch_page,
                                           np.int32)])
    seq_lens = np.concatenate([seq_lens, np.ones(pad, np.int32)])
    params = tuple(np.concatenate([col, np.zeros(pad, col.dtype)]) for col in params)
    return (tokens, positions, table, seq_lens) + params


def test_staged_inputs_equal_the_padded_arrays_step_after_step():
    rng = random.Random(7)
    alloc = PageAllocator(2000, 4)
    scratch = alloc.pages(alloc.add_sequence(1))[0]
    runner = _Runner(alloc, scratch)
    requests, staged = [], {}
    for i in range(40):
        request = Request(i, [rng.randrange(50000) for _ in range(rng.randrange(1, 30))],
                          _random_params(rng))
        request.sampling_seed = rng.randrange(2**62)
        request.output_token_ids = [rng.randrange(50000) for _ in range(rng.randrange(0, 4))]
        request.seq_id = alloc.add_sequence(request.num_tokens - 1)
        requests.append(request)
    names = ["token_ids", "positions", "table", "seq_lens"] + [n for n, _ in SAMPLING_PARAMS]
    # batches that grow and shrink within a bucket, so padding rows are left stale and refilled
    for size in [5, 8, 6, 3, 7, 1, 2, 2, 16, 9, 12, 3, 40, 33, 17, 40]:
        batch = rng.sample(requests, size)
        entries = [BatchEntry(r, r.seq_id, 1, r.num_tokens - 1) for r in batch]
        want = _reference_decode_inputs(runner, entries)
        rows, width = want[0].shape[0], want[2].shape[1]
        inputs = staged.get((rows, width))
        if inputs is None:
            inputs = staged[rows, width] = StagedInputs(rows, width, sampling=True,
                                                        device="cpu", pad_page=scratch)
        runner._stage(entries, [e.seq_id for e in entries], inputs.writable())
        host = (inputs.token_ids, inputs.positions, inputs.table, inputs.seq_lens) + inputs.params
        for name, got, w in zip(names, host, want):
            assert got.dtype == w.dtype and got.shape == w.shape, name
            assert got.tobytes() == w.tobytes(), name
        inputs.copy()
        for name, w in zip(names, want):
            device = inputs.on_device[name]
            assert device.numpy().tobytes() == w.tobytes() and device.shape == w.shape, name
        inputs.copied()
        for r in batch:  # each request decoded one more token
            r.output_token_ids.append(rng.randrange(50000))
            alloc.extend([r.seq_id], 1)
    assert len(staged) > 3


def test_graph_decode_through_staged_inputs_samples_the_eager_tokens():
    """The engine with its decode steps run through ``DecodeGraph`` (staged inputs, padded
    batches; no capture off the GPU) draws the same tokens as the eager decode, with requests
    finishing at different steps so the batch shrinks across buckets."""
    from test_engine import KV_CACHE_MEMORY

    from llmspeed_numba import LLM
    from llmspeed_numba.models.random_model import preset_config

    config = preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    sampling = [SamplingParams(max_tokens=4, temperature=0.8, seed=1),
                SamplingParams(max_tokens=2, temperature=1.0, top_k=5, seed=2),
                SamplingParams(max_tokens=3, top_p=0.9, temperature=0.7, seed=3)]
    outs, chained = [], []
    for graphs in (False, "staged", "copied"):
        # "staged" chains steps (async scheduling: token ids copied on the device); "copied"
        # runs each step alone, as a tensor-parallel worker does, its inputs as other arrays
        llm = LLM(config, load_format="dummy", max_num_seqs=4, seed=0,
                  kv_cache_memory=KV_CACHE_MEMORY, async_scheduling=graphs == "staged")
        llm.runner.cuda_graphs = bool(graphs)
        launch = llm.runner.launch_decode
        llm.runner.launch_decode = lambda entries, after=None, rows=None: (
            chained.append((after is not None, rows is not None)) or launch(entries, after, rows))
        if graphs == "copied":
            llm.runner.__class__ = _CopiedInputs
        outs.append([o.token_ids for o in llm.generate(prompts, sampling)])
        if graphs:
            assert {rows for rows, _ in llm.runner.graphs} == {1, 2, 4}
            # captured on a GPU; the simulator has no graphs, so each step ran through the bucket
            assert all((g.graph is None) == SIMULATOR for g in llm.runner.graphs.values())
    assert outs[0] == outs[1] == outs[2] and [len(t) for t in outs[0]] == [4, 2, 3]
    assert (True, False) in chained and (True, True) in chained  # row for row, and not


class _DeviceTokens:
    """A runner whose "model" draws token ``(31 * fed + 7 * position + seed) % 61`` for each
    row, so the engine's logic is tested without kernels: ``execute`` from the host's tokens;
    ``launch_decode`` / ``collect_decode`` as on a GPU, a chained launch taking its token ids
    from the launch before it (never from the requests, which then hold placeholders)."""

    chains = True

    def __init__(self):
        self.last_replayed, self.last_wait, self.last_gpu_idle = True, 0.0, None
        self.chained = 0

    @staticmethod
    def _draw(fed, positions, entries):
        return [(31 * t + 7 * p + e.request.sampling_seed) % 61
                for t, p, e in zip(fed, positions, entries)]

    def execute(self, batch):
        out = {}
        for i in batch.sample_indices:
            e = batch.entries[i]
            last = e.start_position + e.num_new_tokens - 1
            fed = e.request.token_slice(last, last + 1)
            out[e.request.request_id] = self._draw(fed, [last], [e])[0]
        return out

    def launch_decode(self, entries, after=None, rows=None):
        fed = [e.request.token_slice(e.start_position, e.start_position + 1)[0]
               for e in entries]
        if after is not None:
            rows = range(len(entries)) if rows is None else rows
            fed = [after.tokens[r] if r >= 0 else t for r, t in zip(rows, fed)]
            assert all(e.request.output_token_ids[-1] != -1 or r >= 0
                       for e, r in zip(entries, rows))
            self.chained += 1
        return types.SimpleNamespace(tokens=self._draw(
            fed, [e.start_position for e in entries], entries))

    def collect_decode(self, launch, following=None):
        return list(launch.tokens)


def test_async_scheduling_gives_the_tokens_of_the_step_by_step_engine():
    """With ``async_scheduling`` a decode step starts before the previous one's tokens are
    read (``Scheduler.advance`` placeholders, ``resolve`` after): requests that stop on a
    token waste a row of the step already started, a request at its length limit ends the
    chain, a cache too small preempts (the plan changes after ``advance``: the tokens are read
    first), requests arrive while others decode. Tokens, finish reasons and the pages left
    equal the step-by-step engine's (the device path: the staged-inputs test above)."""
    from test_engine import KV_CACHE_MEMORY

    from llmspeed_numba import LLM
    from llmspeed_numba.models.random_model import preset_config

    config = preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 20))] for _ in range(9)]
    sampling = [SamplingParams(max_tokens=rng.randint(1, 30), seed=i,
                               stop_token_ids=rng.sample(range(61), 2) if i % 3 else None)
                for i in range(9)]
    page = 2 * 16 * config.num_key_value_heads * config.head_dim * 2  # one layer, bf16
    for memory in (KV_CACHE_MEMORY, 6 * page):
        results = []
        for overlap in (False, True):
            llm = LLM(config, load_format="dummy", max_num_seqs=4, seed=0,
                      kv_cache_memory=memory, async_scheduling=overlap, max_model_len=40)
            llm.runner = runner = _DeviceTokens()
            outs = llm.generate(prompts[:5], sampling[:5])
            for p, sp in zip(prompts[5:], sampling[5:]):  # arrivals while others decode
                llm.add_request(p, sp)
                outs += llm.step()
            while llm.has_unfinished():
                outs += llm.step()
            while llm._ahead is not None:  # the step started after the last one finished
                assert llm.step() == []
            assert llm.cache.num_free_pages == llm.cache.num_blocks - 1
            results.append((sorted((o.request_id, o.token_ids, o.finish_reason) for o in outs),
                            llm.num_preemptions))
            assert (runner.chained > 0) == overlap
        assert results[0] == results[1]
        reasons = {r for _, _, r in results[0][0]}
        assert reasons == {"stop", "length"}, reasons
    assert results[0][1] > 0  # the small cache preempted


class _CopiedInputs(ModelRunner):
    """A runner whose decode inputs arrive as other arrays (as a tensor-parallel worker's do;
    not the plain runner, so it does not chain steps)."""

    def run_decode(self, *args):
        return super().run_decode(*_copies(args))


def _copies(x):
    return tuple(_copies(v) for v in x) if isinstance(x, tuple) else np.array(x, copy=True)


@pytest.mark.parametrize("max_width", [1, 5, 16, 48, 512])
@pytest.mark.parametrize("max_rows", [1, 3, 8, 256])
def test_decode_shapes_are_every_shape_a_step_can_take(max_rows, max_width):
    """``ModelRunner.decode_shapes`` (the graphs captured at start-up) is exactly the set of
    (batch bucket, table width) a decode step of 1 .. max_rows sequences of 1 .. max_width pages
    can ask for: none missing (a step would capture), none extra, no duplicate."""
    runner = ModelRunner(None, None, scratch_page=0, cuda_graphs=False, max_width=max_width)
    shapes = runner.decode_shapes(max_rows)
    reached = {(_bucket(n, BATCH_BUCKETS), runner._width(pages))
               for n in range(1, max_rows + 1) for pages in range(1, max_width + 1)}
    assert len(shapes) == len(set(shapes)) and set(shapes) == reached


def test_warm_up_lists_every_step_kind_once_and_marks_it(tmp_path):
    """``ModelRunner.warm_up`` (``LLM()`` runs it on a GPU) hands the compile step the kernels of
    every decode shape and of prefill steps (prompts from their start, chunks continuing one)
    in one list, makes each decode graph (run eagerly here: no capture off the GPU), writes its
    marker, and with the marker there skips the listing."""
    from test_engine import KV_CACHE_MEMORY

    from llmspeed_numba import LLM
    from llmspeed_numba.engine.runner import prefill_sizes
    from llmspeed_numba.models.random_model import preset_config

    config = preset_config("tiny", num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    llm = LLM(config, load_format="dummy", max_num_seqs=1, max_num_batched_tokens=8, seed=0,
              kv_cache_memory=KV_CACHE_MEMORY)
    runner = llm.runner
    runner.cuda_graphs = True
    lists = []

    def compile(kernels, **_):
        lists.append({k.name for k in kernels})
        return []

    marker = str(tmp_path / "engine.done")
    runner.warm_up(1, 8, page_tokens=16, max_model_len=64, marker=marker, compile=compile)
    (names,) = lists
    assert {"paged_decode_kernel", "sample_kernel", "rotary_append_kernel"} <= names
    assert any("paged_prefill" in n for n in names)             # a chunk continuing a sequence
    assert any(n.startswith("flash_attn") for n in names)       # a prompt from its start
    assert set(runner.graphs) == set(runner.decode_shapes(1)) == {(1, 4)}
    runner.warm_up(1, 8, page_tokens=16, max_model_len=64, marker=marker, compile=compile)
    assert len(lists) == 1 and prefill_sizes(8) == [1, 2, 3, 4, 5, 8]
    assert prefill_sizes(1) == [1] and prefill_sizes(100)[-3:] == [64, 65, 100]
