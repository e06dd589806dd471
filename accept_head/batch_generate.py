"""Batched sampling from one model with left padding: the work-horse of ``data_gen`` and draft distillation.

One prompt at a time through ``generate`` runs at ~37 tok/s on a 2-core CPU; a batch of 64 reaches ~10x that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .sampling import SamplingConfig, probabilities, sample


@dataclass
class SampledResponse:
    """One sampled continuation. ``token_ids`` ends with the EOS token when one was produced."""

    token_ids: list[int]
    topk_ids: torch.Tensor | None = None
    """(n, k) int32: the k most likely next tokens at each response position (raw model distribution)."""
    topk_logprobs: torch.Tensor | None = None
    """(n, k) float16: their log-probabilities."""


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``input_ids`` and ``attention_mask``, both (B, L) LongTensors."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def sample_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator | None,
    capture_topk: int = 0,
) -> list[SampledResponse]:
    """Sample a continuation for every prompt in one left-padded batch.

    Rows stop at their first EOS (kept in the output) or after ``max_new_tokens``. With ``capture_topk > 0`` the
    model's top-k log-probabilities at every generated position are returned too (used as distillation targets).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample_batch needs at least one prompt and no empty prompt.")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.as_tensor(list(eos_token_ids), device=device)
    batch = len(prompts)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    topk_ids: list[torch.Tensor] = []
    topk_logp: list[torch.Tensor] = []
    cache = DynamicCache()
    step_ids, step_pos = ids, positions
    for _ in range(max_new_tokens):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        if capture_topk:
            top = torch.topk(logits.float().log_softmax(-1), capture_topk, dim=-1)
            topk_ids.append(top.indices.to(torch.int32).cpu())
            topk_logp.append(top.values.to(torch.float16).cpu())
        probs = probabilities(logits, sampling)
        next_ids = sample(probs.cpu(), generator).to(device)
        next_ids = torch.where(finished, torch.full_like(next_ids, pad_token_id), next_ids)
        tokens.append(next_ids)
        finished |= torch.isin(next_ids, eos)
        if bool(finished.all()):
            break
        step_ids = next_ids[:, None]
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
    generated = torch.stack(tokens, dim=1).cpu()
    results = []
    eos_set = set(int(e) for e in eos_token_ids)
    for row in range(batch):
        row_ids = generated[row].tolist()
        length = next((i + 1 for i, t in enumerate(row_ids) if t in eos_set), len(row_ids))
        response = SampledResponse(token_ids=row_ids[:length])
        if capture_topk:
            response.topk_ids = torch.stack([t[row] for t in topk_ids[:length]])
            response.topk_logprobs = torch.stack([t[row] for t in topk_logp[:length]])
        results.append(response)
    return results
