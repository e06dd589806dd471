"""Variants of the responses stage's compiled generator side by side (issue 36), each ``sampler:fraction[:prefill]``:
the sampler of the full-width steps (``blocked``: :func:`~accept_head.models.slot_generate.sample_rows_blocked`
compiled, what ``slot_generate`` does now; ``full``: :func:`~accept_head.models.slot_generate.sample_rows`, the
float32 copy of every row's logits it did before), how many slots must be free before a refill (``refill_fraction``)
and whether rows of one prompt share its prefill (``shared``, now; ``separate``: each prefilled, as before). Each is a
``slot_generate(compile=True, features=True)`` pass over the same rows as ``python -m train.feature_draft
bench_responses`` (the CPU config's first ``--rows`` training rows, one T = 1 sample each; ``--stage_rows``: the
stage's own mix instead, a T = 1 sample and a greedy row per prompt), 192 new tokens, 128 slots, interleaved
``--repeats`` times after one untimed compiling pass.

    python docs/experiments/slot_generate_ab.py --variants blocked:0.125 full:0.125 blocked:0.03125 --repeats 2 \
        --out docs/experiments/slot_generate_ab-zen5.json   # ~12 min
    python docs/experiments/slot_generate_ab.py --stage_rows --variants blocked:0.125:shared blocked:0.125:separate \
        --repeats 2 --out docs/experiments/slot_generate_ab-shared-zen5.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from jsonargparse import ActionConfigFile, ArgumentParser

from accept_head.core.prompts import load_prompts, training_prompts
from accept_head.core.records import machine_info
from accept_head.models import slot_generate as sg
from accept_head.models.loading import load_model, load_tokenizer
from accept_head.models.pairs import eos_token_ids
from accept_head.training.feature_draft_recipe import FeatureDraftRecipe, _encode
from accept_head.training.own_responses import GREEDY, response_rows

CONFIG = "configs/distill/smollm2-135m-feature-draft-cpu.yaml"
SHARED = sg.first_of_each_prompt


def bench_rows(rows: int, stage_rows: bool):
    """The recipe, its target, the first ``rows`` training prompts as ``bench_responses`` takes them (``stage_rows``:
    as the ``responses`` stage does) and which of them are greedy."""
    parser = ArgumentParser()
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--cfg", type=FeatureDraftRecipe)
    cfg = parser.instantiate(parser.parse_args(["--config", CONFIG])).cfg
    tokenizer, model = load_tokenizer(cfg.target), load_model(cfg.target)
    held_out = load_prompts(cfg.eval_prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    train = training_prompts(cfg.prompts, held_out, seed=cfg.seed, split_seed=cfg.split_seed, limit=cfg.max_prompts)
    samples, greedy = (cfg.samples_per_prompt, cfg.greedy_responses) if stage_rows else (1, False)
    batches = response_rows(_encode(tokenizer, train, cfg.max_prompt_tokens), samples, greedy, 128, cfg.sort_window)
    chosen = [row for batch in batches for row in batch][:rows]
    return cfg, tokenizer, model, [row.prompt.ids for row in chosen], [row.sample == GREEDY for row in chosen]


def run(model, prompts, greedy, eos, pad, variant: str, seed: int) -> tuple[int, float]:
    sampler, fraction, prefill = (variant + ":shared").split(":")[:3]
    sg.compiled_sampler = sg.__dict__["_compiled_blocked"] if sampler == "blocked" else (lambda: sg.sample_rows)
    sg.first_of_each_prompt = SHARED if prefill == "shared" else (lambda prompts: list(range(len(prompts))))
    start = time.perf_counter()
    out, _ = sg.slot_generate(
        model, prompts, greedy, max_new_tokens=192, temperature=1.0, eos_token_ids=eos,
        pad_token_id=pad, generator=torch.Generator().manual_seed(seed), slots=128,
        refill_fraction=float(fraction), compile=True, features=True,
    )  # fmt: skip
    return sum(len(r) for r in out), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["blocked:0.125", "full:0.125"])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--stage_rows", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg, tokenizer, model, prompts, greedy = bench_rows(args.rows, args.stage_rows)
    eos = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sg._compiled_blocked = sg.compiled_sampler
    start = time.perf_counter()
    run(model, prompts, greedy, eos, pad, args.variants[0], cfg.seed)  # compiles the step (and the blocked sampler)
    result = {"machine": machine_info(), "compile_seconds": time.perf_counter() - start, "settings": vars(args)}
    passes = {variant: [] for variant in args.variants}
    for _ in range(args.repeats):
        for variant in args.variants:
            tokens, seconds = run(model, prompts, greedy, eos, pad, variant, cfg.seed)
            passes[variant].append({"tokens": tokens, "seconds": seconds})
            print(
                f"{variant:>16}: {tokens / seconds:6.0f} response tok/s ({tokens} tokens, {seconds:.1f} s)", flush=True
            )
    result["passes"] = passes
    result["tokens_per_second"] = {
        variant: statistics.median(p["tokens"] / p["seconds"] for p in runs) for variant, runs in passes.items()
    }
    print(json.dumps(result["tokens_per_second"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
