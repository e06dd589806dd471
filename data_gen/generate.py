"""The data_gen pipeline: prompts → batched target responses → teacher-forced labels → resumable shards → dataset.

Layout of an output folder::

    <output_dir>/meta.json, data-*.arrow, state.json, dataset_info.json   the finished dataset (save_to_disk)
    <output_dir>/_work/config.json                                          what a partial run was started with
    <output_dir>/_work/batches/000012/                                      one finished batch (atomic rename)
    <output_dir>/shards/0-of-4/                                             a --shard 0/4 output (same layout)

meta.json is written last, so a folder with it is complete. A batch is written to a temporary folder and renamed
into place, so a killed run leaves only whole batches; rerunning the same command skips them. Batch b is generated
and labelled with generators seeded from (seed, b) only, so resuming, or splitting the batches over shards, gives
the same dataset as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accept_head.batch_generate import sample_batch
from accept_head.labels import (
    FORMAT,
    FORMAT_VERSION,
    label_features,
    label_responses,
    label_transform,
    load_label_dataset,
)
from accept_head.pairs import check_same_tokenizer, check_same_vocab, load_model, load_tokenizer
from accept_head.prompts import Prompt, PromptStats, chat_prompt_ids, load_prompts

from .config import DataGenConfig, config_differences

META = "meta.json"
WORK = "_work"
SHARDS = "shards"
LOCK = ".data_gen.lock"
DATASET_FILES = ("state.json", "dataset_info.json")
SHARD_NAME = re.compile(r"^(\d+)-of-(\d+)$")


# ----------------------------------------------------------------------------------------------------------------
# Output folder: checks before any model is loaded, atomic writes
# ----------------------------------------------------------------------------------------------------------------


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _dataset_files(folder: Path) -> list[Path]:
    return [p for p in folder.glob("data-*.arrow")] + [folder / n for n in DATASET_FILES if (folder / n).exists()]


@dataclass
class OutputState:
    """What an output folder holds, as found before a run."""

    path: Path
    status: str
    """fresh (nothing yet), resume (a partial run of this config), complete (this config, finished) or replace
    (another config's output, to be cleared once the run is ready to write)."""
    created: Path | None = None
    """The outermost folder this check created; removed again if the run fails before writing anything."""


def _make_writable_dir(path: Path) -> Path | None:
    """Create ``path`` if needed and prove it is writable; return the outermost folder created (None if none)."""
    created = None
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        created = parent
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"output_dir={str(path)!r} is not writable ({err.strerror or err}); pass a folder you can write to "
            "with --output_dir."
        ) from err
    return created


def check_output(path: Path, fingerprint: dict, overwrite: bool) -> OutputState:
    """Decide what to do with ``path`` before loading any model; raise ValueError when it must not be touched."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"output_dir={str(path)!r} is a file, not a folder; pass a folder with --output_dir.")
    created = _make_writable_dir(path)
    meta = _read_json(path / META) if (path / META).is_file() else None
    work = _read_json(path / WORK / "config.json") if (path / WORK).is_dir() else None
    if meta is not None and meta.get("format") == FORMAT:
        previous, status = meta.get("fingerprint"), "complete"
    elif work is not None:
        previous, status = work.get("fingerprint"), "resume"
    else:
        known = {WORK, SHARDS, LOCK}
        foreign = sorted(p.name for p in path.iterdir() if p.name not in known and not p.name.startswith(".write-"))
        if foreign:
            raise ValueError(
                f"output_dir={str(path)!r} is not empty and holds no data_gen output ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}); choose a new or empty folder with --output_dir."
            )
        return OutputState(path, "fresh", created)
    if previous == fingerprint:
        return OutputState(path, status, created)
    if not overwrite:
        what = "a finished dataset" if status == "complete" else "a partial run"
        diff = config_differences(previous or {}, fingerprint)
        raise ValueError(
            f"output_dir={str(path)!r} holds {what} made with a different config: {'; '.join(diff[:8]) or 'unknown'}. "
            "Pass --overwrite true to replace it, or choose another --output_dir."
        )
    return OutputState(path, "replace", created)


def _clear_output(path: Path) -> None:
    """Remove the data_gen content of ``path`` (dataset files, meta.json, _work); leave ``shards/`` alone."""
    for file in _dataset_files(path):
        file.unlink()
    (path / META).unlink(missing_ok=True)
    shutil.rmtree(path / WORK, ignore_errors=True)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an advisory lock on ``path`` so two processes never write the same output (released even on kill -9)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with (path / LOCK).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            raise ValueError(
                f"Another data_gen process is writing to {path}; wait for it or pick another --output_dir."
            ) from err
        yield


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence ``datasets``' per-save progress bars (they would interleave with ours); restore them afterwards."""
    from datasets.utils import logging as ds_logging

    enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            ds_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PromptPlan:
    """The tokenized prompts of a run, in dataset order, and what was dropped on the way."""

    prompts: list[Prompt]
    ids: list[list[int]]
    stats: PromptStats
    too_long: Counter = field(default_factory=Counter)
    """Prompts skipped for length, per source."""
    truncated: Counter = field(default_factory=Counter)
    """Prompts left-truncated to fit, per source."""
    max_prompt_tokens: int | None = None

    def digest(self) -> str:
        """Hash of the exact token ids and ids of every prompt, to refuse resuming over a changed prompt set."""
        h = hashlib.sha256()
        for prompt, ids in zip(self.prompts, self.ids, strict=True):
            h.update(json.dumps([prompt.id, ids]).encode())
        return h.hexdigest()


