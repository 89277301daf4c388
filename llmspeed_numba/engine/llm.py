"""``LLM``: the engine behind vLLM's offline API, on our model and ops.

Requests wait in the ``Scheduler`` (continuous batching, chunked prefill, preemption); each
engine step the ``ModelRunner`` runs the scheduled tokens (decodes replayed from CUDA graphs,
prefill chunks packed eagerly) and samples on the GPU; finished requests come back as
``RequestOutput``. A bad request is refused alone (``add_request`` raises; ``generate`` reports
it in that request's output) while the others go on.
"""

import itertools
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from .. import _env
from .loading import BLOCK_SIZE, cache_pages, load
from .runner import BATCH_BUCKETS, ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Request, RequestStatus, Scheduler


def _continues(following, batch):
    """Whether ``following`` (scheduled after ``batch`` advanced) decodes only requests of
    ``batch``, so it can take their tokens from ``batch``'s output on the GPU: False, or the
    row of ``batch`` each of its entries continues (None when row for row)."""
    entries = following.entries
    if following.num_decodes != len(entries) or following.preempted or following.finished:
        return False
    if len(entries) == len(batch.entries) and all(
            a.request is b.request for a, b in zip(entries, batch.entries)):
        return None
    rows = {id(e.request): i for i, e in enumerate(batch.entries)}
    source = [rows.get(id(e.request), -1) for e in entries]
    return False if -1 in source else source


@dataclass
class DecodeStats:
    """Engine steps that only decoded, from a replayed CUDA graph: their wall time, and the part
    the host spent waiting for the GPU (the rest is host work: scheduling, inputs, launch)."""

    steps: int = 0
    seconds: float = 0.0
    gpu_wait_seconds: float = 0.0
    #: GPU idle time before the steps that follow a graph decode step (CUDA timing events
    #: between the one's token read and the other's input copy), over ``idle_steps`` steps
    gpu_idle_seconds: float = 0.0
    idle_steps: int = 0

    def add(self, seconds, wait, idle=None):
        self.steps += 1
        self.seconds += seconds
        self.gpu_wait_seconds += wait
        if idle is not None:
            self.idle_steps += 1
            self.gpu_idle_seconds += idle

    @property
    def host_share(self):
        """Fraction of a decode step's wall time that was host work (0 without steps); with
        async scheduling that work overlaps the GPU's step before, so see ``gpu_idle_share``."""
        return 1.0 - self.gpu_wait_seconds / self.seconds if self.seconds else 0.0

    @property
    def gpu_idle_share(self):
        """Fraction of a decode step's wall time the GPU had no work queued: the host time
        that costs throughput (None without measured steps)."""
        if not self.idle_steps:
            return None
        mean_step = self.seconds / self.steps
        return self.gpu_idle_seconds / self.idle_steps / mean_step


