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

from accept_head.labels import load_label_dataset

from .config import DataGenConfig, config_differences
from .generate import TOTAL_KEYS, code_version, format_summary, summary_stats
from .output import (
    META,
    SHARD_NAME,
    SHARDS,
    check_output,
    clear_output,
    exclusive,
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


def merge(cfg: DataGenConfig) -> dict[str, Any]:
    """Join the finished ``--shard i/n`` outputs under ``<output_dir>/shards`` into ``<output_dir>``; loads no model."""
    import datasets

    cfg.validate()
    started = time.perf_counter()
    out = Path(cfg.output_dir).expanduser()
    shard_root = out / SHARDS
    found: dict[int, tuple[int, Path]] = {}
    for d in sorted(shard_root.iterdir()) if shard_root.is_dir() else []:
        match = SHARD_NAME.match(d.name)
        if d.is_dir() and match:
            found[int(match.group(1))] = (int(match.group(2)), d)
    if not found:
        raise FileNotFoundError(
            f"No shard outputs under {shard_root}: run `python -m data_gen ... --output_dir {out} --shard i/n` "
            "for i = 0..n-1 first."
        )
    counts = {n for n, _ in found.values()}
    if len(counts) != 1:
        raise ValueError(f"{shard_root} mixes shard counts {sorted(counts)}; keep the shards of one --shard i/n split.")
    count = counts.pop()
    missing = [i for i in range(count) if i not in found]
    unfinished = [found[i][1].name for i in sorted(found) if not (found[i][1] / META).is_file()]
    if missing or unfinished:
        raise ValueError(
            f"Cannot merge {shard_root}: "
            + "; ".join(
                (
                    [f"missing shards {', '.join(f'{i}/{count}' for i in missing)} (run them with --shard i/{count})"]
                    if missing
                    else []
                )
                + ([f"unfinished shards {unfinished} (rerun their commands to finish them)"] if unfinished else [])
            )
            + "."
        )
    state = check_output(out, cfg.fingerprint(), cfg.overwrite)
    if state.status == "complete":
        print(f"data_gen: {out} is already merged for this config; nothing to do.", file=sys.stderr)
        return read_json(out / META) or {}
    metas: list[dict[str, Any]] = []
    with exclusive(out), quiet_datasets():
        parts = []
        for i in range(count):
            dataset, meta = load_label_dataset(found[i][1])
            expected = _without_devices(cfg.fingerprint())
            diff = config_differences(_without_devices(meta.get("fingerprint", {})), expected)
            if diff:
                raise ValueError(
                    f"Shard {found[i][1]} was made with a different config: {'; '.join(diff[:8])}. "
                    "Merge only shards of this config (or fix the config)."
                )
            if meta.get("prompts_digest") != (metas[0]["prompts_digest"] if metas else meta.get("prompts_digest")):
                raise ValueError(f"Shard {found[i][1]} saw different prompts than shard 0; rerun it.")
            parts.append(dataset)
            metas.append(meta)
        if state.status in ("replace", "resume"):
            clear_output(out)
        save_dataset(datasets.concatenate_datasets(parts), out)
    totals = {key: sum(m["totals"][key] for m in metas) for key in TOTAL_KEYS}
    merged = dict(metas[0])
    merged.update(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        target=cfg.target.to_dict(),
        draft=cfg.draft.to_dict(),
        shard=None,
        merged_from=[
            {
                "shard": f"{i}/{count}",
                "rows": m["totals"]["rows"],
                "devices": [m["target"]["device"], m["draft"]["device"]],
            }
            for i, m in enumerate(metas)
        ],
        totals=totals,
        stats=summary_stats(totals),
        timing={
            "wall_s_last_run": time.perf_counter() - started,
            "generation_s": totals["generation_s"],
            "scoring_s": totals["scoring_s"],
        },
        code=code_version(),
        config=cfg.to_dict(),
        fingerprint=cfg.fingerprint(),
    )
    merged["sources"] = [
        {**src, "rows": sum(m["sources"][k]["rows"] for m in metas)} for k, src in enumerate(metas[0]["sources"])
    ]
    write_json_atomic(out / META, merged)
    print(format_summary(merged), file=sys.stderr)
    return merged