def tokenize_prompts(cfg: DataGenConfig, prompts: list[Prompt], tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, p.text, cfg.prompt_mode, cfg.system_prompt) for p in prompts]


def context_length(*models: torch.nn.Module) -> int | None:
    """The shortest ``max_position_embeddings`` among the models (None if none declares one)."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models]
    limits = [int(n) for n in limits if n]
    return min(limits) if limits else None


def fit_prompts(
    cfg: DataGenConfig, prompts: list[Prompt], ids: list[list[int]], stats: PromptStats, context: int | None
) -> PromptPlan:
    """Apply the length limit: skip or left-truncate prompts that leave no room for ``max_new_tokens``."""
    limit = cfg.max_prompt_tokens
    if context is not None:
        room = context - cfg.max_new_tokens
        if room < 1:
            raise ValueError(
                f"--max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the models' "
                f"context of {context} tokens; lower --max_new_tokens."
            )
        limit = room if limit is None else min(limit, room)
    plan = PromptPlan([], [], stats, max_prompt_tokens=limit)
    for prompt, prompt_ids in zip(prompts, ids, strict=True):
        if not prompt_ids:
            stats.empty += 1
            continue
        if limit is not None and len(prompt_ids) > limit:
            if cfg.too_long == "skip":
                plan.too_long[prompt.source] += 1
                continue
            prompt_ids = prompt_ids[-limit:]
            plan.truncated[prompt.source] += 1
        plan.prompts.append(prompt)
        plan.ids.append(prompt_ids)
    if not plan.prompts:
        raise ValueError(
            f"No prompt left to label: {sum(stats.per_source.values())} loaded, {sum(plan.too_long.values())} longer "
            f"than {limit} tokens, {stats.empty} empty. Check --prompts, --max_prompt_tokens and --too_long."
        )
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Seeds, code version
# ----------------------------------------------------------------------------------------------------------------


def derive_seed(seed: int, purpose: str, index: int) -> int:
    """A 63-bit seed for (run seed, purpose, batch index); independent of everything else in the run."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def code_version() -> dict[str, Any]:
    """Package version and, when the code sits in a git checkout, its commit and whether it has local changes."""
    import accept_head

    info: dict[str, Any] = {"package": "accept-head", "version": accept_head.__version__, "git_commit": None}
    root = Path(accept_head.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["git_dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def eos_token_ids(tokenizer, model: torch.nn.Module) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config (chat models often add an end-of-turn id)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if not ids:
        raise ValueError("Neither the tokenizer nor the target's generation_config defines an EOS token.")
    return sorted(ids)


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


TOTAL_KEYS = ("rows", "tokens", "eos_responses", "sum_accept_prob", "sum_expected_accept", "generation_s", "scoring_s")


def _stats(totals: dict[str, float]) -> dict[str, float]:
    rows, tokens = totals["rows"], totals["tokens"]
    compute = totals["generation_s"] + totals["scoring_s"]
    return {
        "rows": int(rows),
        "tokens": int(tokens),
        "mean_response_tokens": tokens / rows if rows else 0.0,
        "eos_fraction": totals["eos_responses"] / rows if rows else 0.0,
        "mean_accept_prob": totals["sum_accept_prob"] / tokens if tokens else 0.0,
        "mean_expected_accept": totals["sum_expected_accept"] / tokens if tokens else 0.0,
        "scoring_fraction": totals["scoring_s"] / compute if compute else 0.0,
        "labelled_tokens_per_s": tokens / compute if compute else 0.0,
    }


def batch_range(n_prompts: int, batch_size: int, shard: tuple[int, int] | None) -> range:
    """Global batch indices this run labels: all of them, or the i-th of n contiguous parts."""
    n_batches = math.ceil(n_prompts / batch_size)
    if shard is None:
        return range(n_batches)
    index, count = shard
    return range(index * n_batches // count, (index + 1) * n_batches // count)


def run_dir(cfg: DataGenConfig) -> Path:
    """The folder this run writes: ``output_dir``, or ``output_dir/shards/i-of-n`` for ``--shard i/n``."""
    shard = cfg.shard_index()
    out = Path(cfg.output_dir).expanduser()
    return out if shard is None else out / SHARDS / f"{shard[0]}-of-{shard[1]}"


def generate(cfg: DataGenConfig) -> dict[str, Any]:
    """Label the prompts of ``cfg`` (or its shard) and write the dataset; return its meta dict.

    Order of work: flags, output folder (before any model is loaded), prompts, tokenizers, models, then batches.
    Nothing is written to the output folder until every check has passed.
    """
    cfg.validate()
    started = time.perf_counter()
    out = run_dir(cfg)
    state = check_output(out, cfg.fingerprint(), cfg.overwrite)
    if state.status == "complete":
        meta = _read_json(out / META) or {}
        print(f"data_gen: {out} is already complete for this config; nothing to do.", file=sys.stderr)
        return meta
    try:
        with _exclusive(out):
            return _generate(cfg, out, state, started)
    except BaseException:
        _remove_created(out, state.created)
        raise


def _remove_created(out: Path, created: Path | None) -> None:
    """Undo the folders the output check created, as long as they hold nothing but our lock file."""
    if created is None or (out / WORK).exists():
        return
    (out / LOCK).unlink(missing_ok=True)
    for folder in [out, *out.parents]:
        try:
            folder.rmdir()  # only succeeds on an empty folder: never removes another process's work
        except OSError:
            return
        if folder == created:
            return


def _generate(cfg: DataGenConfig, out: Path, state: OutputState, started: float) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stats = PromptStats()
    prompts = load_prompts(cfg.prompts, seed=cfg.seed, split_seed=cfg.split_seed, stats=stats)
    tokenizer = load_tokenizer(cfg.target)
    check_same_tokenizer(tokenizer, load_tokenizer(cfg.draft), cfg.target.path, cfg.draft.path)
    ids = tokenize_prompts(cfg, prompts, tokenizer)
    target = load_model(cfg.target)
    draft = load_model(cfg.draft)
    check_same_vocab(target, draft)
    plan = fit_prompts(cfg, prompts, ids, stats, context_length(target, draft))
    eos = eos_token_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    batches = batch_range(len(plan.prompts), cfg.batch_size, cfg.shard_index())
    digest = plan.digest()

    # Every check passed: from here on the folder holds this run's (resumable) work.
    if state.status == "replace":
        _clear_output(out)
    work = out / WORK
    batch_root = work / "batches"
    if state.status == "resume":
        previous = _read_json(work / "config.json") or {}
        if previous.get("prompts_digest") != digest:
            raise ValueError(
                f"The prompts differ from those of the partial run in {out} (a prompt file or the tokenizer changed). "
                "Pass --overwrite true to start over, or restore the inputs."
            )
    else:
        shutil.rmtree(work, ignore_errors=True)
    batch_root.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(
        work / "config.json", {"fingerprint": cfg.fingerprint(), "prompts_digest": digest, "config": cfg.to_dict()}
    )
    for stale in batch_root.glob(".tmp-*"):  # a batch that was being written when the process died
        shutil.rmtree(stale, ignore_errors=True)

    sampling = cfg.sampling()
    done = [b for b in batches if (batch_root / f"{b:06d}").is_dir()]
    rows_total = sum(len(_batch_slice(plan, b, cfg.batch_size)) for b in batches)
    rows_done = sum(len(_batch_slice(plan, b, cfg.batch_size)) for b in done)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=rows_total,
        initial=rows_done,
        unit="prompt",
        desc=f"data_gen {out.name}",
        file=sys.stderr,
        disable=not cfg.progress,
        dynamic_ncols=True,
        smoothing=0.0,
    )
    tokens_this_run, compute_this_run = 0, 0.0
    with _quiet_datasets(), bar:
        for b in batches:
            if (batch_root / f"{b:06d}").is_dir():
                continue
            rows = _batch_slice(plan, b, cfg.batch_size)
            prompt_ids = [plan.ids[i] for i in rows]
            t0 = time.perf_counter()
            responses = sample_batch(
                target,
                prompt_ids,
                max_new_tokens=cfg.max_new_tokens,
                sampling=sampling,
                eos_token_ids=eos,
                pad_token_id=pad,
                generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "generate", b)),
            )
            t1 = time.perf_counter()
            response_ids = [r.token_ids for r in responses]
            labels = label_responses(
                target,
                draft,
                prompt_ids,
                response_ids,
                sampling=sampling,
                label_mode=cfg.label_mode,
                generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "labels", b)),
                pad_token_id=pad,
                score_tokens=cfg.score_tokens,
            )
            t2 = time.perf_counter()
            _write_batch(
                batch_root,
                b,
                [plan.prompts[i] for i in rows],
                prompt_ids,
                response_ids,
                labels,
                eos,
                generation_s=t1 - t0,
                scoring_s=t2 - t1,
            )
            n_tokens = sum(len(r) for r in response_ids)
            tokens_this_run += n_tokens
            compute_this_run += t2 - t0
            bar.update(len(rows))
            bar.set_postfix_str(f"{tokens_this_run / max(compute_this_run, 1e-9):.0f} labelled tok/s")

    meta = _finalize(cfg, out, plan, batches, tokenizer, eos, pad, digest, started)
    print(format_summary(meta), file=sys.stderr)
    return meta


