"""The label-generation pipeline: prompts → batched target responses, labelled as sampled → resumable batches → dataset.

Every batch is written to a temporary folder and renamed into ``_work/batches/<b>`` when done (see
:mod:`.output`), so a killed run leaves only whole batches and rerunning the same command skips them. Batch
b is generated and labelled with generators seeded from (seed, b) only, so resuming, or splitting the batches over
shards, gives the same dataset as one uninterrupted run.

With ``label_mode: rollout`` a batch is ``batch_size`` prompts decoded one at a time by real speculative rounds of
``k_max`` candidates (:func:`accept_head.chain.rollout.rollout_labels`), each prompt with a generator seeded from (seed,
its row index); the rows hold per-candidate lists and the drafter's hidden states, flattened into a ``hidden``
column (:data:`accept_head.chain.rollout.ROLLOUT_COLUMNS`; its width and dtype are in ``meta.json["rollout"]``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..acceptance.inputs import dataset_inputs
from ..acceptance.labels import (
    COLUMNS,
    FORMAT,
    FORMAT_VERSION,
    LockstepLabeller,
    label_features,
    label_responses,
    label_transform,
)
from ..chain.rollout import ROLLOUT_COLUMNS, rollout_features, rollout_labels
from ..core.prompts import Prompt, PromptStats, chat_prompt_ids, load_prompts
from ..core.records import code_version
from ..core.seeds import seeded_generator
from ..core.timing import device_timer, module_device
from ..models.batch_generate import sample_batch
from ..models.loading import check_draft_weights, is_feature_draft, load_model, load_tokenizer, weights_digest
from ..models.pairs import check_same_tokenizer, check_same_vocab, eos_token_ids
from .config import DataGenConfig
from .output import (
    META,
    SHARDS,
    WORK,
    clear_output,
    empty_dataset,
    exclusive,
    make_writable_dir,
    output_status,
    quiet_datasets,
    read_json,
    remove_created,
    save_dataset,
    write_json_atomic,
)

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


def context_length(*models: torch.nn.Module) -> int | None:
    """The shortest ``max_position_embeddings`` among the models (None if none declares one)."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models]
    return min((int(n) for n in limits if n), default=None)


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


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


TOTAL_KEYS = ("rows", "tokens", "eos_responses", "sum_accept_prob", "sum_expected_accept", "generation_s", "scoring_s")
ROLLOUT_TOTAL_KEYS = ("candidates", "rounds", "accepted_candidates")
"""Totals only rollout batches have: labelled candidates, speculative rounds (target passes), accepted candidates."""


def total_keys(rollout: bool) -> tuple[str, ...]:
    """The keys summed over batches (and shards) for a run of this label mode."""
    return TOTAL_KEYS + (ROLLOUT_TOTAL_KEYS if rollout else ())


def summary_stats(totals: dict[str, float]) -> dict[str, float]:
    """Means and rates for meta.json and the summary, from summed per-batch totals (:func:`total_keys`).

    Label means are per labelled position: per response token, or per candidate for rollout labels.
    """
    rows, tokens = totals["rows"], totals["tokens"]
    rollout = "candidates" in totals
    labelled = totals["candidates"] if rollout else tokens
    compute = totals["generation_s"] + totals["scoring_s"]
    stats = {
        "rows": int(rows),
        "tokens": int(tokens),
        "mean_response_tokens": tokens / rows if rows else 0.0,
        "eos_fraction": totals["eos_responses"] / rows if rows else 0.0,
        "mean_accept_prob": totals["sum_accept_prob"] / labelled if labelled else 0.0,
        "mean_expected_accept": totals["sum_expected_accept"] / labelled if labelled else 0.0,
        "scoring_fraction": totals["scoring_s"] / compute if compute else 0.0,
        "labelled_tokens_per_s": labelled / compute if compute else 0.0,
    }
    if rollout:
        rounds = totals["rounds"]
        stats.update(
            candidates=int(labelled),
            rounds=int(rounds),
            mean_candidates_per_round=labelled / rounds if rounds else 0.0,
            mean_accepted_per_round=totals["accepted_candidates"] / rounds if rounds else 0.0,
        )
    return stats


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
    created = make_writable_dir(out)
    with exclusive(out):
        try:
            status = output_status(out, cfg.fingerprint(), cfg.overwrite)
            if status == "complete":
                meta = read_json(out / META) or {}
                stale = stale_inputs(cfg, meta)
                if stale:
                    raise ValueError(
                        f"{out} holds a finished dataset of this config, but {' and '.join(stale)}. Pass "
                        "--overwrite true to make it again, or choose another --output_dir."
                    )
                print(f"data_gen: {out} is already complete for this config; nothing to do.", file=sys.stderr)
                return meta
            return _generate(cfg, out, status, started)
        except BaseException:
            remove_created(out, created)  # only undoes folders that are still empty
            raise


