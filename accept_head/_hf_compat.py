"""The one place that touches version-sensitive details of transformers' KV cache.

Everything else drives models through ``forward(past_key_values=..., use_cache=True)``.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)
_NEGATIVE_CROP = TRANSFORMERS_VERSION >= Version("5.0.0")


def cache_length(cache) -> int:
    """Number of positions held by a ``DynamicCache`` (0 for None)."""
    return 0 if cache is None else cache.get_seq_length()


def crop_cache(cache, length: int) -> None:
    """Crop a ``DynamicCache`` in place to its first ``length`` positions.

    transformers < 5 takes the final length; 5.x takes a negative count of positions to remove.
    """
    current = cache.get_seq_length()
    if length > current:
        raise AssertionError(f"cannot crop a cache of {current} positions to {length}")
    if length == current:
        return
    cache.crop(length - current if _NEGATIVE_CROP else length)
