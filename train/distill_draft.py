"""Distill a small draft model from a target's own responses (the recipe behind ``checkpoints/smollm2-135m-draft``).

Three resumable stages, each a subcommand::

    python -m train.distill_draft generate --config configs/distill/smollm2-135m-draft.yaml
    python -m train.distill_draft fit      --config configs/distill/smollm2-135m-draft.yaml
    python -m train.distill_draft evaluate --config configs/distill/smollm2-135m-draft.yaml

``generate`` lets the target answer the distillation prompts (chat template, batched sampling) and stores, per
response token, the target's top-k log-probabilities; ``fit`` trains a Llama-architecture draft on them with a
cross-entropy against the target's distribution (top-k mass, the sampled token carrying the tail);
``evaluate`` measures expected acceptance Σ_x min(p, q) and greedy agreement on held-out prompts with exact target
distributions. Shards and checkpoints are written atomically, so a killed stage resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from accept_head.batch_generate import sample_batch
from accept_head.pairs import ModelSpec, load_model, load_tokenizer
from accept_head.prompts import PromptSource, chat_prompt_ids, load_prompts
from accept_head.sampling import SamplingConfig


@dataclass
class DraftArchitecture:
    hidden_size: int = 256
    """Model width; the tied embedding (vocab x width) dominates size and per-token time."""
    num_layers: int = 2
    intermediate_size: int = 1024
    num_heads: int = 4


@dataclass
class DistillConfig:
    target: ModelSpec
    """The model the draft imitates."""
    prompts: list[PromptSource]
    """Distillation prompts (keep them disjoint from head-training and evaluation prompts)."""
    eval_prompts: list[PromptSource]
    """Held-out prompts for the acceptance metrics and the learning curve."""
    work_dir: str = "~/.cache/accept_head/distill/smollm2-135m"
    """Where response shards and training checkpoints go (outside the repository: hundreds of MB)."""
    output_dir: str = "checkpoints/smollm2-135m-draft"
    """Final HF model folder (model + tokenizer + model card)."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    """Temperature of the target's responses (1 = its own distribution)."""
    batch_size: int = 64
    """Prompts per generation batch; one batch is one shard."""
    topk: int = 32
    """Target log-probabilities kept per response position."""
    seed: int = 0
    threads: int | None = None
    """torch intra-op threads (None: torch's default)."""
    architecture: DraftArchitecture = field(default_factory=DraftArchitecture)
    lr: float = 2e-3
    warmup_steps: int = 100
    train_tokens: int = 4_000_000
    """Response tokens to train on in total (epochs over the shards are implied)."""
    batch_tokens: int = 8192
    """Response tokens per optimizer step (sequences are packed up to this)."""
    eval_every_tokens: int = 250_000


def _work(cfg: DistillConfig) -> Path:
    return Path(os.path.expanduser(cfg.work_dir))


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def generate(cfg: DistillConfig) -> None:
    """Stage 1: the target answers eval prompts then distillation prompts; one shard per batch, resumable."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    work = _work(cfg)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.target)
    model = load_model(cfg.target)
    sampling = SamplingConfig(temperature=cfg.temperature)
    for kind, sources in (("eval", cfg.eval_prompts), ("train", cfg.prompts)):
        prompts = load_prompts(sources, seed=cfg.seed)
        n_shards = math.ceil(len(prompts) / cfg.batch_size)
        print(f"[generate] {kind}: {len(prompts)} prompts in {n_shards} shards", flush=True)
        for shard in range(n_shards):
            path = work / "shards" / f"{kind}-{shard:05d}.pt"
            if path.exists():
                continue
            batch = prompts[shard * cfg.batch_size : (shard + 1) * cfg.batch_size]
            ids = [chat_prompt_ids(tokenizer, p.text) for p in batch]
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard + (0 if kind == "train" else 7))
            start = time.perf_counter()
            responses = sample_batch(
                model,
                ids,
                max_new_tokens=cfg.max_new_tokens,
                sampling=sampling,
                eos_token_ids=[tokenizer.eos_token_id],
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
                capture_topk=cfg.topk,
            )
            seconds = time.perf_counter() - start
            n_tokens = sum(len(r.token_ids) for r in responses)
            _save_atomic(
                {
                    "prompt_id": [p.id for p in batch],
                    "prompt_ids": [torch.tensor(x, dtype=torch.int32) for x in ids],
                    "response_ids": [torch.tensor(r.token_ids, dtype=torch.int32) for r in responses],
                    "topk_ids": [r.topk_ids for r in responses],
                    "topk_logprobs": [r.topk_logprobs for r in responses],
                },
                path,
            )
            print(f"[generate] {path.name}: {n_tokens} tokens in {seconds:.1f}s ({n_tokens / seconds:.0f} tok/s)", flush=True)


def main() -> None:
    from jsonargparse import CLI

    CLI({"generate": generate}, as_positional=False)


if __name__ == "__main__":
    main()