@dataclass
class LoadedPair:
    """The models of a run and the token ids generation needs."""

    target: torch.nn.Module
    draft: torch.nn.Module
    """An HF causal LM, or a :class:`~accept_head.models.feature_draft.FeatureDraft` bound to ``target`` (rollout
    only)."""
    tokenizer: Any
    eos: list[int]
    """Token ids that end a response (tokenizer EOS plus the target's generation_config EOS ids)."""
    pad: int


def load_run(cfg: DataGenConfig) -> tuple[PromptPlan, LoadedPair]:
    """Read the prompts, check the tokenizers, load both models and apply the length limit.

    Cheap checks run first: a bad prompt file or a tokenizer mismatch fails before any model is loaded.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    feature_draft = is_feature_draft(cfg.draft)
    if feature_draft and not cfg.rollout:
        raise ValueError(
            f"--draft.path={cfg.draft.path!r} is a feature draft (it reads the target's hidden states), which "
            f"--label_mode={cfg.label_mode} cannot run (it feeds the draft tokens alone); use --label_mode rollout."
        )
    stats = PromptStats()
    prompts = load_prompts(cfg.prompts, seed=cfg.seed, split_seed=cfg.split_seed, stats=stats)
    tokenizer = load_tokenizer(cfg.target)
    if not feature_draft:  # a feature draft has no tokenizer of its own: binding checks it was made for the target
        check_same_tokenizer(tokenizer, load_tokenizer(cfg.draft), cfg.target.path, cfg.draft.path)
    ids = [chat_prompt_ids(tokenizer, p.text, cfg.prompt_mode, cfg.system_prompt) for p in prompts]
    target = load_model(cfg.target)
    draft = load_model(cfg.draft)
    if feature_draft:
        draft.bind(target)  # refuses a draft trained for another target (fingerprint of its embeddings)
    check_same_vocab(target, draft)
    plan = fit_prompts(cfg, prompts, ids, stats, context_length(target, draft))
    eos = eos_token_ids(tokenizer, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return plan, LoadedPair(target, draft, tokenizer, eos, pad)


@dataclass
class LabelledBatch:
    response_ids: list[list[int]]
    labels: list[dict[str, list]]
    """Per row, the per-position label lists of :func:`accept_head.acceptance.labels.label_responses` (per-candidate
    lists and
    ``hidden`` for rollout batches, :meth:`accept_head.chain.rollout.RolloutLabels.row`)."""
    generation_s: float
    scoring_s: float
    totals: dict[str, float] = field(default_factory=dict)
    """Extra batch totals (:data:`ROLLOUT_TOTAL_KEYS` for rollout batches)."""


def label_batch(cfg: DataGenConfig, pair: LoadedPair, prompt_ids: list[list[int]], index: int) -> LabelledBatch:
    """Batch ``index``: the target samples responses (left-padded batch) and the draft's candidates are labelled.

    With ``scoring: lockstep`` the draft runs beside the target and labels each position as it is sampled; with
    ``teacher_forced`` both models score the finished responses. Every draw comes from generators seeded by
    (cfg.seed, index) alone, so a batch comes out the same whether it is labelled in one run, after a restart or in a
    shard.
    """
    if cfg.rollout:
        return rollout_batch(cfg, pair, prompt_ids, index)
    sampling = cfg.sampling()
    labels_generator = seeded_generator(cfg.seed, "labels", index)
    labeller = None
    if cfg.scoring == "lockstep":
        labeller = LockstepLabeller(
            pair.draft,
            batch=len(prompt_ids),
            max_new_tokens=cfg.max_new_tokens,
            sampling=sampling,
            label_mode=cfg.label_mode,
            generator=labels_generator,
        )
    devices = {module_device(pair.target), module_device(pair.draft)}
    with device_timer(devices) as generation:
        responses = sample_batch(
            pair.target,
            prompt_ids,
            max_new_tokens=cfg.max_new_tokens,
            sampling=sampling,
            eos_token_ids=pair.eos,
            pad_token_id=pair.pad,
            generator=seeded_generator(cfg.seed, "generate", index),
            follower=labeller,
        )
    response_ids = [r.token_ids for r in responses]
    if labeller is not None:
        labels = labeller.rows([len(r) for r in response_ids])
        return LabelledBatch(response_ids, labels, generation.seconds - labeller.seconds, labeller.seconds)
    with device_timer(devices) as scoring:
        labels = label_responses(
            pair.target,
            pair.draft,
            prompt_ids,
            response_ids,
            sampling=sampling,
            label_mode=cfg.label_mode,
            generator=labels_generator,
            pad_token_id=pair.pad,
            score_tokens=cfg.score_tokens,
        )
    return LabelledBatch(response_ids, labels, generation.seconds, scoring.seconds)


def rollout_batch(cfg: DataGenConfig, pair: LoadedPair, prompt_ids: list[list[int]], index: int) -> LabelledBatch:
    """Batch ``index`` in rollout mode: each prompt decoded alone by speculative rounds of ``k_max`` candidates, every
    candidate labelled from its round's verification pass (:func:`accept_head.chain.rollout.rollout_labels`).

    Prompt ``i`` of the batch (row ``index * batch_size + i`` of the run) uses a generator seeded from (seed, row),
    so its row does not depend on the batching, a restart or the shard it falls in.
    """
    sampling = cfg.sampling()
    responses: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    generation_s = scoring_s = 0.0
    totals = dict.fromkeys(ROLLOUT_TOTAL_KEYS, 0.0)
    for offset, ids in enumerate(prompt_ids):
        row_index = index * cfg.batch_size + offset
        generator = seeded_generator(cfg.seed, "rollout", row_index)
        result = rollout_labels(
            pair.target, pair.draft, ids, cfg.max_new_tokens, cfg.k_max, sampling, pair.eos, generator
        )
        row = result.row(cfg.hidden_dtype)
        if not np.isfinite(row["hidden"]).all():
            raise ValueError(
                f"The draft's hidden states do not fit --hidden_dtype={cfg.hidden_dtype} (largest magnitude "
                f"{float(result.hidden.abs().max()):.4g}); rerun with --hidden_dtype float32."
            )
        rows.append(row)
        responses.append(result.response_ids.tolist())
        generation_s += result.stats.total_time - result.label_seconds
        scoring_s += result.label_seconds
        totals["candidates"] += len(result.accept_prob)
        totals["rounds"] += result.stats.target_calls
        totals["accepted_candidates"] += int(result.accepted.sum())
    return LabelledBatch(responses, rows, generation_s, scoring_s, totals)


def _open_work(out: Path, status: str, cfg: DataGenConfig, digest: str) -> Path:
    """Start or resume the work folder (replacing another config's output if so decided); return its batch folder."""
    if status == "replace":
        clear_output(out)
    work = out / WORK
    if status == "resume":
        previous = read_json(work / "config.json") or {}
        if previous.get("prompts_digest") != digest:
            raise ValueError(
                f"The prompts differ from those of the partial run in {out} (a prompt file or the tokenizer changed). "
                "Pass --overwrite true to start over, or restore the inputs."
            )
        check_draft_weights(previous.get("draft_weights"), cfg.draft.path, f"the partial run in {out}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    batch_root = work / "batches"
    batch_root.mkdir(parents=True, exist_ok=True)
    record = {
        "fingerprint": cfg.fingerprint(),
        "prompts_digest": digest,
        "draft_weights": weights_digest(cfg.draft.path),
        "config": cfg.to_dict(),
    }
    write_json_atomic(work / "config.json", record)
    for stale in batch_root.glob(".tmp-*"):  # a batch that was being written when the process died
        shutil.rmtree(stale, ignore_errors=True)
    return batch_root


def _generate(cfg: DataGenConfig, out: Path, status: str, started: float) -> dict[str, Any]:
    from tqdm.auto import tqdm

    plan, pair = load_run(cfg)
    batches = batch_range(len(plan.prompts), cfg.batch_size, cfg.shard_index())
    digest = plan.digest()
    batch_root = _open_work(out, status, cfg, digest)  # every check passed: from here on the folder holds our work
    todo = [b for b in batches if not (batch_root / f"{b:06d}").is_dir()]
    bar = tqdm(
        total=sum(len(_batch_slice(plan, b, cfg.batch_size)) for b in batches),
        initial=sum(len(_batch_slice(plan, b, cfg.batch_size)) for b in batches if b not in todo),
        unit="prompt",
        desc=f"data_gen {out.name}",
        file=sys.stderr,
        disable=not cfg.progress,
        dynamic_ncols=True,
        smoothing=0.0,
    )
    tokens, seconds = 0, 0.0
    features = dataset_features(cfg)
    with quiet_datasets(), bar:
        for b in todo:
            rows = _batch_slice(plan, b, cfg.batch_size)
            prompt_ids = [plan.ids[i] for i in rows]
            batch = label_batch(cfg, pair, prompt_ids, b)
            _write_batch(batch_root, b, [plan.prompts[i] for i in rows], prompt_ids, batch, pair.eos, features)
            tokens += sum(len(r) for r in batch.response_ids)
            seconds += batch.generation_s + batch.scoring_s
            bar.update(len(rows))
            bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):.0f} labelled tok/s")
    meta = _finalize(cfg, out, plan, batches, pair, digest, started)
    print(format_summary(meta), file=sys.stderr)
    return meta


