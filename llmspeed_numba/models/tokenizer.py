"""Text <-> token ids and the chat template, for a Hugging Face directory or a GGUF file.

A Hugging Face directory has ``tokenizer.json`` (loaded by the ``tokenizers`` library) and
``tokenizer_config.json`` (chat template, bos / eos, ``add_bos_token``). A GGUF file stores the
vocabulary as metadata; for byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3,
Qwen2) we rebuild the ``tokenizers`` BPE from it, with the pre-tokenizer named by
``tokenizer.ggml.pre`` (llama.cpp's regexes for that name); SentencePiece vocabularies
(``"llama"``) go through transformers' GGUF converter.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

# llama.cpp's tokenizer.ggml.pre names, grouped by the split they stand for.
# GPT-2's regex, applied by ByteLevel itself.
_PRE_GPT2 = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
# Every digit its own piece, then GPT-2's regex: llama.cpp splits by "\p{N}" first for these,
# as SmolLM2's own tokenizer.json does with Digits(individual_digits=True).
_PRE_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_SUPPORTED_PRE = _PRE_GPT2 + _PRE_DIGITS + tuple(_PRE_SPLITS)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """Encode / decode and the chat template of one model.

    Attributes: ``bos_token_id`` (int or None), ``eos_token_ids`` (set of ints: every token that
    ends generation), ``vocab_size`` (including added tokens), ``chat_template`` (str or None).
    """

    def __init__(self, backend, *, bos_token=None, eos_tokens=(), chat_template=None,
                 add_bos_token=None, add_eos_token=False, eos_token_ids=()):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.chat_template = chat_template
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        ids = {backend.token_to_id(t) for t in eos_tokens} | set(eos_token_ids)
        self.eos_token_ids = {i for i in ids if i is not None}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # tokenizer.json's post-processor may add BOS already (Llama 2/3): find out, then add or
        # drop it so that add_bos_token, when given, decides.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._backend_adds_bos = bool(probe) and probe[0] == self.bos_token_id
        self._add_bos = self._backend_adds_bos if add_bos_token is None else bool(add_bos_token)
        self._add_eos = bool(add_eos_token) and self.eos_token is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS first when the model wants it."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            if self._add_bos and not self._backend_adds_bos:
                ids = [self.bos_token_id] + ids
            elif not self._add_bos and self._backend_adds_bos and ids[:1] == [self.bos_token_id]:
                ids = ids[1:]
        if add_special_tokens and self._add_eos:
            ids = ids + [self.backend.token_to_id(self.eos_token)]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (a sequence of ints)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered
        with the model's jinja2 chat template in a sandbox, as transformers renders it
        (``bos_token``, ``eos_token``, ``raise_exception``, ``strftime_now``; extra ``kwargs``
        are template variables). Raises ValueError when the model has no chat template."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict)
                                                              for m in messages):
            raise TypeError("messages: expected a list of dicts with 'role' and 'content'")
        return _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja`` and
        ``generation_config.json`` when present). Raises FileNotFoundError naming a missing
        file, ValueError naming a corrupt one."""
        import tokenizers

        path = os.fspath(path)
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        except Exception as e:
            raise ValueError(f"{tokenizer_json}: not a readable tokenizer ({e})") from None
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        eos = _token_content(config.get("eos_token"))
        generation = _read_json(os.path.join(path, "generation_config.json")) or {}
        eos_ids = generation.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        return cls(backend, bos_token=_token_content(config.get("bos_token")),
                   eos_tokens=(eos,) if eos else (), chat_template=template,
                   add_bos_token=config.get("add_bos_token"),
                   add_eos_token=config.get("add_eos_token", False), eos_token_ids=eos_ids)

    @classmethod
    def from_gguf(cls, reader_or_path) -> Tokenizer:
        """From a GGUF's ``tokenizer.*`` metadata (a path or a ``gguf.GGUFReader``).

        Raises ValueError naming the file when it has no tokenizer, NotImplementedError for an
        unknown tokenizer model or pre-tokenizer, ImportError (saying what to install) for a
        SentencePiece vocabulary without transformers."""
        from .gguf_loader import gguf_field, open_gguf

        reader = reader_or_path if hasattr(reader_or_path, "fields") else open_gguf(reader_or_path)
        where = getattr(reader, "_llmspeed_path", "GGUF")
        kind = gguf_field(reader, "tokenizer.ggml.model")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise ValueError(f"{where}: no tokenizer metadata (tokenizer.ggml.model / tokens)")
        if kind == "gpt2":
            backend = _byte_level_bpe(reader, tokens, where)
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_via_transformers(where)
            add_bos_default = True  # llama.cpp adds BOS to SentencePiece vocabularies by default
        else:
            raise NotImplementedError(f"{where}: tokenizer.ggml.model {kind!r} is not supported; "
                                      "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)")

        def token(key):
            i = gguf_field(reader, f"tokenizer.ggml.{key}")
            return None if i is None or not 0 <= i < len(tokens) else tokens[i]

        # llama.cpp ends generation on eos and on the end-of-turn / end-of-message tokens.
        eos_ids = [i for i in (gguf_field(reader, f"tokenizer.ggml.{k}_token_id")
                               for k in ("eos", "eot", "eom")) if i is not None]
        eos = token("eos_token_id")
        return cls(backend, bos_token=token("bos_token_id"), eos_tokens=(eos,) if eos else (),
                   chat_template=gguf_field(reader, "tokenizer.chat_template"),
                   add_bos_token=gguf_field(reader, "tokenizer.ggml.add_bos_token",
                                            add_bos_default),
                   add_eos_token=gguf_field(reader, "tokenizer.ggml.add_eos_token", False),
                   eos_token_ids=eos_ids)


def _byte_level_bpe(reader, tokens, where):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from .gguf_loader import gguf_field

    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _SUPPORTED_PRE:
        raise NotImplementedError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported; "
                                  f"supported: {', '.join(_SUPPORTED_PRE)}")
    merges = gguf_field(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{where}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelling = _byte_spelling()
    # A token outside the byte alphabet (a few files store some raw) is respelled, as
    # transformers does, so it can be matched.
    vocab = {}
    for i, t in enumerate(tokens):
        t = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    # BPE vocabularies get no prefix space (llama.cpp's add_space_prefix is for SentencePiece).
    if pre in _PRE_GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _PRE_DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special and always matched whole; user-defined ones are
    # matched whole but not special. A control token outside the byte alphabet is a mislabel.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types)
                                if k == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
    return backend


def _sentencepiece_via_transformers(where):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(
            f"{where}: its tokenizer is SentencePiece (tokenizer.ggml.model 'llama'); building "
            "it needs transformers: pip install transformers") from None
    folder, name = os.path.split(os.path.abspath(where))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name).backend_tokenizer


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset:
    return frozenset(_byte_spelling().values())


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which templates do not expect
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def _token_content(token):
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path):
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
