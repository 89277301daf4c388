"""``_overrides``: the one way tests and benchmarks force a kernel choice. Unknown scopes, knobs
and values are refused at the ``with``; blocks nest and restore; entering and leaving forgets
every recorded call plan, so a fast path never replays a kernel chosen under other settings."""

import pytest

from llmspeed_numba import _replay, compile_check
from llmspeed_numba._overrides import Knobs, known, overrides
from llmspeed_numba._launch import sm_count
from llmspeed_numba.ops import _paged_decode_plan, _rowwise, flash_attn, paged_decode
from llmspeed_numba.ops import softmax as sm_mod


# every ops module imported, as in the whole suite: each declares its scope at import
compile_check._import_ops()


def test_every_op_scope_is_declared():
    scopes = known()
    assert {"flash_attn", "paged_prefill", "paged_decode", "softmax", "rms_norm", "rotary",
            "activations", "sample", "rowwise", "split_rows", "device"} <= set(scopes)
    assert scopes["flash_attn"] == {"impl": None, "config": None,
                                    "tma_min_work": flash_attn.TMA_MIN_WORK}
    assert scopes["rowwise"]["min_block_threads"] == _rowwise.MIN_BLOCK_THREADS


def test_values_inside_and_restored_after():
    assert sm_mod.TUNING.split_path == "auto"
    sms = sm_count()
    with overrides(softmax={"split_path": "streamed", "splits": 3}):
        assert (sm_mod.TUNING.split_path, sm_mod.TUNING.splits) == ("streamed", 3)
        with overrides(softmax={"splits": 5}, device={"sm_count": 132}):
            assert (sm_mod.TUNING.split_path, sm_mod.TUNING.splits) == ("streamed", 5)
            assert sm_count() == 132
        assert (sm_mod.TUNING.split_path, sm_mod.TUNING.splits) == ("streamed", 3)
        assert sm_count() == sms
    assert (sm_mod.TUNING.split_path, sm_mod.TUNING.splits, sm_mod.TUNING.spin_polls) == (
        "auto", None, sm_mod.SPIN_POLLS)


def test_restored_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with overrides(rowwise={"min_block_threads": 32}):
            raise RuntimeError
    assert _rowwise.TUNING.min_block_threads == _rowwise.MIN_BLOCK_THREADS


def test_lists_become_tuples():
    with overrides(paged_decode={"tuning": [2, 2, False]}):
        assert paged_decode.TUNING.tuning == (2, 2, False)


@pytest.mark.parametrize("scopes, message", [
    ({"softmaxx": {}}, "unknown scope 'softmaxx'"),
    ({"softmax": {"split": 2}}, "softmax has no knob 'split'"),
    ({"softmax": {"split_path": "two_kernels"}}, r"softmax.split_path: expected one of"),
    ({"flash_attn": {"impl": "cudnn"}}, r"flash_attn.impl: expected one of"),
])
def test_unknown_scopes_knobs_and_values(scopes, message):
    with pytest.raises(ValueError, match=message):
        with overrides(**scopes):
            pass
    assert sm_mod.TUNING.split_path == "auto"


def test_not_a_dict():
    with pytest.raises(TypeError, match="softmax: expected a dict"):
        with overrides(softmax=("split_path", "streamed")):
            pass


def test_a_scope_is_declared_with_one_set_of_knobs_and_names_checked():
    with pytest.raises(ValueError, match="declared twice, with other knobs"):
        Knobs("softmax", splits=None)
    with pytest.raises(ValueError, match="reserved"):
        Knobs("test_overrides_reserved", defaults=1)
    with pytest.raises(AttributeError, match="no knob 'nope'"):
        sm_mod.TUNING.nope  # noqa: B018


def test_entering_and_leaving_forget_recorded_plans():
    calls = _replay.OpCalls("test_overrides_op")
    calls.plans["key"] = object()
    _paged_decode_plan.launch_plan(1, 1, 4, 1, 16, 16, 2, "float16")
    with overrides(softmax={"splits": 2}):
        assert not calls.plans and _paged_decode_plan.launch_plan.cache_info().currsize == 0
        calls.plans["inside"] = object()
        _paged_decode_plan.launch_plan(1, 1, 4, 1, 16, 16, 2, "float16")
    assert not calls.plans and _paged_decode_plan.launch_plan.cache_info().currsize == 0
