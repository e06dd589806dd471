"""What an int8 draft buys on this CPU: the drafting step's cost, the acceptance it gives up, and decoding speed.

    python docs/experiments/draft_int8.py --output docs/experiments/draft_int8.json

A drafting step here is weight streaming (docs/measurements.md: 77% of it in eight matrix products over 27 MB of
bf16 weights, evicted from the caches by every target pass). ``quantize: int8`` (``ModelSpec.quantize``,
``SpecDecPP.from_pretrained(..., draft_quantize="int8")``) stores the feature draft's linear layers and LM head as
int8 with one scale per row, half the bytes. Three measurements, the bundle's draft as trained (bf16) against the same
draft in int8, 2 threads:

1. **Cost**: one drafting step (the acceptance head not included) against a one-token target forward, alternated as
   decoding alternates them, medians of ``--repeats``, the two drafts interleaved twice.
2. **Acceptance**: step-1 Σ_x min(p, q) over the response positions of the target's greedy continuations of the
   chat's built-in prompts (they choose nothing), the draft reading the target's true features; and the total
   variation between the two drafts' q.
3. **Decoding**: ``bundle.generate`` at the bundle's h* per mode, greedy and T = 1, the two drafts and autoregressive
   decoding interleaved prompt by prompt, ``--decode_repeats`` times, tokens/s.

Decoding stays lossless with either draft (verification uses the q the draft computed); the bundle's cost model and
h* price the draft as trained.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from accept_head import SpecDecPP, autoregressive_generate
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info, write_json
from accept_head.models.loading import load_model
from accept_head.specdecpp.chat import DEFAULT_PROMPTS


def step_cost(target, draft, ids: torch.Tensor, features: torch.Tensor, repeats: int) -> dict:
    """ms of a drafting step and of a one-token target pass, alternated; their ratio c."""
    cache = DynamicCache()
    target(input_ids=ids, **cache_kwargs(target, cache))
    context, token = cache.get_seq_length(), torch.tensor([[123]])
    drafter = draft.make_drafter(target)
    drafter.start(ids[0].tolist(), features[:-1])
    drafter.propose(None)
    base = drafter.cache.get_seq_length()
    draft_s, target_s = [], []
    for _ in range(repeats + 5):
        began = time.perf_counter()
        target(input_ids=token, **cache_kwargs(target, cache), logits_to_keep=1)
        crop_cache(cache, context)
        target_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        drafter.propose(321)
        crop_cache(drafter.cache, base)
        draft_s.append(time.perf_counter() - began)
    d, t = 1e3 * statistics.median(draft_s[5:]), 1e3 * statistics.median(target_s[5:])
    return {"draft_ms": d, "target_ms": t, "c": d / t}


def step1_q(draft, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The draft's step-1 distribution over the whole vocabulary after each position but the last: row j reads f_j
    and x_(j+1) and predicts x_(j+2)."""
    predicted = draft(features[None, :-1], ids[None, 1:])[0]
    support, logits = draft.support_logits(predicted)
    q = torch.zeros(len(predicted), draft.config.vocab_size)
    q[:, support] = logits.float().softmax(-1)
    return q


def decode_speed(bundles: dict, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """tok/s per method and temperature (bundle.generate at its h*, autoregressive), interleaved per prompt."""
    target = next(iter(bundles.values())).target
    out = {}
    for temperature in (0.0, 1.0):
        tokens, seconds = {}, {}
        for repeat in range(repeats):
            for i, prompt in enumerate(prompts):
                for name, bundle in [("autoregressive", None), *bundles.items()]:
                    generator = torch.Generator().manual_seed(1000 * repeat + i)
                    began = time.perf_counter()
                    if bundle is None:
                        result = autoregressive_generate(
                            target, prompt, new_tokens, temperature=temperature, generator=generator
                        )
                    else:
                        result = bundle.generate(
                            prompt, max_new_tokens=new_tokens, temperature=temperature, generator=generator
                        )
                    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - began
                    tokens[name] = tokens.get(name, 0) + result.sequences.shape[1] - len(prompt)
        out[f"T={temperature:g}"] = {name: tokens[name] / seconds[name] for name in tokens}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--new_tokens", type=int, default=96, help="greedy continuation scored for acceptance")
    parser.add_argument("--decode_tokens", type=int, default=64)
    parser.add_argument("--decode_repeats", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bundles = {"bf16": SpecDecPP.from_pretrained(args.bundle)}
    target, tokenizer = bundles["bf16"].target, bundles["bf16"].tokenizer
    draft_spec = {**bundles["bf16"].draft_spec.to_dict(), "quantize": "int8"}
    bundles["int8"] = SpecDecPP.from_pretrained(
        args.bundle, target=target, tokenizer=tokenizer, draft=load_model(draft_spec)
    )
    drafts = {name: bundle.draft.bind(target) for name, bundle in bundles.items()}
    result: dict = {"machine": machine_info(), "bundle": args.bundle, "cost": {n: [] for n in drafts}}
    prompts = [chat_prompt_ids(tokenizer, text) for text in DEFAULT_PROMPTS]
    with torch.inference_mode():
        sequences = []
        for prompt in prompts:
            ids = target.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False)
            out = target(input_ids=ids, output_hidden_states=True)
            sequences.append((ids[0], out.hidden_states[-1][0], out.logits[0].float().softmax(-1), len(prompt)))
        for _ in range(2):
            for name, draft in drafts.items():
                ids, features, _, _ = sequences[0]
                result["cost"][name].append(step_cost(target, draft, ids[None], features, args.repeats))
        qs = {name: [] for name in drafts}
        accept = {name: [] for name in drafts}
        for ids, features, p, start in sequences:
            for name, draft in drafts.items():
                q = step1_q(draft, features, ids)[start - 2 :]  # rows that predict response tokens
                qs[name].append(q)
                accept[name].append(torch.minimum(p[start - 1 :], q).sum(-1))
        result["acceptance"] = {name: torch.cat(accept[name]).mean().item() for name in drafts}
        result["positions"] = sum(len(a) for a in accept["bf16"])
        tv = [0.5 * (a - b).abs().sum(-1) for a, b in zip(qs["int8"], qs["bf16"])]
        result["tv_int8_vs_bf16"] = torch.cat(tv).mean().item()
    result["decode_tok_s"] = decode_speed(bundles, prompts, args.decode_tokens, args.decode_repeats)
    for name in drafts:
        steps = " / ".join(f"{c['draft_ms']:.2f}" for c in result["cost"][name])
        ratios = " / ".join(f"{c['c']:.4f}" for c in result["cost"][name])
        print(f"{name}: draft step {steps} ms, c = {ratios}; step-1 acceptance {result['acceptance'][name]:.4f}")
    print(f"TV(q_int8, q_bf16) {result['tv_int8_vs_bf16']:.4f} over {result['positions']} positions")
    for mode, speeds in result["decode_tok_s"].items():
        print(mode, {name: round(v, 1) for name, v in speeds.items()})
    if args.output:
        write_json(args.output, result)


if __name__ == "__main__":
    main()
