"""The LightningModule that trains an acceptance head on a frozen draft (SpecDec++ §3.3).

Per batch: the frozen draft reads (prompt, Z) — Z the token-mixed response — and its final hidden states at the
positions holding draft tokens go through the head; the loss is the weighted BCE against the soft labels there
(:mod:`accept_head.acceptance.loss`). Only the head is trained and only the head is checkpointed: the draft's weights
are
reloaded from its spec, never copied into Lightning checkpoints.

Batches of a rollout dataset (:class:`~accept_head.training.data.StoredHiddenDataset`) carry the drafter's stored
hidden states (``hidden``, (B, C, d)) instead of tokens: the head reads them directly and the draft does not run.
The draft is still loaded, for the hidden-size check and the end-of-fit stages (cost model, sweep, bundle).

A head with ``inputs`` beyond the hidden state (:mod:`accept_head.acceptance.inputs`) reads the scalar inputs rollout
batches carry (``inputs``, (B, C, S)); before fitting, their mean and standard deviation over the training
candidates become the head's standardisation, and a dataset that lacks one of them is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import count
from typing import Any, TypeVar

import torch
from lightning.pytorch import LightningModule
from torchmetrics.aggregation import CatMetric

from ..acceptance.head import AcceptanceHead
from ..acceptance.inputs import HIDDEN, SCALAR_INPUTS
from ..acceptance.loss import check_weights, weighted_bce
from ..acceptance.metrics import acceptance_metrics
from ..models.features import decoder_matches_lm_head_input, final_hidden_states
from ..models.loading import load_model
from ..models.pairs import ModelSpec
from .report import FitReport

T = TypeVar("T")

DRAFT_PREFIX = "draft."


class AcceptanceHeadModule(LightningModule):
    """An :class:`~accept_head.acceptance.head.AcceptanceHead` trained on the hidden states of a frozen draft."""

    def __init__(
        self,
        draft: ModelSpec,
        hidden_size: int,
        depth: int,
        w_rej: float,
        lr: float,
        w_acc: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_fraction: float = 0.03,
        min_lr_ratio: float = 0.0,
        inputs: list[str] | None = None,
        residual_on: str | None = None,
        hidden_dim: int | None = None,
    ) -> None:
        """
        Args:
            draft: The frozen draft (linked from ``data.draft``): weights, dtype and device it runs in. It stays in
                eval mode without gradients.
            hidden_size: Width of the head; linked from the draft's hidden size (``data.hidden_size``).
            depth: Residual blocks D of the head (0 = linear probe; the paper sweeps 0..4).
            w_rej: Loss weight of the rejected class (the paper sweeps 1, 3, 6, 12).
            lr: Peak learning rate of AdamW.
            w_acc: Loss weight of the accepted class (1 in the paper).
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_fraction: Fraction of the optimizer steps with a linear warm-up (the paper: 3%).
            min_lr_ratio: The cosine schedule decays to ``lr * min_lr_ratio``.
            inputs: What the head reads (default ``[hidden]``, the paper's head): any of ``hidden``, ``logq``,
                ``entropy``, ``top1``, ``depth``, ``path_logq`` (see ``accept_head/acceptance/inputs.py``). Inputs
                other than ``hidden`` need rollout labels (``python -m data_gen --label_mode rollout``).
            residual_on: ``logq``: the head's logit is logit(q(y)) plus a learned correction that is zero at
                initialisation (the head starts as the draft's own probability); needs ``logq`` in ``inputs``.
            hidden_dim: Project the hidden state to this many dimensions before the ResNet (a narrower head, for
                few labels); None reads it whole, as the paper's head does. Needs ``hidden`` in ``inputs``.
        """
        super().__init__()
        if depth < 0:
            raise ValueError(
                f"depth={depth} must be >= 0 (0 is a linear probe, the paper uses 0..4); set --model.depth."
            )
        check_weights(w_acc, w_rej)
        if not lr > 0:
            raise ValueError(f"lr={lr} must be > 0; set --model.lr.")
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1); set --model.warmup_fraction.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]; set --model.min_lr_ratio.")
        # The draft is recorded once, in the data module's hyperparameters (it is linked from data.draft).
        self.save_hyperparameters(ignore=["draft"])
        self.draft_spec = ModelSpec.coerce(draft)
        self.head = AcceptanceHead(hidden_size, depth, inputs or (HIDDEN,), residual_on, hidden_dim)
        self._input_columns = [SCALAR_INPUTS.index(name) for name in self.head.scalar_inputs]
        self.draft: torch.nn.Module | None = None
        self._use_decoder = True
        self.val_logits, self.val_labels = CatMetric(), CatMetric()
        self.fit_report = FitReport()
        """Results of the end-of-fit callbacks (reset at the start of every fit)."""

    def on_fit_start(self) -> None:
        self.fit_report = FitReport()

    def setup(self, stage: str) -> None:
        """Refuse data without the head's inputs; before fitting, standardise the scalar inputs by the training
        candidates' statistics (a checkpoint being resumed restores the same ones)."""
        dm = getattr(self._trainer, "datamodule", None)
        if not self.head.scalar_inputs or dm is None:
            return
        dm.check_head_inputs(self.head.inputs)
        if stage == "fit":
            self.head.set_scalar_stats(*dm.input_stats(self.head.scalar_inputs))

    # -- the frozen draft

    def configure_model(self) -> None:
        """Load the frozen draft (once; Lightning calls this before moving the module to its device)."""
        if self.draft is not None:
            return
        draft = load_model(self.draft_spec)
        if draft.config.hidden_size != self.head.hidden_size:
            raise ValueError(
                f"The draft's hidden size is {draft.config.hidden_size} but the head is {self.head.hidden_size} wide; "
                "do not set --model.hidden_size by hand (it is linked from the draft)."
            )
        draft.requires_grad_(False).eval()
        self._use_decoder = decoder_matches_lm_head_input(draft)
        self.draft = draft

    def train(self, mode: bool = True) -> AcceptanceHeadModule:
        """Switch the head's mode; the draft stays in eval mode (no dropout) whatever Lightning asks."""
        super().train(mode)
        if self.draft is not None:
            self.draft.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the draft's frozen weights out of checkpoints (they are reloaded from ``draft``)."""
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(DRAFT_PREFIX)]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put the loaded draft's weights back into the state dict so strict loading of the head passes."""
        self.configure_model()
        state = checkpoint["state_dict"]
        for key, value in self.draft.state_dict().items():
            state.setdefault(DRAFT_PREFIX + key, value)

    # -- forward

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The draft's final hidden state at every loss position: (M, H) for M = loss_mask.sum().

        Stored states (a ``hidden`` (B, C, H) entry, rollout data) are taken as they are; otherwise the frozen
        draft reads ``input_ids`` (B, L).
        """
        if "hidden" in batch:
            return batch["hidden"][batch["loss_mask"]]
        assert self.draft is not None, "configure_model() loads the draft"
        with torch.no_grad():
            hidden = final_hidden_states(
                self.draft, batch["input_ids"], batch["attention_mask"], use_decoder=self._use_decoder
            )  # (B, L, H)
        return hidden[batch["loss_mask"]]

    def scalar_inputs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The head's scalar inputs at every loss position (M, S), None for a head that reads none."""
        if not self._input_columns:
            return None
        if "inputs" not in batch:
            raise ValueError(f"The head reads {list(self.head.scalar_inputs)}, which only rollout batches carry.")
        return batch["inputs"][batch["loss_mask"]][:, self._input_columns].float()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Head logits (M,) and soft labels (M,) at the positions of ``batch`` that hold draft tokens."""
        hidden = self.hidden_states(batch).float() if self.head.reads_hidden else None
        logits = self.head(hidden, self.scalar_inputs(batch))
        return logits, batch["labels"][batch["loss_mask"]]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, labels = self(batch)
        loss = weighted_bce(logits, labels, self.hparams.w_acc, self.hparams.w_rej)
        size = int(batch["loss_mask"].shape[0])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/positions", float(labels.numel()), batch_size=size)
        return loss

    # -- validation / test metrics

    def _eval_step(self, batch: dict[str, torch.Tensor]) -> None:
        logits, labels = self(batch)
        self.val_logits.update(logits.detach().float())
        self.val_labels.update(labels.float())

    def _eval_epoch_end(self, prefix: str) -> dict[str, float]:
        logits = _as_1d(self.val_logits.compute())  # gathered across processes
        labels = _as_1d(self.val_labels.compute())
        self.val_logits.reset()
        self.val_labels.reset()
        metrics = acceptance_metrics(logits, labels, self.hparams.w_acc, self.hparams.w_rej)
        logged = {f"{prefix}/{k}": v for k, v in metrics.items() if not math.isnan(v)}
        if "weighted_bce" in metrics and not math.isnan(metrics["weighted_bce"]):
            logged[f"{prefix}/loss"] = metrics["weighted_bce"]
        self.log_dict(logged, sync_dist=True)  # identical on every process already
        if prefix == "val" and not self.trainer.sanity_checking:
            self.fit_report.val_metrics = metrics
        return metrics

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    @torch.no_grad()
    def predict_loader(self, loader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head logits, labels and row ids (M,) over a dataloader, on this process only (for calibration; the
        end-of-fit stages call it in eval mode)."""
        logits, labels, rows = [], [], []
        for batch in loader:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            batch_logits, batch_labels = self(batch)
            logits.append(batch_logits.float().cpu())
            labels.append(batch_labels.float().cpu())
            counts = batch["loss_mask"].sum(-1).cpu()
            rows.append(batch["row"].cpu().repeat_interleave(counts))
        return torch.cat(logits), torch.cat(labels), torch.cat(rows)

    # -- optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW on the head with a linear warm-up then a cosine decay to ``lr * min_lr_ratio``, stepped per batch."""
        hp = self.hparams
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = int(round(hp.warmup_fraction * total))
        adamw = {"weight_decay": hp.weight_decay, "betas": tuple(hp.betas)}
        return adamw_cosine(self.head.parameters(), hp.lr, warmup, total, hp.min_lr_ratio, **adamw)


def adamw_cosine(
    params,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_rate: float = 0.0,
    deadline: float | None = None,
    clock=time.monotonic,
    **adamw,
) -> dict:
    """``configure_optimizers``' answer for AdamW (``adamw``: its other arguments) with a linear warm-up over
    ``warmup_steps``, then a cosine decay to ``lr * min_lr_rate`` at ``total_steps``, stepped per optimizer step.

    With a ``deadline`` (a ``clock()`` value: the end of a time-limited fit) the cosine also runs on the clock, from
    now to the deadline, and the schedule follows whichever of steps and time is further along: a fit stopped by its
    time budget ends with a decayed learning rate instead of one cut off mid-schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, **adamw)
    began = clock()
    span = None if deadline is None else max(deadline - began, 1e-9)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if span is not None:
            progress = max(progress, (clock() - began) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return min_lr_rate + (1.0 - min_lr_rate) * cosine

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _as_1d(value: torch.Tensor | list) -> torch.Tensor:
    """CatMetric returns a tensor, or an empty list when nothing was added."""
    if isinstance(value, list):
        return torch.cat([v.reshape(-1) for v in value]) if value else torch.zeros(0)
    return value.reshape(-1)


def batches_consumed(trainer) -> int:
    """Training batches ``trainer`` has consumed — restored with its step from a checkpoint on resume (0 without a
    trainer): where a resumed fit's stream of batches must begin."""
    return 0 if trainer is None else trainer.global_step * trainer.accumulate_grad_batches


def passes_from(passes: Callable[[int], Sequence[T]], skip: int) -> Iterator[T]:
    """An endless stream of passes, pass e being ``passes(e)`` (e.g. its batches in a seeded order), that begins
    ``skip`` items in — so a resumed fit continues the stream an uninterrupted one would have read, across passes,
    instead of replaying the first."""
    for epoch in count():
        items = passes(epoch)
        yield from items[skip:]
        skip = max(skip - len(items), 0)
