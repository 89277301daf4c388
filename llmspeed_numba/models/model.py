"""``Model``: a loaded checkpoint (config, tokenizer, weights on the device) and greedy
generation for a batch of prompts: one packed prefill, then one decode step per new token.

The engine (scheduling, sampling, CUDA graphs) is built on ``LlamaModel.forward``; this is the
plain loop it is checked against.
"""

import time
from dataclasses import dataclass, field

import numpy as np

from .._arrays import dtype_name
from ._dtypes import torch_dtype
from .decode_graph import DecodeGraph
from .llama import BLOCK_SIZE, LlamaModel, Step, check_quantization, decode_step, to_device

#: Model dtypes (the attention kernels take half precision only).
DTYPES = ("bfloat16", "float16")


def model_dtype(dtype):
    """A model's dtype as a torch dtype: "bfloat16" / "float16" or the torch dtype."""
    dt = torch_dtype(dtype)
    if dtype_name(dt, "dtype") not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES} for a model, got {dtype!r}")
    return dt


@dataclass
class Timings:
    """Wall times of the last ``generate_greedy`` call, in seconds (the device synchronised at
    each token, as the loop reads every token back)."""

    prefill: float = 0.0
    decode_steps: list = field(default_factory=list)

    @property
    def decode_per_token(self):
        return float(np.median(self.decode_steps)) if self.decode_steps else 0.0


