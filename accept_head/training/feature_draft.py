"""Training a :class:`~accept_head.models.feature_draft.FeatureDraft` with Lightning on teacher-forced target features.

Data: for each sequence (prompt + the target's own response) the target's final hidden states f_0..f_{T-1} (bf16)
and the log-normaliser of its full-vocabulary logits at each position (so its probabilities over the kept
vocabulary are exp(f_t·E_kept − lse_t) without a 49k-wide product per step). Pair t of the draft reads
(f_t, x_{t+1}) and is trained to match the target at position t+1:

* ``kl``: soft cross-entropy −Σ_{v ∈ kept} p(v) log q(v) (acceptance is 1 − TV(p, q) = Σ min(p, q); the mass of p
  outside the kept set is out of reach and carries no gradient);
* ``feature``: SmoothL1 between f̂_{t+1} and f_{t+1} (EAGLE), weighted by ``feature_weight``;
* noise: uniform noise of width ``noise`` × the features' RMS added to the input features (EAGLE's robustness
  trick), training only;
* unroll: steps 2..``unroll`` train step k exactly as decoding runs it (:func:`unrolled_predictions`): the
  committed positions read the target's own features, only the round's own earlier candidates read predicted ones;
  each step's loss weighted ``step_decay``^(k−1).

Validation reports, in that same context, per step k the expected acceptance Σ min(p, q) over the full vocabulary
and the greedy agreement 1[argmax q = argmax p] on held-out sequences.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from safetensors.torch import load_file
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from ..acceptance.labels import draft_acceptance
from ..core.seeds import seeded_generator
from ..models.feature_draft import FeatureDraft, FeatureDraftConfig
from .module import adamw_cosine, batches_consumed, passes_from


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
    """Padded batches of ``sequences``. With a ``seed``: an endless stream of passes, pass e in the order of
    ``seeded_generator(seed, e)``, that begins ``start()`` batches in — a resumed fit (``start`` reads the trainer's
    restored step) continues the stream where its checkpoint left it, instead of replaying the first pass. Without a
    seed: one pass in a fixed order (validation)."""

    def __init__(
        self,
        sequences: list[FeatureSequence],
        batch_tokens: int,
        seed: int | None,
        loss_from: int,
        start: Callable[[], int] | None = None,
    ) -> None:
        self.sequences, self.batch_tokens, self.seed, self.loss_from = sequences, batch_tokens, seed, loss_from
        self.start = start

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        lengths = [len(s.tokens) for s in self.sequences]
        if self.seed is None:
            for batch in token_batches(lengths, self.batch_tokens, None):
                yield collate_sequences([self.sequences[i] for i in batch], self.loss_from)
            return
        skip = self.start() if self.start is not None else 0
        passes = passes_from(lambda e: token_batches(lengths, self.batch_tokens, seeded_generator(self.seed, e)), skip)
        for batch in passes:
            yield collate_sequences([self.sequences[i] for i in batch], self.loss_from)


class FeatureDataModule(LightningDataModule):
    """Feature shards → padded batches of about ``batch_tokens`` tokens (train: shuffled passes in one endless stream
    that a resumed fit continues; val: one fixed pass)."""

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

    def state_dict(self) -> dict:
        """What a checkpoint records of the training pool: its shards and sequences (a resume compares them)."""
        return {"train_shards": [p.name for p in self.train_paths], "train_sequences": len(self.train)}

    def load_state_dict(self, state: dict) -> None:
        now = self.state_dict()
        if state and state != now:
            warnings.warn(
                f"The training pool changed since the checkpoint ({state.get('train_sequences')} sequences in "
                f"{len(state.get('train_shards', []))} shards then, {now['train_sequences']} in "
                f"{len(now['train_shards'])} now): the resumed fit reads another stream of batches than an "
                "uninterrupted run would. Keep the pool fixed while a schedule runs, or move checkpoints/last.ckpt "
                "away to start over.",
                stacklevel=2,
            )

    def train_dataloader(self) -> DataLoader:
        stream = _Batches(
            self.train, self.batch_tokens, self.seed, self.loss_from, start=lambda: batches_consumed(self.trainer)
        )
        return DataLoader(stream, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.val, self.batch_tokens, None, self.loss_from), batch_size=None)


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` (…, N, D) moved ``shift`` rows later along N: row s holds row s − ``shift`` (zeros before it)."""
    if shift == 0:
        return x
    pad = x.new_zeros((*x.shape[:-2], shift, x.shape[-1]))
    return torch.cat([pad, x[..., : x.shape[-2] - shift, :]], dim=-2)


