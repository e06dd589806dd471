"""What a T = 1 tree round spends and returns, rule by rule: the head tree against the cost tree (issues 37, 39).

    python docs/experiments/tree_rounds.py --bundle checkpoints/smollm2-135m-specdecpp \
        --output docs/experiments/tree_rounds.json

Decodes each prompt with the bundle's own tree rule (``bundle.tree_rule``: the head, drawn children at T > 0) and with
the cost tree (the same growth and pricing, nodes valued by the draft's probabilities: the head ablated), and chain
SpecDec++ beside them, interleaved prompt by prompt with the same seeds. Per rule: tokens/s, tokens committed per
round, draft forwards and tree tokens fed to the target per round, and the decoder's own split of a round's wall time
(target pass with verification, drafting with proposal and head, the head alone). ``--t_draft`` re-prices the trees'
cost model with another draft-forward time (seconds), to see whether the rules' choices move with it.

Prompts: the three built-in prompts of ``python -m accept_head chat`` plus one more (they choose nothing).
"""

from __future__ import annotations

import argparse
import copy

import torch

from accept_head.chain.decoding import speculative_generate
from accept_head.core.costs import CostModel
from accept_head.core.records import machine_info, write_json
from accept_head.specdecpp.bundle import SpecDecPP
from accept_head.specdecpp.chat import DEFAULT_PROMPTS
from accept_head.trees.decoding import tree_generate
from accept_head.trees.growth import CostTree

EXTRA_PROMPT = "Give me a recipe for pancakes."


def rules(bundle: SpecDecPP, t_draft: float | None, temperature: float) -> dict:
    """The rules compared: name → (decode function, rule)."""
    greedy = temperature == 0
    raw = dict(bundle.cost_model)
    if t_draft is not None:
        raw["t_draft"] = t_draft
    cost = CostModel.from_dict(raw)
    head = copy.copy(bundle.tree_rule(None, greedy=greedy))
    head.cost = cost
    siblings = head.siblings
    return {
        "chain SpecDec++": (speculative_generate, bundle.policy(None, greedy=greedy)),
        "head tree": (tree_generate, head),
        "cost tree": (tree_generate, CostTree(cost, siblings=siblings)),
    }


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--t_draft", type=float, default=None, help="seconds per draft forward in the trees' cost model")
    ap.add_argument("--output", default="eval_out/tree_rounds.json")
    args = ap.parse_args()
    bundle = SpecDecPP.from_pretrained(args.bundle)
    prompts = [bundle.encode([{"role": "user", "content": p}]) for p in [*DEFAULT_PROMPTS, EXTRA_PROMPT]]
    compared = rules(bundle, args.t_draft, args.temperature)
    keys = ("total_time", "target_time", "draft_time", "head_time")
    sums = {name: dict.fromkeys([*keys, "rounds", "generated", "fed", "draft_calls"], 0.0) for name in compared}
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name, (decode, rule) in compared.items():
                generator = torch.Generator().manual_seed(1000 * repeat + i)
                stats = decode(
                    bundle.target, bundle.draft, torch.tensor([ids]), rule, max_new_tokens=args.tokens,
                    temperature=args.temperature, eos_token_id=None, generator=generator,
                ).stats  # fmt: skip
                total = sums[name]
                for key in keys:
                    total[key] += getattr(stats, key)
                total["rounds"] += len(stats.accepted)
                total["generated"] += stats.generated
                total["draft_calls"] += stats.draft_calls
                total["fed"] += sum(getattr(stats, "fed", [])) or sum(k + 1 for k in stats.proposed)
    result = {}
    for name, total in sums.items():
        rounds = total["rounds"]
        result[name] = {
            "tokens_per_second": total["generated"] / total["total_time"],
            "tokens_per_round": total["generated"] / rounds,
            "draft_forwards_per_round": total["draft_calls"] / rounds,
            "target_tokens_per_round": total["fed"] / rounds,
            "ms_per_round": {key.removesuffix("_time"): 1e3 * total[key] / rounds for key in keys},
            "rounds": rounds,
        }
        r, ms = result[name], result[name]["ms_per_round"]
        print(
            f"{name}: {r['tokens_per_second']:.1f} tok/s, {r['tokens_per_round']:.2f} tokens/round, "
            f"{r['draft_forwards_per_round']:.2f} draft forwards and {r['target_tokens_per_round']:.2f} target tokens "
            f"a round; ms/round {ms['total']:.1f} = target {ms['target']:.1f} + draft {ms['draft']:.1f} "
            f"(head {ms['head']:.2f})",
            flush=True,
        )
    payload = {
        "machine": machine_info(),
        "settings": vars(args),
        "rules": {k: v[1].describe() for k, v in compared.items()},
    }
    write_json(args.output, payload | {"results": result})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