def _batch_slice(plan: PromptPlan, b: int, batch_size: int) -> range:
    return range(b * batch_size, min(len(plan.prompts), (b + 1) * batch_size))


def _write_batch(
    batch_root: Path,
    b: int,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    labels: list[dict[str, list]],
    eos: list[int],
    *,
    generation_s: float,
    scoring_s: float,
) -> None:
    """Write one finished batch atomically: a temporary folder renamed to ``batches/<b>``."""
    import datasets

    columns: dict[str, list] = {
        "prompt_id": [p.id for p in prompts],
        "source": [p.source for p in prompts],
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
    }
    for name in labels[0]:
        columns[name] = [row[name] for row in labels]
    eos_set = set(eos)
    totals = {
        "rows": len(prompts),
        "tokens": sum(len(r) for r in response_ids),
        "eos_responses": sum(1 for r in response_ids if r and r[-1] in eos_set),
        "sum_accept_prob": float(sum(sum(row["accept_prob"]) for row in labels)),
        "sum_expected_accept": float(sum(sum(row["expected_accept"]) for row in labels)),
        "generation_s": generation_s,
        "scoring_s": scoring_s,
        "rows_per_source": dict(Counter(p.source for p in prompts)),
    }
    tmp = batch_root / f".tmp-{b:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(columns, features=label_features()).save_to_disk(str(tmp))
    _write_json_atomic(tmp / "batch.json", totals)
    os.replace(tmp, batch_root / f"{b:06d}")


