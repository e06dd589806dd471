"""The data side of head training: a ``data_gen`` label dataset, a seeded prompt-level split, token mixing and
length-bucketed batches, wrapped in a LightningDataModule.

A training example is one prompt x with the target's response X, the draft's samples Y and the soft labels
ℓ_i = min(1, p_i(Y_i)/q_i(Y_i)) (see :mod:`accept_head.acceptance.labels`). Each epoch builds Z by token mixing
(:mod:`accept_head.acceptance.mixing`) and feeds (x, Z) to the frozen draft; the loss applies where Z_i = Y_i, at the
hidden
state whose input token is Z_i.

Rollout datasets (``label_mode: rollout`` in ``meta.json``, :mod:`accept_head.chain.rollout`) are detected
automatically:
they store the drafter's hidden state of every candidate next to its on-policy label, so an example is one prompt's
(hidden, label) pairs (:class:`StoredHiddenDataset`) — no draft forward and no token mixing (``mix_ratio`` and
``max_length`` do not apply). The prompt split is the same. Their rows also carry every candidate's scalar head
inputs (:mod:`accept_head.acceptance.inputs`: log q, entropy, top-1, depth, path log q), which heads with
``inputs`` beyond the hidden state read; token-level datasets hold the hidden state only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterator, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from ..acceptance.inputs import (
    INPUTS,
    SCALAR_INPUTS,
    SOURCES,
    dataset_inputs,
    require_inputs,
    standardisation,
    stored_inputs,
)
from ..acceptance.labels import recorded_temperature
from ..acceptance.mixing import check_ratio, mix_tokens
from ..core.sampling import SamplingConfig
from ..core.seeds import seeded_generator
from ..models.feature_draft import read_config
from ..models.loading import check_draft_weights, is_feature_draft, load_model, load_tokenizer
from ..models.pairs import ModelSpec, eos_token_ids, local_folder, local_path

ROLLOUT = "rollout"
"""``meta.json["label_mode"]`` of a dataset with stored hidden states (:mod:`accept_head.chain.rollout`)."""

VALIDATION_EPOCH = -1
"""The mixing 'epoch' of validation examples: fixed, so validation metrics are comparable across epochs."""


# ---- rows and the split -------------------------------------------------------------------------------------------


@dataclass
class LabelRow:
    """One prompt of a label dataset; tensors are 1-D LongTensor / FloatTensor."""

    prompt_id: str
    prompt_ids: torch.Tensor
    """(P,) prompt tokens (chat template applied by data_gen)."""
    response_ids: torch.Tensor
    """(N,) X: the target's response."""
    draft_ids: torch.Tensor
    """(N,) Y: Y_i ~ q(·|x, X_<i)."""
    accept_prob: torch.Tensor
    """(N,) soft labels min(1, p_i(Y_i)/q_i(Y_i))."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class HiddenRow:
    """One prompt of a rollout dataset: the drafter's stored hidden states of its candidates and their labels."""

    prompt_id: str
    prompt_ids: torch.Tensor
    """(P,) prompt tokens (for the end-of-fit sweep's held-out prompts)."""
    hidden: torch.Tensor
    """(C, d) the drafter's hidden state of each candidate (float16 or float32, as stored)."""
    accept_prob: torch.Tensor
    """(C,) on-policy soft labels min(1, p_k(y_k)/q_k(y_k))."""
    inputs: torch.Tensor
    """(C, S) float32 scalar head inputs in :data:`~accept_head.acceptance.inputs.SCALAR_INPUTS` order (NaN in the
    columns of inputs the dataset lacks)."""

    def __len__(self) -> int:
        return len(self.accept_prob)


