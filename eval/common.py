"""What every ``python -m eval`` command shares: encoding prompt sets, the cost model, and output. The pair itself
is loaded by :func:`accept_head.pairs.load_pair` and decoded by :mod:`accept_head.engine`.

Nothing here runs at import time.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accept_head.cost_model import CostModel, measure_costs
from accept_head.pairs import Pair
from accept_head.prompts import EncodedPrompt, PromptSource, PromptStats, chat_prompt_ids, load_prompts
from accept_head.tables import markdown_table as markdown_table  # eval.report and eval.bench import these here
from accept_head.tables import text_table as text_table


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


def encode_prompts(
    name: str,
    sources: Sequence[PromptSource],
    tokenizer,
    prompt_mode: str = "chat",
    system_prompt: str | None = None,
    max_prompt_tokens: int = 512,
    seed: int = 0,
    limit: int | None = None,
    split_seed: int = 0,
) -> PromptSet:
    """Read ``sources`` (seeded shuffle, per-source limits, hash splits) and encode them with the chat template.

    Prompts longer than ``max_prompt_tokens`` tokens are skipped and counted. ``limit`` caps the whole set, taking
    prompts round-robin across sources so every source is represented. ``split_seed`` must be the one the hash splits
    were made with (data_gen's ``split_seed``) for ``split: eval`` to be the held-out slice.
    """
    if not sources:
        raise ValueError(f"The prompt set {name!r} has no sources; give at least one {{path: ..., field: ...}}.")
    sources = [PromptSource(**s) if isinstance(s, dict) else s for s in sources]
    stats = PromptStats()
    loaded = load_prompts(list(sources), seed=seed, split_seed=split_seed, stats=stats)
    ordered = round_robin(loaded) if limit is not None else loaded
    prompts, skipped = [], 0
    for prompt in ordered:  # encode lazily: a small limit on a large pool encodes only what it keeps
        if limit is not None and len(prompts) >= limit:
            break
        ids = chat_prompt_ids(tokenizer, prompt.text, prompt_mode, system_prompt)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(EncodedPrompt(prompt.id, prompt.source, list(ids)))
    per_source: dict[str, int] = {}
    for prompt in prompts:
        per_source[prompt.source] = per_source.get(prompt.source, 0) + 1
    if not prompts:
        raise ValueError(
            f"The prompt set {name!r} is empty after filtering ({skipped} longer than max_prompt_tokens="
            f"{max_prompt_tokens}); raise the limits or max_prompt_tokens."
        )
    return PromptSet(name, prompts, [s.to_dict() for s in sources], skipped, per_source)


def round_robin(prompts: Sequence[Any], limit: int | None = None) -> list[Any]:
    """Prompts (anything with a ``.source``) taken in turn from each source, sources in order of first appearance,
    optionally only the first ``limit``."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1.")
    groups: dict[str, list[Any]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.source, []).append(prompt)
    out: list[Any] = []
    for rank in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[rank] for g in groups.values() if rank < len(g)]
    return out if limit is None else out[:limit]


def check_disjoint(a: PromptSet, b: PromptSet) -> None:
    """Raise ValueError if two prompt sets share a prompt (validation must never see test prompts)."""
    shared = {tuple(p.ids) for p in a.prompts} & {tuple(p.ids) for p in b.prompts}
    if shared:
        raise ValueError(
            f"The prompt sets {a.name!r} and {b.name!r} share {len(shared)} prompt(s); use different hash splits "
            "(e.g. split: head for validation and split: eval for testing) or different files."
        )


# ---- cost model ----------------------------------------------------------------------------------------------------


def resolve_cost_model(source: str, pair: Pair, seed: int = 0) -> tuple[CostModel, str]:
    """The cost model ``source`` names: ``bundle`` (stored in the bundle; measured if absent), ``measure`` (measured
    now on this machine, head included) or a path to a ``costs.json``. Returns it and where it came from."""
    if source == "bundle":
        if pair.bundle is not None and pair.bundle.cost_model:
            return CostModel.from_dict(pair.bundle.cost_model), "bundle"
        source = "measure"
    if source == "measure":
        head = pair.bundle.head if pair.bundle is not None else None
        return measure_costs(pair.target, pair.draft, head, seed=seed), "measured"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"cost_model={source!r} is neither 'bundle', 'measure' nor an existing costs.json; "
            "write one with `python -m eval costs`."
        )
    return CostModel.from_dict(json.loads(path.read_text())), str(path)


# ---- output --------------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    """Where the numbers were measured."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
    }


def command_line() -> str:
    """The command that is running, as a user would type it (``python -m eval ...`` for this CLI)."""
    import shlex

    if not sys.argv:
        return ""
    program = Path(sys.argv[0])
    head = "python -m eval" if program.name == "__main__.py" and program.parent.name == "eval" else program.name
    return " ".join([head, *(shlex.quote(arg) for arg in sys.argv[1:])])


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: str | Path, payload: dict) -> Path:
    """Write ``payload`` as sorted, indented JSON (non-finite floats become null / "inf")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=True) + "\n")
    return path


def output_folder(output_dir: str | Path) -> Path:
    """Create ``output_dir`` (failing early, before any model is loaded, if it cannot be written)."""
    folder = Path(output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"output_dir={str(folder)!r} is not writable ({err}); pick another --output_dir.") from err
    return folder


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A number for a table ("–" for missing)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}{suffix}"
