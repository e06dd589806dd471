"""The label-generation configuration: one dataclass whose fields are the ``python -m data_gen`` flags and YAML keys."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..acceptance.labels import LABEL_MODES
from ..chain.rollout import HIDDEN_DTYPES, check_k_max
from ..core.prompts import PromptSource
from ..core.sampling import SamplingConfig
from ..models.pairs import ModelSpec

RUN_ONLY_KEYS = ("output_dir", "overwrite", "merge", "progress", "threads")
"""Keys that change how a run goes, not what it produces: left out of the fingerprint that guards resumption."""

ROLLOUT = "rollout"
DATA_GEN_LABEL_MODES = (*LABEL_MODES, ROLLOUT)
ROLLOUT_ONLY_KEYS = ("k_max", "hidden_dtype")
"""Keys that only matter with ``label_mode: rollout``: left out of the fingerprint of other modes, so datasets made
before they existed keep their fingerprint."""


@dataclass
class DataGenConfig:
    """Run a target/draft pair on prompt sets and write token-level acceptance labels (SpecDec++ §3.3)."""

    target: ModelSpec
    """The target model p: writes the responses and gives p_i (path, dtype, device, attn_implementation, ...)."""
    draft: ModelSpec
    """The draft model q whose candidates are labelled; must share the target's tokenizer. A feature-draft folder
    (:class:`~accept_head.models.feature_draft.FeatureDraft`, which reads the target's hidden states and uses its
    tokenizer) needs ``label_mode: rollout``."""
    prompts: list[PromptSource]
    """Prompt sources, e.g. [{path: humaneval}, {path: data.jsonl, field: instruction, limit: 500, split: head}]."""
    output_dir: str
    """Where the dataset (Arrow, ``save_to_disk``) and its meta.json go; partial work is kept in ``_work/`` inside."""
    max_new_tokens: int = 256
    """Longest target response, in tokens (a response ends earlier at EOS)."""
    temperature: float = 1.0
    """Sampling temperature of the target's responses and (in sample mode) of the label transform; 0 = greedy."""
    top_p: float | None = None
    """Nucleus filter of the sampling transform (None or 1.0: off)."""
    top_k: int | None = None
    """Top-k filter of the sampling transform (None or 0: off)."""
    seed: int = 0
    """Seeds the prompt shuffle, the target's sampling and the draws Y_i ~ q_i: same config, same dataset."""
    batch_size: int = 16
    """Prompts per generation batch; one batch is one unit of resumable work."""
    label_mode: Literal["sample", "greedy", "rollout"] = "rollout"
    """rollout (the default, for every drafter kind): on-policy labels (:mod:`accept_head.chain.rollout`): real
    speculative
    rounds of ``k_max`` candidates, one prompt at a time; each candidate is labelled min(1, p_k(y_k)/q_k(y_k)) under
    the sampling flags (greedy when temperature is 0) from its round's verification pass, and the drafter's hidden
    state of each candidate is stored, so head training needs no draft forward. On the embedded pair's standalone
    draft a head trained on them scored held-out rounds better than one trained on token mixing (AUC 0.634 vs 0.608,
    calibrated ECE 0.052 vs 0.067; findings §0) at equal modeled throughput, but generating them took ~5× longer
    (one prompt at a time). sample (token mixing, SpecDec++ §3.3; batched, faster): Y_i ~ q_i, label
    min(1, p_i(Y_i)/q_i(Y_i)). greedy: Y_i = argmax q_i, label 1[Y_i = argmax p_i]. Feature drafts need rollout."""
    k_max: int = 8
    """rollout: candidates drafted (and labelled) per speculative round (FixedK(k_max))."""
    hidden_dtype: Literal["float16", "float32"] = "float16"
    """rollout: storage type of the hidden states (float16 halves the size; float32 if the draft's states exceed
    float16's range)."""
    prompt_mode: Literal["chat", "raw"] = "chat"
    """chat: wrap each prompt in the target tokenizer's chat template (if it has one); raw: tokenize the text as is."""
    system_prompt: str | None = None
    """Optional system message placed before the prompt in chat mode."""
    too_long: Literal["skip", "truncate"] = "skip"
    """A prompt with more than ``max_prompt_tokens`` tokens (or that leaves no room for ``max_new_tokens`` in the
    models' context) is skipped, or truncated from the left to fit. Both are counted in meta.json."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (None: the models' context length minus ``max_new_tokens``)."""
    split_seed: int = 0
    """Seed of the hash split that ``split: distill|head|eval`` on a prompt source selects from."""
    scoring: Literal["lockstep", "teacher_forced"] = "lockstep"
    """lockstep: the draft runs beside the target while it samples, and each position is labelled as it is sampled
    (no extra target pass). teacher_forced: sample first, then score (prompt, response) with both models in batched
    passes. Same labels, different random draws Y_i."""
    score_tokens: int = 2048
    """Response positions per teacher-forced scoring pass (``scoring: teacher_forced``); bounds the
    (rows, positions, vocab) logits in memory."""
    shard: str | None = None
    """``i/n``: label only the i-th of n contiguous parts of the prompts (i = 0..n-1), into
    ``<output_dir>/shards/i-of-n``; join the parts with ``--merge true``."""
    merge: bool = False
    """Join the finished shard outputs under ``<output_dir>/shards`` into ``<output_dir>`` (loads no model)."""
    overwrite: bool = False
    """Replace an existing output (finished or partial) that was made with a different config."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self) -> None:
        """Raise ValueError, naming the flag, for values no run can use."""
        if not self.prompts:
            raise ValueError("--prompts is empty: give at least one prompt source, e.g. [{path: humaneval}].")
        names = [source.display_name for source in self.prompts]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"--prompts: several sources are named {repeated} (prompt ids are '<name>:<row>' and must be unique); "
                "give each source its own `name:`."
            )
        for name in ("max_new_tokens", "batch_size", "score_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max_prompt_tokens must be >= 1 (or null), got {self.max_prompt_tokens}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (or null), got {self.threads}.")
        if self.label_mode not in DATA_GEN_LABEL_MODES:
            raise ValueError(f"--label_mode={self.label_mode!r} must be one of {DATA_GEN_LABEL_MODES}.")
        check_k_max(self.k_max, flag="--k_max")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"--hidden_dtype={self.hidden_dtype!r} must be one of {HIDDEN_DTYPES}.")
        if self.prompt_mode not in ("chat", "raw"):
            raise ValueError(f"--prompt_mode={self.prompt_mode!r} must be chat or raw.")
        if self.scoring not in ("lockstep", "teacher_forced"):
            raise ValueError(f"--scoring={self.scoring!r} must be lockstep or teacher_forced.")
        if self.too_long not in ("skip", "truncate"):
            raise ValueError(f"--too_long={self.too_long!r} must be skip or truncate.")
        if self.merge and self.shard is not None:
            raise ValueError("Can't use both --merge and --shard: run each --shard i/n first, then --merge true alone.")
        if not self.output_dir:
            raise ValueError("--output_dir is empty: name the folder the dataset should be written to.")
        self.shard_index()
        try:
            self.sampling()
        except ValueError as err:
            raise ValueError(f"Invalid sampling flags (--temperature/--top_k/--top_p): {err}") from err

    @property
    def rollout(self) -> bool:
        """Whether this run writes on-policy rollout labels (``label_mode: rollout``)."""
        return self.label_mode == ROLLOUT

    def sampling(self) -> SamplingConfig:
        """The sampling transform of the responses and, in sample mode, of p and q."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def shard_index(self) -> tuple[int, int] | None:
        """``(i, n)`` parsed from ``--shard i/n``, or None for an unsharded run."""
        if self.shard is None:
            return None
        parts = str(self.shard).replace(" ", "").split("/")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"--shard={self.shard!r} must look like i/n, e.g. 0/4 (shards are numbered 0..n-1).")
        index, count = int(parts[0]), int(parts[1])
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"--shard={self.shard!r}: need n >= 1 and 0 <= i < n (shards are numbered 0..n-1).")
        return index, count

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON types."""
        return json.loads(json.dumps(asdict(self), default=str))

    def fingerprint(self) -> dict[str, Any]:
        """What determines the dataset: the config without :data:`RUN_ONLY_KEYS`."""
        config = self.to_dict()
        for key in RUN_ONLY_KEYS + (() if self.rollout else ROLLOUT_ONLY_KEYS):
            config.pop(key, None)
        return config


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two fingerprints, as ``key (old → new)`` strings."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key} ({json.dumps(a)} → {json.dumps(b)})")
    return out
