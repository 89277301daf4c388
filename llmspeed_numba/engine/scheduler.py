"""Continuous-batching scheduler: which tokens of which requests one engine step computes.

Pure Python on the host (no torch, no numba); pages are accounted through a ``PageAllocator``.
The engine loop::

    sched = Scheduler(allocator, max_num_seqs=256, max_num_batched_tokens=2048,
                      max_model_len=4096, eos_token_ids=[eos])
    sched.add(Request("r0", prompt_ids, SamplingParams(max_tokens=64)))  # ValueError: that one
    while sched.has_unfinished():
        batch = sched.schedule()
        sampled = run_model(batch) if batch.entries else {}   # {request_id: token id}
        for request in sched.update(batch, sampled):         # finished this step
            report(request)

An engine that starts a decode step before reading the previous one's tokens (async
scheduling) calls ``advance(batch)`` instead of ``update``, schedules the next step, then
``resolve(batch, tokens)`` once the tokens are read (placeholders ``PENDING`` in between).

A request's tokens are ``prompt_token_ids + output_token_ids``; ``num_computed_tokens`` of them
have their K/V in the cache. An entry ``(request, seq_id, num_new_tokens, start_position)`` feeds
the tokens ``[start_position, start_position + num_new_tokens)`` (``entry.token_ids``) at those
positions; ``schedule`` has already grown the sequence's pages to hold them, so
``allocator.host_tables(batch.seq_ids)`` gives the block table and the lengths after this step.
An entry samples (one token from the logits of its last position) when it reaches the end of the
request's tokens: every decode (one token) and the last chunk of a prefill.

Policy, per step:

- Budget: at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests. Every
  running request in decode gets its token first (the budget is at least ``max_num_seqs``, so
  decodes are never starved); prefill chunks share what is left.
- Running requests are served oldest first (arrival order). When pages run out, the newest
  running request is preempted, recompute style: its pages are freed, ``num_computed_tokens``
  returns to 0, its outputs are kept, and it waits again (first in line, as it is older than
  every waiting request) to recompute prompt + outputs. A prefill chunk shrinks to the pages
  there are before preempting anyone; a request that is itself the newest waits a step, keeping
  its pages. A request that cannot fit even alone finishes with finish_reason "length".
- Waiting requests are admitted in arrival order (no overtaking) while a seq slot, budget and
  free pages for their whole prefill are there; none in a step that preempted (vLLM's rule: the
  freed pages go to the running requests). A prefill longer than the budget left is chunked.

Thus the running requests are always older than the waiting ones, and the oldest unfinished
request computes at least one token every step: nobody starves.
"""

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from numbers import Integral
from typing import Callable, Hashable, NamedTuple

from ..paged_cache import PageAllocator
from .sampling_params import SamplingParams

__all__ = ["Batch", "BatchEntry", "PENDING", "Request", "RequestStatus", "Scheduler"]

#: The output token a request holds between ``Scheduler.advance`` and ``resolve``.
PENDING = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # added, never run
    RUNNING = "running"        # holds pages; prefilling or decoding
    PREEMPTED = "preempted"    # waiting again after a preemption, to recompute its tokens
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress. The scheduler fills everything after
    ``params``; ``prompt_token_ids`` is copied to a list of ints by ``Scheduler.add``."""

    request_id: Hashable
    prompt_token_ids: list
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    #: "stop" (eos, a stop token id or a stop string), "length" (max_tokens, max_model_len, or
    #: no room in the cache), "abort"
    finish_reason: str | None = None
    #: the stop token id or stop string that ended it, if any
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    arrival: int = -1
    seq_id: int | None = None
    #: decoded output, cut before a stop string (only for requests with stop strings)
    text: str | None = None
    num_preemptions: int = 0
    #: the sampler's seed for this request (``params.seed``, or one the engine draws)
    sampling_seed: int = 0
    #: the runner's cache of this request's packed sampling row (``ModelRunner._params``)
    sampling_row: tuple | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self):
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self):
        return self.status is RequestStatus.FINISHED

    @property
    def in_decode(self):
        """All tokens but the last sampled one are in the cache: the next step feeds one."""
        return self.num_computed_tokens == self.num_tokens - 1

    def __repr__(self):  # token lists can be long: their lengths only
        return (f"Request({self.request_id!r}, {self.status.value}, prompt "
                f"{len(self.prompt_token_ids)}, outputs {len(self.output_token_ids)}, computed "
                f"{self.num_computed_tokens}, finish_reason {self.finish_reason!r})")

    def token_slice(self, start, stop):
        """``all_token_ids[start:stop]`` without copying the whole history."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]