def _empty_dataset():
    import datasets

    features = label_features()
    return datasets.Dataset.from_dict({name: [] for name in features}, features=features)


def _save_dataset(dataset, out: Path) -> None:
    for file in _dataset_files(out):
        file.unlink()
    dataset.save_to_disk(str(out), num_shards=1 if len(dataset) == 0 else None)


def _finalize(
    cfg: DataGenConfig,
    out: Path,
    plan: PromptPlan,
    batches: range,
    tokenizer,
    eos: list[int],
    pad: int,
    digest: str,
    started: float,
) -> dict[str, Any]:
    """Join the batches into the dataset, write meta.json (last), then drop the work folder."""
    import datasets

    batch_root = out / WORK / "batches"
    dirs = [batch_root / f"{b:06d}" for b in batches]
    missing = [d.name for d in dirs if not d.is_dir()]
    assert not missing, f"batches {missing} missing after the loop"
    totals: dict[str, float] = dict.fromkeys(TOTAL_KEYS, 0.0)
    rows_per_source: Counter = Counter()
    for d in dirs:
        batch = _read_json(d / "batch.json") or {}
        for key in TOTAL_KEYS:
            totals[key] += batch.get(key, 0.0)
        rows_per_source.update(batch.get("rows_per_source", {}))
    with _quiet_datasets():
        parts = [datasets.load_from_disk(str(d)) for d in dirs]
        dataset = datasets.concatenate_datasets(parts) if parts else _empty_dataset()
        _save_dataset(dataset, out)
    shard = cfg.shard_index()
    transform = label_transform(cfg.sampling(), cfg.label_mode)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": cfg.target.to_dict(),
        "draft": cfg.draft.to_dict(),
        "tokenizer": {
            "name_or_path": getattr(tokenizer, "name_or_path", None),
            "vocab_size": len(tokenizer),
            "eos_token_ids": eos,
            "pad_token_id": pad,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        },
        "sampling": cfg.sampling().to_dict(),
        "label_mode": cfg.label_mode,
        "label_transform": transform.to_dict(),
        "feature_transform": "softmax (temperature 1)" if transform.greedy else "label_transform",
        "seed": cfg.seed,
        "split_seed": cfg.split_seed,
        "prompt_format": {"mode": cfg.prompt_mode, "system_prompt": cfg.system_prompt},
        "max_new_tokens": cfg.max_new_tokens,
        "max_prompt_tokens": plan.max_prompt_tokens,
        "too_long": cfg.too_long,
        "sources": [
            {
                **source.to_dict(),
                "name": source.display_name,
                "loaded": plan.stats.per_source.get(source.display_name, 0),
                "too_long": plan.too_long.get(source.display_name, 0),
                "truncated": plan.truncated.get(source.display_name, 0),
                "rows": int(rows_per_source.get(source.display_name, 0)),
            }
            for source in cfg.prompts
        ],
        "skipped": {
            "empty": plan.stats.empty,
            "duplicates": plan.stats.duplicates,
            "too_long": sum(plan.too_long.values()),
        },
        "truncated": sum(plan.truncated.values()),
        "prompts_total": len(plan.prompts),
        "prompts_digest": digest,
        "shard": None
        if shard is None
        else {"index": shard[0], "count": shard[1], "batches": [batches.start, batches.stop]},
        "totals": totals,
        "stats": _stats(totals),
        "timing": {
            "wall_s_last_run": time.perf_counter() - started,
            "generation_s": totals["generation_s"],
            "scoring_s": totals["scoring_s"],
        },
        "code": code_version(),
        "config": cfg.to_dict(),
        "fingerprint": cfg.fingerprint(),
    }
    _write_json_atomic(out / META, meta)
    shutil.rmtree(out / WORK, ignore_errors=True)
    return meta