class Model:
    """A model ready to run: ``config`` (``ModelConfig``), ``tokenizer``, and the device weights.

    ``generate_greedy(prompt_token_ids, max_new_tokens)`` decodes a batch greedily;
    ``prefill_logits(prompt_token_ids)`` returns every position's logits (for checks).
    ``quantization``: None, "int4", "int8", "fp8" or "gguf" (``llama``'s module docstring).
    ``tp``: None, or a ``distributed.Communicator``: this process runs its rank's share of the
    model (tensor parallelism), the whole model's ``weights`` given on every rank (each keeps
    its shards); every rank then makes the same calls.
    """

    def __init__(self, config, tokenizer, weights, dtype="bfloat16", quantization=None, *,
                 tp=None):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = model_dtype(dtype)
        if tp is None:
            self.llama = LlamaModel(config, weights, self.dtype, quantization)
        else:
            from ..distributed import (TensorParallel, check_tensor_parallel, shard_config,
                                       shard_weights)

            check_tensor_parallel(config, tp.size, quantization)
            self.llama = LlamaModel(shard_config(config, tp.size),
                                    shard_weights(weights, config, tp.rank, tp.size),
                                    self.dtype, quantization,
                                    tp=TensorParallel(tp, config.vocab_size))
        self.timings = Timings()

    # ---- checks ----------------------------------------------------------------------------

    def _check_prompts(self, prompt_token_ids, max_new_tokens):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TypeError(f"max_new_tokens: expected an int, got "
                            f"{type(max_new_tokens).__name__}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens}")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids: expected a non-empty list of token-id lists")
        vocab = self.config.vocab_size
        prompts = []
        for b, prompt in enumerate(prompt_token_ids):
            ids = np.asarray(prompt)
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"prompt_token_ids[{b}]: expected a non-empty list of ints, got "
                                 f"{type(prompt).__name__} of shape {ids.shape}")
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"prompt_token_ids[{b}]: token ids must be in [0, {vocab}), got "
                                 f"min {ids.min()}, max {ids.max()}")
            limit = self.llama.max_position
            if ids.size + max_new_tokens > limit:
                raise ValueError(
                    f"prompt_token_ids[{b}]: {ids.size} prompt tokens + max_new_tokens "
                    f"{max_new_tokens} exceed the model's context of {limit} positions "
                    f"(max_position_embeddings)")
            prompts.append(ids.astype(np.int64))
        return prompts

    # ---- steps -----------------------------------------------------------------------------

    def _device(self, array):
        return to_device(array, self.llama.device)

    def _prefill_step(self, cache, seqs, prompts):
        lengths = [p.size for p in prompts]
        for seq, n in zip(seqs, lengths):
            cache.extend(seq, n)
        table, _ = cache.host_tables(seqs)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return Step(
            token_ids=self._device(np.concatenate(prompts)),
            positions=self._device(np.concatenate([np.arange(n, dtype=np.int32)
                                                   for n in lengths])),
            token_tables=self._device(np.repeat(table, lengths, axis=0)),
            last_rows=self._device(cu[1:].astype(np.int64) - 1),
            cu_seqlens=self._device(cu), max_seqlen=max(lengths))

    @staticmethod
    def _advance(cache, seqs, width=None):
        """Grow ``seqs`` by one token in ``cache``: host ``(positions, block_table, seq_lens)``
        of the step (each sequence's new position, its pages, its length after the step)."""
        before = np.array([cache.length(s) for s in seqs], np.int32)
        cache.extend(seqs, 1)
        table, after = cache.host_tables(seqs, width=width)
        return before, table, after

    def _decode_step(self, cache, seqs, tokens, width=None):
        """The eager ``Step`` feeding ``tokens`` to ``seqs`` (their pages grown by one)."""
        before, table, after = self._advance(cache, seqs, width)
        return decode_step(self.llama.device, tokens, before, table, after)

    def _decode(self, cache, seqs, tokens, width, graphs):
        """One greedy decode step of ``seqs`` fed ``tokens``: their next tokens (a list).
        ``graphs``: None (eager), or a dict of ``DecodeGraph`` by batch size to replay from."""
        if graphs is None:
            return self.llama.greedy(self._decode_step(cache, seqs, tokens, width),
                                     cache).tolist()
        before, table, after = self._advance(cache, seqs, width)
        graph = graphs.get(len(seqs))
        if graph is None:
            graph = graphs[len(seqs)] = DecodeGraph(self.llama, cache, len(seqs), width)
        return graph.run(np.asarray(tokens, np.int64), before, table, after)

    def _new_cache(self, prompts, max_new_tokens):
        pages = sum(-(-(p.size + max_new_tokens) // BLOCK_SIZE) for p in prompts)
        cache = self.llama.new_cache(max(pages, 1))
        return cache, [cache.add_sequence() for _ in prompts]

    # ---- public ----------------------------------------------------------------------------

    def prefill_logits(self, prompt_token_ids):
        """float32 logits (len, vocab) of every position of each prompt (a list of CPU
        tensors), from one packed prefill."""
        prompts = self._check_prompts(prompt_token_ids, 0)
        cache, seqs = self._new_cache(prompts, 0)
        logits = self.llama.forward(self._prefill_step(cache, seqs, prompts), cache,
                                    all_logits=True).cpu()
        bounds = np.cumsum([0] + [p.size for p in prompts])
        return [logits[bounds[b]:bounds[b + 1]] for b in range(len(prompts))]

    def generate_greedy(self, prompt_token_ids, max_new_tokens, *, stop_at_eos=True,
                        cuda_graphs=None):
        """Greedy continuation of each prompt (a list of token-id lists of any lengths).

        Returns one list of new token ids per prompt, at most ``max_new_tokens`` long; with
        ``stop_at_eos`` a sequence ends at (and includes) its first end-of-sequence token.
        ``cuda_graphs`` (default: on a GPU) replays each batch size's decode step from a CUDA
        graph (``decode_graph``) instead of calling the ops from Python.
        Raises ``ValueError`` for empty prompts, ids outside the vocabulary, or a prompt plus
        ``max_new_tokens`` longer than the model's context.
        """
        prompts = self._check_prompts(prompt_token_ids, max_new_tokens)
        eos = set(self.config.eos_token_id or ()) if stop_at_eos else set()
        out = [[] for _ in prompts]
        self.timings = Timings()
        if max_new_tokens == 0:
            return out
        if cuda_graphs is None:
            cuda_graphs = self.llama.device == "cuda"
        elif cuda_graphs and self.llama.device != "cuda":
            raise ValueError("cuda_graphs: CUDA graphs need a GPU (this is the simulator)")
        graphs = {} if cuda_graphs else None
        cache, seqs = self._new_cache(prompts, max_new_tokens)
        width = -(-(max(p.size for p in prompts) + max_new_tokens) // BLOCK_SIZE)
        start = time.perf_counter()
        tokens = self.llama.greedy(self._prefill_step(cache, seqs, prompts), cache).tolist()
        self.timings.prefill = time.perf_counter() - start
        active = list(range(len(prompts)))
        while True:
            for b, token in zip(active, tokens):
                out[b].append(int(token))
            going = [(b, t) for b, t in zip(active, tokens)
                     if t not in eos and len(out[b]) < max_new_tokens]
            if not going:
                break
            active, tokens = [b for b, _ in going], [t for _, t in going]
            start = time.perf_counter()
            tokens = self._decode(cache, [seqs[b] for b in active], tokens, width, graphs)
            self.timings.decode_steps.append(time.perf_counter() - start)
        return out

    def release(self):
        """Free the model's device memory."""
        self.llama.release()


def load_model(model=None, *, dtype="bfloat16", quantization=None):
    """Load a checkpoint onto the device: ``model`` is a Hugging Face directory, a .gguf file,
    or None for the embedded default (SmolLM2-135M-Instruct). GGUF block types are dequantized
    to ``dtype`` ("bfloat16" or "float16"), except with ``quantization="gguf"``, which keeps a
    GGUF's Q4_0 / Q4_1 / Q8_0 projection weights packed; "int4" / "int8" / "fp8" quantize the
    projections at load (``llama``'s module docstring). Errors name the file, tensor or limit
    at fault (ValueError for "gguf" on a checkpoint without such blocks); a failed load leaves
    nothing on the device."""
    from .checkpoint import load_checkpoint

    dt = model_dtype(dtype)
    quantization = check_quantization(quantization)
    if quantization is None:
        config, weights, tokenizer = load_checkpoint(model, dt)
        return Model(config, tokenizer, weights, dt)
    config, weights, tokenizer = load_checkpoint(model, dt, keep_blocks=quantization == "gguf")
    return Model(config, tokenizer, weights, dt, quantization)