class BatchEntry(NamedTuple):
    """One request's share of a step: ``num_new_tokens`` tokens from ``start_position``."""

    request: Request
    seq_id: int
    num_new_tokens: int
    start_position: int

    @property
    def token_ids(self):
        """The token ids to feed (valid until ``update``)."""
        return self.request.token_slice(self.start_position,
                                        self.start_position + self.num_new_tokens)


@dataclass(frozen=True)
class Batch:
    """One engine step: ``entries`` (the ``num_decodes`` decodes first, then prefill chunks),
    ``sample_indices`` (entries that sample a token, in entry order), and what scheduling did
    besides: ``preempted`` requests (their ``seq_id``s are gone) and ``finished`` ones (no room
    even alone), which ``update`` also returns."""

    entries: tuple
    num_decodes: int
    sample_indices: tuple
    preempted: tuple
    finished: tuple
    step: int

    @property
    def num_tokens(self):
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def seq_ids(self):
        return [e.seq_id for e in self.entries]

    @property
    def sampling(self):
        """The entries that sample, in order (``sampled`` may be given aligned with these)."""
        return [self.entries[i] for i in self.sample_indices]


class _StepPlan:
    """The entries, budget and side effects of the step being scheduled."""

    def __init__(self, budget, reserved_decodes):
        self.budget_left = budget
        self.reserved_decodes = reserved_decodes  # decodes not yet placed, each owed 1 token
        self.decodes, self.prefills = [], []
        self.prefill_samples = []  # indices into prefills of the chunks that end a prompt
        self.preempted, self.finished = [], []

    @property
    def prefill_budget(self):
        return self.budget_left - self.reserved_decodes

    def add(self, request, num_new_tokens, decode):
        start = request.num_computed_tokens
        entry = BatchEntry(request, request.seq_id, num_new_tokens, start)
        self.budget_left -= num_new_tokens
        if decode:  # a decode always samples
            self.decodes.append(entry)
            return
        if start + num_new_tokens == request.num_tokens:
            self.prefill_samples.append(len(self.prefills))
        self.prefills.append(entry)

    def batch(self, step):
        d = len(self.decodes)
        samples = tuple(range(d)) + tuple(d + k for k in self.prefill_samples)
        return Batch(tuple(self.decodes + self.prefills), d, samples, tuple(self.preempted),
                     tuple(self.finished), step)


class _StopChecker:
    """Decides whether a request ends after its newest token, and why."""

    def __init__(self, eos_token_ids, max_model_len, detokenize):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenize = detokenize

    def __call__(self, request):
        """(finish_reason, stop_reason) or None. Stops are checked before lengths, so a last
        token that is eos reads "stop"."""
        params = request.params
        found = self._stop_string(request) if params.stop_strings else None
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", token
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop", token
        if found:
            return "stop", found
        if len(request.output_token_ids) >= params.max_tokens:
            return "length", None
        if request.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def may_stop(self, request, token):
        """False when ``__call__`` surely returns None for ``token``, the newest output (a
        cheap test of the same conditions, run on every token); True: call it."""
        params = request.params
        return bool(params.stop is not None or params.stop_token_ids
                    or len(request.output_token_ids) >= params.max_tokens
                    or len(request.prompt_token_ids) + len(request.output_token_ids)
                    >= self.max_model_len
                    or (token in self.eos_token_ids and not params.ignore_eos))

    def _stop_string(self, request):
        # The whole output is decoded each time: a later token may change how earlier bytes
        # decode. Sets request.text, cut before the earliest stop string.
        text = self.detokenize(list(request.output_token_ids))
        cut, found = len(text), None
        for s in request.params.stop_strings:
            at = text.find(s)
            if 0 <= at < cut:
                cut, found = at, s
        request.text = text[:cut]
        return found