def unrolled_predictions(
    draft: FeatureDraft, batch: dict[str, torch.Tensor], steps: int, noise: float = 0.0, generator=None
) -> list[torch.Tensor]:
    """Predicted features for pairs s = 0..N−1 (N = T − 1) at drafting steps 1..``steps``: each (B, N, d).

    Step k at pair s is the k-th candidate of the round that starts after position t = s − k + 1 is committed,
    computed exactly as :class:`~accept_head.models.feature_draft.FeatureDrafter` decodes it (EAGLE-3's training-time
    test): the pairs 0..t read the target's own features f (the committed text), the pairs t+1..s−1 read the round's
    own earlier predictions (steps 2..k−1), and pair s reads the step-(k−1) prediction f̂_s. The draft's single
    decoder layer makes this one pass per step: its keys and values at a pair depend only on that pair's input, so
    step k attends to step 1's keys at pairs ≤ t (a causal mask moved back by k − 1) plus, for each earlier step j
    ≥ 2, the one key of step j at pair s − k + j (a diagonal). Pairs s < k − 1 have no such round and give
    meaningless rows: mask them out of any loss (:func:`step_loss_mask`).

    ``noise`` (a fraction of the features' RMS) perturbs the target's features, as EAGLE does in training.
    """
    features = batch["features"][:, :-1].float()
    tokens, mask = batch["tokens"][:, 1:], batch["mask"][:, 1:].bool()
    if noise > 0:
        scale = noise * features.pow(2).mean().sqrt()
        device = generator.device if generator is not None else features.device
        uniform = torch.rand(features.shape, generator=generator, device=device).to(features)
        features = features + (uniform - 0.5) * 2 * scale
    b, n, _ = features.shape
    layer = draft.decoder.layers[0]
    attn = layer.self_attn
    positions = torch.arange(n, device=features.device)[None].expand(b, n)
    dtype = draft.fc.weight.dtype
    with torch.no_grad():
        emb = draft.embed(tokens).to(dtype)
    cos, sin = draft.decoder.rotary_emb(emb, positions)
    pair = torch.arange(n, device=features.device)
    outputs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    inputs = features
    for k in range(1, steps + 1):
        x = draft.fc(torch.cat([inputs.to(dtype), emb], dim=-1))
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)  # (B, H, N, hd)
        key = attn.k_proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)
        value = attn.v_proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)
        q, key = apply_rotary_pos_emb(q, key, cos, sin)
        keys.append(repeat_kv(key, attn.num_key_value_groups))
        values.append(repeat_kv(value, attn.num_key_value_groups))
        # Step 1's keys at the committed pairs s' <= s - k + 1 (and not padding).
        allowed = (pair[None, :] <= pair[:, None] - (k - 1))[None, None] & mask[:, None, None, :]
        lowest = torch.finfo(torch.float32).min  # finite: rows without an allowed key stay NaN-free
        scores = [(q @ keys[0].transpose(-1, -2)).float().mul(attn.scaling).masked_fill(~allowed, lowest)]
        for j in range(2, k + 1):  # step j's own key at pair s - (k - j): one score per query
            diagonal = (q * _shifted(keys[j - 1], k - j)).float().sum(-1, keepdim=True) * attn.scaling
            scores.append(diagonal.masked_fill((pair < k - j)[None, None, :, None], lowest))
        weights = torch.cat(scores, dim=-1).softmax(-1).to(values[0].dtype)
        out = weights[..., :n] @ values[0]
        for j in range(2, k + 1):
            out = out + weights[..., n + j - 2, None] * _shifted(values[j - 1], k - j)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        predicted = draft.decoder.norm(x)
        outputs.append(predicted)
        # Step k + 1 at pair s reads the step-k prediction of position s (made at pair s - 1).
        inputs = torch.cat([features[:, :1], predicted[:, :-1].float()], dim=1)
    return outputs


