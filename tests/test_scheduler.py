"""The continuous-batching scheduler (``llmspeed_numba/engine/scheduler.py``), on the CPU.

A fake model stands in for the forward step: it keeps its own "KV cache" per seq_id, checks that
each entry feeds the next positions of that sequence with the request's tokens, and samples a
token that is a hash of the whole token history. Its output is thus a function of the tokens
alone, so a request's outputs must equal ``reference_generate`` (the request run alone) however
it was batched, chunked or preempted and recomputed.
"""

import ast
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmspeed_numba.engine.sampling_params import SamplingParams
from llmspeed_numba.engine.scheduler import Request, RequestStatus, Scheduler
from llmspeed_numba.paged_cache import PageAllocator

VOCAB = 32
EOS = 0


def _mix(h):
    h ^= h >> 29
    h = (h * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return h ^ (h >> 32)


def _fold(h, token):
    return (h * 1000003 + token + 1) % (2**61 - 1)


def next_token(tokens):
    h = 0
    for t in tokens:
        h = _fold(h, t)
    return _mix(h) % VOCAB


def detokenize(token_ids):
    return "".join("abcdefgh"[t % 8] for t in token_ids)


class FakeModel:
    """Checks what each step feeds and samples ``next_token(history)`` for entries that sample."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.kv = {}  # seq_id -> (length, rolling hash); seq ids are never reused

    def __call__(self, batch):
        sampled = {}
        for i, (request, seq_id, n, start) in enumerate(batch.entries):
            length, h = self.kv.get(seq_id, (0, 0))
            assert start == length, "an entry must continue its sequence where it stopped"
            assert self.allocator.length(seq_id) == start + n, "pages not grown for the step"
            tokens = request.all_token_ids[start:start + n]
            assert list(batch.entries[i].token_ids) == tokens
            for t in tokens:
                h = _fold(h, t)
            self.kv[seq_id] = (start + n, h)
            if i in batch.sample_indices:
                assert start + n == request.num_tokens
                sampled[request.request_id] = _mix(h) % VOCAB
        return sampled


def reference_generate(prompt, params, *, max_model_len, max_seq_len=10**9, eos=(EOS,)):
    """(outputs, finish_reason, text) of a request run alone, straight from the definition."""
    tokens, out, text = list(prompt), [], None
    stops = params.stop_strings
    while True:
        if len(tokens) > max_seq_len:  # the next token needs K/V for all of them
            return out, "length", text
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        hit = None
        if stops:
            decoded = detokenize(out)
            found = [(decoded.find(s), k) for k, s in enumerate(stops) if s in decoded]
            cut = min(found)[0] if found else len(decoded)
            text, hit = decoded[:cut], bool(found)
        if ((not params.ignore_eos and t in eos) or t in (params.stop_token_ids or ())
                or hit):
            return out, "stop", text
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length", text


def make(num_blocks=64, block_size=4, *, max_num_seqs=4, budget=16, max_model_len=256,
         max_blocks_per_seq=None, **kw):
    alloc = PageAllocator(num_blocks, block_size, max_blocks_per_seq=max_blocks_per_seq)
    sched = Scheduler(alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, eos_token_ids=[EOS],
                      detokenize=kw.pop("detokenize", detokenize), **kw)
    return sched, alloc, FakeModel(alloc)


def check_step(sched, batch):
    """Invariants of every step, checked right after schedule()."""
    alloc = sched.allocator
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch.entries) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    ids = [e.request.request_id for e in batch.entries]
    assert len(set(ids)) == len(ids)
    for k, (request, seq_id, n, start) in enumerate(batch.entries):
        assert request.status is RequestStatus.RUNNING and request.seq_id == seq_id
        assert start == request.num_computed_tokens and n >= 1
        assert (k < batch.num_decodes) == (n == 1 and start == request.num_tokens - 1) or (
            k >= batch.num_decodes and start + n == request.num_tokens)  # 1-token tail chunk
    scheduled = {e.request.request_id for e in batch.entries}
    for request in sched.running:  # a decode left out had no page to grow into
        if request.in_decode and request.request_id not in scheduled:
            assert alloc.room(request.seq_id) == 0
    # Running requests are all older than waiting ones, both in arrival order.
    arrivals = [r.arrival for r in sched.running + sched.waiting]
    assert arrivals == sorted(arrivals)
    if batch.preempted:  # the freed pages go to running requests: no admission this step
        assert all(e.start_position > 0 for e in batch.entries)
    check_pages(sched)


def check_pages(sched):
    alloc = sched.allocator
    held = sum(len(alloc.pages(s)) for s in alloc.sequences)
    assert held + alloc.num_free_pages == alloc.num_blocks
    assert sorted(alloc.sequences) == sorted(r.seq_id for r in sched.running)
    assert all(r.seq_id is None for r in sched.waiting)


def simulate(sched, model, arrivals, *, max_steps=10_000):
    """Run to completion; ``arrivals``: {step: [Request]}. Returns ({id: Request} finished,
    {id: exception} rejected, steps)."""
    arrivals = {k: list(v) for k, v in arrivals.items()}
    finished, rejected, step = {}, {}, 0
    while arrivals or sched.has_unfinished():
        for request in arrivals.pop(step, []):
            try:
                sched.add(request)
            except (ValueError, TypeError) as e:
                rejected[request.request_id] = e
        batch = sched.schedule()
        check_step(sched, batch)
        for request in sched.update(batch, model(batch)):
            assert request.request_id not in finished
            finished[request.request_id] = request
        check_pages(sched)
        step += 1
        assert step <= max_steps, "no progress"
    assert sched.allocator.num_free_pages == sched.allocator.num_blocks
    assert sched.allocator.sequences == [] and sched.num_waiting == sched.num_running == 0
    return finished, rejected, step


def req(rid, prompt_len, max_tokens=8, **params):
    prompt = [(7 * rid + 3 * j) % (VOCAB - 1) + 1 for j in range(prompt_len)]  # no eos inside
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params))


def assert_as_alone(request, sched):
    out, reason, text = reference_generate(
        request.prompt_token_ids, request.params, max_model_len=sched.max_model_len,
        max_seq_len=sched.allocator.max_seq_len)
    assert (request.output_token_ids, request.finish_reason) == (out, reason), request.request_id
    assert request.text == text


# ---- SamplingParams -------------------------------------------------------------------------
def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 0.0, 0, 1.0, 0.0)
    assert p.validate() is p and p.stop_strings == ()
    assert SamplingParams(stop="x").stop_strings == ("x",)
    SamplingParams(max_tokens=1, temperature=0.7, top_k=50, top_p=0.5, min_p=1, seed=3,
                   stop=["a", "bc"], stop_token_ids=[2, 5], ignore_eos=True).validate()
    bad_values = [("max_tokens", 0), ("temperature", -0.1), ("temperature", float("inf")),
                  ("temperature", float("nan")), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
                  ("top_p", float("nan")), ("min_p", -0.5), ("min_p", 2), ("seed", -1),
                  ("stop_token_ids", [3, -1]), ("stop", [""])]
    for name, value in bad_values:
        with pytest.raises(ValueError, match=f"^{name}:"):
            SamplingParams(**{name: value}).validate()
    bad_types = [("max_tokens", 2.0), ("max_tokens", True), ("temperature", "hot"),
                 ("top_k", 1.5), ("top_p", None), ("seed", 1.0), ("stop", 5), ("stop", ["a", 1]),
                 ("stop_token_ids", 7), ("stop_token_ids", [1.0]), ("ignore_eos", 1)]
    for name, value in bad_types:
        with pytest.raises(TypeError, match=f"^{name}:"):
            SamplingParams(**{name: value}).validate()


# ---- admission, budget, chunked prefill -------------------------------------------------------
def test_admission_is_fifo_within_max_num_seqs():
    sched, alloc, model = make(max_num_seqs=2, budget=64)
    for rid in range(3):
        sched.add(req(rid, 3, max_tokens=2, ignore_eos=True))
    batch = sched.schedule()
    assert [(e.request.request_id, e.num_new_tokens, e.start_position) for e in batch.entries] \
        == [(0, 3, 0), (1, 3, 0)]
    assert batch.num_decodes == 0 and batch.sample_indices == (0, 1)
    assert [r.request_id for r in sched.waiting] == [2] and sched.num_running == 2
    sched.update(batch, model(batch))
    batch = sched.schedule()  # two decodes, no slot for request 2
    assert [e.request.request_id for e in batch.entries] == [0, 1] and batch.num_decodes == 2
    done = sched.update(batch, model(batch))  # max_tokens=2 reached by both
    assert [r.request_id for r in done] == [0, 1] and {r.finish_reason for r in done} == {"length"}
    assert alloc.num_free_pages == alloc.num_blocks
    batch = sched.schedule()
    assert [e.request.request_id for e in batch.entries] == [2]


def test_decodes_first_and_the_budget_is_shared_by_prefills():
    sched, alloc, model = make(max_num_seqs=4, budget=8)
    for rid in range(3):
        sched.add(req(rid, 2, max_tokens=20, ignore_eos=True))
    batch = sched.schedule()  # 2 + 2 + 2 = 6 tokens of prefill
    sched.update(batch, model(batch))
    sched.add(req(3, 20, max_tokens=3, ignore_eos=True))
    starts = []
    for _ in range(4):
        batch = sched.schedule()
        entries = [(e.request.request_id, e.num_new_tokens) for e in batch.entries]
        assert entries[:3] == [(0, 1), (1, 1), (2, 1)] and batch.num_decodes == 3
        assert batch.num_tokens <= 8
        if len(entries) > 3:
            starts.append((batch.entries[3].start_position, entries[3][1]))
        sched.update(batch, model(batch))
    # The 20-token prompt goes in chunks of the 5 tokens left beside the 3 decodes, and samples
    # only with its last chunk.
    assert starts == [(0, 5), (5, 5), (10, 5), (15, 5)]
    assert sched.running[3].output_token_ids and sched.running[3].in_decode


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    sched, alloc, model = make(max_num_seqs=2, budget=4, num_blocks=16)
    sched.add(req(0, 10, max_tokens=5, ignore_eos=True))
    chunks = []
    while sched.has_unfinished():
        batch = sched.schedule()
        chunks.append([(e.num_new_tokens, e.start_position, i in batch.sample_indices)
                       for i, e in enumerate(batch.entries)])
        sched.update(batch, model(batch))
    assert chunks[:3] == [[(4, 0, False)], [(4, 4, False)], [(2, 8, True)]]
    assert chunks[3:] == [[(1, 10 + k, True)] for k in range(4)]


# ---- preemption ------------------------------------------------------------------------------
def test_preemption_frees_the_newest_which_comes_back_first_and_recomputes():
    # 6 pages of 2 tokens; three requests of 3-token prompts that each want 9 more tokens.
    sched, alloc, model = make(num_blocks=6, block_size=2, max_num_seqs=3, budget=9)
    requests = [req(rid, 3, max_tokens=9, ignore_eos=True) for rid in range(3)]
    for r in requests:
        sched.add(r)
    sched.add(req(3, 2, max_tokens=1))  # arrives later than all three
    preempted, finished = [], {}
    while sched.has_unfinished():
        batch = sched.schedule()
        check_step(sched, batch)
        for e in batch.entries:  # a readmitted request recomputes prompt + outputs so far
            if e.start_position == 0 and e.request.num_preemptions:
                assert e.request.output_token_ids and e.request.num_tokens > 3
        if batch.preempted:
            preempted.append([r.request_id for r in batch.preempted])
            newest = max(r.arrival for r in sched.running + batch.preempted)
            assert batch.preempted[0].arrival == newest
            # the preempted come back before the request that arrived after them
            assert [r.request_id for r in sched.waiting][:len(batch.preempted)] == \
                sorted(r.request_id for r in batch.preempted)
        for r in sched.update(batch, model(batch)):
            finished[r.request_id] = r
    assert preempted and preempted[0] == [2]
    assert sum(r.num_preemptions for r in requests) >= 1
    for r in requests:
        assert_as_alone(r, sched)
        out, _, _ = reference_generate(r.prompt_token_ids, r.params, max_model_len=256)
        assert r.output_token_ids == out and len(out) == 9  # as with unlimited pages
    assert alloc.num_free_pages == alloc.num_blocks


def test_prefill_waits_for_pages_rather_than_thrashing():
    # A waiting request is admitted only once its whole prefill fits the free pages.
    sched, alloc, model = make(num_blocks=4, block_size=4, max_num_seqs=2, budget=16)
    sched.add(req(0, 8, max_tokens=4, ignore_eos=True))
    sched.add(req(1, 9, max_tokens=1, ignore_eos=True))  # needs 3 pages; 2 are free
    batch = sched.schedule()
    assert [e.request.request_id for e in batch.entries] == [0]
    sched.update(batch, model(batch))
    finished, _, _ = simulate(sched, model, {})
    assert sorted(finished) == [0, 1] and finished[1].num_preemptions == 0


def test_a_prefill_chunk_shrinks_to_the_pages_left_then_waits_then_is_preempted():
    # 5 pages of 2 tokens: request 1 (6-token prompt) is admitted beside the decoding request 0,
    # whose growth then takes its pages: its next chunk shrinks to 1 token, then it waits a step
    # (newest, keeping its pages), then request 0 needs a page and preempts it.
    sched, alloc, model = make(num_blocks=5, block_size=2, max_num_seqs=2, budget=4)
    a = req(0, 2, max_tokens=10, ignore_eos=True)
    b = req(1, 6, max_tokens=2, ignore_eos=True)
    steps = []
    sched.add(a)
    while sched.has_unfinished():
        if len(steps) == 2:
            sched.add(b)
        batch = sched.schedule()
        check_step(sched, batch)
        steps.append(([(e.request.request_id, e.start_position, e.num_new_tokens)
                       for e in batch.entries], [r.request_id for r in batch.preempted]))
        sched.update(batch, model(batch))
    assert steps[2:6] == [([(0, 3, 1), (1, 0, 3)], []), ([(0, 4, 1), (1, 3, 1)], []),
                          ([(0, 5, 1)], []), ([(0, 6, 1)], [1])]
    assert steps[9:] == [([(1, 0, 4)], []), ([(1, 4, 2)], []), ([(1, 6, 1)], [])]
    assert a.finish_reason == "length" and len(a.output_token_ids) == 9  # 10 tokens of cache
    assert b.num_preemptions == 1
    assert_as_alone(a, sched)
    assert_as_alone(b, sched)


def test_a_sequence_that_cannot_fit_alone_finishes_with_length():
    # 2 pages of 4 tokens: a 6-token prompt can produce 3 tokens (K/V of 6, 7, 8 tokens).
    sched, alloc, model = make(num_blocks=2, block_size=4, max_num_seqs=2, budget=8)
    sched.add(req(0, 6, max_tokens=10, ignore_eos=True))
    finished, _, _ = simulate(sched, model, {})
    assert finished[0].finish_reason == "length" and len(finished[0].output_token_ids) == 3
    assert_as_alone(finished[0], sched)
    # The same with max_blocks_per_seq limiting one sequence in a larger cache.
    sched, alloc, model = make(num_blocks=8, block_size=4, max_blocks_per_seq=2)
    a, b = req(0, 6, max_tokens=10, ignore_eos=True), req(1, 6, max_tokens=10, ignore_eos=True)
    finished, _, _ = simulate(sched, model, {0: [a, b]})
    assert [len(r.output_token_ids) for r in (a, b)] == [3, 3]
    assert {a.finish_reason, b.finish_reason} == {"length"}


# ---- retirement ------------------------------------------------------------------------------
def test_steady_decode_fast_path_and_the_cases_it_hands_on():
    # schedule() grows the leading decodes in one allocator call (extend_while_fits) and hands
    # on to the general loop at the first that does not fit. 5 pages of 4 tokens; after the
    # prefill step the sequences hold 3, 4, 4, 3 tokens in one page each, one page free.
    sched, alloc, model = make(num_blocks=5, block_size=4, max_num_seqs=4, budget=16)
    p0 = req(0, 3).prompt_token_ids
    first = next_token(p0)
    second = next_token(p0 + [first])
    assert first != second  # so r0's stop token ends it on the decode step, not before
    requests = [req(0, 3, max_tokens=8, stop_token_ids=[second], ignore_eos=True),
                req(1, 4, max_tokens=2, ignore_eos=True),          # max_tokens on the decode
                req(2, 4, max_tokens=6, ignore_eos=True),
                req(3, 3, max_tokens=6, ignore_eos=True)]
    for r in requests:
        sched.add(r)
    batch = sched.schedule()
    check_step(sched, batch)
    assert batch.num_decodes == 0 and len(batch.entries) == 4 and alloc.num_free_pages == 1
    assert sched.update(batch, model(batch)) == []
    batch = sched.schedule()  # the decode step
    check_step(sched, batch)
    # r0 fills its last page (no page taken), r1 crosses into a new page (the free one), r2
    # needs a page and none is left: the newest, r3, is preempted for it.
    assert [e.request.request_id for e in batch.entries] == [0, 1, 2]
    assert batch.num_decodes == 3 and batch.sample_indices == (0, 1, 2)
    assert [(e.num_new_tokens, e.start_position) for e in batch.entries] == [(1, 3), (1, 4),
                                                                             (1, 4)]
    assert [r.request_id for r in batch.preempted] == [3] and requests[3].seq_id is None
    assert [alloc.length(r.seq_id) for r in requests[:3]] == [4, 5, 5]
    assert [alloc.num_pages(r.seq_id) for r in requests[:3]] == [1, 2, 2]
    finished = sched.update(batch, model(batch))
    assert [(r.request_id, r.finish_reason, r.stop_reason) for r in finished] == [
        (0, "stop", second), (1, "length", None)]
    assert requests[0].output_token_ids == [first, second]
    simulate(sched, model, {})
    for r in requests:
        assert_as_alone(r, sched)


def test_retirement_reasons():
    sched, alloc, model = make(max_model_len=12)
    prompts = ([1 + k % 31, 1 + k // 31, 5, 9] for k in range(31 * 31))
    eos_prompt = next(p for p in prompts if next_token(p) == EOS)  # eos is its first output
    stop_prompt = req(200, 4).prompt_token_ids
    stop_id = next_token(stop_prompt)
    cases = {
        "eos": Request("eos", eos_prompt, SamplingParams(max_tokens=5)),
        "ignore_eos": Request("ignore_eos", eos_prompt,
                              SamplingParams(max_tokens=5, ignore_eos=True)),
        "stop_id": Request("stop_id", stop_prompt,
                           SamplingParams(max_tokens=5, stop_token_ids=[stop_id],
                                          ignore_eos=True)),
        "max_tokens": req(300, 4, max_tokens=3, ignore_eos=True),
        "max_model_len": req(301, 10, max_tokens=50, ignore_eos=True),  # 12: 2 tokens
    }
    finished, _, _ = simulate(sched, model, {0: list(cases.values())})
    assert cases["eos"].finish_reason == "stop" and cases["eos"].stop_reason == EOS
    assert cases["eos"].output_token_ids == [EOS]
    assert cases["ignore_eos"].finish_reason == "length"
    assert len(cases["ignore_eos"].output_token_ids) == 5
    assert cases["stop_id"].output_token_ids == [stop_id]
    assert (cases["stop_id"].finish_reason, cases["stop_id"].stop_reason) == ("stop", stop_id)
    assert len(cases["max_tokens"].output_token_ids) == 3
    assert len(cases["max_model_len"].output_token_ids) == 2
    assert cases["max_tokens"].finish_reason == cases["max_model_len"].finish_reason == "length"
    for r in finished.values():
        assert_as_alone(r, sched)


def test_stop_strings_cut_the_text():
    sched, alloc, model = make()
    probe = req(7, 5, max_tokens=12, ignore_eos=True)
    full, _, _ = reference_generate(probe.prompt_token_ids, probe.params, max_model_len=256)
    text = detokenize(full)
    stop = text[4:6]
    r = req(7, 5, max_tokens=12, ignore_eos=True, stop=[stop, "zz"])
    finished, _, _ = simulate(sched, model, {0: [r]})
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == text[:text.find(stop)] and len(r.output_token_ids) == text.find(stop) + 2
    no_detok, _, _ = make(detokenize=None)
    with pytest.raises(ValueError, match="stop strings need a detokenizer"):
        no_detok.add(req(8, 3, stop="x"))


# ---- bad requests, abort, protocol ----------------------------------------------------------
def test_bad_requests_are_rejected_alone():
    sched, alloc, model = make(num_blocks=4, block_size=4, max_model_len=20)
    good = [req(0, 3, max_tokens=2), req(5, 4, max_tokens=2)]
    bad = [
        (Request(1, [], SamplingParams()), ValueError, "empty prompt"),
        (req(2, 3, max_tokens=0), ValueError, "max_tokens"),
        (req(3, 21), ValueError, "longer than max_model_len 20"),
        (req(4, 3, top_p=0.0), ValueError, "top_p"),
        (req(6, 17), ValueError, "cannot fit the KV cache"),
        (Request(7, [1, -2], SamplingParams()), ValueError, "negative token id"),
        (Request(8, [1, 2.5], SamplingParams()), TypeError, "expected ints"),
        (Request(9, "hello", SamplingParams()), TypeError, "list of ints"),
        (req(0, 3), ValueError, "already in use"),
    ]
    sched.add(good[0])
    for request, error, match in bad:
        with pytest.raises(error, match=match):
            sched.add(request)
    sched.add(good[1])
    assert [r.request_id for r in sched.waiting] == [0, 5]
    finished, _, _ = simulate(sched, model, {})
    assert sorted(finished) == [0, 5]


def test_abort_frees_pages_wherever_the_request_is():
    sched, alloc, model = make(num_blocks=16, max_num_seqs=2)
    for rid in range(3):
        sched.add(req(rid, 6, max_tokens=10, ignore_eos=True))
    batch = sched.schedule()
    sched.update(batch, model(batch))
    held = alloc.num_free_pages
    assert sched.abort(2).finish_reason == "abort" and sched.num_waiting == 0  # waiting
    assert alloc.num_free_pages == held
    aborted = sched.abort(0)                                                   # running
    assert aborted.status is RequestStatus.FINISHED and aborted.seq_id is None
    assert alloc.num_free_pages == held + 2 and sched.abort(0) is None and sched.abort(99) is None
    batch = sched.schedule()
    assert sched.abort(1).finish_reason == "abort"   # between schedule and update
    assert sched.update(batch, {}) == []
    assert alloc.num_free_pages == alloc.num_blocks and not sched.has_unfinished()


def test_update_protocol_errors():
    sched, alloc, model = make()
    sched.add(req(0, 3))
    batch = sched.schedule()
    with pytest.raises(RuntimeError, match="update"):
        sched.schedule()
    with pytest.raises(KeyError, match="no token for request"):
        sched.update(batch, {})
    with pytest.raises(ValueError, match="expected 1 tokens"):
        sched.update(batch, [])
    assert sched.update(batch, [5]) == [] and sched.running[0].output_token_ids == [5]
    with pytest.raises(ValueError, match="last schedule"):
        sched.update(batch, [5])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=8)
    with pytest.raises(TypeError, match="allocator"):
        Scheduler(None, max_num_seqs=1, max_num_batched_tokens=4, max_model_len=8)


def test_scheduler_imports_neither_torch_nor_numba():
    source = pathlib.Path(__file__).parents[1] / "llmspeed_numba" / "engine"
    for name in ("scheduler.py", "sampling_params.py"):
        tree = ast.parse((source / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom)}
        assert not imported & {"torch", "numba", "cupy", "numpy"}, (name, imported)
    code = "import sys, llmspeed_numba.engine.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# ---- properties ------------------------------------------------------------------------------
@st.composite
def workloads(draw):
    max_num_seqs = draw(st.integers(1, 5))
    config = dict(
        block_size=draw(st.sampled_from([1, 2, 4, 8])),
        num_blocks=draw(st.integers(1, 24)),
        max_num_seqs=max_num_seqs,
        budget=draw(st.integers(max_num_seqs, 24)),
        max_model_len=draw(st.integers(2, 64)),
    )
    requests = []
    for rid in range(draw(st.integers(1, 8))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 24)), ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=2)),
            stop=draw(st.none() | st.lists(st.text("abcdefgh", min_size=2, max_size=3),
                                           min_size=1, max_size=2)))
        requests.append((draw(st.integers(0, 6)), Request(rid, prompt, params)))
    return config, requests


@settings(max_examples=400, deadline=None, derandomize=True)
@given(workloads())
def test_property_every_request_finishes_as_if_alone(workload):
    config, requests = workload
    sched, alloc, model = make(**config)
    arrivals = {}
    for step, request in requests:
        arrivals.setdefault(step, []).append(request)
    finished, rejected, steps = simulate(sched, model, arrivals)
    for _, r in requests:
        n = len(r.prompt_token_ids)
        if n > sched.max_model_len or n > alloc.max_seq_len:
            assert r.request_id in rejected
            continue
        assert r.request_id in finished and r.status is RequestStatus.FINISHED
        assert_as_alone(r, sched)
        # Alone, with plenty of pages: the same unless the cache cut it short.
        alone_sched, _, alone_model = make(num_blocks=64, block_size=4, max_num_seqs=1,
                                           budget=config["budget"],
                                           max_model_len=config["max_model_len"])
        alone = Request(r.request_id, r.prompt_token_ids, r.params)
        simulate(alone_sched, alone_model, {0: [alone]})
        if r.num_tokens <= alloc.max_seq_len and r.finish_reason != "length":
            assert alone.output_token_ids == r.output_token_ids
        else:
            assert alone.output_token_ids[:len(r.output_token_ids)] == r.output_token_ids
    # Nobody starves: the oldest unfinished request computes a token every step.
    work = sum(len(r.prompt_token_ids) + r.params.max_tokens for _, r in requests)
    assert steps <= work + max(arrivals) + 1