def _batch_slice(plan: PromptPlan, b: int, batch_size: int) -> range:
    return range(b * batch_size, min(len(plan.prompts), (b + 1) * batch_size))


def dataset_features(cfg: DataGenConfig):
    """The ``datasets.Features`` this run writes: token-level labels, or rollout labels with hidden states."""
    return rollout_features(cfg.hidden_dtype) if cfg.rollout else label_features()


def _write_batch(
    batch_root: Path,
    b: int,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    batch: LabelledBatch,
    eos: list[int],
    features,
) -> None:
    """Write one finished batch atomically: a temporary folder renamed to ``batches/<b>``."""
    import datasets

    columns: dict[str, list] = {
        "prompt_id": [p.id for p in prompts],
        "source": [p.source for p in prompts],
        "prompt_ids": prompt_ids,
        "response_ids": batch.response_ids,
        **{name: [row[name] for row in batch.labels] for name in batch.labels[0]},
    }
    eos_set = set(eos)
    totals = {
        "rows": len(prompts),
        "tokens": sum(len(r) for r in batch.response_ids),
        "eos_responses": sum(1 for r in batch.response_ids if r and r[-1] in eos_set),
        "sum_accept_prob": float(sum(sum(row["accept_prob"]) for row in batch.labels)),
        "sum_expected_accept": float(sum(sum(row["expected_accept"]) for row in batch.labels)),
        "generation_s": batch.generation_s,
        "scoring_s": batch.scoring_s,
        "rows_per_source": dict(Counter(p.source for p in prompts)),
        **batch.totals,
    }
    tmp = batch_root / f".tmp-{b:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
    write_json_atomic(tmp / "batch.json", totals)
    os.replace(tmp, batch_root / f"{b:06d}")