@dataclass
class RequestOutput:
    """One request's result: ``finish_reason`` "stop", "length", "abort", or "error" (then
    ``error`` says why and nothing was generated)."""

    request_id: object
    prompt: object
    prompt_token_ids: list
    token_ids: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class LLM:
    """A model served by the engine.

    ``model``: a Hugging Face directory, a .gguf file, or None (the embedded SmolLM2-135M); with
    ``load_format="dummy"``, also a preset name of ``models.random_model.PRESETS``
    ("llama-3-8b", "llama-3-70b", "smollm2-135m", "tiny") or a ``ModelConfig``, weights drawn at
    random. ``kv_cache_memory``: the fraction of the GPU memory free after loading (a float in
    (0, 1]) or a byte count (an int) given to the paged KV cache. ``max_model_len``: prompt +
    output tokens at most (default: the model's context, capped by the cache).
    ``max_num_batched_tokens``: tokens per step (default 8192, at least ``max_num_seqs``).
    ``seed`` draws the seeds of requests that set none. ``quantization``: None (the model
    dtype), "int4" / "int8" / "fp8" (the projection weights quantized at load, run by
    ``quant_gemm``; fp8 also quantizes their inputs, Hopper only) or "gguf" (a GGUF's Q4_0 /
    Q4_1 / Q8_0 projection blocks kept packed); see ``models.llama``. ``tensor_parallel_size``:
    GPUs the model is split over (``engine/tp.py``): this process drives the first (its current
    device) and starts one process for each other; every one keeps 1 / N of the weights and of
    the KV cache (whose memory budget is per GPU). ``close()`` stops those processes.
    On a GPU, start-up makes ready every kernel a step can launch (prefill steps of up to
    ``max_num_batched_tokens``, decode batches up to ``max_num_seqs``), compiling the missing ones
    in parallel processes, and with ``cuda_graphs`` captures the decode step of every batch
    bucket and block-table width (as vLLM captures at start-up), so no step of a load compiles or
    captures (``ModelRunner.warm_up``).
    """

    def __init__(self, model=None, *, dtype="bfloat16", max_num_seqs=256, max_model_len=None,
                 kv_cache_memory=0.9, load_format="auto", cuda_graphs=True, seed=0,
                 max_num_batched_tokens=None, quantization=None, tensor_parallel_size=1,
                 async_scheduling=True):
        from ..distributed.sharding import check_size
        from ..models.llama import LlamaModel, check_quantization
        from ..models.model import model_dtype

        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or not (
                1 <= max_num_seqs <= BATCH_BUCKETS[-1]):
            raise ValueError(f"max_num_seqs: expected an int in [1, {BATCH_BUCKETS[-1]}], got "
                             f"{max_num_seqs!r}")
        dt = model_dtype(dtype)
        quantization = check_quantization(quantization)
        self.tensor_parallel_size = check_size(tensor_parallel_size)
        self._tp = None
        if self.tensor_parallel_size == 1:
            config, weights, self.tokenizer = load(model, dt, load_format, seed, quantization)
            self.llama = LlamaModel(config, weights, dt, quantization)
            del weights
        else:
            from .tp import RankSpec, TensorParallelGroup

            spec = RankSpec(model, dt, load_format, seed, quantization, kv_cache_memory)
            self._tp = TensorParallelGroup.start(spec, self.tensor_parallel_size)
            weakref.finalize(self, self._tp.close)
            group = self._tp
            config, self.tokenizer, self.llama = group.config, group.tokenizer, group.llama
        self.config = config
        try:
            pages = (cache_pages(self.llama.config, kv_cache_memory, dt) if self._tp is None
                     else self._tp.pages(spec))
            context = config.max_position_embeddings
            limit = min(context, (pages - 1) * BLOCK_SIZE)
            if max_model_len is None:
                max_model_len = limit
            elif isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not (
                    1 <= max_model_len <= limit):
                raise ValueError(f"max_model_len: expected an int in [1, {limit}] (the model's "
                                 f"context {context}, and the KV cache's {pages - 1} pages of "
                                 f"{BLOCK_SIZE}), got {max_model_len!r}")
        except BaseException:
            if self._tp is not None:
                self._tp.close(abort=True)
            raise
        self.max_model_len = max_model_len
        self.cache = self.llama.new_cache(pages)
        scratch = self.cache.add_sequence(1)  # padded decode rows write here, never read
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(8192, max_num_seqs)
        tok = self.tokenizer
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, eos_token_ids=config.eos_token_id,
            detokenize=None if tok is None else tok.decode)
        setup = dict(scratch_page=self.cache.pages(scratch)[0],
                     cuda_graphs=bool(cuda_graphs) and not _env.SIMULATOR,
                     max_width=-(-max_model_len // BLOCK_SIZE))
        self.runner = (ModelRunner(self.llama, self.cache, **setup) if self._tp is None
                       else self._tp.runner(self.cache, **setup))
        #: seconds the start-up warm-up took (``ModelRunner.warm_up``; 0 off the GPU)
        self.warm_up_seconds = 0.0
        try:
            if not _env.SIMULATOR:
                from ..warm import marker_path

                marker = marker_path("engine", config, dt, quantization,
                                     self.tensor_parallel_size, max_num_seqs, max_model_len,
                                     max_num_batched_tokens, self.runner.cuda_graphs)
                self.warm_up_seconds = self.runner.warm_up(
                    max_num_seqs, max_num_batched_tokens, page_tokens=BLOCK_SIZE,
                    max_model_len=max_model_len, marker=marker)
        except BaseException:
            if self._tp is not None:
                self._tp.close(abort=True)
            raise
        self._seeds = np.random.default_rng(seed)
        #: requests preempted (pages freed, recomputed later) so far
        self.num_preemptions = 0
        self.decode_stats = DecodeStats()
        #: start a decode step before the previous one's tokens are read (``step``)
        self.async_scheduling = bool(async_scheduling)
        self._ahead = None   # (batch, DecodeLaunch) started and not yet read
        self._ids = itertools.count()
        self._prompts = {}

    # ---- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer (dummy weights); pass "
                                 "token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.config.vocab_size
            bad = [t for t in prompt if not isinstance(t, (int, np.integer))
                   or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token ids must be ints in [0, {vocab}), got "
                                 f"{bad[0]!r}")
            return [int(t) for t in prompt]
        raise TypeError(f"prompt: expected a str or a list of token ids, got "
                        f"{type(prompt).__name__}")

    def add_request(self, prompt, sampling=None):
        """Queue one request; returns its id. Raises ``ValueError`` / ``TypeError`` for a bad
        one (empty prompt, a prompt over max_model_len, bad sampling parameters...), which
        changes nothing."""
        params = SamplingParams() if sampling is None else sampling
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(params).__name__}")
        request_id = next(self._ids)
        request = Request(request_id, self._prompt_ids(prompt), params)
        request.sampling_seed = (params.seed if params.seed is not None
                                 else int(self._seeds.integers(2**62)))
        self.scheduler.add(request)
        self._prompts[request_id] = (prompt, request)
        return request_id

    def has_unfinished(self):
        return self.scheduler.has_unfinished()

    def request(self, request_id):
        """The live ``Request`` of ``request_id`` (its tokens so far), or None once finished."""
        entry = self._prompts.get(request_id)
        return None if entry is None else entry[1]

    def step(self):
        """One engine step; returns the ``RequestOutput`` of each request finished in it.

        Decode-only steps run from CUDA graphs. With ``async_scheduling``, while no request
        waits to be admitted, a decode step starts the next one before reading its tokens:
        ``Scheduler.advance`` moves the requests on with placeholder tokens, the next step is
        scheduled and launched with its token ids taken from this step's output on the GPU,
        and only then are this step's tokens read and ``resolve``d (a request that stopped
        wasted its row of the next step, which the one after leaves out). The host's work then
        overlaps the GPU's, as vLLM's async scheduling does; the tokens are the same."""
        start = time.perf_counter()
        runner, scheduler = self.runner, self.scheduler
        if self._ahead is None:
            batch = scheduler.schedule()
            self.num_preemptions += len(batch.preempted)
            decodes_only = batch.entries and batch.num_decodes == len(batch.entries)
            if not (decodes_only and runner.chains):
                sampled = runner.execute(batch) if batch.entries else {}
                finished = scheduler.update(batch, sampled)
                if decodes_only:  # a tensor-parallel runner's graph decode
                    self._count_decode(start)
                return self._outputs(finished)
            self._ahead = (batch, runner.launch_decode(batch.entries))
        batch, launch = self._ahead
        self._ahead = None
        if not self._chains(batch):
            tokens = runner.collect_decode(launch)
            finished = scheduler.update(batch, tokens)
            self._count_decode(start)
            return self._outputs(finished)
        scheduler.advance(batch)
        following = scheduler.schedule()
        self.num_preemptions += len(following.preempted)
        rows = _continues(following, batch) if following.entries else False
        if rows is not False:
            ahead = runner.launch_decode(following.entries, after=launch, rows=rows)
            finished = scheduler.resolve(batch, runner.collect_decode(launch, ahead))
            self._ahead = (following, ahead)
            self._count_decode(start)
            return self._outputs(finished)
        # the plan changed (a preemption): this step's tokens first, then the next step
        finished = scheduler.resolve(batch, runner.collect_decode(launch))
        self._count_decode(start)
        sampled = runner.execute(following) if following.entries else {}
        return self._outputs(finished + scheduler.update(following, sampled))

    def _chains(self, batch):
        """Whether the next step can start before ``batch``'s tokens are read (``batch``: a
        launched decode step): nobody waits to be admitted (whose prefill needs the host), and
        some request of it still runs. One that stops on this token (a stop, or its length)
        costs a row of the next step; the step after leaves it out."""
        if not self.async_scheduling or self.scheduler.num_waiting:
            return False
        running = RequestStatus.RUNNING
        return any(e.request.status is running for e in batch.entries)

    def _count_decode(self, start):
        runner = self.runner
        if runner.last_replayed:
            self.decode_stats.add(time.perf_counter() - start, runner.last_wait,
                                  runner.last_gpu_idle)

    def _outputs(self, finished):
        return [self._output(r) for r in finished]

    def _text(self, request):
        if self.tokenizer is None:
            return ""
        if request.text is not None:
            return request.text
        return self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)

    def _output(self, request):
        prompt, _ = self._prompts.pop(request.request_id)
        return RequestOutput(request.request_id, prompt, list(request.prompt_token_ids),
                             list(request.output_token_ids), self._text(request),
                             request.finish_reason)

    def generate(self, prompts, sampling=None):
        """Generate for ``prompts`` (a str, a list of token ids, or a list of either) with
        ``sampling`` (one ``SamplingParams`` for all, or one per prompt). Returns one
        ``RequestOutput`` per prompt, in order; a bad request's has finish_reason "error"."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and
            isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(
            prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: expected one SamplingParams or {len(prompts)}, got "
                             f"{len(params)}")
        outputs, slot = [None] * len(prompts), {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                slot[self.add_request(prompt, sp)] = i
            except (TypeError, ValueError) as exc:
                outputs[i] = RequestOutput(None, prompt, [], finish_reason="error",
                                           error=str(exc))
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in slot:
                    outputs[slot[out.request_id]] = out
        return outputs

    def close(self):
        """Stop the tensor-parallel workers and leave their group (nothing to do with
        ``tensor_parallel_size=1``); the LLM runs no step after. Also done when it is
        garbage-collected or at exit."""
        if self._tp is not None:
            self.runner.graphs.clear()      # graphs holding collectives go before the group
            self._tp.close()

    def stream(self, prompt, sampling=None):
        """Yield the text of one request's new tokens as they are produced."""
        request_id = self.add_request(prompt, sampling)
        request = self.request(request_id)
        shown = ""
        while True:
            done = any(out.request_id == request_id for out in self.step())
            text = self._text(request)
            if text.startswith(shown) and len(text) > len(shown) and (
                    done or not text.endswith("\ufffd")):
                yield text[len(shown):]
                shown = text
            if done:
                return
