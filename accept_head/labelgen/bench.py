"""Benchmark: labelled tokens per second of the label-generation pipeline against a naive loop, side by side.

``python -m data_gen.bench`` runs it. It takes a :class:`DataGenConfig` (pair, prompts, sampling, batch size) and
writes nothing:

- **batched**: what ``python -m data_gen`` does per batch (:func:`.generate.label_batch`): left-padded batched
  sampling with a KV cache, finished rows dropped, and (``scoring: lockstep``, the default) the draft labelling each
  position beside the target as it is sampled; ``--scoring teacher_forced`` times the two-pass variant instead.
- **naive**: one prompt at a time through HF ``generate``, then one teacher-forced forward per model and a Python
  loop that labels the response token by token (the shape of the original SpecDec++ data code, at batch size 1).

Both sides label prompts drawn evenly from the same prompt set; the naive side uses the first ``naive_prompts`` of
them. Reported: labelled tokens/s of each, the speedup, the batch size, and the share of time in scoring vs generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from ..acceptance.labels import label_transform, position_labels
from ..core.seeds import seeded_generator
from ..core.timing import device_timer
from .config import DataGenConfig
from .generate import LoadedPair, label_batch, load_run


@dataclass
class Timing:
    """Labelled prompts, tokens and seconds of one side of the benchmark."""

    prompts: int = 0
    tokens: int = 0
    generation_s: float = 0.0
    scoring_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.generation_s + self.scoring_s, 1e-9)

    @property
    def scoring_fraction(self) -> float:
        return self.scoring_s / max(self.generation_s + self.scoring_s, 1e-9)

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s, "scoring_fraction": self.scoring_fraction}


def run_batched(cfg: DataGenConfig, pair: LoadedPair, prompt_ids: list[list[int]]) -> Timing:
    """The label-generation path: batches of ``cfg.batch_size`` through :func:`label_batch` (no disk writes)."""
    timing = Timing()
    for index, start in enumerate(range(0, len(prompt_ids), cfg.batch_size)):
        batch = label_batch(cfg, pair, prompt_ids[start : start + cfg.batch_size], index)
        timing.prompts += len(batch.response_ids)
        timing.tokens += sum(len(r) for r in batch.response_ids)
        timing.generation_s += batch.generation_s
        timing.scoring_s += batch.scoring_s
    return timing


@torch.inference_mode()
def run_naive(cfg: DataGenConfig, pair: LoadedPair, prompt_ids: list[list[int]]) -> Timing:
    """One prompt at a time: HF ``generate``, then per-token labelling from one forward pass per model."""
    timing = Timing()
    sampling = cfg.sampling()
    transform = label_transform(sampling, cfg.label_mode)
    device = next(pair.target.parameters()).device
    generator = seeded_generator(cfg.seed, "naive", 0)
    for prompt in prompt_ids:
        ids = torch.tensor([prompt], device=device)
        with device_timer(device) as generation:
            with torch.random.fork_rng(devices=[]):  # HF sampling draws from the global RNG: keep it local
                torch.manual_seed(cfg.seed)
                out = pair.target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=not sampling.greedy,
                    temperature=sampling.temperature if not sampling.greedy else None,
                    top_k=sampling.top_k or 0,
                    top_p=sampling.top_p if sampling.top_p is not None else 1.0,
                    max_new_tokens=cfg.max_new_tokens,
                    eos_token_id=pair.eos,
                    pad_token_id=pair.pad,
                )
            response = out[0, len(prompt) :].tolist()
            end = next((i + 1 for i, t in enumerate(response) if t in pair.eos), len(response))
            response = response[:end]
        with device_timer(device) as scoring:
            sequence = torch.tensor([prompt + response[:-1]], device=device)
            first = len(prompt) - 1
            p_logits = pair.target(sequence).logits[0, first:]
            q_logits = pair.draft(sequence).logits[0, first:]
            for i in range(len(response)):
                u = torch.rand(1, generator=generator, dtype=torch.float64)
                position_labels(p_logits[i : i + 1], q_logits[i : i + 1], transform=transform, uniforms=u)
        timing.scoring_s += scoring.seconds
        timing.generation_s += generation.seconds
        timing.prompts += 1
        timing.tokens += len(response)
    return timing


def bench(cfg: DataGenConfig, n_prompts: int = 64, naive_prompts: int = 8, output_json: str | None = None) -> dict:
    """Time both paths on the same pair and prompts; print the comparison and return it as a dict."""
    plan, pair = load_run(cfg)
    step = max(1, len(plan.ids) // n_prompts)
    prompt_ids = plan.ids[::step][:n_prompts]
    warm = replace(cfg, max_new_tokens=4)
    run_batched(warm, pair, prompt_ids[:2])  # first calls allocate and pick kernels: keep them out of the timings
    run_naive(warm, pair, prompt_ids[:1])
    batched = run_batched(cfg, pair, prompt_ids)
    naive = run_naive(cfg, pair, prompt_ids[:naive_prompts])
    result = {
        "target": cfg.target.to_dict(),
        "draft": cfg.draft.to_dict(),
        "threads": torch.get_num_threads(),
        "batch_size": cfg.batch_size,
        "max_new_tokens": cfg.max_new_tokens,
        "sampling": cfg.sampling().to_dict(),
        "label_mode": cfg.label_mode,
        "scoring": cfg.scoring,
        "batched": batched.as_dict(),
        "naive": naive.as_dict(),
        "speedup": batched.tokens_per_s / max(naive.tokens_per_s, 1e-9),
    }
    target, draft = cfg.target, cfg.draft
    print(
        f"pair      target {target.path} ({target.dtype}, {target.device}) / draft {draft.path} ({draft.dtype}, "
        f"{draft.device}); torch threads {torch.get_num_threads()}; max_new_tokens {cfg.max_new_tokens}, "
        f"label_mode {cfg.label_mode}\n"
        f"batched   batch_size {cfg.batch_size}, {batched.prompts} prompts, {batched.tokens} tokens: "
        f"{batched.tokens_per_s:.1f} labelled tok/s (generation {batched.generation_s:.1f}s, {cfg.scoring} scoring "
        f"{batched.scoring_s:.1f}s = {100 * batched.scoring_fraction:.1f}% of the time)\n"
        f"naive     1 prompt at a time (HF generate + per-token scoring), {naive.prompts} prompts, {naive.tokens} "
        f"tokens: {naive.tokens_per_s:.1f} labelled tok/s (generation {naive.generation_s:.1f}s, scoring "
        f"{naive.scoring_s:.1f}s = {100 * naive.scoring_fraction:.1f}%)\n"
        f"speedup   {result['speedup']:.1f}x labelled tokens/s"
    )
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result
