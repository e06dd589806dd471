"""How long should a row copied from the text be? The copying chain with fixed and match-dependent copy lengths.

``generate`` verifies, beside each chain, rows copied from the text (:class:`~accept_head.trees.context.ContextRow`,
``context_row`` tokens each). Offline on the greedy rollout labels of `head`-split prompts, a copy's accepted run grew
with the length of the recurring suffix it was found after (``docs/experiments/README.md``): this script decodes the
held-out test prompts of a bench config with SpecDec++ (the bundle's policy and h*) and copies of each setting of
``--variants`` (``base:4`` = 4 tokens always; ``long:4:16:5`` = 4 tokens, 16 after a recurring suffix of 5 or more;
``repeating:4:16:5`` = the same, but only while the previous round's root copy was accepted whole; ``padded:4`` = 4
tokens, but only into the positions a static or compiled target pads its pass to anyway, ``CopyingChain``'s
``padding_only``; ``plain`` = the chain alone, no copies, through the chain decoder),
variants interleaved per prompt in alternating order, EOS ignored (as ``eval bench``), and prints per mode the
tokens/s of each over all decodes, tokens a round, tokens fed a round, and its ratio to the first variant with a
95% paired bootstrap interval over the prompts (each repeat a prompt of its own).

    python docs/experiments/copy_length.py --output docs/experiments/copy-length-epyc.json
    python docs/experiments/copy_length.py --variants base:4,long:4:16:5 --temperatures 0 --per_source 2 \
        --target_runtime compiled --warm_all --repeats 2
    python docs/experiments/copy_length.py --config configs/eval/bench-clean.yaml --variants plain,base:4,padded:4 \
        --target_runtime compiled --warm_all --per_source 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from accept_head import SpecDecPP, speculative_generate
from accept_head.core.prompts import PromptOptions, PromptSource
from accept_head.core.records import machine_info
from accept_head.trees import chain_copies
from accept_head.trees.chain_copies import chain_copy_generate
from accept_head.trees.context import ContextRow


def test_prompts(bundle: SpecDecPP, config: str, per_source: int | None) -> list[tuple[str, list[int]]]:
    """(source, ids) of the test prompts of a bench config (held out: they chose nothing)."""
    sources = []
    for raw in yaml.safe_load(Path(config).read_text())["prompts"]:
        sources.append(PromptSource(**({**raw, "limit": per_source} if per_source else raw)))
    encoded = PromptOptions(prompt_mode="chat", max_prompt_tokens=512).encode("test", sources, bundle.tokenizer, 0)
    return [(p.source, list(p.ids)) for p in encoded.prompts]


class RepeatingRow(ContextRow):
    """A :class:`ContextRow` that copies ``long_length`` tokens after a long match only while the text is repeating
    itself: when the previous round's root copy was accepted whole (its ``length`` tokens, or all of a long one), read
    from the committed text of this call. Still a function of the committed text alone, so decoding stays exact."""

    def __init__(self, length: int, long_length: int, long_match: int) -> None:
        super().__init__(length, long_length=long_length, long_match=long_match)
        self.rule, self.previous, self.repeating = self.long, None, False

    def __call__(self, tokens, length=None, path=()):
        if path:
            return super().__call__(tokens, length, path)
        if self.previous is not None:  # the root copy of the round before: how much of it was committed
            start, row = self.previous
            run = next((i for i, t in enumerate(row) if start + i >= len(tokens) or tokens[start + i] != t), len(row))
            self.repeating = run >= min(len(row), self.length) and run > 0
        self.long = self.rule if self.repeating else None
        row = super().__call__(tokens, length, path)
        self.previous = (len(tokens), row) if row else None
        return row


def copy_rows(spec: str):
    """``base:<n>``, ``padded:<n>``, ``long:<n>:<long_length>:<long_match>`` or
    ``repeating:<n>:<long_length>:<long_match>`` (long copies only while the previous root copy was accepted whole:
    :class:`RepeatingRow`) → (n, a factory of rows)."""
    kind, *numbers = spec.split(":")
    values = [int(n) for n in numbers]
    if kind in ("base", "padded") and len(values) == 1:
        return values[0], lambda length, **_: ContextRow(length)
    if kind == "long" and len(values) == 3:
        return values[0], lambda length, **_: ContextRow(length, long_length=values[1], long_match=values[2])
    if kind == "repeating" and len(values) == 3:
        return values[0], lambda length, **_: RepeatingRow(length, values[1], values[2])
    raise ValueError(
        f"variant {spec!r}: expected plain, base:<n>, padded:<n>, long:<n>:<l>:<m> or repeating:<n>:<l>:<m>."
    )


def decode(
    bundle: SpecDecPP, spec: str, ids: list[int], temperature: float, new_tokens: int, seed: int, runtime: str = "eager"
) -> dict:
    """One decode of the copying chain with ``spec``'s rows over the ``runtime`` target; its time and round counts."""
    generator = torch.Generator().manual_seed(seed)
    if spec == "plain":
        start = time.perf_counter()
        result = speculative_generate(
            bundle.target, bundle.draft, ids, bundle.decoding_rule(False, None, temperature == 0, 0), new_tokens,
            temperature=temperature, eos_token_id=None, generator=generator, target_runtime=runtime,
        )  # fmt: skip
        seconds, stats = time.perf_counter() - start, result.stats
        fed = sum(stats.proposed) + stats.target_calls  # each pass: the last token and the candidates
        return {
            "tokens": result.sequences.shape[1] - len(ids),
            "seconds": seconds,
            "rounds": stats.target_calls,
            "fed": fed,
        }
    length, factory = copy_rows(spec)
    rule = bundle.decoding_rule(False, None, temperature == 0, length)
    original = chain_copies.ContextRow
    chain_copies.ContextRow = factory
    try:
        start = time.perf_counter()
        result = chain_copy_generate(
            bundle.target,
            bundle.draft,
            ids,
            rule.policy,
            new_tokens,
            context_row=length,
            temperature=temperature,
            eos_token_id=None,
            generator=generator,
            target_runtime=runtime,
            padding_only=spec.startswith("padded:"),
        )
        seconds = time.perf_counter() - start
    finally:
        chain_copies.ContextRow = original
    stats = result.stats
    return {
        "tokens": result.sequences.shape[1] - len(ids),
        "seconds": seconds,
        "rounds": stats.target_calls,
        "fed": sum(stats.fed),
    }


