"""Calibration maps for the head's probabilities: temperature scaling and isotonic regression.

A map is stored in the bundle's ``config.json`` as plain numbers, so loading needs no pickles.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class Calibration:
    """Maps a raw acceptance probability to a calibrated one.

    ``kind='temperature'``: sigmoid(logit(p) / temperature). ``kind='isotonic'``: piecewise-linear interpolation
    through the fitted (x, y) knots, clamped at both ends.
    """

    kind: str
    temperature: float = 1.0
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("temperature", "isotonic"):
            raise ValueError(f"calibration kind={self.kind!r} must be 'temperature' or 'isotonic'.")
        if self.kind == "temperature" and not self.temperature > 0:
            raise ValueError(f"calibration temperature={self.temperature} must be > 0.")
        if self.kind == "isotonic" and (len(self.x) != len(self.y) or not self.x):
            raise ValueError("isotonic calibration needs equally long, non-empty x and y knot lists.")

    def __call__(self, prob: float) -> float:
        if self.kind == "temperature":
            p = min(max(prob, 1e-7), 1 - 1e-7)
            return 1.0 / (1.0 + math.exp(-math.log(p / (1 - p)) / self.temperature))
        if prob <= self.x[0]:
            return self.y[0]
        if prob >= self.x[-1]:
            return self.y[-1]
        i = bisect.bisect_right(self.x, prob)
        x0, x1, y0, y1 = self.x[i - 1], self.x[i], self.y[i - 1], self.y[i]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (prob - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        if self.kind == "temperature":
            return {"kind": "temperature", "temperature": self.temperature}
        return {"kind": "isotonic", "x": list(self.x), "y": list(self.y)}

    @classmethod
    def from_dict(cls, raw: dict) -> Calibration:
        return cls(**raw)
