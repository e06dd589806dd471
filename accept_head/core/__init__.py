"""Shared basics every part of the toolkit stands on: the sampling transform, seeds, timing, prompts, tables,
the cost model's arithmetic, machine records, and the version-sensitive details of transformers' KV cache."""

__version__ = "0.1.0"
