"""``python -m data_gen join``: one label dataset from several finished ones of the same pair (no model loaded).

Labels are cheap to add to and dear to redo: a head that wants more prompts than a first run labelled gets them from a
second config (further prompts, e.g. an offset past the first run's), and the two are joined into the one dataset
head training reads. Joining refuses datasets that disagree on anything the labels depend on (target, draft, sampling,
label mode, tokenizer, prompt format, the rollout's hidden-state layout) and prompts labelled twice; the joined
``meta.json`` keeps each part's record under ``joined_from``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..acceptance.labels import load_label_dataset
from .generate import total_keys, totals_record
from .output import (
    META,
    clear_output,
    exclusive,
    make_writable_dir,
    output_status,
    quiet_datasets,
    save_dataset,
    write_json_atomic,
)

MUST_AGREE = (
    "format",
    "format_version",
    "target",
    "draft",
    "tokenizer",
    "sampling",
    "label_mode",
    "label_transform",
    "feature_transform",
    "split_seed",
    "prompt_format",
    "rollout",
)
"""``meta.json`` keys that every joined dataset must share (model devices aside): what its labels mean."""


def _without_device(value: Any) -> Any:
    """A model record without its device (a dataset labelled on another device labels the same thing)."""
    return {k: v for k, v in value.items() if k != "device"} if isinstance(value, dict) else value


def check_joinable(paths: list[str], metas: list[dict[str, Any]]) -> None:
    """Raise ValueError naming the first dataset and key on which ``metas`` disagree with ``metas[0]``."""
    first = metas[0]
    for path, meta in zip(paths[1:], metas[1:], strict=True):
        mine, theirs = meta.get("draft_weights"), first.get("draft_weights")
        if mine and theirs and mine != theirs:  # datasets from before the digest (None) cannot be told apart
            raise ValueError(
                f"Cannot join {path} to {paths[0]}: they were labelled by different weights of the draft "
                f"(sha256 {mine[:12]}… vs {theirs[:12]}…; it was retrained in between). Relabel the older one."
            )
        for key in MUST_AGREE:
            mine, theirs = meta.get(key), first.get(key)
            if key in ("target", "draft"):
                mine, theirs = _without_device(mine), _without_device(theirs)
            if mine != theirs:
                where = key
                if isinstance(mine, dict) and isinstance(theirs, dict):  # name the sub-key that differs
                    sub = next(k for k in sorted(set(mine) | set(theirs), key=str) if mine.get(k) != theirs.get(k))
                    where, mine, theirs = f"{key}.{sub}", mine.get(sub), theirs.get(sub)
                raise ValueError(
                    f"Cannot join {path} to {paths[0]}: their {where!r} differ ({json.dumps(mine, default=str)[:200]} "
                    f"vs {json.dumps(theirs, default=str)[:200]}). Join only labels of the same pair, sampling and "
                    "label mode; relabel one of them with the other's config."
                )


def joined_meta(paths: list[str], metas: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """``meta.json`` of the joined dataset: the shared description, the parts' sources and summed counts."""
    keys = total_keys(metas[0].get("label_mode") == "rollout")
    totals = {key: sum(m["totals"].get(key, 0.0) for m in metas) for key in keys}
    fingerprint = {"joined": [m.get("fingerprint") for m in metas]}
    digest = hashlib.sha256("".join(str(m.get("prompts_digest")) for m in metas).encode()).hexdigest()
    return {
        **metas[0],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sources": [{**source, "dataset": path} for path, m in zip(paths, metas) for source in m["sources"]],
        "skipped": {key: sum(m["skipped"].get(key, 0) for m in metas) for key in metas[0]["skipped"]},
        "truncated": sum(m.get("truncated", 0) for m in metas),
        "prompts_total": sum(m.get("prompts_total", 0) for m in metas),
        "prompts_digest": digest,
        "max_new_tokens": max(m.get("max_new_tokens", 0) for m in metas),
        "shard": None,
        **totals_record(totals, started),
        "config": {"join": list(paths)},
        "joined_from": [
            {
                "path": path,
                "rows": m["totals"]["rows"],
                "created": m.get("created"),
                "prompts_digest": m.get("prompts_digest"),
                "config": m.get("config"),
            }
            for path, m in zip(paths, metas)
        ],
        "fingerprint": fingerprint,
    }


def join(datasets: list[str], output_dir: str, overwrite: bool = False) -> dict[str, Any]:
    """Join finished label datasets into one at ``output_dir`` and return its meta dict.

    Args:
        datasets: Two or more folders written by ``python -m data_gen`` (their ``meta.json`` present): the same
            target, draft, sampling and label mode, each prompt labelled in only one of them.
        output_dir: The joined dataset's folder (new or empty; a finished join of the same datasets is left as is).
        overwrite: Replace another dataset already in ``output_dir``.
    """
    import datasets as hf_datasets

    started = time.perf_counter()
    paths = [str(Path(p).expanduser()) for p in datasets]
    if len(paths) < 2:
        raise ValueError(f"--datasets={datasets!r}: give at least two label datasets to join.")
    if len({Path(p).resolve() for p in paths}) < len(paths):
        raise ValueError(f"--datasets={datasets!r} names a dataset twice; each prompt must be labelled once.")
    out = Path(output_dir).expanduser()
    if any(out.resolve() == Path(p).resolve() for p in paths):
        raise ValueError(f"--output_dir={output_dir!r} is one of the datasets to join; choose a new folder.")
    for path in paths:
        if not (Path(path) / META).is_file():
            raise FileNotFoundError(
                f"{path} holds no finished label dataset (no {META}); finish it with its `python -m data_gen` run."
            )
    with quiet_datasets():
        loaded = [load_label_dataset(path) for path in paths]
    parts, metas = [d for d, _ in loaded], [m for _, m in loaded]
    check_joinable(paths, metas)
    seen: dict[str, str] = {}
    for path, part in zip(paths, parts):
        for prompt_id in part["prompt_id"]:
            if prompt_id in seen:
                raise ValueError(
                    f"Prompt {prompt_id!r} is labelled in both {seen[prompt_id]} and {path}; join datasets of "
                    "disjoint prompts (e.g. a second config with an offset past the first one's prompts)."
                )
            seen[prompt_id] = path
    meta = joined_meta(paths, metas, started)
    make_writable_dir(out)
    with exclusive(out), quiet_datasets():
        status = output_status(out, meta["fingerprint"], overwrite)
        if status == "complete":
            print(f"data_gen: {out} already joins these datasets; nothing to do.", file=sys.stderr)
            return json.loads((out / META).read_text())
        if status in ("replace", "resume"):
            clear_output(out)
        save_dataset(hf_datasets.concatenate_datasets(parts), out)
        write_json_atomic(out / META, meta)
    print(
        f"data_gen join: {len(seen)} prompts from {len(paths)} datasets ({', '.join(str(len(p)) for p in parts)}) "
        f"-> {out}",
        file=sys.stderr,
    )
    return meta