def paired_ratio(rates: np.ndarray, base: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of summed tokens/s-weighted rates (tokens over seconds pooled) and its 95% paired prompt bootstrap."""
    tokens, seconds = rates[:, 0], rates[:, 1]
    base_tokens, base_seconds = base[:, 0], base[:, 1]

    def ratio(index):
        return (tokens[index].sum() / seconds[index].sum()) / (base_tokens[index].sum() / base_seconds[index].sum())

    rng = np.random.default_rng(seed)
    n = len(tokens)
    samples = [ratio(rng.integers(0, n, n)) for _ in range(2000)]
    return float(ratio(np.arange(n))), float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--config", default="configs/eval/bench-wide.yaml", help="a bench config: its test prompts")
    parser.add_argument("--per_source", type=int, default=None, help="default: every test prompt of the config")
    parser.add_argument("--variants", default="base:4,long:4:16:5,long:4:16:3")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts (pooled)")
    parser.add_argument("--target_runtime", default="eager", help="eager, static or compiled")
    parser.add_argument(
        "--warm_all", action="store_true", help="decode every prompt with every variant once, untimed (compiled)"
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    bundle = SpecDecPP.from_pretrained(args.bundle)
    prompts = test_prompts(bundle, args.config, args.per_source)
    variants = args.variants.split(",")
    record = {"machine": machine_info(), "args": vars(args), "modes": {}}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for _, ids in prompts if args.warm_all else prompts[:1]:  # warm-up (compiled: every width and bucket), untimed
            for v in variants if args.warm_all else variants[:1]:
                decode(bundle, v, ids, temperature, args.max_new_tokens if args.warm_all else 8, 0, args.target_runtime)
        runs = {v: [] for v in variants}
        for i, (source, ids) in enumerate(prompts * args.repeats):
            order = variants if i % 2 == 0 else variants[::-1]
            for v in order:
                timed = decode(bundle, v, ids, temperature, args.max_new_tokens, i, args.target_runtime)
                runs[v].append({"source": source, **timed})
        base = np.array([[r["tokens"], r["seconds"]] for r in runs[variants[0]]])
        summary = {}
        for v in variants:
            rows = runs[v]
            arr = np.array([[r["tokens"], r["seconds"]] for r in rows])
            point, low, high = paired_ratio(arr, base)
            rounds = sum(r["rounds"] for r in rows)
            summary[v] = {
                "tok_s": float(arr[:, 0].sum() / arr[:, 1].sum()),
                "tokens_per_round": float(arr[:, 0].sum() / rounds),
                "fed_per_round": sum(r["fed"] for r in rows) / rounds,
                "ratio": [point, low, high],
            }
            print(
                f"T={temperature:g} {v:16s} {summary[v]['tok_s']:6.1f} tok/s  {summary[v]['tokens_per_round']:.2f} "
                f"tokens/round  fed {summary[v]['fed_per_round']:.1f}/round  x{point:.3f} [{low:.3f}-{high:.3f}]",
                flush=True,
            )
        record["modes"][str(temperature)] = {"summary": summary, "runs": runs}
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