def _finalize(
    cfg: DataGenConfig,
    out: Path,
    plan: PromptPlan,
    batches: range,
    pair: LoadedPair,
    digest: str,
    started: float,
) -> dict[str, Any]:
    """Join the batches into the dataset, write meta.json (last), then drop the work folder."""
    import datasets

    batch_root = out / WORK / "batches"
    dirs = [batch_root / f"{b:06d}" for b in batches]
    missing = [d.name for d in dirs if not d.is_dir()]
    assert not missing, f"batches {missing} missing after the loop"
    keys = total_keys(cfg.rollout)
    totals: dict[str, float] = dict.fromkeys(keys, 0.0)
    rows_per_source: Counter = Counter()
    for d in dirs:
        batch = read_json(d / "batch.json") or {}
        for key in keys:
            totals[key] += batch.get(key, 0.0)
        rows_per_source.update(batch.get("rows_per_source", {}))
    with quiet_datasets():
        parts = [datasets.load_from_disk(str(d)) for d in dirs]
        dataset = datasets.concatenate_datasets(parts) if parts else empty_dataset(dataset_features(cfg))
        save_dataset(dataset, out)
    shard = cfg.shard_index()
    transform = cfg.sampling() if cfg.rollout else label_transform(cfg.sampling(), cfg.label_mode)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            "name_or_path": getattr(pair.tokenizer, "name_or_path", None),
            "vocab_size": len(pair.tokenizer),
            "eos_token_ids": pair.eos,
            "pad_token_id": pair.pad,
            "chat_template": bool(getattr(pair.tokenizer, "chat_template", None)),
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
        **run_record(cfg, totals, started),
    }
    if cfg.rollout:
        meta["rollout"] = rollout_meta(cfg, pair)
    write_json_atomic(out / META, meta)
    shutil.rmtree(out / WORK, ignore_errors=True)
    return meta


