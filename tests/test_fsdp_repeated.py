"""FSDP2 module groups reduce-scattered more than once per training step (issue 47): torchtitan's chunked loss
(the ``[norm, head]`` group's head gradient in the chunks' backward, its norm gradient in the decoder's) and a
module called twice in one forward. Each buffer has state of its own, keyed by the parameters it holds; every call
is compressed, counted and committed. Real gloo workers, each run with a timeout."""

from __future__ import annotations

import pytest
import torch

import chunked_workers as cw
from gradcompress.adapters.fsdp_keys import GroupKeys
from gradcompress.testbed import launch

TIMEOUT = 240
STEPS = 6
PATTERNS = ["chunked", "twice"]


class _Step:
    """A stand-in for a compressor step: only its identity matters to the keys."""


def test_keys_name_the_parameters_in_the_buffer() -> None:
    first, step = _Step(), _Step()
    keys = GroupKeys("fsdp:out", [("norm.weight", 32), ("norm.bias", 32), ("out.weight", 160), ("out.bias", 5)])
    assert keys.key(first, 229) == "fsdp:out"                      # the whole group: the key of earlier versions
    assert keys.key(first, 165) == "fsdp:out[out.weight,out.bias]"
    assert keys.key(first, 64) == "fsdp:out[norm.weight,norm.bias]"
    assert keys.key(first, 32) == "fsdp:out[32/rank]"              # norm.weight or norm.bias: the size cannot tell
    assert keys.key(first, 64) == "fsdp:out[norm.weight,norm.bias]#2"  # the same buffer again in the same step
    assert keys.key(step, 64) == "fsdp:out[norm.weight,norm.bias]"  # a new step counts afresh
    assert GroupKeys("fsdp:x", []).key(step, 7) == "fsdp:x"    # no view of FSDP's group: one key, as before


@pytest.fixture(scope="module", params=PATTERNS)
def feedback(request):
    return request.param, launch.run(cw.feedback_runs, 2, request.param, "int8", STEPS, timeout=TIMEOUT)


@pytest.mark.slow
def test_each_buffer_has_its_own_state(feedback) -> None:
    pattern, results = feedback
    for r in results:
        assert "fsdp:head[head.weight,head.bias]" in r["keys"] and "fsdp:head[norm.weight,norm.bias]" in r["keys"]
        assert "fsdp:head" not in r["keys"], r["keys"]


@pytest.mark.slow
def test_error_feedback_invariant_holds_on_every_buffer(feedback) -> None:
    """Same gradients every step: what was delivered over T steps plus the ranks' mean residual is T times the
    exact average, for every parameter — those of the group reduced in parts included."""
    pattern, results = feedback
    for r in results:
        for name, exact in r["exact"].items():
            total = r["delivered"][name] + r["residual"][name]
            scale = STEPS * float(exact.abs().max()) + 1e-12
            assert torch.allclose(total, STEPS * exact, rtol=1e-4, atol=1e-5 * scale), (pattern, name)


@pytest.mark.slow
def test_every_call_is_counted() -> None:
    """Each parameter is reduced once per training step in both layouts: the same raw bytes as one whole backward;
    the chunked loss's two backward passes are two compressor steps, the module called twice one."""
    whole = launch.run(cw.feedback_runs, 2, "whole", "int8", 3, timeout=TIMEOUT)[0]["stats"]
    for pattern, steps in (("chunked", 6), ("twice", 3)):
        stats = launch.run(cw.feedback_runs, 2, pattern, "int8", 3, timeout=TIMEOUT)[0]["stats"]
        assert stats["steps"] == steps, (pattern, stats["steps"])
        assert stats["raw_bytes"] == whole["raw_bytes"], pattern
        assert 3.5 < stats["ratio"] <= whole["ratio"] * 1.01, (pattern, stats["ratio"], whole["ratio"])


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_none_is_plain_fsdp(pattern: str) -> None:
    for r in launch.run(cw.repeated_runs, 2, pattern, ["plain", "none"], 2, timeout=TIMEOUT):
        for got, ref in zip(r["none"]["grads"], r["plain"]["grads"]):
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(got, ref)), pattern


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "topk:ratio=0.1"])
def test_chunked_training_resumes_exactly(scheme: str) -> None:
    for r in launch.run(cw.training_runs, 2, "chunked", scheme, 6, 3, timeout=TIMEOUT):
        assert r["straight"]["losses"] == r["resumed"]["losses"], scheme
        assert all(torch.equal(a, b) for a, b in zip(r["straight"]["params"], r["resumed"]["params"])), scheme
