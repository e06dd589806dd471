"""Training a standalone draft (a small Llama) with Lightning on a target's own responses.

Data: response shards written by ``python -m train.distill_draft generate`` — per response token the target's top-k
log-probabilities and the token it sampled. The loss is the cross-entropy of the draft against the target's
distribution (the top-k mass matched directly, the sampled token carrying the tail 1 − Σ top-k: an unbiased
one-sample estimate, so the loss estimates E_p[−log q]). Validation measures, on held-out responses with the
target's exact distributions, the expected acceptance Σ_x min(p, q) at temperature 1 and the greedy agreement.

Shards are re-listed at every pass over the data, so training can run beside a ``generate`` stage that is still
writing them; Lightning checkpoints (``last.ckpt``) make the stage resumable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch.nn.utils.rnn import pad_sequence

from ..acceptance.labels import draft_acceptance
from ..core.seeds import seeded_generator
from .module import adamw_cosine, batches_consumed, passes_from

Example = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""(prompt_ids, response_ids, topk_ids, topk_logprobs) of one target response."""


@dataclass
class DraftArchitecture:
    hidden_size: int = 256
    """Model width; the tied embedding (vocab x width) dominates size and per-token time."""
    num_layers: int = 2
    intermediate_size: int = 1024
    num_heads: int = 4


def load_shards(work: Path, kind: str) -> list[dict]:
    """The ``train`` or ``eval`` response shards under ``work/shards``, in name order."""
    return [torch.load(p, weights_only=True) for p in sorted((work / "shards").glob(f"{kind}-*.pt"))]


def shard_examples(shards: list[dict]) -> list[Example]:
    """One :data:`Example` per response, empty responses dropped."""
    out = []
    for shard in shards:
        for p, r, ti, tl in zip(shard["prompt_ids"], shard["response_ids"], shard["topk_ids"], shard["topk_logprobs"]):
            if len(r):
                out.append((p.long(), r.long(), ti.long(), tl.float()))
    return out


def token_packed(examples: Sequence[Example], batch_tokens: int, generator: torch.Generator) -> Iterator[list]:
    """Examples in a random order, packed into batches of at least ``batch_tokens`` response tokens (the last one
    may hold fewer)."""
    batch, n = [], 0
    for i in torch.randperm(len(examples), generator=generator).tolist():
        batch.append(examples[i])
        n += len(examples[i][1])
        if n >= batch_tokens:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def build_draft(target_config, arch: DraftArchitecture, target_embedding: torch.Tensor | None = None):
    """A Llama draft with the target's vocabulary and special tokens; embeddings from an SVD projection of the
    target's (E_draft = E_target V_d, the best rank-d approximation seen through the draft's width)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        head_dim=arch.hidden_size // arch.num_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=getattr(target_config, "rope_parameters", None),
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )
    draft = LlamaForCausalLM(config)
    if target_embedding is not None:
        emb = target_embedding.float()
        _, _, v = torch.linalg.svd(emb[: min(len(emb), 16384)], full_matrices=False)
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(emb @ v[: arch.hidden_size].T)
    return draft


class SoftTargetCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy −Σ_j w_j log softmax(z)[i_j] for sparse soft targets (weights summing to 1).

    Equals logsumexp(z) − Σ_j w_j z_{i_j}; the gradient softmax(z) − w is written straight into one (N, V) buffer.
    Two passes over the logits instead of the ~8 that log_softmax + gather + their backwards take — on a CPU the
    full-vocabulary softmax dominates a small draft's training step.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        loss = lse - (weight * z.gather(1, index)).sum(-1)
        ctx.save_for_backward(logits, index, weight, lse)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, index, weight, lse = ctx.saved_tensors
        g = logits.to(torch.float32, copy=True).sub_(lse[:, None]).exp_()
        g.scatter_add_(1, index, -weight.to(g.dtype))
        g.mul_(grad[:, None])
        return g.to(logits.dtype), None, None


def distill_loss(draft, batch: Sequence[Example], pad_token_id: int) -> tuple[torch.Tensor, int]:
    """Cross-entropy of the draft against the target's distribution at every response position of ``batch`` (see
    the module docstring); returns the mean loss and the number of response tokens."""
    seqs = [torch.cat([p, r]) for p, r, _, _ in batch]
    ids = pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)
    mask = pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    # (N, d): the states predicting each response token
    h = torch.cat([hidden[row, len(p) - 1 : len(p) + len(r) - 1] for row, (p, r, _, _) in enumerate(batch)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = draft.lm_head(h)
    topk_ids = torch.cat([b[2] for b in batch])
    topk_p = torch.cat([b[3] for b in batch]).exp()
    sampled = torch.cat([b[1] for b in batch])
    tail = (1 - topk_p.sum(-1, keepdim=True)).clamp(min=0)
    index = torch.cat([topk_ids, sampled[:, None]], dim=1)
    weight = torch.cat([topk_p, tail], dim=1)
    loss = SoftTargetCrossEntropy.apply(logits, index, weight)
    return loss.mean(), len(sampled)


@torch.inference_mode()
def target_distributions(target, examples: Sequence[Example]) -> list[torch.Tensor]:
    """Exact target distributions (bf16, (R, V) each) at every response position of ``examples``."""
    out = []
    for p_ids, r_ids, _, _ in examples:
        seq = torch.cat([p_ids, r_ids])[None]
        logits = target(input_ids=seq).logits[0, len(p_ids) - 1 : len(p_ids) + len(r_ids) - 1]
        out.append(logits.float().softmax(-1).to(torch.bfloat16))
    return out


@torch.inference_mode()
def response_acceptance(draft, example: Example, target_probs: torch.Tensor) -> tuple[float, int, int]:
    """(Σ min(p, q), greedy agreements, positions) of ``draft`` over one response against the target's ``probs``."""
    p_ids, r_ids, _, _ = example
    seq = torch.cat([p_ids, r_ids])[None]
    logits = draft(input_ids=seq).logits[0, len(p_ids) - 1 : len(p_ids) + len(r_ids) - 1].float()
    accept, same = draft_acceptance(target_probs.float(), logits.softmax(-1))
    return float(accept.sum()), int(same.sum()), len(r_ids)


