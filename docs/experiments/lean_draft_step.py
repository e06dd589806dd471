"""What the lean drafting step buys: the step's cost against a target pass, and decoding speed, side by side.

    python docs/experiments/lean_draft_step.py --output docs/experiments/lean_draft_step-epyc.json

``FeatureDraft.step`` runs a feature draft's one Llama layer as a ``LeanStep`` (``accept_head/models/draft_step.py``):
query/key/value as one int8 product, gate/up as one, RoPE from a table, the same numbers bit for bit. This script
measures it against the layer's modules called one by one (the step as it was, the rest of the code unchanged), on
the committed bundle (its int8 draft), 2 threads:

1. **Cost**: ``draft_int8.step_cost`` — a drafting step right after a one-token target pass, as decoding alternates
   them, medians of ``--repeats``: the draft's forward alone (``c``) and the whole step as chain SpecDec++ spends it at
   T = 1 with the head (``c_step``); the two paths interleaved ``--rounds`` times. And a round's first call, which
   feeds the 1–4 tokens verification fixed (``first_call_ms``), right after a target pass, medians of ``--repeats``.
2. **Decoding**: ``bundle.generate`` at the bundle's h*, greedy and T = 1, on the chat's built-in prompts (they choose
   nothing), the two paths and autoregressive decoding interleaved prompt by prompt, ``--decode_repeats`` times.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from draft_int8 import comparison_arguments, decode_speed, drafting_context, finish, step_cost, step_cost_summary

import accept_head.models.feature_draft as feature_draft
from accept_head import SpecDecPP
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info
from accept_head.specdecpp.chat import DEFAULT_PROMPTS


@contextlib.contextmanager
def step_path(lean: bool):
    """Drafters made inside draft with the lean step (``lean``) or with the layer's modules one by one."""
    applies = feature_draft.lean_step_applies
    if not lean:
        feature_draft.lean_step_applies = lambda decoder: False
    try:
        yield
    finally:
        feature_draft.lean_step_applies = applies


def first_call_ms(target, draft, ids: torch.Tensor, features: torch.Tensor, repeats: int, lean: bool) -> dict:
    """ms of a round's first drafting call feeding T = 1..4 fixed tokens (``FeatureDraft.extend``), each right after
    a one-token target pass; medians of ``repeats``."""
    with step_path(lean):
        cache, context, drafter, base = drafting_context(target, draft, ids, features)
        out = {}
        for count in (1, 2, 3, 4):
            times = []
            for _ in range(repeats + 3):
                target(input_ids=ids[:, -1:], **cache_kwargs(target, cache), logits_to_keep=1)
                crop_cache(cache, context)
                began = time.perf_counter()
                drafter.model.extend(features[-count:], ids[0, -count:].tolist(), drafter.cache, base, drafter.lean)
                times.append(time.perf_counter() - began)
                crop_cache(drafter.cache, base)
            out[count] = 1e3 * statistics.median(times[3:])
        return out


class Path:
    """The bundle decoding through one step path (what ``draft_int8.decode_speed`` calls)."""

    def __init__(self, bundle: SpecDecPP, lean: bool) -> None:
        self.bundle, self.lean, self.target = bundle, lean, bundle.target

    def generate(self, *args, **kwargs):
        with step_path(self.lean):
            return self.bundle.generate(*args, **kwargs)


def main() -> None:
    args = comparison_arguments(__doc__.split("\n\n")[0], repeats=60).parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    target, draft = bundle.target, bundle.draft.bind(bundle.target)
    prompts = [chat_prompt_ids(bundle.tokenizer, text) for text in DEFAULT_PROMPTS]
    paths = {"lean": True, "modules": False}
    result: dict = {"machine": machine_info(), "bundle": args.bundle, "cost": {name: [] for name in paths}}
    result["first_call_ms"] = {name: [] for name in paths}
    with torch.inference_mode():
        ids = target.generate(torch.tensor([prompts[0]]), max_new_tokens=96, do_sample=False)
        features = target(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        for _ in range(args.rounds):
            for name, lean in paths.items():
                with step_path(lean):
                    result["cost"][name].append(step_cost(target, draft, ids, features, args.repeats, bundle.policy()))
                result["first_call_ms"][name].append(first_call_ms(target, draft, ids, features, args.repeats, lean))
    if args.decode_repeats:
        variants = {name: Path(bundle, lean) for name, lean in paths.items()}
        result["decode_tok_s"] = decode_speed(variants, prompts, args.decode_tokens, args.decode_repeats)
    for name in paths:
        print(f"{name}: {step_cost_summary(result['cost'][name])}")
    for name, rounds in result["first_call_ms"].items():
        print(
            f"{name}: a round's first call, 1 / 2 / 3 / 4 tokens: "
            + "; ".join(" / ".join(f"{ms:.3f}" for ms in one.values()) + " ms" for one in rounds)
        )
    finish(result, args.output)


if __name__ == "__main__":
    main()
