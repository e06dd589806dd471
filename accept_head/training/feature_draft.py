"""Training a :class:`~accept_head.feature_draft.FeatureDraft` with Lightning on teacher-forced target features.

Data: for each sequence (prompt + the target's own response) the target's final hidden states f_0..f_{T-1} (bf16)
and the log-normaliser of its full-vocabulary logits at each position (so its probabilities over the kept
vocabulary are exp(f_t·E_kept − lse_t) without a 49k-wide product per step). Pair t of the draft reads
(f_t, x_{t+1}) and is trained to match the target at position t+1:

* ``kl``: soft cross-entropy −Σ_{v ∈ kept} p(v) log q(v) (acceptance is 1 − TV(p, q) = Σ min(p, q); the mass of p
  outside the kept set is out of reach and carries no gradient);
* ``feature``: SmoothL1 between f̂_{t+1} and f_{t+1} (EAGLE), weighted by ``feature_weight``;
* noise: uniform noise of width ``noise`` × the features' RMS added to the input features (EAGLE's robustness
  trick), training only;
* unroll: steps 2..``unroll`` feed the draft's own predictions back as input features (what drafting step k ≥ 2
  sees), each step's loss weighted ``step_decay``^(k−1).

Validation reports per step k the expected acceptance Σ min(p, q) over the full vocabulary and the greedy
agreement 1[argmax q = argmax p] on held-out sequences.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from safetensors.torch import load_file
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from ..feature_draft import FeatureDraft, FeatureDraftConfig
from ..labels import draft_acceptance
from ..seeds import seeded_generator
from .module import adamw_cosine


@dataclass
class FeatureSequence:
    tokens: torch.Tensor
    """(T,) int64: prompt then response."""
    features: torch.Tensor
    """(T, d) bf16: the target's final hidden state at each position."""
    lse: torch.Tensor
    """(T,) float32: logsumexp of the target's full logits at each position."""
    prompt_length: int


def read_feature_shards(paths: Sequence[Path]) -> list[FeatureSequence]:
    """Load the sequences of feature shards written by ``python -m train.feature_draft features``."""
    out = []
    for path in paths:
        shard = load_file(str(path))
        for (a, b), prompt_length in zip(pairwise(shard["offsets"].tolist()), shard["prompt_lengths"].tolist()):
            out.append(
                FeatureSequence(shard["tokens"][a:b].long(), shard["features"][a:b], shard["lse"][a:b], prompt_length)
            )
    return out