def prompt_texts_digest(cfg: DataGenConfig) -> str | None:
    """sha256 of the ids and texts of ``cfg``'s prompts as its sources read now (before tokenization and length
    limits); None when a source cannot be read any more."""
    try:
        prompts = load_prompts(cfg.prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    except (FileNotFoundError, ValueError):
        return None
    h = hashlib.sha256()
    for prompt in prompts:
        h.update(json.dumps([prompt.id, prompt.text]).encode())
    return h.hexdigest()


def stale_inputs(cfg: DataGenConfig, meta: dict[str, Any]) -> list[str]:
    """What changed since the finished dataset ``meta`` describes was made with ``cfg`` (whose fingerprint it
    shares): the draft's weights (retrained in place) or the prompt files' contents. Empty when nothing did, or when
    the dataset predates the record."""
    reasons = []
    recorded, current = meta.get("draft_weights"), weights_digest(cfg.draft.path)
    if recorded and current and recorded != current:
        reasons.append(
            f"the draft {cfg.draft.path!r} was retrained in place since ({recorded[:12]}… then, {current[:12]}… now)"
        )
    recorded, current = meta.get("prompt_texts"), prompt_texts_digest(cfg)
    if recorded and current and recorded != current:
        reasons.append("its prompt files changed since")
    return reasons


def run_record(cfg: DataGenConfig, totals: dict[str, float], started: float) -> dict[str, Any]:
    """The ``meta.json`` keys a finished run and a merge both write: the models, summed totals and their stats,
    times, code version and config."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": cfg.target.to_dict(),
        "draft": cfg.draft.to_dict(),
        "draft_weights": weights_digest(cfg.draft.path),  # sha256 of a local draft's weights (None: hub or package)
        "prompt_texts": prompt_texts_digest(cfg),  # a finished dataset whose prompt files change is stale
        # what an acceptance head trained on this dataset may read (accept_head/acceptance/inputs.py)
        "head_inputs": list(dataset_inputs(cfg.rollout, list(ROLLOUT_COLUMNS if cfg.rollout else COLUMNS))),
        **totals_record(totals, started),
        "config": cfg.to_dict(),
        "fingerprint": cfg.fingerprint(),
    }


def totals_record(totals: dict[str, float], started: float) -> dict[str, Any]:
    """The ``meta.json`` keys of summed totals (a run's, a merge's or a join's): the totals, their stats, times and
    the code version."""
    return {
        "totals": totals,
        "stats": summary_stats(totals),
        "timing": {
            "wall_s_last_run": time.perf_counter() - started,
            "generation_s": totals["generation_s"],
            "scoring_s": totals["scoring_s"],
        },
        "code": code_version(),
    }


def rollout_meta(cfg: DataGenConfig, pair: LoadedPair) -> dict[str, Any]:
    """``meta.json["rollout"]``: how the rollout ran and how its ``hidden`` column is laid out."""
    return {
        "k_max": cfg.k_max,
        "drafter": type(pair.draft).__name__,
        "hidden_size": int(pair.draft.config.hidden_size),
        "hidden_dtype": cfg.hidden_dtype,
        "hidden_layout": "per row: (candidates, hidden_size) row-major, flattened into one list",
        "label_unit": "candidate",
    }


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------


def format_summary(meta: dict[str, Any]) -> str:
    """A one-screen summary of a finished run (prompts, responses, tokens, mean label, time)."""
    stats, skipped, timing = meta["stats"], meta["skipped"], meta["timing"]
    sources = ", ".join(f"{s['name']} {s['rows']}/{s['loaded']}" for s in meta["sources"])
    shard = meta.get("shard")
    title = "data_gen summary" + (f" (shard {shard['index']}/{shard['count']})" if shard else "")
    labels = f"{stats['tokens']} tokens"
    if "candidates" in stats:
        k_max = (meta.get("rollout") or {}).get("k_max")
        labels = (
            f"{stats['candidates']} candidates in {stats['rounds']} rounds (k_max {k_max}, "
            f"{stats['mean_accepted_per_round']:.2f} accepted per round)"
        )
    lines = [
        title,
        f"  prompts   {stats['rows']} labelled of {meta['prompts_total']} after filtering  [{sources}]",
        f"            skipped: {skipped['empty']} empty, {skipped['duplicates']} duplicates, "
        f"{skipped['too_long']} too long (> {meta['max_prompt_tokens']} tokens); {meta['truncated']} truncated",
        f"  responses {stats['rows']}, mean {stats['mean_response_tokens']:.1f} tokens, "
        f"{100 * stats['eos_fraction']:.0f}% ended with EOS (max_new_tokens {meta['max_new_tokens']})",
        f"  labels    {labels}, mode {meta['label_mode']}, mean accept_prob "
        f"{stats['mean_accept_prob']:.3f}, mean expected_accept {stats['mean_expected_accept']:.3f}",
        f"  time      generation {timing['generation_s']:.1f}s + scoring {timing['scoring_s']:.1f}s "
        f"({100 * stats['scoring_fraction']:.0f}% scoring), {stats['labelled_tokens_per_s']:.0f} labelled tok/s, "
        f"wall {timing['wall_s_last_run']:.1f}s (this run)",
    ]
    return "\n".join(lines)
