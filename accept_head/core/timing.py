"""Wall-clock timing of work that may run asynchronously on an accelerator.

CUDA kernels are launched asynchronously: a ``perf_counter`` read right after a forward call measures the launches,
not the work, and the work is then billed to whichever later region first waits for the device. Every timed region
of the toolkit goes through :func:`device_timer`, which waits for the device before reading the clock at both ends,
so a region's seconds are the work it queued. On a CPU the waits are no-ops and the numbers are plain wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

clock: Callable[[], float] = time.perf_counter
"""The clock every timed region reads (seconds). A module attribute so that a test can replace it."""


def synchronize(device: torch.device | str | int | Iterable[torch.device | str | int] | None = None) -> None:
    """Wait until all work queued on ``device`` has finished.

    A CPU (or ``meta``) device returns at once; a CUDA device waits for that device (``"cuda"`` or an index without
    a type: as ``torch.cuda.synchronize``); any other accelerator goes through ``torch.accelerator.synchronize``.
    Several devices (a model placed over GPUs with ``device_map``) are waited for in turn. ``None`` waits for the
    current CUDA device if this process has initialised CUDA, and does nothing otherwise: it never creates a CUDA
    context, so a process that uses one GPU of many (a ``torchrun`` rank) touches no other.
    """
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return
    if not isinstance(device, torch.device):
        if not isinstance(device, (str, int)):
            for one in dict.fromkeys(device):
                synchronize(one)
            return
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type in ("cpu", "meta"):  # the common case, checked before anything else is built
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        torch.accelerator.synchronize(device)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (CPU for a module without parameters)."""
    first = next(module.parameters(), None)
    return torch.device("cpu") if first is None else first.device


@dataclass
class Stopwatch:
    """What :func:`device_timer` measured; ``seconds`` is set when the ``with`` block ends."""

    seconds: float = 0.0


@contextmanager
def device_timer(
    device: torch.device | str | int | Iterable[torch.device | str | int] | None = None,
) -> Iterator[Stopwatch]:
    """Time the ``with`` block, device work included: wait for ``device`` (see :func:`synchronize`), read
    :data:`clock`, run the block, wait again, read the clock again.

    >>> with device_timer("cpu") as watch:
    ...     pass
    >>> watch.seconds >= 0
    True
    """
    watch = Stopwatch()
    synchronize(device)  # work queued before the block is not this block's
    start = clock()
    try:
        yield watch
    finally:
        synchronize(device)  # the block's kernels may still be running: wait for them
        watch.seconds = clock() - start
