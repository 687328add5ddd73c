"""The core's seams that fault tolerance and per-bucket decisions build on: the session's divisor, the step's plan,
the outside commit decision, the generator depth of one DDP bucket, FSDP's asynchronous reduce-scatter.

Single-process tests run on ``LocalCollectives(W)`` (every rank holds the same tensors: a sum is W times the
tensor); the reduce-scatter runs on 2 gloo processes.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import core_workers
import gradcompress
from gradcompress import make
from gradcompress.testbed import launch
from gradcompress.collectives import LocalCollectives, Running, Stopwatch
from gradcompress.schedule import Plan

SPECS = ["none", "fp16", "int8", "int4", "topk:ratio=0.1", "powersgd:rank=2", "sign"]


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 48, generator=g), torch.randn(3000, generator=g), torch.randn(40, generator=g)]


def _average(spec, world: int, divisor=None, tensors=None, **step) -> list[torch.Tensor]:
    comp = gradcompress.Compressor(spec, min_numel=100, error_feedback=False, divisor=divisor)
    tensors = [t.clone() for t in (tensors or _tensors())]
    with comp.step(LocalCollectives(world), **step) as s:
        s.drive([s.exchange(list(range(len(tensors))), tensors)])
    return tensors


@pytest.mark.parametrize("spec", SPECS)
def test_every_exchange_divides_by_the_sessions_divisor(spec):
    """With W = 4 identical ranks the sum is 4x; dividing by 3 instead of 4 scales every result by 4/3 (the
    quantisers' scales and PowerSGD's orthonormal bases are scale-free, so only rounding differs)."""
    by_world = _average(spec, 4)
    by_three = _average(spec, 4, divisor=lambda: 3)
    for a, b in zip(by_world, by_three):
        torch.testing.assert_close(b, a * (4 / 3), rtol=3e-3, atol=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(by_world, by_three))


def test_the_default_divisor_is_the_group_size_bit_for_bit():
    for spec in SPECS:
        for a, b in zip(_average(spec, 4), _average(spec, 4, divisor=lambda: 4)):
            assert torch.equal(a, b), spec


def test_a_plan_gives_each_key_its_own_codec():
    """Keys of one group under a plan of two codecs: each key's result is the one its codec gives it alone."""
    tensors = _tensors(1)
    plan = Plan(make("int8"), {1: make("fp16"), 2: None})
    mixed = _average("int8", 2, tensors=tensors, plan=plan)
    for key, codec in ((0, make("int8")), (1, make("fp16")), (2, None)):
        alone = gradcompress.Compressor("int8", min_numel=100, error_feedback=False)
        t = [tensors[key].clone()]
        with alone.step(LocalCollectives(2), plan=Plan(codec)) as s:
            s.drive([s.exchange([key], t)])
        assert torch.equal(mixed[key], t[0]), key
    assert not torch.equal(mixed[1], _average("int8", 2, tensors=tensors)[1])


def _commit_run(agree: bool, finite: bool = True):
    comp = gradcompress.Compressor("topk:ratio=0.1", min_numel=0)
    asked = []
    g = _tensors()[0]
    if not finite:
        g[0, 0] = float("inf")
    with comp.step(LocalCollectives(1), should_commit=lambda: asked.append(1) or agree) as s:
        s.drive([s.exchange([0], [g])])
    return comp, s, asked


def test_the_outside_decision_can_veto_the_commit():
    comp, step, asked = _commit_run(agree=False)
    assert asked == [1] and step.committed is False
    state = comp.state_dict()
    assert state["step"] == 0 and state["residual"] == {}
    assert comp.stats()["skipped"] == 1 and comp.stats()["steps"] == 1
    comp, step, asked = _commit_run(agree=True)
    assert asked == [1] and step.committed is True and comp.state_dict()["step"] == 1
    assert list(comp.state_dict()["residual"]) == ["0"]


def test_the_outside_decision_is_asked_on_a_non_finite_step_too():
    """torchft's should_commit is a collective: every replica must call it every step, finite or not."""
    comp, step, asked = _commit_run(agree=True, finite=False)
    assert asked == [1] and step.committed is False and comp.state_dict()["step"] == 0


class _Probe(LocalCollectives):
    """Records, at the second round (the all-gather), the generator frames between the driver's resume and here."""

    levels = None

    def all_gather_flat(self, t):
        levels, frame = [], inspect.currentframe().f_back
        while frame is not None and frame.f_code.co_name != "_resume":
            if frame.f_code.co_flags & inspect.CO_GENERATOR:
                levels.append(frame.f_code.co_name)
            frame = frame.f_back
        self.levels = levels[::-1]
        return super().all_gather_flat(t)


def test_an_int8_ddp_bucket_resumes_through_three_generator_levels():
    """A DDP-like bucket (two matrices and a small bias; the bucket's flat buffer) under int8: from the driver's
    resume to the code that issues the second round, at most 4 generator frames (the issue's bound)."""
    comp = gradcompress.Compressor("int8", min_numel=1024)
    buffer = torch.randn(64 * 48 + 48 * 32 + 32)
    grads = [buffer[:3072].view(64, 48), buffer[3072:4608].view(48, 32), buffer[4608:]]
    probe = _Probe(4)
    step = comp.begin_step(probe)
    running = Running(step.exchange([0, 1, 2], grads, buffer), Stopwatch())
    while running.works is not None:
        running.advance(probe)
    step.end()
    assert probe.levels == ["job", "parallel", "bucketed_two_step_mean"], probe.levels  # <= 4


def test_fsdp_reduce_scatter_returns_a_work_when_async():
    results = launch.run(core_workers.async_reduce_scatter, 2, timeout=120)
    for r in results:
        assert r["types"] == ["Work", "Work", "NoneType"], r["types"]
        assert r["waited_equal"] and r["unwaited_equal"], r
        assert r["launched_before_wait"], r