def is_rollout(meta: dict) -> bool:
    """Whether a dataset's ``meta.json`` describes rollout labels with stored hidden states."""
    return meta.get("label_mode") == ROLLOUT


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs name the same weights (dtype and device may differ)."""

    def where(spec: ModelSpec) -> str:
        return str(local_path(spec) or spec.path)

    return (where(a), a.gguf_file, a.adapter, a.revision) == (where(b), b.gguf_file, b.adapter, b.revision)


def check_draft(meta: dict, draft: ModelSpec, path: str | Path) -> None:
    """Refuse a dataset whose labels were computed for another draft than the configured one, or for the same local
    draft folder before its weights changed (a draft retrained in place: labels record a digest of its weights)."""
    raw = meta.get("draft")
    if not isinstance(raw, dict) or "path" not in raw:
        raise ValueError(f"{path}/meta.json names no draft model; regenerate the dataset with python -m data_gen.")
    labelled = ModelSpec(**raw)
    if not same_model(labelled, draft):
        raise ValueError(
            f"The dataset {path} was labelled with draft {labelled.path!r} (gguf_file={labelled.gguf_file!r}, "
            f"adapter={labelled.adapter!r}) but data.draft is {draft.path!r} (gguf_file={draft.gguf_file!r}, "
            f"adapter={draft.adapter!r}). Labels depend on the draft: set --data.draft.path={labelled.path} or "
            f"regenerate the labels with `python -m data_gen ... --draft.path {draft.path}`."
        )
    check_draft_weights(meta.get("draft_weights"), draft.path, f"The label dataset {str(path)!r}")


def _check_train_fraction(train_fraction: float) -> None:
    if not 0.0 < train_fraction <= 1.0:
        raise ValueError(f"train_fraction={train_fraction} must be in (0, 1]; 1 trains on every training prompt.")


def _check_split(val_fraction: float, val_size: int | None, train_fraction: float) -> None:
    """Raise ValueError unless the validation split is non-empty and ``train_fraction`` is in (0, 1]."""
    if val_size is None and not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"val_fraction={val_fraction} must be in (0, 1) (or set --data.val_size): an empty validation split "
            "leaves nothing to validate, calibrate or sweep on."
        )
    if val_size is not None and val_size < 1:
        raise ValueError(f"val_size={val_size}: the validation split would be empty; set --data.val_size >= 1.")
    _check_train_fraction(train_fraction)


def _check_batching(batch_size: int, max_length: int | None) -> None:
    """Raise ValueError unless ``batch_size`` >= 1 and ``max_length`` is None or >= 2."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2 (or null for no truncation).")


def _check_greedy_labels(greedy_path: str | None, greedy_data_gen: str | dict[str, Any] | None) -> None:
    """Raise ValueError when ``greedy_data_gen`` is set without ``greedy_path`` (where it would write)."""
    if greedy_data_gen is not None and greedy_path is None:
        raise ValueError("data.greedy_data_gen needs data.greedy_path: the folder to write the greedy labels to.")


def prompt_split(
    prompt_ids: Sequence[str], val_fraction: float, val_size: int | None, seed: int, train_fraction: float = 1.0
) -> dict[str, Any]:
    """A seeded, disjoint train/validation split of prompt ids (a permutation of the sorted ids).

    ``train_fraction`` < 1 keeps a seeded subset of the training prompts (training-set-size experiments); the
    validation split does not depend on it, so heads trained on different fractions are validated alike.
    Returns a JSON-ready record: ``{"seed", "val_fraction", "val_size", "train_fraction", "train": [...],
    "val": [...]}``; the validation ids keep the permuted order, so "the first n validation prompts" is itself a
    seeded sample.
    """
    _check_train_fraction(train_fraction)
    ids = sorted(set(prompt_ids))
    if len(ids) != len(prompt_ids):
        raise ValueError(f"The dataset holds duplicate prompt_ids ({len(prompt_ids) - len(ids)}); regenerate it.")
    n_val = val_size if val_size is not None else int(round(val_fraction * len(ids)))
    if n_val < 1:
        raise ValueError(
            f"The validation split is empty: val_fraction={val_fraction}, val_size={val_size} of {len(ids)} prompts. "
            "Raise --data.val_fraction (or set --data.val_size >= 1) or label more prompts."
        )
    if n_val >= len(ids):
        raise ValueError(
            f"val_size={n_val} leaves no training prompts out of {len(ids)}; "
            "lower --data.val_fraction / --data.val_size."
        )
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    val = [ids[i] for i in order[:n_val]]
    kept = order[n_val:]
    if train_fraction < 1.0:
        n_train = max(1, int(round(train_fraction * len(kept))))
        subset = torch.randperm(len(kept), generator=seeded_generator(seed, "train subset"))[:n_train].tolist()
        kept = [kept[i] for i in subset]
    train = [ids[i] for i in sorted(kept)]
    return {
        "seed": seed,
        "val_fraction": val_fraction,
        "val_size": val_size,
        "train_fraction": train_fraction,
        "train": train,
        "val": val,
    }


# ---- mixing dataset, bucketed batches, collation -------------------------------------------------------------------


class _RowDataset(Dataset):
    """A dataset of one example per row; ``lengths`` drive :class:`BucketBatchSampler`."""

    rows: list

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.rows]


