"""What gradcompress refuses under torchft, and why: these run without torchft installed (the refusals come before
any torchft call), unlike the scenarios of tests/test_torchft.py."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("make", ["CompressedAdam", "OneBitAdam", "DeMo"])
def test_optimizers_that_exchange_inside_step_refuse_a_manager(make):
    """They exchange inside optimizer.step(), after torchft's should_commit: refused, saying why and what instead."""
    import torch

    import gradcompress.optim as optim

    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="after torchft's should_commit.*DistributedDataParallel"):
        getattr(optim, make)(params, manager=object())


def test_auto_and_hierarchical_topologies_are_refused_under_torchft():
    import gradcompress
    from gradcompress.integrations.torchft import Compressor
    from gradcompress.quorum import under

    with pytest.raises(ValueError, match="'auto' is not supported"):
        Compressor("auto", manager=object())
    with pytest.raises(ValueError, match="'auto' is not supported"):
        gradcompress.Compressor("auto", coordinator=under(object()))
    with pytest.raises(ValueError, match="topology must be 'flat'"):
        Compressor("int8", manager=object(), topology=2)
    with pytest.raises(ValueError, match="topology must be 'flat'"):
        gradcompress.Compressor("int8", topology=2, coordinator=under(object()))


def test_diloco_refuses_what_it_cannot_do_under_a_manager():
    import torch

    from gradcompress.optim import DiLoCo

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"delay must be at most sync_every // fragments \(2\); got delay=3"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=4, fragments=2, delay=3, manager=object())
    with pytest.raises(ValueError, match="process_group and a hierarchical topology do not apply"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=4, topology=2, manager=object())


def test_a_programming_error_in_a_collective_is_raised_not_reported():
    """A fault of the group (a peer gone, a timeout) is reported to the Manager and loses the step; an error of
    our own code (a TypeError, an AttributeError) is raised: it is no fault of the group and must not hide."""
    import torch

    from gradcompress.quorum import QuorumCollectives

    class Manager:
        def __init__(self):
            self.errors = []

        def report_error(self, error):
            self.errors.append(error)

    class Group:
        def allreduce(self, tensors, opts):
            raise RuntimeError("Connection closed by peer")

        def allgather(self, outs, ins, opts):
            raise AttributeError("no such method")

    m = Manager()
    comm = QuorumCollectives(m, Group())
    comm.world = 2
    comm.wait([comm.all_reduce(torch.zeros(3))])
    assert comm.failed and len(m.errors) == 1
    comm.failed = False
    with pytest.raises(AttributeError, match="no such method"):
        comm.all_gather(torch.zeros(3))
