"""Where a T=1 chain drafting step's time goes beyond the draft forward: each part of the step as
``docs/experiments/draft_int8.py`` takes it (the forward, the draw over the kept vocabulary, q scattered to the whole
vocabulary, the head's inputs, the stop rule, the head), timed right after a one-token target pass as decoding
alternates them; medians of 60.

    python docs/experiments/draft_step_parts.py
"""

import statistics
import time

import torch
from draft_int8 import decoding_step, drafting_context

from accept_head import SpecDecPP
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.specdecpp.chat import DEFAULT_PROMPTS

PARTS = ("forward", "draw", "scatter", "stats", "should_stop", "score")


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained("checkpoints/smollm2-135m-specdecpp")
    target, draft = bundle.target, bundle.draft.bind(bundle.target)
    prompt = torch.tensor([chat_prompt_ids(bundle.tokenizer, DEFAULT_PROMPTS[0])])
    ids = target.generate(prompt, max_new_tokens=64, do_sample=False)
    features = target(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    cache, context, drafter, base = drafting_context(target, draft, ids, features)
    generator, policy, token = torch.Generator().manual_seed(0), bundle.policy(), torch.tensor([[123]])
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for i in range(70):
        target(input_ids=token, **cache_kwargs(target, cache), logits_to_keep=1)
        crop_cache(cache, context)
        marks = [time.perf_counter()]
        decoding_step(drafter, policy, generator, marks)
        crop_cache(drafter.cache, base)
        if i >= 10:
            for name, began, ended in zip(PARTS, marks, marks[1:]):
                parts[name].append((ended - began) * 1e3)
    for name, values in parts.items():
        print(f"{name:>12}: {statistics.median(values):.3f} ms")


if __name__ == "__main__":
    main()