class MixedTokenDataset(_RowDataset):
    """Examples for the head: ``dataset[(row, epoch)]`` mixes row ``row`` for epoch ``epoch``.

    The generator of each (row, epoch) is seeded from (seed, epoch, prompt_id)
    (:func:`accept_head.core.seeds.derive_seed`),
    so the mixing is resampled every epoch, reproducible per seed, and independent of batch order, workers and
    processes. Items: ``input_ids`` (L,) = prompt + Z, ``loss_mask`` (L,) True where Z_i = Y_i,
    ``labels`` (L,) the soft labels there, ``row`` the row index.
    """

    def __init__(self, rows: Sequence[LabelRow], mix_ratio: float, seed: int) -> None:
        check_ratio(mix_ratio)
        self.rows = list(rows)
        self.mix_ratio = mix_ratio
        self.seed = seed

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        row = self.rows[index]
        generator = seeded_generator(self.seed, epoch, row.prompt_id)
        z, from_draft = mix_tokens(row.response_ids, row.draft_ids, self.mix_ratio, generator)
        prompt_len = len(row.prompt_ids)
        loss_mask = torch.zeros(len(row), dtype=torch.bool)
        loss_mask[prompt_len:] = from_draft
        labels = torch.zeros(len(row), dtype=torch.float32)
        labels[prompt_len:] = row.accept_prob
        return {
            "input_ids": torch.cat([row.prompt_ids, z]),
            "loss_mask": loss_mask,
            "labels": labels,
            "row": torch.tensor(index),
        }


