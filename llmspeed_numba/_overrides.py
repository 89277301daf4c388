"""Forcing a kernel choice: the one way tests and benchmarks steer what an op launches.

An op's planner reads its tunable settings (a tile configuration, a split count, the threads of
a block) through a ``Knobs`` declared in its module, whose defaults are the module's documented
constants. ``overrides`` replaces some of them for the duration of a ``with`` block:

    from llmspeed_numba._overrides import overrides

    with overrides(flash_attn={"impl": "simt", "config": (16, 16)}):
        flash_attn(q, k, v)                  # the SIMT kernel, 16 x 16 tiles
    with overrides(rowwise={"min_block_threads": 32}, split_rows={"split_threads": 8}):
        softmax(x)                           # launch configurations the simulator runs quickly

Each keyword is a scope (``known()`` lists them with their knobs and defaults: one per op, and
``rowwise`` / ``split_rows`` / ``device`` for the layers several ops share); an unknown scope,
knob or value is a ``ValueError`` at the ``with``. Blocks nest (the inner value wins) and are
process-wide, not per thread. Entering and leaving a block forgets every recorded call plan
(``_recording.clear``): a repeated-call fast path never replays a kernel chosen under other
settings.

Public signatures carry no such settings, and no module global is patched to change them.
"""

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from . import _recording

#: scope -> its ``Knobs``, in declaration order.
_DECLARED: dict[str, "Knobs"] = {}
#: scope -> {knob: value} of the active ``overrides`` blocks (a scope's dict is replaced, never
#: changed in place).
_ACTIVE: dict[str, dict[str, Any]] = {}


class Knobs:
    """The settings of one scope a planner reads: ``knobs.name`` is the active override, else
    the default given here. ``choices`` (knob -> allowed values) is checked by ``overrides``."""

    __slots__ = ("scope", "defaults", "choices")
    scope: str
    defaults: dict[str, Any]
    choices: dict[str, tuple]

    def __init__(self, scope: str, choices: Mapping[str, tuple] | None = None,
                 **defaults: Any) -> None:
        # the same knobs again (the module reloaded, or a copy of it timed beside it) replace the
        # declaration; other knobs under a taken scope are a mistake
        old = _DECLARED.get(scope)
        if old is not None and set(old.defaults) != set(defaults):
            raise ValueError(f"overrides: scope {scope!r} declared twice, with other knobs")
        clash = set(defaults) & set(self.__slots__)
        if clash:
            raise ValueError(f"overrides: knob names {sorted(clash)} are reserved")
        unknown = set(choices or ()) - set(defaults)
        if unknown:
            raise ValueError(f"overrides: choices for unknown knobs {sorted(unknown)}")
        self.scope = scope
        self.defaults = dict(defaults)
        self.choices = dict(choices or {})
        _DECLARED[scope] = self

    def __getattr__(self, name: str) -> Any:
        try:
            default = object.__getattribute__(self, "defaults")[name]
        except KeyError:
            raise AttributeError(f"{self.scope!r} has no knob {name!r}") from None
        active = _ACTIVE.get(self.scope)
        if active is not None and name in active:
            return active[name]
        return default


def known() -> dict[str, dict[str, Any]]:
    """Every declared scope with its knobs and their defaults."""
    return {scope: dict(k.defaults) for scope, k in _DECLARED.items()}


def _frozen(value: Any) -> Any:
    """Lists become tuples (settings are hashed into kernel caches)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


@contextlib.contextmanager
def overrides(**scopes: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, planners read the given knobs' values instead of their defaults (see
    the module docstring); ``None`` for a knob whose default is None restores "planned"."""
    changed = {}
    for scope, values in scopes.items():
        knobs = _DECLARED.get(scope)
        if knobs is None:
            raise ValueError(f"overrides: unknown scope {scope!r}; expected one of "
                             f"{sorted(_DECLARED)}")
        if not isinstance(values, Mapping):
            raise TypeError(f"overrides: {scope}: expected a dict of knob values, got "
                            f"{type(values).__name__}")
        for name, value in values.items():
            if name not in knobs.defaults:
                raise ValueError(f"overrides: {scope} has no knob {name!r}; expected one of "
                                 f"{sorted(knobs.defaults)}")
            allowed = knobs.choices.get(name)
            if allowed is not None and value not in allowed:
                raise ValueError(f"overrides: {scope}.{name}: expected one of {allowed}, got "
                                 f"{value!r}")
        changed[scope] = {**_ACTIVE.get(scope, {}),
                          **{n: _frozen(v) for n, v in values.items()}}
    saved = dict(_ACTIVE)
    _ACTIVE.update(changed)
    _recording.clear()
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)
        _recording.clear()