# ----------------------------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------------------------


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
        return _read_json(out / META) or {}
    metas: list[dict[str, Any]] = []
    with _exclusive(out), _quiet_datasets():
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
            _clear_output(out)
        _save_dataset(datasets.concatenate_datasets(parts), out)
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
        stats=_stats(totals),
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
    _write_json_atomic(out / META, merged)
    print(format_summary(merged), file=sys.stderr)
    return merged


def run(cfg: DataGenConfig) -> dict[str, Any]:
    """Entry point of ``python -m data_gen``: merge shard outputs or generate labels."""
    return merge(cfg) if cfg.merge else generate(cfg)


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------


def format_summary(meta: dict[str, Any]) -> str:
    """A one-screen summary of a finished run (prompts, responses, tokens, mean label, time)."""
    stats, skipped, timing = meta["stats"], meta["skipped"], meta["timing"]
    sources = ", ".join(f"{s['name']} {s['rows']}/{s['loaded']}" for s in meta["sources"])
    shard = meta.get("shard")
    title = "data_gen summary" + (f" (shard {shard['index']}/{shard['count']})" if shard else "")
    lines = [
        title,
        f"  prompts   {stats['rows']} labelled of {meta['prompts_total']} after filtering  [{sources}]",
        f"            skipped: {skipped['empty']} empty, {skipped['duplicates']} duplicates, "
        f"{skipped['too_long']} too long (> {meta['max_prompt_tokens']} tokens); {meta['truncated']} truncated",
        f"  responses {stats['rows']}, mean {stats['mean_response_tokens']:.1f} tokens, "
        f"{100 * stats['eos_fraction']:.0f}% ended with EOS (max_new_tokens {meta['max_new_tokens']})",
        f"  labels    {stats['tokens']} tokens, mode {meta['label_mode']}, mean accept_prob "
        f"{stats['mean_accept_prob']:.3f}, mean expected_accept {stats['mean_expected_accept']:.3f}",
        f"  time      generation {timing['generation_s']:.1f}s + scoring {timing['scoring_s']:.1f}s "
        f"({100 * stats['scoring_fraction']:.0f}% scoring), {stats['labelled_tokens_per_s']:.0f} labelled tok/s, "
        f"wall {timing['wall_s_last_run']:.1f}s (this run)",
    ]
    return "\n".join(lines)
