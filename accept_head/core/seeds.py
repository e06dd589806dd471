"""Seeds derived from a run's seed — per prompt, batch, row or epoch — by one scheme: numpy's ``SeedSequence``.

A derived seed depends only on the run seed and its keys (``"labels", batch_index`` or ``epoch, prompt_id``), so a
stream does not depend on the order in which work is done, on the number of workers, or on a run being resumed;
``SeedSequence`` hashes its input so that neighbouring keys give unrelated streams.
"""

from __future__ import annotations

import numpy as np
import torch


def _word(key: int | str) -> int:
    """A non-negative integer for ``SeedSequence``: strings by their UTF-8 bytes, negative integers modulo 2^64."""
    if isinstance(key, str):
        return int.from_bytes(key.encode(), "little")
    return int(key) % 2**64


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit generator seed for ``keys`` under the run ``seed``, e.g. ``derive_seed(seed, "labels", index)``."""
    # The keys go in as a spawn key: unlike extra entropy words, trailing zeros there still change the stream.
    sequence = np.random.SeedSequence(_word(seed), spawn_key=tuple(_word(key) for key in keys))
    return int(sequence.generate_state(1, np.uint64)[0]) >> 1


def seeded_generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``(seed, *keys)``."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
