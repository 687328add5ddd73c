"""The autopilot's clocks (issue 39): right where collectives complete after ``wait()`` returns, as under NCCL.

The double: a virtual GPU with a compute stream and a communication stream in virtual time (no sleeping). Kernels
are launched (the host returns at once); a collective starts when the compute stream reaches it and runs on the
communication stream; ``wait()`` makes the compute stream wait for it and returns at once (NCCL's semantics); the
loop's ``loss.item()`` synchronises the host with the compute stream. :class:`StreamClock` marks the compute
stream (as a CUDA event recorded on the current stream would); the host clock is the double's host time.
"""

from __future__ import annotations

import pytest
import torch

from gradcompress.autopilot.measure import Meter
from gradcompress.clocks import EventClock, HostClock, for_device
from gradcompress.collectives import Collectives, LocalCollectives
from gradcompress.schedule import Plan
from gradcompress.terms import Seen, StepRecord

COMPUTE_S, OPTIMIZER_S, LAUNCH_S = 0.100, 0.005, 0.001  # device time of forward+backward, of the step; host time
BANDWIDTH = 1e8  # bytes/s of the emulated link
ALPHA = 1e-4


class Device:
    """Virtual time: ``host`` (the host's clock), ``compute``/``comm`` (when each stream is free); each launch costs
    the host ``launch_s``."""

    def __init__(self, launch_s: float = LAUNCH_S):
        self.host = self.compute = self.comm = 0.0
        self.launch_s = launch_s

    def launch(self, seconds: float) -> None:
        """A kernel on the compute stream: the host spends ``launch_s``, the stream ``seconds``."""
        self.host += self.launch_s
        self.compute = max(self.compute, self.host) + seconds

    def collective(self, seconds: float) -> None:
        """A collective on the communication stream, after the compute stream's work so far (its inputs)."""
        self.host += self.launch_s
        self.comm = max(self.comm, self.compute, self.host) + seconds

    def stream_waits(self) -> None:
        self.compute = max(self.compute, self.comm)

    def synchronize(self) -> None:
        self.host = max(self.host, self.compute)


class StreamClock:
    """A mark is when the compute stream reaches it (an event recorded on it); resolved later."""

    asynchronous = True

    def __init__(self, device: Device):
        self.device = device

    def mark(self) -> float:
        return max(self.device.compute, self.device.host)

    def seconds(self, a: float, b: float) -> float:
        return b - a


class AsyncCollectives(LocalCollectives):
    """``LocalCollectives`` whose all-reduce takes link time on the device's communication stream; its work's
    ``wait()`` makes the compute stream wait and returns at once; waited on as a real group's are."""

    wait = Collectives.wait

    def __init__(self, device: Device, world: int = 4):
        super().__init__(world)
        self.device = device

    def all_reduce(self, t, monitor: bool = False):
        super().all_reduce(t, monitor)
        nbytes = t.numel() * t.element_size()
        self.device.collective(2 * (self.world - 1) / self.world * nbytes / BANDWIDTH + 2 * (self.world - 1) * ALPHA)
        device = self.device

        class Work:
            def wait(self):
                device.stream_waits()
                return True

        return Work()


def _steps(meter: Meter, comm: AsyncCollectives, n: int, numel: int) -> None:
    """``n`` steps of a loop: forward and backward launched, the gradient all-reduced and waited on, the optimizer
    launched, ``loss.item()``."""
    device, plan, grad = comm.device, Plan(None), torch.zeros(numel)
    seen = (Seen((0,), ((numel,),), torch.device("cpu")),)
    for index in range(n):
        meter.step_started(comm)
        device.launch(COMPUTE_S)
        comm.wait([comm.all_reduce(grad)])
        device.launch(OPTIMIZER_S)
        device.synchronize()
        meter.closed(StepRecord(index, plan, True, True, seen, False, 4 * numel, 0.0, False))
    meter.step_started(comm)
    meter.settle()