def pooled_acceptance(scores: Sequence[tuple[float, int, int]]) -> dict:
    """:func:`response_acceptance` of several responses pooled over their positions."""
    n = sum(s[2] for s in scores)
    return {
        "expected_accept": sum(s[0] for s in scores) / n,
        "greedy_agreement": sum(s[1] for s in scores) / n,
        "positions": n,
    }


def held_out_acceptance(draft, target_probs: list[torch.Tensor], examples: Sequence[Example]) -> dict:
    """Mean Σ_x min(p, q) (expected acceptance at temperature 1) and greedy agreement over response positions."""
    return pooled_acceptance([response_acceptance(draft, e, p) for e, p in zip(examples, target_probs, strict=True)])


class ShardBatches(torch.utils.data.IterableDataset):
    """Token-packed batches of the training shards under ``work``: an endless stream of passes, the shards re-listed
    at the start of each and pass e drawn in the order of ``seeded_generator(seed, "distill", e)``. The stream
    begins ``start()`` batches in (the module sets ``start`` to the batches its trainer has consumed), so a resumed
    fit continues where its checkpoint left it instead of replaying the first pass."""

    def __init__(self, work: Path, batch_tokens: int, seed: int, start: Callable[[], int] | None = None) -> None:
        self.work, self.batch_tokens, self.seed, self.start = work, batch_tokens, seed, start
        self.distinct_tokens = 0

    def __iter__(self) -> Iterator[list[Example]]:
        yield from passes_from(self._pass, self.start() if self.start is not None else 0)

    def _pass(self, epoch: int) -> list[list[Example]]:
        examples = shard_examples(load_shards(self.work, "train"))
        if not examples:
            raise FileNotFoundError(f"No training shards under {self.work / 'shards'}: run the generate stage first.")
        self.distinct_tokens = sum(len(e[1]) for e in examples)
        return list(token_packed(examples, self.batch_tokens, seeded_generator(self.seed, "distill", epoch)))


class DistillDraftModule(LightningModule):
    """Trains a standalone draft on response shards with :func:`distill_loss` (AdamW, linear warm-up then cosine
    decay to 10% of ``lr``); each validation scores :func:`held_out_acceptance` on the held-out responses and hands
    the row to ``on_validation`` (the recipe appends it to its learning curve)."""

    def __init__(
        self,
        draft,
        pad_token_id: int,
        eval_examples: Sequence[Example],
        target_probs: list[torch.Tensor],
        data: ShardBatches,
        lr: float = 2e-3,
        warmup_steps: int = 100,
        total_steps: int = 1000,
        on_validation: Callable[[dict], None] | None = None,
    ) -> None:
        super().__init__()
        self.draft, self.pad_token_id, self.data = draft, pad_token_id, data
        data.start = lambda: batches_consumed(self._trainer)
        self.eval_examples, self.target_probs = list(eval_examples), target_probs
        self.lr, self.warmup_steps, self.total_steps = lr, warmup_steps, total_steps
        self.on_validation = on_validation
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self._scores: list[tuple[float, int, int]] = []

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=None, collate_fn=lambda batch: batch)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(range(len(self.eval_examples)), batch_size=None)  # example indices

    def training_step(self, batch: list[Example], batch_idx: int) -> torch.Tensor:
        loss, n = distill_loss(self.draft, batch, self.pad_token_id)
        self.tokens_seen += n
        self.log("train/loss", loss, batch_size=n)
        self.log("train/tokens", self.tokens_seen.float(), batch_size=n)
        if self.global_step % 20 == 0:
            print(f"[fit] step {self.global_step} tokens {int(self.tokens_seen)} loss {loss.item():.3f}", flush=True)
        return loss

    def validation_step(self, index: int, batch_idx: int) -> None:
        self._scores.append(response_acceptance(self.draft, self.eval_examples[index], self.target_probs[index]))

    def on_validation_epoch_end(self) -> None:
        if not self._scores:
            return
        metrics, self._scores = pooled_acceptance(self._scores), []
        self.log("val/expected_accept", metrics["expected_accept"])
        self.log("val/greedy_agreement", metrics["greedy_agreement"])
        row = self.curve_row(metrics)
        print(f"[fit] eval {row}", flush=True)
        if self.on_validation is not None and not self.trainer.sanity_checking:
            self.on_validation(row)

    def curve_row(self, metrics: dict) -> dict:
        """A learning-curve row: tokens trained on so far, the step and the held-out ``metrics``."""
        return {"train_tokens": int(self.tokens_seen), "distinct_tokens": self.data.distinct_tokens,
                "step": self.global_step, **metrics}  # fmt: skip

    def configure_optimizers(self):
        adamw = {"weight_decay": 0.01, "betas": (0.9, 0.95)}
        return adamw_cosine(self.draft.parameters(), self.lr, self.warmup_steps, self.total_steps, 0.1, **adamw)
