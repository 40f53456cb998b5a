"""StepClock: host clocks on the CPU; on CUDA, events resolved after the step (a fake event class
stands in for torch.cuda.Event), never a host synchronisation per mark."""

import json
import time

import pytest
import torch

from parallel import comm
from parallel.comm import collectives
from parallel.testing import run_ranks
from parallel.timing import StepClock, named_range


class FakeGPU:
    """A device timeline: ``queued`` is when the work enqueued so far will end, ``done`` how far it ran."""

    def __init__(self, kernel_s: float = 0.0):
        self.queued, self.done, self.syncs, self.kernel_s = 0.0, 0.0, 0, kernel_s

    def launch(self, seconds: float) -> None:
        self.queued += seconds


def fake_event_class(gpu: FakeGPU):
    class FakeEvent:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing, "timing events must be created with enable_timing=True"
            self.t = None

        def record(self, stream=None):
            gpu.launch(gpu.kernel_s)  # work enqueued since the previous mark
            self.t = gpu.queued

        def query(self) -> bool:
            return gpu.done >= self.t

        def synchronize(self) -> None:
            gpu.syncs += 1
            gpu.done = max(gpu.done, self.t)

        def elapsed_time(self, end) -> float:
            assert self.query() and end.query(), "elapsed_time before both events completed"
            return (end.t - self.t) * 1e3

    return FakeEvent


def test_cpu_marks_are_host_seconds():
    clock = StepClock("cpu")
    t0 = clock.mark()
    time.sleep(0.05)
    assert 0.04 < clock.seconds(t0, clock.mark()) < 1.0 and clock.syncs == 0


def test_cuda_marks_time_the_device_and_synchronise_once_when_resolved():
    gpu = FakeGPU()
    clock = StepClock("cuda", fake_event_class(gpu))
    start = clock.mark()
    marks = []
    for _ in range(8):  # eight micro-batches of 0.5 s of device work, enqueued in no host time
        gpu.launch(0.5)
        marks.append(clock.mark())
    assert gpu.syncs == 0  # marking never waits for the device
    assert clock.seconds(start, marks[-1]) == pytest.approx(4.0)  # device time, not the host's ~0 s
    assert gpu.syncs == 1 and clock.syncs == 1
    assert [clock.seconds(start, m) for m in marks] == pytest.approx([0.5 * (i + 1) for i in range(8)])
    assert gpu.syncs == 1  # the earlier events had completed: no further waits


def _counted_on_a_fake_gpu():
    gpu = FakeGPU(kernel_s=0.25)  # each mark ends 0.25 s of device work after the previous one
    collectives.clock_for = lambda device: StepClock("cuda", fake_event_class(gpu))
    counter = comm.CommCounter()
    with counter:
        comm.all_reduce(torch.ones(4))
        comm.all_reduce(torch.ones(4), async_op=True).wait()
    unresolved = sum(len(s.unresolved) for s in counter.stats.values())
    syncs_before = gpu.syncs
    blocked = counter.wait_seconds("world")
    return unresolved, syncs_before, blocked, gpu.syncs, json.dumps(counter.summary())


def test_comm_counter_times_collectives_with_device_events_read_after_the_step():
    for unresolved, syncs_before, blocked, syncs_after, summary in run_ranks(_counted_on_a_fake_gpu, 2, timeout=60):
        assert unresolved == 2 and syncs_before == 0  # two intervals, nothing read during the "step"
        assert blocked == pytest.approx(0.5) and syncs_after >= 1  # read once asked
        assert '"wait_s": 0.5' in summary


def test_named_ranges_appear_only_under_a_profiler():
    calls = []

    def name():
        calls.append(1)
        return "gridtrain.test_range"

    with named_range(name):
        pass
    assert calls == []  # no profiler: the name is never even built
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with named_range(name):
            torch.ones(2).sum()
    assert calls == [1] and any(e.name == "gridtrain.test_range" for e in prof.events())
