"""Chains with rows copied from the text over the compiled target, after every pass width has compiled.

``python -m eval bench --target_runtime compiled`` times each method's first decodes while ``torch.compile`` still
builds a graph per pass width and per cache-length bucket (minutes each on 2 cores), so on prompts of several lengths
its tokens/s measure compilation. This script decodes every prompt once with every method untimed (compiling what
they need), then times ``--repeats`` passes, methods interleaved per prompt (the order alternating), and prints the
tokens/s of each over all timed decodes and the ratios: SpecDec++ at the bundle's h* without and with copied rows
(``context_row``), and autoregressive decoding, all on the compiled target, and the same three eager.

    python docs/experiments/compiled_copies.py --per_source 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from accept_head import SpecDecPP, autoregressive_generate
from accept_head.core.prompts import PromptOptions, PromptSource
from accept_head.core.records import machine_info


def test_prompts(bundle: SpecDecPP, config: str, per_source: int) -> list[list[int]]:
    """The first ``per_source`` prompts of each test source of a bench config (held out: they chose nothing)."""
    sources = []
    for raw in yaml.safe_load(Path(config).read_text())["prompts"]:
        sources.append(PromptSource(**{**raw, "limit": per_source}))
    encoded = PromptOptions(prompt_mode="chat", max_prompt_tokens=512).encode("test", sources, bundle.tokenizer, 0)
    return [list(p.ids) if hasattr(p, "ids") else list(p) for p in encoded.prompts]


def methods(bundle: SpecDecPP, new_tokens: int) -> dict:
    """Name → decode(prompt), greedy."""

    def specdec(runtime: str, copies: int):
        return lambda p: bundle.generate(
            p, max_new_tokens=new_tokens, temperature=0, context_row=copies, target_runtime=runtime
        )

    def target_alone(runtime: str):
        return lambda p: autoregressive_generate(bundle.target, p, new_tokens, temperature=0, target_runtime=runtime)

    out = {}
    for runtime in ("compiled", "eager"):
        out[f"autoregressive {runtime}"] = target_alone(runtime)
        out[f"SpecDec++ {runtime}"] = specdec(runtime, 0)
        out[f"SpecDec++ {runtime} + copies"] = specdec(runtime, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--config", default="configs/eval/bench-wide.yaml", help="a bench config: its test prompts")
    parser.add_argument("--per_source", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--output", default=None, help="a JSON file for the numbers")
    args = parser.parse_args()
    bundle = SpecDecPP.from_pretrained(args.bundle)
    prompts, decoders = test_prompts(bundle, args.config, args.per_source), methods(bundle, args.max_new_tokens)
    for prompt in prompts:  # untimed: every width and cache bucket compiles here
        for decode in decoders.values():
            decode(prompt)
    seconds, tokens = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = list(decoders.items())
            for name, decode in order[:: -1 if (repeat + i) % 2 else 1]:
                start = time.perf_counter()
                out = decode(prompt)
                seconds[name] += time.perf_counter() - start
                tokens[name] += out.sequences.shape[1] - len(prompt)
    speed = {name: tokens[name] / seconds[name] for name in decoders}
    for name, value in speed.items():
        print(f"{name:32s} {value:6.1f} tok/s")
    for runtime in ("compiled", "eager"):
        base, chain = speed[f"autoregressive {runtime}"], speed[f"SpecDec++ {runtime}"]
        copies = speed[f"SpecDec++ {runtime} + copies"]
        print(
            f"{runtime}: SpecDec++ {chain / base:.2f}x autoregressive, with copies {copies / base:.2f}x "
            f"({copies / chain:.2f}x SpecDec++ without)"
        )
    if args.output:
        record = {"machine": machine_info(), "args": vars(args), "prompts": len(prompts), "tokens_per_second": speed}
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
