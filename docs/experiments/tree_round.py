"""A short CPU check of tree rounds on the embedded pair: the head tree against chain SpecDec++ and EAGLE-2's tree.

Decodes held-out test prompts of ``configs/eval/bench.yaml`` (the ``eval`` hash split; the first ``--prompts`` of
its in-distribution sources, one per source) with the committed bundle, methods interleaved per prompt, greedy and
T = 1: autoregressive, chain SpecDec++ at the bundle's h* for the mode, the head tree (``generate(tree=True)`` with
the bundle's cost model and HeadTree's defaults), the same with its first depth always fed (``min_depth=2``, so the
head has scored it before the first growth decision) and a confidence tree (EAGLE-2: width 4, top-4 children, depth 4,
16 nodes verified). No setting was chosen on any prompt: every one is a default fixed before this script ran.
Prints and stores pooled tokens/s (wall clock), tokens/s modeled by the bundle's cost model from the counted passes
(t_draft per draft forward, t_target(n) per target call over n candidates: what the head tree plans with), tokens per
target call, mean tree size and, for greedy, whether the output equals autoregressive greedy.

Run from the repository root (about 5 minutes on 2 shared CPU cores):
    python docs/experiments/tree_round.py --out docs/experiments/tree_round.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import yaml

from accept_head import SpecDecPP, autoregressive_generate
from accept_head.core.costs import CostModel
from accept_head.core.prompts import PromptOptions, PromptSource
from accept_head.engine.runner import aggregate
from accept_head.trees.decoding import tree_generate
from accept_head.trees.growth import ConfidenceTree, HeadTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/experiments/tree_round.json")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = yaml.safe_load(open("configs/eval/bench.yaml"))
    sources = [PromptSource(**{**s, "limit": 1}) for s in config["prompts"] if s["path"] != "humaneval"]
    bundle = SpecDecPP.from_pretrained("checkpoints/smollm2-135m-specdecpp", dtype=args.dtype)
    prompts = PromptOptions().encode("test", sources, bundle.tokenizer, seed=0).prompts[: args.prompts]
    eos, new = bundle.eos_token_ids, args.max_new_tokens
    cost = CostModel.from_dict(bundle.cost_model)

    def fed_first(greedy: bool) -> HeadTree:
        calibration = bundle.calibration_for(greedy)
        return HeadTree(bundle.head, cost, calibration=calibration, min_depth=2)

    confidence = ConfidenceTree(width=4, top_k=4, max_depth=4, max_nodes=16)
    results: dict = {}
    for temperature in (0.0, 1.0):
        greedy = temperature == 0
        methods = {
            "autoregressive": lambda ids, g: autoregressive_generate(
                bundle.target, ids, new, temperature, eos_token_id=eos, generator=g
            ),
            "chain SpecDec++": lambda ids, g: bundle.generate(ids, new, temperature, generator=g),
            "head tree": lambda ids, g: bundle.generate(ids, new, temperature, generator=g, tree=True),
            "head tree, min_depth=2": lambda ids, g: tree_generate(
                bundle.target, bundle.draft, ids, fed_first(greedy), new, temperature, eos_token_id=eos, generator=g
            ),
            "confidence tree": lambda ids, g: tree_generate(
                bundle.target, bundle.draft, ids, confidence, new, temperature, eos_token_id=eos, generator=g
            ),
        }
        empty = {"generated": 0, "seconds": 0.0, "target_calls": 0, "fed": [], "identical": 0}
        rows = {name: {**empty, "fed": [], "stats": []} for name in methods}
        for prompt in prompts:
            ids = list(prompt.ids)
            reference = None
            for name, decode in methods.items():  # interleaved: every method on this prompt before the next
                start = time.perf_counter()
                out = decode(ids, torch.Generator().manual_seed(0))
                seconds = time.perf_counter() - start
                row, stats = rows[name], out.stats
                row["generated"] += stats.generated
                row["seconds"] += seconds
                row["target_calls"] += stats.target_calls
                row["fed"] += getattr(stats, "fed", [])
                row["stats"].append(stats)
                sequence = out.sequences[0].tolist()
                reference = sequence if name == "autoregressive" else reference
                row["identical"] += sequence == reference
        summary = {}
        for name, row in rows.items():
            summary[name] = {
                "tokens_per_second": row["generated"] / row["seconds"],
                "modeled_tokens_per_second": aggregate(name, row["stats"], cost).modeled_tokens_per_second,
                "tokens_per_target_call": row["generated"] / row["target_calls"],
                "draft_calls": sum(s.draft_calls for s in row["stats"]),
                "mean_tree_size": sum(row["fed"]) / len(row["fed"]) - 1 if row["fed"] else None,
                "generated": row["generated"],
                "target_calls": row["target_calls"],
                **({"identical_to_autoregressive": f"{row['identical']}/{len(prompts)}"} if greedy else {}),
            }
            print(f"T={temperature:g} {name:16s} {json.dumps(summary[name])}", flush=True)
        results["greedy" if greedy else "T=1"] = summary
    meta = {"prompts": [p.id for p in prompts], "max_new_tokens": new, "dtype": args.dtype, "threads": args.threads}
    with open(args.out, "w") as f:
        json.dump({**meta, "confidence_tree": confidence.describe(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
