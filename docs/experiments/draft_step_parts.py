"""Where a T=1 chain drafting step's time goes beyond the draft forward: each part of the step as
``docs/experiments/draft_int8.py`` takes it (the forward, the draw over the kept vocabulary, q scattered to the whole
vocabulary, the head's inputs, the stop rule, the head), timed right after a one-token target pass as decoding
alternates them; medians of 60.

    python docs/experiments/draft_step_parts.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

from accept_head import SpecDecPP
from accept_head.acceptance.inputs import draft_step_stats
from accept_head.chain.decoding import draw
from accept_head.chain.policies import RoundState
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.sampling import SamplingConfig
from accept_head.specdecpp.chat import DEFAULT_PROMPTS

torch.set_num_threads(2)
S = SamplingConfig(1.0, None, None)
b = SpecDecPP.from_pretrained("checkpoints/smollm2-135m-specdecpp")
target, draft = b.target, b.draft.bind(b.target)
with torch.inference_mode():
    ids = target.generate(
        torch.tensor([chat_prompt_ids(b.tokenizer, DEFAULT_PROMPTS[0])]), max_new_tokens=64, do_sample=False
    )
    feats = target(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    cache = DynamicCache()
    target(input_ids=ids, **cache_kwargs(target, cache))
    ctx = cache.get_seq_length()
    drafter = draft.make_drafter(target)
    drafter.start(ids[0].tolist(), feats[:-1])
    drafter.propose(None)
    base = drafter.cache.get_seq_length()
    gen = torch.Generator().manual_seed(0)
    policy = b.policy()
    parts = {k: [] for k in ("forward", "draw", "scatter", "stats", "should_stop", "score")}
    tok = torch.tensor([[123]])
    for i in range(70):
        target(input_ids=tok, **cache_kwargs(target, cache), logits_to_keep=1)
        crop_cache(cache, ctx)
        t0 = time.perf_counter()
        step = drafter.propose(321)
        t1 = time.perf_counter()
        index, q = draw(step.support_logits, S, gen)
        t2 = time.perf_counter()
        q.new_zeros(step.vocab_size).index_copy_(0, step.support, q)
        t3 = time.perf_counter()
        logq, ent, top1 = draft_step_stats(step.support_logits, q, index, greedy=False)
        t4 = time.perf_counter()
        state = RoundState(n=1, candidates=[int(step.support[index])], draft_logps=[logq], entropies=[ent])
        state.top1s.append(top1)
        policy.should_stop(state)
        t5 = time.perf_counter()
        policy.score(step.hidden, state)
        t6 = time.perf_counter()
        crop_cache(drafter.cache, base)
        if i >= 10:
            for k, (a, c) in zip(parts, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)]):
                parts[k].append((c - a) * 1e3)
for k, v in parts.items():
    print(f"{k:>12}: {statistics.median(v):.3f} ms")
