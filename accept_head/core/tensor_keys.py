"""Keys that change when a tensor is replaced or updated in place: what caches built from weights (packed copies,
fused projections, a head read out as floats) compare to know they are stale."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s in-place version counter (None for an inference tensor, which keeps none and cannot change)."""
    return None if tensor.is_inference() else tensor._version


def tensors_key(tensors: Iterable[torch.Tensor]) -> tuple:
    """The storage, dtype and version of each of ``tensors``: equal as long as none was replaced or updated."""
    return tuple((t.data_ptr(), t.dtype, version(t)) for t in tensors)
