"""Does a compiled target pass slow the drafting step that follows it? (issue 37)

    python docs/experiments/draft_after_pass.py --output docs/experiments/draft_after_pass-epyc.json

On 2026-11-29 the drafting step timed after compiled target passes ran slower than after eager ones (1.52 against
1.15 ms, docs/measurements.md), which would make compilation itself cost the draft time. This times the bundle's
drafting step (``FeatureDrafter.propose``, its int8 draft as the bundle loads it) right after four kinds of one-token
target pass, interleaved ``--rounds`` times: the model's eager forward over a ``DynamicCache``, a
:class:`~accept_head.models.static_target.StaticTarget` (static), the same compiled, and none (steps back to back).
Medians after three warm-up rounds; the target passes' own medians beside them. 2 threads, bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from draft_int8 import drafting_context

from accept_head import SpecDecPP
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info, write_json
from accept_head.models.static_target import StaticTarget
from accept_head.specdecpp.chat import DEFAULT_PROMPTS


def passes(target, ids: torch.Tensor, cache, context: int) -> dict:
    """One-token target passes after ``ids`` by runtime, each leaving the cache as it found it."""
    token, kept = torch.tensor([[123]]), ids.shape[1]

    def eager():
        target(input_ids=token, **cache_kwargs(target, cache), logits_to_keep=1)
        crop_cache(cache, context)

    def over(static: StaticTarget):
        static.forward(ids)

        def run():
            static.forward(token, last_only=True)
            static.crop(kept)

        return run

    static = {name: StaticTarget(target, kept + 64, compile=name == "compiled") for name in ("static", "compiled")}
    return {"eager": eager, **{name: over(s) for name, s in static.items()}, "none": lambda: None}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    target, draft = bundle.target, bundle.draft.bind(bundle.target)
    prompt = chat_prompt_ids(bundle.tokenizer, DEFAULT_PROMPTS[0])
    ids = target.generate(torch.tensor([prompt]), max_new_tokens=96, do_sample=False)
    features = target(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    cache, context, drafter, base = drafting_context(target, draft, ids, features)
    runs = passes(target, ids, cache, context)
    draft_s: dict[str, list[float]] = {name: [] for name in runs}
    target_s: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds + 3):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            between = time.perf_counter()
            drafter.propose(321)
            crop_cache(drafter.cache, base)
            target_s[name].append(between - began)
            draft_s[name].append(time.perf_counter() - between)
    result = {"machine": machine_info(), "bundle": args.bundle, "rounds": args.rounds, "after": {}}
    for name in runs:
        draft_ms, target_ms = (1e3 * statistics.median(s[name][3:]) for s in (draft_s, target_s))
        result["after"][name] = {"draft_step_ms": draft_ms, "target_pass_ms": target_ms}
        print(f"after {name:8s}: target pass {target_ms:6.2f} ms, drafting step {draft_ms:.3f} ms", flush=True)
    if args.output:
        write_json(args.output, result)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