class EpochRandomSampler(RandomSampler):
    """A random permutation seeded by (seed + epoch): reproducible, new every epoch, the same for a resumed fit."""

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = seeded_generator(self.seed, self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class BucketBatchSampler(BatchSampler):
    """Length-bucketed batches: indices from ``sampler`` are taken ``pool`` batches at a time, sorted by length and cut
    into batches, so a batch pads little; batch order is then shuffled (seeded by seed and epoch) when ``shuffle``.

    Yields lists of ``(row, epoch)`` keys for :class:`MixedTokenDataset`. The epoch is ``fixed_epoch`` when given,
    else the sampler's ``epoch`` (Lightning calls ``set_epoch`` on it, also on the ``DistributedSampler`` it injects
    under DDP in place of ``sampler``). ``start()``, read as each pass begins, is how many of the epoch's batches were
    already trained on (a fit resumed from a mid-epoch checkpoint): those are skipped, so the epoch goes on with the
    batches it had left.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        lengths: Sequence[int] = (),
        pool: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        fixed_epoch: int | None = None,
        start: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.start = start
        if pool < 1:
            raise ValueError(f"pool={pool} must be >= 1 (batches per length-sorted bucket).")
        self.lengths = list(lengths)
        self.pool, self.shuffle, self.seed, self.fixed_epoch = pool, shuffle, seed, fixed_epoch

    @property
    def epoch(self) -> int:
        return self.fixed_epoch if self.fixed_epoch is not None else int(getattr(self.sampler, "epoch", 0))

    def _batches(self) -> list[list[int]]:
        indices = list(self.sampler)
        pool_size = self.batch_size * self.pool
        batches: list[list[int]] = []
        for start in range(0, len(indices), pool_size):
            pool = sorted(indices[start : start + pool_size], key=lambda i: self.lengths[i], reverse=True)
            chunk = [pool[j : j + self.batch_size] for j in range(0, len(pool), self.batch_size)]
            if self.drop_last and chunk and len(chunk[-1]) < self.batch_size:
                chunk.pop()
            batches += chunk
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        batches = self._batches()
        order = range(len(batches))
        if self.shuffle:
            generator = seeded_generator(self.seed, epoch, "batch order")
            order = torch.randperm(len(batches), generator=generator).tolist()
        for b in order[self.start() if self.start is not None else 0 :]:
            yield [(index, epoch) for index in batches[b]]

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        pool_size = self.batch_size * self.pool
        full, rest = divmod(n, pool_size)
        last = rest // self.batch_size if self.drop_last else math.ceil(rest / self.batch_size)
        return full * self.pool + last


class StoredHiddenDataset(_RowDataset):
    """Examples for the head from stored hidden states: ``dataset[(row, epoch)]`` is row ``row``'s candidates.

    Items: ``hidden`` (C, d), ``inputs`` (C, S) the scalar head inputs, ``labels`` (C,), ``row`` the row index. The
    epoch is accepted (and ignored) so the same :class:`BucketBatchSampler` drives both kinds of dataset.
    """

    def __init__(self, rows: Sequence[HiddenRow]) -> None:
        self.rows = list(rows)

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index = key[0] if isinstance(key, tuple) else key
        row = self.rows[index]
        return {"hidden": row.hidden, "inputs": row.inputs, "labels": row.accept_prob, "row": torch.tensor(index)}


def collate_hidden(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Zero-pad stored-hidden examples into a batch: hidden (B, C, d), inputs (B, C, S), loss_mask / labels (B, C),
    row (B,)."""
    labels = [item["labels"].float() for item in items]
    return {
        "hidden": pad_sequence([item["hidden"] for item in items], batch_first=True),
        "inputs": pad_sequence([item["inputs"] for item in items], batch_first=True),
        "loss_mask": pad_sequence([torch.ones_like(y, dtype=torch.bool) for y in labels], batch_first=True),
        "labels": pad_sequence(labels, batch_first=True),
        "row": torch.stack([item["row"] for item in items]),
    }


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad examples with zeros into a batch: input_ids / attention_mask / loss_mask / labels (B, L), row (B,)."""
    ids = [item["input_ids"] for item in items]
    return {
        "input_ids": pad_sequence(ids, batch_first=True),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
        "loss_mask": pad_sequence([item["loss_mask"].bool() for item in items], batch_first=True),
        "labels": pad_sequence([item["labels"].float() for item in items], batch_first=True),
        "row": torch.stack([item["row"] for item in items]),
    }


# ---- data_gen in prepare_data --------------------------------------------------------------------------------------


def run_data_gen(config: str | dict, output_dir: str | Path, draft: ModelSpec) -> dict:
    """Run ``python -m data_gen``'s pipeline into ``output_dir``; return the dataset's meta dict.

    ``config`` is the path of a data_gen YAML file or a mapping of its keys (``draft`` defaults to ``draft``);
    ``output_dir`` always comes from the data module. A draft other than ``draft`` is refused before any work.
    """
    from ..labelgen.run import parse_config, run

    if isinstance(config, str):
        if not Path(config).is_file():
            raise FileNotFoundError(f"data.data_gen={config!r}: no such data_gen config file.")
        argv = ["--config", config]
    else:
        raw = dict(config)
        raw.setdefault("draft", draft.to_dict())
        argv = ["--config", json.dumps(raw)]
    cfg = parse_config([*argv, "--output_dir", str(output_dir)])
    if not same_model(cfg.draft, draft):
        raise ValueError(
            f"data.data_gen labels draft {cfg.draft.path!r} but data.draft is {draft.path!r}; "
            "make them the same model (or drop draft from the data_gen config to inherit data.draft)."
        )
    return run(cfg)


# ---- the data module -----------------------------------------------------------------------------------------------


class AcceptanceDataModule(LightningDataModule):
    """Training data of the acceptance head from a ``python -m data_gen`` label dataset.

    The prompts are split into train / validation by a seeded permutation (recorded in ``split.json`` next to the
    logs and in the bundle). Every epoch re-mixes the training responses (token mixing, ratio ``mix_ratio``);
    validation uses one fixed mixing. Batches group prompts of similar length.

    A rollout dataset (``meta.json["label_mode"] == "rollout"``, written by ``python -m data_gen --label_mode
    rollout``) is recognised from its meta.json: the head then trains on the stored (hidden state, label) pairs of
    each prompt's candidates, with the same split, batches of ``batch_size`` prompts and no draft forward
    (``mix_ratio``, ``mix_seed``'s mixing and ``max_length`` are unused). ``rollout`` tells which kind was loaded,
    ``inputs`` what a head may read from every dataset loaded (:meth:`check_head_inputs`).
    """

    # What ``setup`` loads: nothing until it runs (``meta``, ``split`` and ``dropped`` are set per instance).
    rollout: bool = False
    """Whether ``path`` holds rollout labels with stored hidden states (set by ``setup``)."""
    inputs: tuple[str, ...] = INPUTS
    """The head inputs every dataset loaded so far holds (:func:`~accept_head.acceptance.inputs.dataset_inputs`;
    narrowed by ``setup``)."""
    train_set: MixedTokenDataset | StoredHiddenDataset | None = None
    val_set: MixedTokenDataset | StoredHiddenDataset | None = None
    test_set: MixedTokenDataset | StoredHiddenDataset | None = None
    greedy_set: MixedTokenDataset | StoredHiddenDataset | None = None
    """The greedy labels of prompts the head does not train on (``greedy_path``), for the greedy calibration."""
    _target: torch.nn.Module | None = None
    _tokenizer: Any = None

    def __init__(
        self,
        path: str,
        draft: ModelSpec,
        target: ModelSpec | None = None,
        data_gen: str | dict[str, Any] | None = None,
        mix_ratio: float = 0.15,
        val_fraction: float = 0.1,
        val_size: int | None = None,
        train_fraction: float = 1.0,
        split_seed: int = 0,
        mix_seed: int = 0,
        batch_size: int = 32,
        bucket_pool: int = 16,
        max_length: int | None = None,
        num_workers: int = 0,
        test_path: str | None = None,
        greedy_path: str | None = None,
        greedy_data_gen: str | dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            path: Folder of the label dataset written by ``python -m data_gen`` (``save_to_disk`` + ``meta.json``);
                a ``label_mode: rollout`` dataset trains on its stored hidden states (detected from meta.json).
            draft: The frozen draft whose hidden states feed the head; must be the draft the labels were made with
                (dtype and device may differ). A feature-draft folder needs a rollout dataset.
            target: Overrides the target recorded in the dataset's ``meta.json`` (e.g. another device or dtype);
                used after training for the cost model, the threshold sweep and the bundle.
            data_gen: Run data_gen into ``path`` in ``prepare_data`` when the dataset does not exist yet: the path
                of a data_gen YAML config or a mapping of its keys (``draft`` defaults to ``draft``).
            mix_ratio: Token mixing ratio r in [0, 1): probability that a position holds the target's token X_i
                rather than the draft's Y_i (no loss there). The official code uses 0.15.
            val_fraction: Fraction of prompts held out for validation (ignored when ``val_size`` is set).
            val_size: Number of prompts held out for validation.
            train_fraction: Train on this seeded fraction of the training prompts (in (0, 1]; for training-set-size
                experiments: the validation split stays the same).
            split_seed: Seed of the prompt-level train/validation permutation.
            mix_seed: Seed of the token mixing (combined with the epoch and each prompt's id).
            batch_size: Prompts per batch.
            bucket_pool: Batches per length-sorted pool (1 = no bucketing).
            max_length: Truncate each (prompt + response) to this many tokens (the response's tail is cut);
                prompts that alone reach it are dropped. None keeps everything. Unused for rollout datasets.
            num_workers: DataLoader worker processes.
            test_path: Another label dataset (same draft) for ``python -m train test``; default: the validation split.
            greedy_path: A label dataset of the same draft decoded greedily (data_gen ``temperature: 0``): greedy
                verification accepts by another rule than the sampling labels the head trains on, so calibration
                fits a second map on these labels for greedy decoding (prompts the head trains on are left out).
            greedy_data_gen: Run data_gen into ``greedy_path`` in ``prepare_data`` when it does not exist yet (as
                ``data_gen``); its temperature must be 0.
        """
        super().__init__()
        check_ratio(mix_ratio)
        _check_split(val_fraction, val_size, train_fraction)
        _check_batching(batch_size, max_length)
        self.path = str(Path(path).expanduser())
        self.draft = ModelSpec.coerce(draft)
        self.target_override = ModelSpec.coerce(target) if target is not None else None
        self.data_gen = data_gen
        self.mix_ratio, self.mix_seed = mix_ratio, mix_seed
        self.val_fraction, self.val_size, self.split_seed = val_fraction, val_size, split_seed
        self.train_fraction = train_fraction
        self.batch_size, self.bucket_pool, self.max_length = batch_size, bucket_pool, max_length
        self.num_workers = num_workers
        self.test_path = str(Path(test_path).expanduser()) if test_path else None
        _check_greedy_labels(greedy_path, greedy_data_gen)
        self.greedy_path = str(Path(greedy_path).expanduser()) if greedy_path else None
        self.greedy_data_gen = greedy_data_gen
        self.hidden_size = draft_hidden_size(self.draft)
        """The draft's hidden size: the head's width (linked to ``model.hidden_size`` by the CLI)."""
        self.meta: dict = {}
        self.split: dict = {}
        self.dropped: dict[str, int] = {}
        self.save_hyperparameters()

    # -- Lightning hooks

    def prepare_data(self) -> None:
        """Run data_gen (rank 0 only) when the dataset is absent and ``data_gen`` is configured; refuse a dataset made
        by another draft, or by ``data.draft``'s folder before it was retrained in place, before any training."""
        for config, path in ((self.data_gen, self.path), (self.greedy_data_gen, self.greedy_path)):
            if path is None:
                continue
            meta = Path(path) / "meta.json"
            if meta.is_file():
                check_draft(json.loads(meta.read_text()), self.draft, path)
            elif config is not None:
                run_data_gen(config, path, self.draft)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        rows, self.meta = self._load(self.path)
        labelled = self.meta.get("target")
        override = self.target_override
        if override is not None and isinstance(labelled, dict) and not same_model(override, ModelSpec(**labelled)):
            raise ValueError(
                f"data.target={override.path!r} is not the target the labels of {self.path} were made with "
                f"({labelled.get('path')!r}); data.target may change dtype/device/attention only."
            )
        self.split = prompt_split(
            [row.prompt_id for row in rows], self.val_fraction, self.val_size, self.split_seed, self.train_fraction
        )
        by_id = {row.prompt_id: row for row in rows}
        self.rollout = is_rollout(self.meta)
        self.train_set = self._examples([by_id[pid] for pid in self.split["train"]])
        self.val_set = self._examples([by_id[pid] for pid in self.split["val"]])
        self.test_set = self._examples(self._load(self.test_path)[0]) if self.test_path is not None else self.val_set
        if self.greedy_path is not None:
            self.greedy_set = self._greedy_examples(set(self.split["train"]))
        self._record_split()

    def _greedy_examples(self, train_ids: set[str]) -> MixedTokenDataset | StoredHiddenDataset:
        """The greedy labels (``greedy_path``) of the prompts the head does not train on."""
        rows, meta = self._load(self.greedy_path)
        temperature = recorded_temperature(meta)
        if temperature != 0:
            raise ValueError(
                f"data.greedy_path={self.greedy_path!r} holds labels made at temperature {temperature!r}; greedy "
                "calibration needs data_gen --temperature 0 labels."
            )
        held = [row for row in rows if row.prompt_id not in train_ids]
        if not held:
            raise ValueError(
                f"Every prompt of data.greedy_path={self.greedy_path!r} is a training prompt of the head; label "
                "other prompts greedily (e.g. the same sources with an offset past the training ones)."
            )
        self.split["greedy"] = [row.prompt_id for row in held]
        return self._examples(held)

    def _examples(self, rows: Sequence[LabelRow | HiddenRow]) -> MixedTokenDataset | StoredHiddenDataset:
        """The torch dataset of ``rows``: stored hidden states, or token mixing."""
        if rows and isinstance(rows[0], HiddenRow):
            return StoredHiddenDataset(rows)
        return MixedTokenDataset(rows, self.mix_ratio, self.mix_seed)

    def _load(self, path: str) -> tuple[list[LabelRow] | list[HiddenRow], dict]:
        from ..acceptance.labels import load_label_dataset

        if not Path(path).exists():
            hint = (
                "set --data.data_gen to a data_gen config to create it in prepare_data, or run "
                f"`python -m data_gen --config <config> --output_dir {path}`"
            )
            raise FileNotFoundError(f"data.path={path!r} does not exist: {hint}.")
        dataset, meta = load_label_dataset(path)
        check_draft(meta, self.draft, path)
        held = dataset_inputs(is_rollout(meta), dataset.column_names)
        self.inputs = tuple(name for name in self.inputs if name in held)
        rows, dropped = (
            self._load_rollout(path, dataset, meta) if is_rollout(meta) else self._load_tokens(path, dataset)
        )
        if path == self.path:
            self.dropped = dropped
        if not rows:
            raise ValueError(f"{path} holds no prompt with a response or a labelled candidate to train on ({dropped}).")
        return rows, meta

    def _load_tokens(self, path: str, dataset) -> tuple[list[LabelRow], dict[str, int]]:
        """Rows of a token-level dataset, each (prompt + response) cut to ``max_length``; and the rows dropped."""
        if is_feature_draft(self.draft):
            raise ValueError(
                f"data.draft={self.draft.path!r} is a feature draft, whose hidden states depend on the target's and "
                f"cannot be recomputed from the tokens of {path}; label it with `python -m data_gen ... "
                "--label_mode rollout` and train on that dataset."
            )
        columns = dataset.select_columns(["prompt_id", "prompt_ids", "response_ids", "draft_ids", "accept_prob"])
        rows, dropped = [], {"empty_response": 0, "prompt_too_long": 0, "truncated": 0}
        for record in columns.to_list():
            n = len(record["response_ids"])
            if len(record["draft_ids"]) != n or len(record["accept_prob"]) != n:
                raise ValueError(
                    f"{path}: prompt {record['prompt_id']!r} has {n} response tokens but {len(record['draft_ids'])} "
                    f"draft tokens and {len(record['accept_prob'])} labels; regenerate the dataset."
                )
            if n == 0:
                dropped["empty_response"] += 1
                continue
            prompt_len = len(record["prompt_ids"])
            if self.max_length is not None:
                if prompt_len >= self.max_length:
                    dropped["prompt_too_long"] += 1
                    continue
                if prompt_len + n > self.max_length:
                    dropped["truncated"] += 1
                    n = self.max_length - prompt_len
            rows.append(
                LabelRow(
                    prompt_id=record["prompt_id"],
                    prompt_ids=torch.tensor(record["prompt_ids"], dtype=torch.long),
                    response_ids=torch.tensor(record["response_ids"][:n], dtype=torch.long),
                    draft_ids=torch.tensor(record["draft_ids"][:n], dtype=torch.long),
                    accept_prob=torch.tensor(record["accept_prob"][:n], dtype=torch.float32),
                )
            )
        return rows, dropped

    def _load_rollout(self, path: str, dataset, meta: dict) -> tuple[list[HiddenRow], dict[str, int]]:
        """Rows of a rollout dataset: each prompt's stored hidden states (C, d) and labels (C,); and the rows
        dropped."""
        from ..chain.rollout import read_hidden

        width = (meta.get("rollout") or {}).get("hidden_size")
        if width != self.hidden_size:
            raise ValueError(
                f"{path} stores hidden states of width {width} but data.draft {self.draft.path!r} has hidden size "
                f"{self.hidden_size}; regenerate the rollout labels for this draft."
            )
        sources = [column for column in SOURCES if column in dataset.column_names]
        records = dataset.select_columns(["prompt_id", "prompt_ids", "accept_prob", *sources]).to_list()
        counts = [len(record["accept_prob"]) for record in records]
        hidden = read_hidden(dataset, width, counts)
        rows, dropped = [], {"no_candidates": 0}
        for record, states in zip(records, hidden, strict=True):
            if not len(states):
                dropped["no_candidates"] += 1
                continue
            rows.append(
                HiddenRow(
                    prompt_id=record["prompt_id"],
                    prompt_ids=torch.tensor(record["prompt_ids"], dtype=torch.long),
                    hidden=states,
                    accept_prob=torch.tensor(record["accept_prob"], dtype=torch.float32),
                    inputs=stored_inputs({column: record[column] for column in sources}),
                )
            )
        return rows, dropped

    def check_head_inputs(self, needed: Sequence[str]) -> None:
        """ValueError naming the inputs in ``needed`` (a head's) that a loaded dataset lacks, and the fix."""
        kind = "rollout" if self.rollout else f"token-level ({self.meta.get('label_mode')!r})"
        paths = [p for p in (self.path, self.test_path, self.greedy_path) if p is not None]
        require_inputs(needed, self.inputs, f"the {kind} label data {paths}")

    def input_stats(self, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std (S,) of the scalar inputs ``names`` over the training candidates (how the head standardises
        them)."""
        self.check_head_inputs(names)
        if not isinstance(self.train_set, StoredHiddenDataset):
            raise RuntimeError("The data module is not set up with rollout data: call setup() first.")
        columns = [SCALAR_INPUTS.index(name) for name in names]
        return standardisation(torch.cat([row.inputs[:, columns] for row in self.train_set.rows]))

    def _record_split(self) -> None:
        trainer = getattr(self, "_trainer", None)
        log_dir = trainer.log_dir if trainer is not None else None
        if log_dir is not None and trainer.is_global_zero:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "split.json").write_text(json.dumps(self.split_record(), indent=1) + "\n")

    def split_record(self) -> dict[str, Any]:
        """The split with its provenance: dataset path, counts, seeds, dropped rows and the prompt ids."""
        return {
            "dataset": self.path,
            "n_train": len(self.split.get("train", [])),
            "n_val": len(self.split.get("val", [])),
            "rollout": self.rollout,
            "mix_ratio": self.mix_ratio,
            "mix_seed": self.mix_seed,
            "dropped": self.dropped,
            **self.split,
        }

    def _loader(self, dataset: MixedTokenDataset | StoredHiddenDataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("The data module is not set up: call setup() first.")
        sampler = EpochRandomSampler(dataset, seed=self.mix_seed) if train else SequentialSampler(dataset)
        batches = BucketBatchSampler(
            sampler,
            batch_size=self.batch_size,
            lengths=dataset.lengths,
            pool=self.bucket_pool,
            shuffle=train,
            seed=self.mix_seed,
            fixed_epoch=None if train else VALIDATION_EPOCH,
            start=self._trained_in_epoch if train else None,
        )
        return DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collate_hidden if isinstance(dataset, StoredHiddenDataset) else collate,
            num_workers=self.num_workers,
        )

    def _trained_in_epoch(self) -> int:
        """Batches of the current epoch a fit resumed from a mid-epoch checkpoint has already trained on (0 otherwise:
        as an epoch begins, after a fit, outside one)."""
        loop = None if self.trainer is None else self.trainer.fit_loop.epoch_loop
        return loop.batch_progress.current.ready if loop is not None and loop.restarting else 0

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def greedy_dataloader(self) -> DataLoader | None:
        """The greedy calibration labels (``greedy_path``), or None without them."""
        return None if self.greedy_set is None else self._loader(self.greedy_set, train=False)

    def calibration_dataloader(self, greedy: bool = False, exclude: Collection[str] = ()) -> DataLoader | None:
        """The labels a calibration map is fitted on: the validation split (``greedy``: the greedy labels, None
        without them) less the prompts in ``exclude`` — those a later comparison reports on, which must choose
        nothing."""
        dataset = self.greedy_set if greedy else self.val_set
        if dataset is None:
            return None
        if exclude:
            excluded = set(exclude)
            kept = [row for row in dataset.rows if row.prompt_id not in excluded]
            if not kept:
                raise ValueError(
                    f"Every {'greedy' if greedy else 'validation'} prompt is reserved for the held-out comparison "
                    "(sweep.eval_prompts); lower sweep.eval_prompts or raise data.val_size."
                )
            dataset = self._examples(kept)
        return self._loader(dataset, train=False)

    # -- what the end-of-fit stages need

    @property
    def target_spec(self) -> ModelSpec:
        """The target the labels were made with (``meta.json``), or the configured override."""
        if self.target_override is not None:
            return self.target_override
        raw = self.meta.get("target")
        if not isinstance(raw, dict):
            raise ValueError(f"{self.path}/meta.json names no target; set --data.target.")
        return ModelSpec(**raw)

    @property
    def sampling(self) -> SamplingConfig:
        """The transform the labels were made under (``label_transform``; greedy labels decode greedily)."""
        raw = self.meta.get("label_transform") or self.meta.get("sampling")
        if not isinstance(raw, dict):
            raise ValueError(f"{self.path}/meta.json records no sampling transform; regenerate the dataset.")
        return SamplingConfig(**raw)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids label generation stopped on (recorded in meta.json; older datasets: :func:`eos_token_ids`)."""
        ids = (self.meta.get("tokenizer") or {}).get("eos_token_ids")
        if ids:
            return [int(i) for i in ids]
        return eos_token_ids(self.tokenizer(), self.target())

    def target(self) -> torch.nn.Module:
        """The target model, loaded once (for the cost model, the sweep and the bundle)."""
        if self._target is None:
            self._target = load_model(self.target_spec)
        return self._target

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.target_spec)
        return self._tokenizer

    def val_prompts(self, count: int, offset: int = 0) -> list[tuple[str, list[int]]]:
        """``count`` held-out validation prompts ``(prompt_id, token ids)`` starting at ``offset`` (seeded order)."""
        if self.val_set is None:
            raise RuntimeError("The data module is not set up: call setup() first.")
        rows = self.val_set.rows[offset : offset + count]
        return [(row.prompt_id, row.prompt_ids.tolist()) for row in rows]

    def teardown(self, stage: str) -> None:
        self._target = None


def draft_hidden_size(draft: ModelSpec) -> int:
    """The hidden size of ``draft`` read from its config (no weights are loaded)."""
    from transformers import AutoConfig

    if is_feature_draft(draft):
        return int(read_config(Path(draft.path)).hidden_size)
    try:
        config = AutoConfig.from_pretrained(local_folder(draft), revision=draft.revision)
    except OSError as err:
        raise FileNotFoundError(
            f"data.draft.path={draft.path!r} is neither a model folder nor a reachable hub id ({err}). Train or "
            "fetch the draft first (the embedded pair's draft: `python -m train.distill_draft`), or point "
            "--data.draft.path at it."
        ) from err
    return int(config.get_text_config().hidden_size)