def test_stream_marks_see_the_wait_the_host_clock_books_as_compute():
    """1 MB all-reduced over a 100 MB/s link (15 ms + latency): with marks on the compute stream the meter reads
    the compute, the wait and the step as the device ran them; with the host clock the wait reads zero and the
    communication is booked as compute (what the autopilot saw on a GPU before)."""
    numel = 250_000
    link_s = 2 * 3 / 4 * 4 * numel / BANDWIDTH + 6 * ALPHA
    compute_s = LAUNCH_S + COMPUTE_S + OPTIMIZER_S  # the stream idles while the first kernel is launched
    device = Device()
    right = Meter(StreamClock(device))
    _steps(right, AsyncCollectives(device), 6, numel)
    assert right.compute_s() == pytest.approx(compute_s, rel=1e-6)
    assert right.wait_s() == pytest.approx(link_s, rel=1e-6)
    assert right.step_s() == pytest.approx(compute_s + link_s, rel=1e-6)

    device = Device()
    host = Meter(HostClock(lambda: device.host))
    _steps(host, AsyncCollectives(device), 6, numel)
    assert host.wait_s() == 0.0 and host.step_s() == pytest.approx(right.step_s(), rel=1e-6)
    assert host.compute_s() == pytest.approx(compute_s + link_s, rel=1e-6)  # misled


def test_the_probes_read_the_link_on_the_stream():
    """The autopilot's probes timed by marks on the stream give the emulated link's bandwidth (to the probe's own
    resolution: the small probe's payload) and its latency; by the host clock the collectives look free (the
    probe's floor: the link reads as fast as anything)."""
    device = Device(launch_s=0.0)
    meter = Meter(StreamClock(device))
    bandwidth, alpha = meter.link(AsyncCollectives(device), 300 * 4 * 1024 * 1024, torch.device("cpu"))
    assert bandwidth == pytest.approx(BANDWIDTH, rel=1e-3) and alpha == pytest.approx(ALPHA, rel=0.03)
    device = Device(launch_s=0.0)
    fooled = Meter(HostClock(lambda: device.host))
    bandwidth, _ = fooled.link(AsyncCollectives(device), 300 * 4 * 1024 * 1024, torch.device("cpu"))
    assert bandwidth > 100 * BANDWIDTH


def test_marks_are_resolved_only_when_settled():
    """On an asynchronous clock nothing is read between checks: the steps' marks wait for :meth:`Meter.settle`."""
    device = Device()
    meter = Meter(StreamClock(device))
    calls = []
    clock_seconds = meter.clock.seconds
    meter.clock.seconds = lambda a, b: calls.append(1) or clock_seconds(a, b)
    comm = AsyncCollectives(device)
    plan, seen = Plan(None), (Seen((0,), ((10,),), torch.device("cpu")),)
    for index in range(4):
        meter.step_started(comm)
        comm.wait([comm.all_reduce(torch.zeros(10))])
        meter.closed(StepRecord(index, plan, True, True, seen, False, 40, 0.0, False))
    meter.step_started(comm)
    assert calls == [] and meter.compute_s() == 0.0
    meter.settle()
    assert calls and len(meter.compute) == 3  # the first step of a plan is not counted


def test_the_clock_follows_the_device():
    assert isinstance(for_device("cpu"), HostClock) and isinstance(for_device(None), HostClock)
    assert isinstance(for_device("cuda:0"), EventClock) and for_device("cuda:1").device == torch.device("cuda:1")
    meter = Meter()
    meter.closed(StepRecord(0, Plan(None), True, True, (Seen((0,), ((10,),), torch.device("cpu")),), False, 40, 0.0,
                            False))
    assert isinstance(meter.clock, HostClock)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_event_clock_times_the_stream():
    clock = EventClock("cuda")
    a = clock.mark()
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):
        x = x @ x / 4096
    b = clock.mark()
    assert clock.seconds(a, b) > 0


def test_marks_never_resolved_are_bounded():
    """Where no check ever settles them (a group of one), the pending marks keep at most PENDING_STEPS steps."""
    from gradcompress.autopilot.measure import PENDING_STEPS

    device = Device()
    meter = Meter(StreamClock(device))
    comm = AsyncCollectives(device)
    plan, seen = Plan(None), (Seen((0,), ((10,),), torch.device("cpu")),)
    for index in range(PENDING_STEPS + 20):
        meter.step_started(comm)
        comm.wait([comm.all_reduce(torch.zeros(10))])
        meter.closed(StepRecord(index, plan, True, True, seen, False, 40, 0.0, False))
    assert len(meter.marker.pending) == PENDING_STEPS
