"""Methods run side by side over prompts: the pair, the interleaved runner that decodes and prices them, the cost
model's measurement, the threshold sweep and the adaptive row stop of the learning-free decoders."""

from .runner import (
    MethodSpec,
    MethodSummary,
    PolicyGrid,
    PolicyResult,
    Runner,
    TrainedHead,
    aggregate,
    run_decoders,
    run_interleaved,
    summarize,
)

__all__ = [
    "MethodSpec",
    "MethodSummary",
    "PolicyGrid",
    "PolicyResult",
    "Runner",
    "TrainedHead",
    "aggregate",
    "run_decoders",
    "run_interleaved",
    "summarize",
]
