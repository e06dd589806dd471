"""What an int8 draft buys on this CPU: the drafting step's cost, the acceptance it gives up, and decoding speed.

    python docs/experiments/draft_int8.py --output docs/experiments/draft_int8.json

A drafting step here is weight streaming (docs/measurements.md: 77% of it in eight matrix products over 27 MB of
bf16 weights, evicted from the caches by every target pass). ``quantize: int8`` (``ModelSpec.quantize``,
``SpecDecPP.from_pretrained(..., draft_quantize="int8")``) stores the feature draft's linear layers and LM head as
int8 with one scale per row, half the bytes. Three measurements, the bundle's draft as trained (bf16) against the same
draft in int8, 2 threads:

1. **Cost**: one drafting step against a one-token target forward, alternated as decoding alternates them, medians
   of ``--repeats``, the two drafts interleaved twice: the draft's forward alone (``draft_ms``, ``c``) and the whole
   step as chain SpecDec++ spends it at T = 1 (``step_ms``, ``c_step``): the forward, the draw over the kept
   vocabulary, q scattered to the whole vocabulary for verification, the head's inputs and the bundle's head with
   its calibration.
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
from accept_head.acceptance.inputs import draft_step_stats
from accept_head.chain.decoding import draw
from accept_head.chain.policies import RoundState
from accept_head.core.hf_compat import cache_kwargs, crop_cache
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info, write_json
from accept_head.core.sampling import SamplingConfig
from accept_head.models.loading import load_model
from accept_head.specdecpp.chat import DEFAULT_PROMPTS

SAMPLING = SamplingConfig(1.0, None, None)


def decoding_step(drafter, policy, generator: torch.Generator, marks: list[float] | None = None) -> None:
    """One drafting step as chain SpecDec++ takes it at T = 1 (:func:`accept_head.chain.decoding.draft_round`);
    ``marks`` (if given) gets ``time.perf_counter()`` after each of its parts: the forward, the draw, q scattered, the
    head's inputs, the stop rule, the head."""
    mark = marks.append if marks is not None else lambda _: None
    step = drafter.propose(321)
    mark(time.perf_counter())
    index, q = draw(step.support_logits, SAMPLING, generator)
    mark(time.perf_counter())
    q.new_zeros(step.vocab_size).index_copy_(0, step.support, q)  # the row verification reads
    mark(time.perf_counter())
    logq, entropy, top1 = draft_step_stats(step.support_logits, q, index, greedy=False)
    mark(time.perf_counter())
    state = RoundState(n=1, candidates=[int(step.support[index])], draft_logps=[logq], entropies=[entropy])
    state.top1s.append(top1)
    policy.should_stop(state)
    mark(time.perf_counter())
    policy.score(step.hidden, state)
    mark(time.perf_counter())


def drafting_context(target, draft, ids: torch.Tensor, features: torch.Tensor):
    """The target's cache after ``ids`` (1, n) and a drafter started on them: (cache, its length, drafter, the
    drafter's cache length), each cache to be cropped back to its length after every timed pass."""
    cache = DynamicCache()
    target(input_ids=ids, **cache_kwargs(target, cache))
    drafter = draft.make_drafter(target)
    drafter.start(ids[0].tolist(), features[:-1])
    drafter.propose(None)
    return cache, cache.get_seq_length(), drafter, drafter.cache.get_seq_length()


def step_cost(target, draft, ids: torch.Tensor, features: torch.Tensor, repeats: int, policy) -> dict:
    """ms of a drafting step (the forward alone, and the whole step with the head) and of a one-token target pass,
    alternated as decoding alternates them; their ratios."""
    cache, context, drafter, base = drafting_context(target, draft, ids, features)
    token = torch.tensor([[123]])
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"draft": [], "step": [], "target": []}
    for _ in range(repeats + 5):
        for name in ("draft", "step"):  # each after a target pass, as in decoding
            began = time.perf_counter()
            target(input_ids=token, **cache_kwargs(target, cache), logits_to_keep=1)
            crop_cache(cache, context)
            times["target"].append(time.perf_counter() - began)
            began = time.perf_counter()
            drafter.propose(321) if name == "draft" else decoding_step(drafter, policy, generator)
            crop_cache(drafter.cache, base)
            times[name].append(time.perf_counter() - began)
    d, s, t = (1e3 * statistics.median(times[name][10 if name == "target" else 5 :]) for name in times)
    return {"draft_ms": d, "step_ms": s, "target_ms": t, "c": d / t, "c_step": s / t}


def comparison_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of a script comparing two ways of drafting with a bundle (this one's siblings): the bundle, the
    medians' ``--repeats``, the interleaved ``--rounds`` of :func:`step_cost`, :func:`decode_speed`'s settings and
    the JSON ``--output``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode_tokens", type=int, default=64)
    parser.add_argument("--decode_repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    return parser


def step_cost_summary(costs: list[dict]) -> str:
    """:func:`step_cost` results of interleaved rounds on one line."""
    forward = " / ".join(f"{c['draft_ms']:.3f}" for c in costs)
    ratios = " / ".join(f"{c['c']:.4f}" for c in costs)
    whole = " / ".join(f"{c['step_ms']:.3f} ms, c = {c['c_step']:.4f}" for c in costs)
    return f"draft forward {forward} ms (c = {ratios}); whole step with the head {whole}"


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
                policy = bundles[name].policy()
                result["cost"][name].append(step_cost(target, draft, ids[None], features, args.repeats, policy))
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
    if args.decode_repeats:
        result["decode_tok_s"] = decode_speed(bundles, prompts, args.decode_tokens, args.decode_repeats)
    for name in drafts:
        costs = result["cost"][name]
        steps = " / ".join(f"{c['draft_ms']:.2f}" for c in costs)
        ratios = " / ".join(f"{c['c']:.4f}" for c in costs)
        with_head = " / ".join(f"{c['step_ms']:.2f} ms, c = {c['c_step']:.4f}" for c in costs)
        print(
            f"{name}: draft forward {steps} ms, c = {ratios}; whole step with the head {with_head}; "
            f"step-1 acceptance {result['acceptance'][name]:.4f}"
        )
    print(f"TV(q_int8, q_bf16) {result['tv_int8_vs_bf16']:.4f} over {result['positions']} positions")
    finish(result, args.output)


def finish(result: dict, output: str | None) -> None:
    """Print the decoding speeds of ``result`` (if measured) and write it to ``output`` (if given)."""
    for mode, speeds in result.get("decode_tok_s", {}).items():
        print(mode, {name: round(v, 1) for name, v in speeds.items()})
    if output:
        write_json(output, result)


if __name__ == "__main__":
    main()