class Scheduler:
    """Continuous batching over a ``PageAllocator`` (see the module docstring for the policy).

    ``max_num_seqs``: running requests at most; ``max_num_batched_tokens``: tokens per step
    (>= max_num_seqs); ``max_model_len``: prompt + output tokens at most; ``eos_token_ids``: ids
    that end a request unless ``ignore_eos``; ``detokenize(token_ids) -> str``: needed for stop
    strings. The allocator should serve this scheduler alone.
    """

    def __init__(self, allocator: PageAllocator, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids=(),
                 detokenize: Callable[[list], str] | None = None):
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator: expected a PageAllocator, got "
                            f"{type(allocator).__name__}")
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens: expected at least max_num_seqs "
                             f"({max_num_seqs}) so every decode fits a step, got "
                             f"{max_num_batched_tokens}")
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, Integral):
            eos_token_ids = (eos_token_ids,)
        if detokenize is not None and not callable(detokenize):
            raise TypeError("detokenize: expected a callable token_ids -> str, or None")
        self.allocator = allocator
        self._max_seq_len = allocator.max_seq_len
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_model_len = int(max_model_len)
        self._stop = _StopChecker([int(t) for t in eos_token_ids], self.max_model_len,
                                  detokenize)
        self._waiting = deque()   # arrival order; all newer than every running request
        self._running = []        # arrival order
        self._requests = {}       # unfinished requests by id
        self._arrivals = 0
        self._steps = 0
        self._pending = None      # the batch awaiting update() (or advance())
        self._unresolved = None   # the batch advance() moved on, awaiting resolve()

    # ---- requests ---------------------------------------------------------------------------
    @property
    def num_waiting(self):
        return len(self._waiting)

    @property
    def num_running(self):
        return len(self._running)

    @property
    def waiting(self):
        """The waiting requests, in the order they will be admitted."""
        return tuple(self._waiting)

    @property
    def running(self):
        """The running requests, oldest first."""
        return tuple(self._running)

    def has_unfinished(self):
        return bool(self._requests)

    def add(self, request: Request):
        """Queue ``request``. A bad one raises ``ValueError`` (``TypeError`` for wrong types)
        naming the problem and changes nothing, so the caller can report it and go on."""
        self._validate(request)
        request.prompt_token_ids = [int(t) for t in request.prompt_token_ids]
        request.arrival = self._arrivals
        self._arrivals += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def _validate(self, request):
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: request_id already in use")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid!r}: expected a new request, got one with status "
                             f"{request.status.value} and {len(request.output_token_ids)} "
                             f"outputs")
        if not isinstance(request.params, SamplingParams):
            raise TypeError(f"request {rid!r}: params: expected SamplingParams, got "
                            f"{type(request.params).__name__}")
        request.params.validate()
        if request.params.stop_strings and self._stop.detokenize is None:
            raise ValueError(f"request {rid!r}: stop strings need a detokenizer; create the "
                             f"Scheduler with detokenize=")
        prompt = request.prompt_token_ids
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"request {rid!r}: prompt_token_ids: expected a list of ints, got "
                            f"{type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"request {rid!r}: prompt_token_ids: empty prompt")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise TypeError(f"request {rid!r}: prompt_token_ids: expected ints, got "
                                f"{type(t).__name__} {t!r}")
            if t < 0:
                raise ValueError(f"request {rid!r}: prompt_token_ids: negative token id {t}")
        if len(prompt) > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {len(prompt)} tokens is longer than "
                             f"max_model_len {self.max_model_len}")
        if len(prompt) > self._max_seq_len:
            raise ValueError(f"request {rid!r}: prompt of {len(prompt)} tokens cannot fit the "
                             f"KV cache ({self._max_seq_len} tokens per sequence at most)")

    def abort(self, request_id):
        """Finish an unfinished request with finish_reason "abort", freeing its pages; returns
        it, or None for an unknown or already finished id. An entry of it in the batch being
        run is ignored by ``update``."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._retire(request, "abort")
        return request

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Plan the next step (see the module docstring); pages for its tokens are allocated."""
        if self._pending is not None:
            raise RuntimeError("schedule: the previous batch has not been passed to update()")
        decoding = [r.in_decode for r in self._running]   # read once a step
        plan = _StepPlan(self.max_num_batched_tokens, sum(decoding))
        self._schedule_running(plan, decoding)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self._pending = plan.batch(self._steps)
        self._steps += 1
        return self._pending

    def _schedule_running(self, plan, decoding):
        running = list(self._running)
        # Fast path, the steady decode step: the leading decodes whose sequences grow by their
        # token without preempting anyone, in one allocator call, exactly as the loop below
        # would grow them one by one; the loop takes over from the first that does not fit.
        lead = len(running) if all(decoding) else decoding.index(False)
        if lead:
            requests = running[:lead]
            seq_ids = [r.seq_id for r in requests]
            grown = self.allocator.extend_while_fits(seq_ids, 1)
            if grown:
                starts = [r.num_computed_tokens for r in requests[:grown]]
                # BatchEntry(request, seq_id, 1, start) each, without NamedTuple's __new__
                plan.decodes.extend(map(tuple.__new__, repeat(BatchEntry),
                                        zip(requests, seq_ids, repeat(1), starts)))
                plan.budget_left -= grown
                plan.reserved_decodes -= grown
                running = running[grown:]
        for request in running:
            if request.status is not RequestStatus.RUNNING:  # preempted for an older one
                continue
            decode = request.in_decode
            if decode:
                plan.reserved_decodes -= 1
                want = 1
            else:
                want = min(request.num_tokens - request.num_computed_tokens,
                           plan.prefill_budget)
                if want <= 0:
                    continue
            granted = self._grow(request, want, shrink=not decode, plan=plan)
            if granted:
                plan.add(request, granted, decode)

    def _grow(self, request, want, *, shrink, plan):
        """Give ``request`` pages for ``want`` more tokens (fewer if ``shrink``), preempting
        newer requests while nothing fits. Returns the tokens granted; 0 if it waits this step
        or was finished for lack of room."""
        alloc = self.allocator
        if alloc.try_extend(request.seq_id, want):  # the common case, first
            return want
        if request.num_computed_tokens + 1 > self._max_seq_len:
            self._retire(request, "length", into=plan.finished)
            return 0
        while True:
            room = alloc.room(request.seq_id)
            if room >= want or (shrink and room > 0):
                break
            newest = self._running[-1]
            if newest is not request:
                self._preempt(newest, plan)
            elif self._running[0] is request:  # alone, yet no room: pages held elsewhere
                self._retire(request, "length", into=plan.finished)
                return 0
            else:  # older requests hold the pages; they preempt this one if they need its
                return 0
        want = min(want, room)
        alloc.extend(request.seq_id, want)
        return want

    def _preempt(self, request, plan):
        if request.in_decode:
            plan.reserved_decodes -= 1
        self._running.remove(request)
        self.allocator.free(request.seq_id)
        request.seq_id = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        # Older than every waiting request (the running ones are), so it goes first.
        self._waiting.appendleft(request)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan):
        alloc = self.allocator
        while (self._waiting and len(self._running) < self.max_num_seqs
               and plan.budget_left > 0):
            request = self._waiting[0]
            need = request.num_tokens  # prompt, plus outputs to recompute after a preemption
            if need > self._max_seq_len:  # a preempted request grown past the whole cache
                self._retire(request, "length", into=plan.finished)
                continue
            if alloc.room() < need:  # its whole prefill must fit now; no overtaking
                break
            self._waiting.popleft()
            chunk = min(need, plan.budget_left)
            request.seq_id = alloc.add_sequence(0)
            alloc.extend(request.seq_id, chunk)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            plan.add(request, chunk, decode=False)

    def update(self, batch: Batch, sampled) -> list:
        """Record a step's results: ``sampled`` maps request_id to the sampled token id of each
        entry that samples (or is a sequence aligned with ``batch.sampling``). Advances
        ``num_computed_tokens``, appends tokens, retires finished requests (pages freed) and
        returns them, with ``batch.finished`` first."""
        if batch is not self._pending:
            raise ValueError("update: expected the batch of the last schedule() call")
        if self._unresolved is not None:
            raise RuntimeError("update: resolve() the advanced batch first")
        tokens = self._sampled_by_index(batch, sampled)
        self._pending = None
        finished = list(batch.finished)
        running = RequestStatus.RUNNING
        stop_check = self._stop
        may_stop = stop_check.may_stop
        for i, (request, _, num_new_tokens, _) in enumerate(batch.entries):
            if request.status is not running:  # aborted since schedule()
                continue
            request.num_computed_tokens += num_new_tokens
            token = tokens.get(i)
            if token is None:
                continue
            request.output_token_ids.append(token)
            # only a request that may stop is checked in full (which decides, and why)
            if may_stop(request, token):
                stop = stop_check(request)
                if stop:
                    self._retire(request, *stop)
                    finished.append(request)
        return finished

    def advance(self, batch: Batch):
        """``update`` ahead of the tokens, for a batch of decodes only (the engine starts the
        next step before reading this one's tokens): each running request's position moves on
        and it gets a ``PENDING`` placeholder token, so ``schedule`` can plan the next step;
        ``resolve`` then puts the tokens in, checks the stops and retires the finished."""
        if batch is not self._pending:
            raise ValueError("advance: expected the batch of the last schedule() call")
        if self._unresolved is not None:
            raise RuntimeError("advance: the previous advanced batch has not been resolved")
        if batch.num_decodes != len(batch.entries):
            raise ValueError(f"advance: expected a batch of decodes only, got "
                             f"{len(batch.entries) - batch.num_decodes} prefill entries")
        self._pending, self._unresolved = None, batch
        running = RequestStatus.RUNNING
        for request, _, _, _ in batch.entries:
            if request.status is running:
                request.num_computed_tokens += 1
                request.output_token_ids.append(PENDING)

    def resolve(self, batch: Batch, tokens) -> list:
        """The sampled ``tokens`` (one per entry, in order) of the batch ``advance`` moved on:
        they replace the placeholders (also of requests preempted or finished since), the
        requests still running or waiting again are checked for stops, and the finished ones
        (``batch.finished`` first) are retired and returned, as ``update`` does."""
        if batch is not self._unresolved:
            raise ValueError("resolve: expected the batch of the last advance() call")
        tokens = list(tokens)
        if len(tokens) != len(batch.entries):
            raise ValueError(f"resolve: expected {len(batch.entries)} tokens, got "
                             f"{len(tokens)}")
        self._unresolved = None
        finished = list(batch.finished)
        live = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
        stop_check = self._stop
        for (request, _, _, _), token in zip(batch.entries, tokens):
            outputs = request.output_token_ids
            if not outputs or outputs[-1] != PENDING:  # not running when advanced
                continue
            if type(token) is not int or token < 0:
                if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
                    raise ValueError(f"resolve: expected token ids >= 0, got {token!r} for "
                                     f"request {request.request_id!r}")
                token = int(token)
            outputs[-1] = token
            if request.status in live and stop_check.may_stop(request, token):
                stop = stop_check(request)
                if stop:
                    self._retire(request, *stop)
                    finished.append(request)
        return finished

    def _sampled_by_index(self, batch, sampled):
        """{entry index: token} for the sampling entries whose request still runs."""
        entries = batch.entries
        if isinstance(sampled, Mapping):
            values = {}
            for i in batch.sample_indices:
                rid = entries[i].request.request_id
                if rid in sampled:
                    values[i] = sampled[rid]
        else:
            sampled = list(sampled)
            if len(sampled) != len(batch.sample_indices):
                raise ValueError(f"sampled: expected {len(batch.sample_indices)} tokens "
                                 f"(batch.sampling), got {len(sampled)}")
            values = dict(zip(batch.sample_indices, sampled))
        tokens = {}
        running = RequestStatus.RUNNING
        for i in batch.sample_indices:
            request = entries[i].request
            if request.status is not running:  # aborted since schedule()
                continue
            if i not in values:
                raise KeyError(f"sampled: no token for request {request.request_id!r}")
            token = values[i]
            if type(token) is int and token >= 0:  # the common case, before the ABC check
                tokens[i] = token
                continue
            if isinstance(token, bool) or not isinstance(token, Integral) or token < 0:
                raise ValueError(f"sampled: expected token ids >= 0, got {token!r} for "
                                 f"request {request.request_id!r}")
            tokens[i] = int(token)
        return tokens

    def _retire(self, request, reason, stop_reason=None, into=None):
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self.allocator.free(request.seq_id)
        else:
            self._waiting.remove(request)
        request.seq_id = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self._requests[request.request_id]
        if into is not None:
            into.append(request)
