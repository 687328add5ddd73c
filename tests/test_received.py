"""What an exchange receives is checked before it is used (issue 38): a payload a peer sent that cannot be used as
sent (a position out of range, sizes that do not add up, values and positions of different counts) is never added;
on the plain path the step raises one clear error naming the rank, the key and the problem (not an IndexError
inside a codec) and commits nothing; under a quorum it is reported (the step fails) and nothing is raised.

A stand-in group of 2 (``LocalCollectives(2)``: every rank holds this rank's tensors) whose all-gather garbles
rank 1's buffer the way a peer gone mid-gather or a corrupted link would."""

from __future__ import annotations

import pytest
import torch

import gradcompress
from gradcompress.codecs.base import PayloadError
from gradcompress.collectives import LocalCollectives


class Garbled(LocalCollectives):
    """Rank 1's part of every all-gather replaced by ``garble(tensor)``; which all-gather: ``at`` (0: the first)."""

    def __init__(self, garble, at=None):
        super().__init__(2)
        self.garble, self.at, self.calls = garble, at, 0

    def all_gather(self, t):
        outs, work = super().all_gather(t)
        if self.at is None or self.calls == self.at:
            outs[1] = self.garble(outs[1])
        self.calls += 1
        return outs, work


def _indices_out_of_range(buf: torch.Tensor) -> torch.Tensor:
    """topk's payload bytes: float32 values then int32 positions; every position set to 10**6 (out of range)."""
    out = buf.clone()
    half = out.numel() // 2
    out[half:].view(torch.int32).fill_(10**6)
    return out


def _grads(n=4096, keys=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for _ in range(keys)]


def test_a_position_out_of_range_is_one_clear_error_naming_the_rank():
    comp = gradcompress.Compressor("topk:ratio=0.01", min_numel=0)
    grads = _grads()
    with pytest.raises(PayloadError, match=r"rank 1's payload for key 0: a position out of range"):
        with comp.step(Garbled(_indices_out_of_range)) as step:
            step.drive([step.exchange([0], grads[:1])])
    assert comp.state.step == 0 and comp.residual == {}  # nothing committed
    with comp.step(LocalCollectives(2)) as step:  # the next step works
        step.drive([step.exchange([0], grads[:1])])
    assert step.committed


@pytest.mark.parametrize("spec", ["threshold:value=0.5", "dgc:ratio=0.05"])
def test_sizes_that_do_not_add_up_are_one_clear_error(spec):
    """Variable-size payloads announce their sizes first: a count that is negative, too large for the tensor or
    does not add up to the bytes announced is refused before anything is allocated from it."""
    comp = gradcompress.Compressor(spec, min_numel=0)

    def garble(counts):
        out = counts.clone()
        out[0] = 10**12  # an element count far beyond the tensor
        return out

    with pytest.raises(PayloadError, match=r"rank 1's payload .*announced sizes"):
        with comp.step(Garbled(garble, at=0)) as step:
            step.drive([step.exchange([0], _grads(keys=1))])


def test_dct_positions_out_of_range_are_refused():
    comp = gradcompress.Compressor("dct:chunk=16,topk=8", min_numel=0)

    def garble(buf):
        out = buf.clone()
        out[-16:] = 255  # the trailing position bytes: offsets beyond the chunk's coefficients
        return out

    with pytest.raises(PayloadError, match="rank 1's payload for key 0"):
        with comp.step(Garbled(garble)) as step:
            step.drive([step.exchange([0], [torch.randn(64, 64)])])


def test_under_a_quorum_a_malformed_payload_fails_the_step_without_raising():
    """The step's terms name who hears of it (a quorum: its Manager's report_error): nothing is raised, nothing
    committed, the rest of the exchange runs (every collective still issued: no peer left waiting)."""
    from gradcompress.terms import Coordinator, Terms
    from gradcompress.schedule import plan_at

    heard = []

    class Reporting(Coordinator):
        def __init__(self, comp):
            self.config = comp.options

        def open(self, comm, index):
            return Terms(plan_at(self.config, index), index, 2, fault=heard.append)

    comp = gradcompress.Compressor("topk:ratio=0.01", min_numel=0, coordinator=Reporting)
    comm = Garbled(_indices_out_of_range)
    with comp.step(comm) as step:
        step.drive([step.exchange([0, 1], _grads())])
    assert step.committed is False and step.finite is False and comm.calls == 1
    assert len(heard) == 1 and isinstance(heard[0], PayloadError) and "rank 1" in str(heard[0])
    assert comp.state.step == 0 and comp.residual == {}


def test_well_formed_payloads_are_not_flagged():
    for spec in ("topk:ratio=0.01", "threshold:value=0.5", "dgc:ratio=0.05", "dct:chunk=16,topk=8",
                 "topk:ratio=0.05,chunk=64,values=int2"):
        comp = gradcompress.Compressor(spec, min_numel=0)
        with comp.step(LocalCollectives(3)) as step:
            step.drive([step.exchange([0, 1], [torch.randn(64, 64), torch.randn(1000)])])
        assert step.committed, spec
