"""What the ``generate(custom_generate=...)`` tests share: greedy ``generate``, a recording streamer and a stopping
criterion that fires at a length."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


def greedy(target: torch.nn.Module, prompt: list[int], **kwargs) -> torch.Tensor:
    return target.generate(torch.tensor([prompt]), do_sample=False, **kwargs)


class Recorder(BaseStreamer):
    """Keeps every ``put`` (as a list of token ids) and counts ``end`` calls."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


class AtLength(StoppingCriteria):
    """Fires once the sequence holds ``length`` tokens; counts its calls."""

    def __init__(self, length: int) -> None:
        self.length, self.calls = length, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)