def step_loss_mask(loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """``loss_mask`` (B, N) restricted to the pairs s >= ``step`` − 1 where drafting step ``step`` has a round (one
    that starts after position s − step + 1 >= 0)."""
    out = loss_mask.clone()
    out[:, : step - 1] = False
    return out


CHUNK_ELEMENTS = 1 << 19
"""Elements per row chunk of the loss's full-vocabulary passes (2 MB in fp32): a chunk stays in the CPU's caches
across its passes, where whole-batch tensors (B·T × V, hundreds of MB) stream through memory once per pass."""


def _chunk_rows(width: int) -> int:
    """Rows per chunk of about :data:`CHUNK_ELEMENTS` elements, for rows ``width`` wide."""
    return max(1, CHUNK_ELEMENTS // max(width, 1))


class WeightedLogSumExp(torch.autograd.Function):
    """``weight · logsumexp(z)`` per row of logits z (N…, V), any float dtype, fp32 result.

    Its gradient is ``weight · softmax(z)``. The forward pass computes each row's maximum, exponentials, sum and
    softmax in fp32 over chunks of rows that stay in the CPU's caches and keeps the softmax in z's dtype; the backward
    pass scales it, chunk by chunk. Whole-batch fp32 temporaries (``z.float().logsumexp(-1)`` and its backward) made
    this the larger part of a feature draft's training step on a CPU.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        softmax = torch.empty_like(flat)
        step = _chunk_rows(flat.shape[1])
        for a in range(0, flat.shape[0], step):
            z = flat[a : a + step].to(torch.float32, copy=True)
            peak = z.amax(-1, keepdim=True)
            total = z.sub_(peak).exp_().sum(-1, keepdim=True)
            lse[a : a + step] = (peak + total.log()).squeeze(-1)
            softmax[a : a + step] = z.div_(total)
        ctx.save_for_backward(softmax, weight)
        ctx.shape = logits.shape
        return weight * lse.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, weight = ctx.saved_tensors
        scale = (grad * weight).reshape(-1, 1).float()
        out = torch.empty_like(softmax)
        step = _chunk_rows(softmax.shape[1])
        for a in range(0, softmax.shape[0], step):  # fp32 products, one rounding into the logits' dtype
            out[a : a + step] = softmax[a : a + step].float().mul_(scale[a : a + step])
        return out.view(ctx.shape), None


@torch.no_grad()
def target_mass_and_rows(
    features: torch.Tensor, target_rows: torch.Tensor, lse: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's probability mass on the kept vocabulary, P = Σ_v p(v) (N…,), and pᵀW (N…, d), for features
    (N…, d), its kept rows (V, d), its full-vocabulary log-normalisers (N…,) and the draft's LM head rows W (V, d),
    without the whole (N…, V) probabilities: row chunks that stay in the caches, products as autocast makes them
    (bf16 in training) and exponentials and sums in fp32."""
    device = features.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else features.dtype
    flat, norm = features.reshape(-1, features.shape[-1]).to(dtype), lse.reshape(-1, 1).float()
    rows_t, head = target_rows.to(dtype).T, weight.to(dtype)  # cast once: autocast would cast them every chunk
    mass = torch.empty(flat.shape[0], dtype=torch.float32, device=features.device)
    rows = torch.empty(flat.shape[0], weight.shape[1], dtype=torch.float32, device=features.device)
    step = _chunk_rows(target_rows.shape[0])
    with torch.autocast(device, enabled=False):
        for a in range(0, flat.shape[0], step):
            p = (flat[a : a + step] @ rows_t).float().sub_(norm[a : a + step]).exp_()
            mass[a : a + step] = p.sum(-1)
            rows[a : a + step] = p.to(dtype) @ head
    return mass.view(lse.shape), rows.view(*lse.shape, weight.shape[1])


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
        min_lr_ratio: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.config = config
        self.draft = FeatureDraft(config)
        self.register_buffer("target_rows", torch.zeros(config.kept_vocab_size, config.hidden_size), persistent=False)
        self.generator = torch.Generator().manual_seed(seed)
        self._step_clock: tuple[float, int] | None = None
        self.schedule_deadline: float | None = None
        """A ``time.monotonic()`` value: the learning-rate cosine ends there if that comes before ``max_steps``."""

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
        greedy agreement, which training skips: they are (n, V) passes of their own)."""
        h = self.hparams
        # Validation always scores steps 1-3, so variants trained with fewer unrolled steps stay comparable.
        depth = h.unroll if train else max(h.unroll, 3)
        steps = unrolled_predictions(self.draft, batch, depth, h.noise if train else 0.0, self.generator)
        # Only the pairs that carry loss go through the LM head and the loss (padding and the chat template's prefix
        # are a fifth of the rows of the CPU pool's batches); step k's are those at columns >= k - 1 (step_loss_mask).
        carries = batch["loss_mask"]
        column = carries.nonzero()[:, 1]
        target = batch["features"][:, 1:][carries].float()  # (n, d)
        lse = batch["lse"][:, 1:][carries]
        weight = self.draft.lm_head.weight
        # Training reads the target's probabilities through bf16 autocast (cheap, slightly noisy); validation keeps
        # them exact in fp32. −Σ_v p(v) log q(v) = P·logsumexp(z) − f̂·(pᵀW) with z = W f̂ the kept logits and
        # P = Σ_v p(v): one logsumexp over z instead of a log-softmax and an (n, V) product, forward and backward.
        p = None
        with torch.autocast(target.device.type, enabled=train and torch.is_autocast_enabled(target.device.type)):
            if train and not weight.requires_grad:  # only P and pᵀW are needed: never the whole (n, V) p
                mass, p_rows = target_mass_and_rows(target, self.target_rows, lse, weight)
            else:  # validation scores acceptance with p; a trained LM head needs p for its own gradient
                p = ((target @ self.target_rows.T).float() - lse[:, None]).exp()  # (n, V_kept)
                mass = p.sum(-1)
                p_rows = None if weight.requires_grad else (p @ weight).float()
        total = torch.zeros((), device=target.device)
        per_step = []
        for k, predicted in enumerate(steps):
            keep = column >= k
            n = keep.sum().clamp(min=1)
            predicted = predicted[carries][keep]
            logits = self.draft.kept_logits(predicted)
            rows = p_rows[keep] if p_rows is not None else p[keep] @ weight.float()
            ce = WeightedLogSumExp.apply(logits, mass[keep]) - (predicted.float() * rows).sum(-1)
            feat = torch.nn.functional.smooth_l1_loss(predicted.float(), target[keep], reduction="none").mean(-1)
            loss_k = (ce + h.feature_weight * feat).sum() / n
            if k < h.unroll:
                total = total + h.step_decay**k * loss_k
            values = {"ce": ce.sum() / n, "feature": feat.sum() / n}
            if not train:
                with torch.no_grad():
                    accept, agree = draft_acceptance(p[keep], logits.float().softmax(-1))
                    values |= {"accept": accept.sum() / n, "agree": agree.float().sum() / n}
            per_step.append(values)
        return total, per_step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the training noise's generator, so a resumed fit draws the noise an uninterrupted one would."""
        checkpoint["noise_generator"] = self.generator.get_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the training noise's generator (checkpoints from before it was saved start it from ``seed``)."""
        if "noise_generator" in checkpoint:
            self.generator.set_state(checkpoint["noise_generator"])

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Log ``train/positions_per_s``: the previous step's loss positions over the wall time from its start to
        this one's (data, forward, backward, optimizer; the step after a validation is not timed)."""
        now = time.perf_counter()
        if self._step_clock is not None:
            began, positions = self._step_clock
            self.log("train/positions_per_s", positions / max(now - began, 1e-9), batch_size=1)
        self._step_clock = (now, int(batch["loss_mask"].sum()))

    def on_validation_start(self) -> None:
        self._step_clock = None

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
        return adamw_cosine(
            params, h.lr, h.warmup_steps, int(total), h.min_lr_ratio, deadline=self.schedule_deadline,
            betas=(0.9, 0.95), weight_decay=h.weight_decay,
        )  # fmt: skip
