"""Timed regions wait for the device: on a simulated asynchronous device (work queued by a forward call only advances
the clock when someone waits for it, as CUDA kernels do), each region's seconds are exactly the work it queued.

Each test fails if :func:`accept_head.core.timing.device_timer` stops synchronising at either end, or if a decoder times
a region with a raw clock read instead of the timer.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llama, perturbed_copy

from accept_head import FixedK, autoregressive_generate, speculative_generate
from accept_head.core import timing as timing_module
from accept_head.core.timing import device_timer, module_device, synchronize
from accept_head.engine.measure import _timed_interleaved

TARGET_PASS_S = 1.0
"""Simulated device seconds one target forward queues."""
DRAFT_PASS_S = 0.125
"""Simulated device seconds one draft forward queues (a power of two: sums stay exact in floating point)."""


class FakeDevice:
    """An asynchronous device with its own clock: ``launch`` queues work and returns at once; ``synchronize`` runs
    the queue, advancing the clock by what was queued."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queued = 0.0
        self.waits = 0

    def launch(self, seconds: float) -> None:
        self.queued += seconds

    def synchronize(self, device=None) -> None:
        self.waits += 1
        self.now += self.queued
        self.queued = 0.0

    def clock(self) -> float:
        return self.now


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    device = FakeDevice()
    monkeypatch.setattr(timing_module, "synchronize", device.synchronize)
    monkeypatch.setattr(timing_module, "clock", device.clock)
    return device


def launches(model: torch.nn.Module, fake: FakeDevice, seconds: float) -> torch.utils.hooks.RemovableHandle:
    """Every forward of ``model`` queues ``seconds`` of simulated device work (the call itself returns at once)."""
    return model.register_forward_hook(lambda *_: fake.launch(seconds))


def test_device_timer_counts_work_queued_inside_the_block_only(fake: FakeDevice) -> None:
    fake.launch(5.0)  # queued before the block: not the block's
    with device_timer("cuda") as watch:
        fake.launch(2.0)
        fake.launch(0.5)
    assert watch.seconds == 2.5
    assert fake.queued == 0.0


def test_timed_interleaved_times_the_work_of_each_call(fake: FakeDevice) -> None:
    times = _timed_interleaved({"a": lambda: fake.launch(1.0), "b": lambda: fake.launch(3.0)}, repeats=2, warmup=1)
    assert times == {"a": [1.0, 1.0], "b": [3.0, 3.0]}


def test_autoregressive_target_time_is_the_work_of_its_forward_passes(fake: FakeDevice) -> None:
    target = make_llama(seed=0)
    launches(target, fake, TARGET_PASS_S)
    result = autoregressive_generate(target, [2, 10, 11, 12], 6, temperature=0)
    stats = result.stats
    assert stats.target_calls == 6
    assert stats.target_time == stats.target_calls * TARGET_PASS_S
    assert stats.total_time == stats.target_time


def test_speculative_times_split_target_and_draft_work(fake: FakeDevice) -> None:
    target = make_llama(seed=0)
    draft = perturbed_copy(target, relative_noise=0.3, seed=1)
    launches(target, fake, TARGET_PASS_S)
    launches(draft, fake, DRAFT_PASS_S)
    result = speculative_generate(target, draft, [2, 10, 11, 12], FixedK(3), 10, temperature=0)
    stats = result.stats
    target_passes = stats.target_calls + 1  # the prompt's prefill, then one verification pass per round
    assert stats.target_time == target_passes * TARGET_PASS_S
    assert stats.draft_time == stats.draft_calls * DRAFT_PASS_S
    assert stats.total_time == stats.target_time + stats.draft_time


def test_synchronize_is_a_no_op_on_cpu_and_module_device_reads_parameters() -> None:
    synchronize("cpu")
    synchronize([torch.device("cpu"), "meta"])
    synchronize(None)  # never creates a CUDA context
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")
    with device_timer("cpu") as watch:
        torch.ones(8).sum()
    assert watch.seconds >= 0.0


def test_synchronize_waits_for_the_named_cuda_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA dispatch, checked without a GPU: which devices ``torch.cuda.synchronize`` is asked to wait for."""
    waited: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    synchronize(None)  # CUDA never used by this process: nothing to wait for, and no context is created
    assert waited == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    synchronize(None)
    assert waited == [None]  # the current device
    waited.clear()
    synchronize({torch.device("cuda", 1), torch.device("cpu")})
    synchronize(["cuda:0", "cuda:0", 3])
    assert sorted(str(d) for d in waited) == ["cuda:0", "cuda:1", "cuda:3"]  # each device once per call, CPU skipped