def token_batches(lengths: Sequence[int], batch_tokens: int, generator: torch.Generator | None) -> list[list[int]]:
    """Group sequence indices into batches of about ``batch_tokens`` padded tokens, similar lengths together
    (sorted within random chunks of 64), batches in random order when ``generator`` is given."""
    order = (
        torch.randperm(len(lengths), generator=generator).tolist()
        if generator is not None
        else list(range(len(lengths)))
    )
    batches = []
    for start in range(0, len(order), 64):
        chunk = sorted(order[start : start + 64], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:
            if batch and (len(batch) + 1) * lengths[i] > batch_tokens:  # chunk is sorted: i is the longest
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def collate_sequences(items: Sequence[FeatureSequence], loss_from: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: tokens (B, T), features (B, T, d), lse (B, T), mask (B, T) and loss_mask (B, T − 1) — the
    pairs t whose target position t + 1 is at or after ``loss_from`` (positions before it, e.g. a system prompt
    every sequence shares, carry no loss)."""
    mask = pad_sequence([torch.ones_like(s.tokens) for s in items], batch_first=True)
    loss_mask = mask[:, 1:].bool()
    loss_mask[:, : max(loss_from - 1, 0)] = False
    return {
        "tokens": pad_sequence([s.tokens for s in items], batch_first=True),
        "features": pad_sequence([s.features for s in items], batch_first=True),
        "lse": pad_sequence([s.lse.float() for s in items], batch_first=True),
        "mask": mask,
        "loss_mask": loss_mask,
    }


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, sequences: list[FeatureSequence], batch_tokens: int, seed: int | None, loss_from: int) -> None:
        self.sequences, self.batch_tokens, self.seed, self.loss_from = sequences, batch_tokens, seed, loss_from
        self.epoch = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        generator = None if self.seed is None else seeded_generator(self.seed, self.epoch)
        self.epoch += 1
        for batch in token_batches([len(s.tokens) for s in self.sequences], self.batch_tokens, generator):
            yield collate_sequences([self.sequences[i] for i in batch], self.loss_from)


class FeatureDataModule(LightningDataModule):
    """Feature shards → padded batches of about ``batch_tokens`` tokens (train shuffled per epoch, val fixed)."""

    def __init__(
        self, train_paths: list[Path], val_paths: list[Path], batch_tokens: int, seed: int, loss_from: int
    ) -> None:
        super().__init__()
        self.train_paths, self.val_paths = train_paths, val_paths
        self.batch_tokens, self.seed, self.loss_from = batch_tokens, seed, loss_from
        self.train: list[FeatureSequence] = []
        self.val: list[FeatureSequence] = []

    def setup(self, stage: str) -> None:
        if not self.train:
            self.train = read_feature_shards(self.train_paths)
            self.val = read_feature_shards(self.val_paths)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.train, self.batch_tokens, self.seed, self.loss_from), batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.val, self.batch_tokens, None, self.loss_from), batch_size=None)


def unrolled_predictions(
    draft: FeatureDraft, batch: dict[str, torch.Tensor], steps: int, noise: float = 0.0, generator=None
) -> list[torch.Tensor]:
    """Predicted features f̂ for pairs t = 0..T−2 at drafting steps 1..``steps``: each (B, T − 1, d).

    Step 1 reads the target's features; step k reads at pair t the step-(k−1) prediction for position t (pair 0
    keeps the target's f_0, which every round has)."""
    features = batch["features"][:, :-1].float()
    tokens, mask = batch["tokens"][:, 1:], batch["mask"][:, 1:]
    if noise > 0:
        scale = noise * features.pow(2).mean().sqrt()
        features = features + (torch.rand(features.shape, generator=generator) - 0.5).to(features) * 2 * scale
    outputs = []
    inputs = features
    for _ in range(steps):
        predicted = draft(inputs, tokens, attention_mask=mask)
        outputs.append(predicted)
        inputs = torch.cat([features[:, :1], predicted[:, :-1]], dim=1)
    return outputs


class WeightedLogSumExp(torch.autograd.Function):
    """``weight · logsumexp(z)`` per row of logits z (N…, V), any float dtype, fp32 result.

    Its gradient ``weight · softmax(z)`` is written into one fp32 buffer and returned in z's dtype: three in-place
    passes over the logits instead of the separate casts and temporaries of ``z.float().logsumexp(-1)`` and its
    backward, which dominate a feature draft's training step on a CPU.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits.float(), dim=-1)
        ctx.save_for_backward(logits, weight, lse)
        return weight * lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, weight, lse = ctx.saved_tensors
        g = logits.to(torch.float32, copy=True).sub_(lse[..., None]).exp_().mul_((grad * weight)[..., None])
        return g.to(logits.dtype), None


class FeatureDraftModule(LightningModule):
    """Trains a :class:`FeatureDraft`; the target's rows of the kept vocabulary give its probabilities there."""

    def __init__(
        self,
        config: FeatureDraftConfig,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        unroll: int = 3,
        step_decay: float = 0.8,
        feature_weight: float = 0.1,
        noise: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.config = config
        self.draft = FeatureDraft(config)
        self.register_buffer("target_rows", torch.zeros(config.kept_vocab_size, config.hidden_size), persistent=False)
        self.generator = torch.Generator().manual_seed(seed)

    def init_from_target(self, target: torch.nn.Module, kept_ids: torch.Tensor) -> None:
        """Start from ``target``'s own weights (:meth:`FeatureDraft.from_target`) and keep its kept-vocabulary rows."""
        fresh = FeatureDraft.from_target(target, kept_ids, train_lm_head=self.config.train_lm_head)
        self.draft.load_state_dict(fresh.state_dict(), strict=False)
        self.draft.bind(target)
        with torch.no_grad():
            self.target_rows.copy_(target.get_output_embeddings().weight[self.draft.kept_ids].float())

    def _losses(
        self, batch: dict[str, torch.Tensor], train: bool
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """The weighted loss over the unrolled steps, and per step its terms (validation adds the acceptance and the
        greedy agreement, which training skips: they are (B, T, V) passes of their own)."""
        h = self.hparams
        # Validation always scores steps 1-3, so variants trained with fewer unrolled steps stay comparable.
        depth = h.unroll if train else max(h.unroll, 3)
        steps = unrolled_predictions(self.draft, batch, depth, h.noise if train else 0.0, self.generator)
        target = batch["features"][:, 1:].float()
        m = batch["loss_mask"]
        n = m.sum().clamp(min=1)
        weight = self.draft.lm_head.weight
        # Training reads the target's probabilities through bf16 autocast (cheap, slightly noisy); validation keeps
        # them exact in fp32.
        with torch.autocast(target.device.type, enabled=train and torch.is_autocast_enabled(target.device.type)):
            log_p = (target @ self.target_rows.T).float() - batch["lse"][:, 1:, None]  # (B, T-1, V_kept), ≤ 0
            p = log_p.exp()
            # −Σ_v p(v) log q(v) = P·logsumexp(z) − f̂·(pᵀW) with z = W f̂ the kept logits and P = Σ_v p(v): one
            # logsumexp over z instead of a log-softmax and a (B, T, V) product, forward and backward.
            p_rows = None if weight.requires_grad else (p @ weight).float()
        mass = p.sum(-1)
        total = torch.zeros((), device=target.device)
        per_step = []
        for k, predicted in enumerate(steps):
            logits = self.draft.kept_logits(predicted)
            rows = p_rows if p_rows is not None else (p @ weight.float())
            ce = WeightedLogSumExp.apply(logits, mass) - (predicted.float() * rows).sum(-1)
            feat = torch.nn.functional.smooth_l1_loss(predicted.float(), target, reduction="none").mean(-1)
            loss_k = ((ce + h.feature_weight * feat) * m).sum() / n
            if k < h.unroll:
                total = total + h.step_decay**k * loss_k
            values = {"ce": (ce * m).sum() / n, "feature": (feat * m).sum() / n}
            if not train:
                with torch.no_grad():
                    accept, agree = draft_acceptance(p, logits.float().softmax(-1))
                    values |= {"accept": (accept * m).sum() / n, "agree": (agree.float() * m).sum() / n}
            per_step.append(values)
        return total, per_step

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, per_step = self._losses(batch, train=True)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(batch["loss_mask"].sum()))
        self.log("train/ce_1", per_step[0]["ce"], batch_size=int(batch["loss_mask"].sum()))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, per_step = self._losses(batch, train=False)
        n = int(batch["loss_mask"].sum())
        self.log("val/loss", loss, batch_size=n)
        for k, values in enumerate(per_step, start=1):
            for name, value in values.items():
                self.log(f"val/{name}_{k}", value, batch_size=n, prog_bar=(name == "accept" and k == 1))

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        total = self.trainer.estimated_stepping_batches
        total = total if math.isfinite(total) else 10_000
        h = self.hparams
        return adamw_cosine(params, h.lr, h.warmup_steps, int(total), betas=(0.9, 0.95), weight_decay=h.weight_decay)
