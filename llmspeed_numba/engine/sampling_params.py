"""Sampling parameters of one request, with vLLM's names and defaults.

``temperature=0`` is greedy (argmax); ``top_k=0``, ``top_p=1`` and ``min_p=0`` disable those
filters. ``stop`` strings need a detokenizer (see ``Scheduler``); ``stop_token_ids`` and the
model's eos ids (unless ``ignore_eos``) end a request with finish_reason "stop", ``max_tokens``
with "length".
"""

import math
from dataclasses import dataclass
from numbers import Integral, Real

__all__ = ["SamplingParams"]


def _is_int(value):
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples and when it stops. ``validate()`` checks every field."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @property
    def stop_strings(self):
        """``stop`` as a tuple (a single string is one stop string)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def validate(self):
        """Raise ``TypeError`` for a field of the wrong type, ``ValueError`` for one out of
        range, each naming the field; return ``self``."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_real("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected a finite number >= 0, got "
                             f"{self.temperature!r}")
        _check_int("top_k", self.top_k, low=0, hint=" (0 disables top-k)")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, hint=" or None")
        self._validate_stop()
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids: expected a list of ints or None, got "
                                f"{type(self.stop_token_ids).__name__}")
            for token in self.stop_token_ids:
                _check_int("stop_token_ids", token, low=0, what="token id")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__}")
        return self

    def _validate_stop(self):
        if self.stop is None or isinstance(self.stop, str):
            strings = self.stop_strings
        elif isinstance(self.stop, (list, tuple)):
            strings = self.stop
        else:
            raise TypeError(f"stop: expected a string, a list of strings or None, got "
                            f"{type(self.stop).__name__}")
        for s in strings:
            if not isinstance(s, str):
                raise TypeError(f"stop: expected strings, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop: the empty string would stop at once; remove it")


def _check_int(name, value, *, low, hint="", what="an int"):
    if not _is_int(value):
        raise TypeError(f"{name}: expected {what}{hint}, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name}: expected {what} >= {low}{hint}, got {value}")


def _check_real(name, value):
    if not _is_real(value):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
