"""``python -m data_gen --merge true``: join the finished ``--shard i/n`` outputs into one dataset (no model loaded).

Shard i of n holds the contiguous batches [i·B/n, (i+1)·B/n) of the same prompt order, each seeded by its global
batch index, so concatenating the shards in order gives exactly the dataset of one unsharded run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..acceptance.labels import load_label_dataset
from .config import DataGenConfig, config_differences
from .generate import format_summary, run_record, total_keys
from .output import (
    META,
    SHARD_NAME,
    SHARDS,
    clear_output,
    exclusive,
    make_writable_dir,
    output_status,
    quiet_datasets,
    read_json,
    save_dataset,
    write_json_atomic,
)


def _without_devices(fingerprint: dict) -> dict:
    """A fingerprint minus what may differ between the shards of one dataset (shard index, devices)."""
    fp = json.loads(json.dumps(fingerprint))
    fp.pop("shard", None)
    for role in ("target", "draft"):
        if isinstance(fp.get(role), dict):
            fp[role].pop("device", None)
    return fp


def find_shards(out: Path) -> list[Path]:
    """The folders ``<out>/shards/i-of-n`` for i = 0..n-1, in order; raise if one is missing or unfinished."""
    shard_root = out / SHARDS
    found: dict[int, tuple[int, Path]] = {}
    for folder in sorted(shard_root.iterdir()) if shard_root.is_dir() else []:
        match = SHARD_NAME.match(folder.name)
        if folder.is_dir() and match:
            found[int(match.group(1))] = (int(match.group(2)), folder)
    if not found:
        raise FileNotFoundError(
            f"No shard outputs under {shard_root}: run `python -m data_gen ... --output_dir {out} --shard i/n` "
            "for i = 0..n-1 first."
        )
    counts = sorted({n for n, _ in found.values()})
    if len(counts) != 1:
        raise ValueError(f"{shard_root} mixes shard counts {counts}; keep the shards of one --shard i/n split.")
    count = counts[0]
    problems = []
    missing = [f"{i}/{count}" for i in range(count) if i not in found]
    if missing:
        problems.append(f"missing shards {', '.join(missing)} (run them with --shard i/{count})")
    unfinished = [found[i][1].name for i in sorted(found) if not (found[i][1] / META).is_file()]
    if unfinished:
        problems.append(f"unfinished shards {unfinished} (rerun their commands to finish them)")
    if problems:
        raise ValueError(f"Cannot merge {shard_root}: {'; '.join(problems)}.")
    return [found[i][1] for i in range(count)]


def merge(cfg: DataGenConfig) -> dict[str, Any]:
    """Join the finished ``--shard i/n`` outputs under ``<output_dir>/shards`` into ``<output_dir>``; loads no model."""
    import datasets

    cfg.validate()
    started = time.perf_counter()
    out = Path(cfg.output_dir).expanduser()
    shards = find_shards(out)
    make_writable_dir(out)
    expected = _without_devices(cfg.fingerprint())
    with exclusive(out), quiet_datasets():
        status = output_status(out, cfg.fingerprint(), cfg.overwrite)
        if status == "complete":
            print(f"data_gen: {out} is already merged for this config; nothing to do.", file=sys.stderr)
            return read_json(out / META) or {}
        parts, metas = [], []
        for folder in shards:
            dataset, meta = load_label_dataset(folder)
            diff = config_differences(_without_devices(meta.get("fingerprint", {})), expected)
            if diff:
                raise ValueError(
                    f"Shard {folder} was made with a different config: {'; '.join(diff[:8])}. "
                    "Merge only shards of this config (or fix the config)."
                )
            if metas and meta.get("prompts_digest") != metas[0].get("prompts_digest"):
                raise ValueError(f"Shard {folder} saw different prompts than {shards[0]}; rerun it.")
            parts.append(dataset)
            metas.append(meta)
        if status in ("replace", "resume"):
            clear_output(out)
        save_dataset(datasets.concatenate_datasets(parts), out)
        merged = _merged_meta(cfg, metas, started)
        write_json_atomic(out / META, merged)
    print(format_summary(merged), file=sys.stderr)
    return merged


def _merged_meta(cfg: DataGenConfig, metas: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """meta.json of the merged dataset: shard 0's description, summed counts and times, this config."""
    keys = total_keys(metas[0].get("label_mode") == "rollout")
    totals = {key: sum(m["totals"].get(key, 0.0) for m in metas) for key in keys}
    return {
        **metas[0],
        "shard": None,
        "merged_from": [
            {
                "shard": f"{i}/{len(metas)}",
                "rows": m["totals"]["rows"],
                "devices": [m["target"]["device"], m["draft"]["device"]],
            }
            for i, m in enumerate(metas)
        ],
        "sources": [
            {**src, "rows": sum(m["sources"][k]["rows"] for m in metas)} for k, src in enumerate(metas[0]["sources"])
        ],
        **run_record(cfg, totals, started),
    }
