"""Would the draft propose better from a sharpened (or flattened) distribution? A proposal temperature at T = 1.

Speculative sampling stays exact for any proposal q' the verifier is told about: a candidate drawn from q' is
accepted with probability min(1, p/q'), and a round's first candidate with Σ_y min(p(y), q'(y)) in expectation. A
distilled draft spreads mass over tokens the target rarely writes, so q' = softmax(logits / τ) with τ < 1 might raise
that overlap. This script measures it on the committed bundle's own decoding contexts:

Chain decoding with FixedK(k) at T = 1, the draft drawing from q_τ for each τ of ``--decode_taus`` (the verifier
reading q_τ, so the output is still the target's), prints accepted candidates per round — counted, and expected
given the drafted candidates (free of the accept draws' noise) — and, at every verified candidate, Σ min(p, q_t) for
each t of ``--taus`` applied on top, per step of the round (step 1: exactly the first candidate's acceptance rate had
it been drawn from q_t; later steps follow contexts drafted at τ).

    python docs/experiments/draft_temperature.py --bundle checkpoints/smollm2-135m-specdecpp \
        --taus '[0.7,0.8,0.85,0.9,1.0,1.1]' --decode_taus '[1.0,0.85]' --repeats 3

Validation-like prompts: the `head` split past every prompt the bundle's labels (and so its sweep and calibration)
read (offset 100), never `eval`.
The script swaps the chain decoder's ``draw`` and ``verify`` for recording versions while it runs (an experiment, not
a feature: the toolkit's decoders draw from the target's own sampling transform).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import accept_head.chain.decoding as decoding
from accept_head.chain.policies import FixedK
from accept_head.core.prompts import PromptSource, chat_prompt_ids, load_prompts
from accept_head.core.records import machine_info
from accept_head.core.sampling import SamplingConfig
from accept_head.core.tables import text_table
from accept_head.specdecpp.bundle import SpecDecPP

DATA = Path("../shared/data")  # as in configs/: run from the repository root


def prompt_sources(per_source: int) -> list[PromptSource]:
    """``per_source`` prompts of each instruction source's `head` split, past the first 100 (the labels')."""
    common = {"split": "head", "offset": 100, "limit": per_source}
    return [
        PromptSource(str(DATA / "alpaca_eval/alpaca_eval.jsonl"), name="alpaca_eval", **common),
        PromptSource(str(DATA / "gsm8k/train.jsonl"), name="gsm8k", field="question", **common),
        PromptSource(str(DATA / "gpteacher/codegen-instruct.json"), name="codegen", **common),
    ]


def tempered(q: torch.Tensor, tau: float) -> torch.Tensor:
    """softmax(logits / τ) from q = softmax(logits): q^(1/τ), renormalised (zeros, a pruned vocabulary's, stay zero)."""
    sharpened = q.double().pow(1.0 / tau)
    return sharpened / sharpened.sum()


def decode_all(bundle: SpecDecPP, prompts: list, k: int, max_new_tokens: int, repeats: int) -> list:
    """FixedK(k) at T = 1 over every prompt, ``repeats`` seeds each; the decodes' stats."""
    out = []
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            ids = chat_prompt_ids(bundle.tokenizer, prompt.text)
            result = decoding.speculative_generate(
                bundle.target,
                bundle.draft,
                torch.tensor([ids]),
                FixedK(k),
                max_new_tokens,
                temperature=1.0,
                eos_token_id=bundle.eos_token_ids,
                generator=torch.Generator().manual_seed(1000 * repeat + index),
            )
            out.append(result.stats)
    return out


def decode_at(bundle: SpecDecPP, prompts: list, tau: float, taus: list[float], args: argparse.Namespace) -> dict:
    """Decode with the draft drawing from q_τ (the verifier reading q_τ). Returns accepted candidates per round
    (counted, and expected given the drafts: Σ_n Π_{j≤n} min(1, p_j(y_j)/q_j(y_j)), free of the accept draws'
    noise) and, per step of the round, the mean overlap Σ min(p, q_t) that drafting from q_t instead of q would
    have had for each t of ``taus`` (relative to the q drawn from: q_t = q^(1/t) renormalised)."""
    draw, verify = decoding.draw, decoding.verify
    steps: dict[int, list[list[float]]] = {}
    expected: list[float] = []

    def tempered_draw(logits, sampling, generator):
        if not sampling.greedy:
            sampling = SamplingConfig(sampling.temperature * tau, sampling.top_k, sampling.top_p)
        return draw(logits, sampling, generator)

    def recording_verify(p, q, candidates, generator):
        rows = torch.arange(q.shape[0])
        ratios = (p[rows, candidates].double() / q[rows, candidates].double()).clamp(max=1.0)
        expected.append(float(ratios.cumprod(0).sum()))
        for step in range(q.shape[0]):
            target = p[step].double()
            overlap = [float(torch.minimum(target, tempered(q[step], t)).sum()) for t in taus]
            steps.setdefault(step + 1, []).append(overlap)
        return verify(p, q, candidates, generator)

    decoding.draw, decoding.verify = tempered_draw, recording_verify
    try:
        stats = decode_all(bundle, prompts, args.k, args.max_new_tokens, args.repeats)
    finally:
        decoding.draw, decoding.verify = draw, verify
    accepted = [m for s in stats for m in s.accepted]
    return {
        "tau": tau,
        "rounds": len(accepted),
        "accepted_per_round": sum(accepted) / len(accepted),
        "expected_accepted_per_round": sum(expected) / len(expected),
        "overlap": {step: torch.tensor(values).mean(0).tolist() for step, values in sorted(steps.items())},
        "overlap_counts": {step: len(values) for step, values in sorted(steps.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--taus", type=json.loads, default=[0.7, 0.8, 0.85, 0.9, 1.0, 1.1])
    parser.add_argument("--decode_taus", type=json.loads, default=[1.0, 0.85, 0.75])
    parser.add_argument("--k", type=int, default=3, help="FixedK's K in both parts")
    parser.add_argument("--per_source", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="seeds per prompt in the decode part")
    parser.add_argument("--output", default=None, help="a JSON file for the numbers")
    args = parser.parse_args()
    torch.manual_seed(0)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    prompts = load_prompts(prompt_sources(args.per_source))
    start = time.time()
    decoded = [decode_at(bundle, prompts, tau, args.taus, args) for tau in args.decode_taus]
    for d in decoded:
        rows = [
            [f"step {step} ({d['overlap_counts'][step]})", *(f"{v:.4f}" for v in values)]
            for step, values in d["overlap"].items()
        ]
        header = ["Σ min(p, q_t)", *(f"t={t:g}" for t in args.taus)]
        print(text_table(header, rows, title=f"overlap in the rounds drafted from q_τ, τ = {d['tau']:g}"))
    rows = [
        [
            f"{d['tau']:g}",
            str(d["rounds"]),
            f"{d['accepted_per_round']:.4f}",
            f"{d['expected_accepted_per_round']:.4f}",
        ]
        for d in decoded
    ]
    header = ["τ", "rounds", "accepted/round", "expected given the drafts"]
    print(text_table(header, rows, title=f"FixedK({args.k}) drafting from q_τ"))
    print(f"{len(prompts)} prompts × {args.repeats} seeds, {time.time() - start:.0f} s")
    if args.output:
        payload = {"args": vars(args), "machine": machine_info(), "prompts": [p.id for p in prompts], "decode": decoded}
        Path(args.output).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
