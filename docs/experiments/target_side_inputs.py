"""Does the target's own uncertainty, or the draft's top-2 margin, rank acceptance beyond the draft's probability?

Issue 39 asks for a head input that ranks acceptance 0.03 AUC above the draft's own probability q(y). The draft-side
scalars (entropy, top-1, depth, path) and the round history add nothing beside log q (findings §9,
``history_inputs.py``); the hidden state adds ~0.025 at T = 1 and nothing greedily. Two inputs no head has read yet,
both known before a round drafts, from tensors the decoder holds:

- **the target's uncertainty at the last committed position**: the entropy and the top-1 probability of the
  target's distribution p from which the previous round's last token was taken (the verification row after the
  accepted prefix) — the target's own view of how predictable the text is right now, which q only estimates;
- **the draft's top-2 margin**: log q₁ − log q₂ of the distribution a candidate was drawn from (greedily a match is
  decided by whether the target's argmax is the draft's, which a near-tie at the top makes a coin flip).

Rollouts of the committed bundle (``rollout_labels`` with ``k_max`` candidates a round, the int8 draft, bf16) on
64 ``head``-split prompts (the split acceptance heads
train on; never the ``eval`` split), greedy and at T = 1; per candidate the label min(1, p/q) (greedy: a
match), whether the decode accepted it and the inputs above. A logistic regression on standardised inputs is fitted
with the soft labels on half of the prompts and scored on the other half, both ways (2-fold cross-fitting by prompt),
by soft AUC and by AUC against the decode's outcome on the candidates it reached; each set's gain over log q alone
comes with a 95% interval from resampling the prompts. Candidates of a prompt's first round (no earlier
verification row) are left out of every set.

    python docs/experiments/target_side_inputs.py --output docs/experiments/target_side_inputs.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

import accept_head.chain.rollout as rollout
from accept_head import SpecDecPP
from accept_head.acceptance.metrics import binary_auc, soft_auc
from accept_head.core.prompts import PromptSource, chat_prompt_ids, load_prompts
from accept_head.core.records import machine_info
from accept_head.core.sampling import SamplingConfig

NAMES = ["log q", "margin", "entropy", "step", "path log q", "target entropy", "target top-1"]
SETS = {
    "log q": [0],
    "log q + margin": [0, 1],
    "log q + target entropy": [0, 5],
    "log q + target top-1": [0, 6],
    "log q + target entropy, top-1": [0, 5, 6],
    "draft-side (log q, margin, entropy, step, path)": [0, 1, 2, 3, 4],
    "all seven": list(range(7)),
    "target side only": [5, 6],
}
SOURCES = [  # the `head` split (heads train on it); the scores are this script's own cross-fitted ones
    PromptSource(
        "../shared/data/alpaca_eval/alpaca_eval.jsonl", name="alpaca_eval", split="head", offset=120, limit=16
    ),
    PromptSource(
        "../shared/data/gsm8k/train.jsonl", field="question", name="gsm8k", split="head", offset=120, limit=16
    ),
    PromptSource("../shared/data/gpteacher/codegen-instruct.json", name="codegen", split="head", offset=120, limit=16),
    PromptSource(
        "../shared/data/gpteacher/toolformer-instruct.json", name="toolformer", split="head", offset=40, limit=8
    ),
    PromptSource("../shared/data/gpteacher/roleplay-instruct.json", name="roleplay", split="head", offset=30, limit=8),
]


class Recorder:
    """Wraps ``rollout._round_labels``: keeps, per labelled candidate, its margin and the target's entropy and top-1
    at the previous round's last committed position (NaN in a prompt's first round)."""

    def __init__(self, inner) -> None:
        self.inner, self.parts, self.previous = inner, [], (float("nan"), float("nan"))

    def reset(self) -> None:
        self.parts, self.previous = [], (float("nan"), float("nan"))

    def __call__(self, drafter, logits, candidate_ids, labelled, accepted, round_index, sampling):
        part = self.inner(drafter, logits, candidate_ids, labelled, accepted, round_index, sampling)
        log_q = torch.stack([s.logits for s in drafter.steps[:labelled]]).float().log_softmax(-1)
        top2 = log_q.topk(2, -1).values
        extra = {
            "margin": (top2[:, 0] - top2[:, 1]).cpu(),
            "target_entropy": torch.full((labelled,), self.previous[0]),
            "target_top1": torch.full((labelled,), self.previous[1]),
        }
        p = logits[accepted].float().softmax(-1)  # the row the round's last committed token was taken from
        self.previous = (float(torch.special.entr(p).sum()), float(p.max()))
        self.parts.append({**{k: part[k].cpu() for k in ("draft_logp", "draft_entropy", "step", "accept_prob",
                                                          "accepted")}, **extra})  # fmt: skip
        return part


def prompt_inputs(parts: list[dict]) -> tuple[np.ndarray, ...]:
    """(C, 7) inputs, (C,) min(1, p/q), (C,) accepted, (C,) judged for one prompt's rounds after its first."""
    rows = []
    for part in parts[1:]:
        logq, steps = part["draft_logp"].double().numpy(), part["step"].numpy()
        accepted = part["accepted"].numpy()
        for i in range(len(steps)):
            rows.append(
                (
                    [
                        logq[i],
                        float(part["margin"][i]),
                        float(part["draft_entropy"][i]),
                        steps[i],
                        logq[:i].sum(),
                        float(part["target_entropy"][i]),
                        float(part["target_top1"][i]),
                    ],  # fmt: skip
                    float(part["accept_prob"][i]),
                    bool(accepted[i]),
                    bool(accepted[:i].all()),
                )
            )
    if not rows:
        return np.zeros((0, 7)), np.zeros(0), np.zeros(0, bool), np.zeros(0, bool)
    x, a, acc, judged = zip(*rows)
    return np.asarray(x), np.asarray(a), np.asarray(acc), np.asarray(judged)


def cross_fitted(data: list[tuple], columns: list[int], folds: list[list[int]]) -> np.ndarray:
    """Per-prompt predicted probabilities, each prompt scored by the model fitted on the other fold."""
    out: list = [None] * len(data)
    for fold, other in ((folds[0], folds[1]), (folds[1], folds[0])):
        x = np.concatenate([data[i][0][:, columns] for i in other])
        a = np.concatenate([data[i][1] for i in other])
        mu, sd = x.mean(0), x.std(0) + 1e-9
        model = LogisticRegression(max_iter=2000).fit(
            np.concatenate([(x - mu) / sd] * 2), np.r_[np.ones(len(a)), np.zeros(len(a))], sample_weight=np.r_[a, 1 - a]
        )
        for i in fold:
            out[i] = model.predict_proba((data[i][0][:, columns] - mu) / sd)[:, 1] if len(data[i][1]) else np.zeros(0)
    return out


def aucs(data: list[tuple], scores: list[np.ndarray], chosen: list[int]) -> tuple[float, float]:
    p = torch.tensor(np.concatenate([scores[i] for i in chosen]))
    a = torch.tensor(np.concatenate([data[i][1] for i in chosen]))
    judged = torch.tensor(np.concatenate([data[i][3] for i in chosen]))
    accepted = torch.tensor(np.concatenate([data[i][2] for i in chosen]), dtype=torch.float64)
    return float(soft_auc(p, a)), float(binary_auc(p[judged], accepted[judged]))


def analyse(data: list[tuple], bootstrap: int, seed: int) -> dict:
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    folds = [order[::2], order[1::2]]
    scores = {name: cross_fitted(data, cols, folds) for name, cols in SETS.items()}
    everyone = list(range(len(data)))
    result = {name: dict(zip(("auc_soft", "auc_accepted"), aucs(data, s, everyone))) for name, s in scores.items()}
    rng = random.Random(seed + 1)
    draws = [[rng.randrange(len(data)) for _ in everyone] for _ in range(bootstrap)]
    base = [aucs(data, scores["log q"], d) for d in draws]
    for name, s in scores.items():
        gains = np.asarray([np.subtract(aucs(data, s, d), b) for d, b in zip(draws, base)])
        low, high = np.nanpercentile(gains, [2.5, 97.5], axis=0)
        result[name]["gain_soft_interval"] = [float(low[0]), float(high[0])]
        result[name]["gain_accepted_interval"] = [float(low[1]), float(high[1])]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--k_max", type=int, default=4)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only (a quick check)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    draft = bundle.draft.bind(bundle.target)
    prompts = load_prompts(SOURCES)[: args.limit]
    recorder = rollout._round_labels = Recorder(rollout._round_labels)
    result: dict = {"machine": machine_info(), "bundle": args.bundle, "prompts": len(prompts), "modes": {}}
    for temperature in (0.0, 1.0):
        began, data = time.perf_counter(), []
        for i, prompt in enumerate(prompts):
            recorder.reset()
            ids = chat_prompt_ids(bundle.tokenizer, prompt.text)
            with torch.inference_mode():
                rollout.rollout_labels(
                    bundle.target, draft, ids, args.max_new_tokens, args.k_max, SamplingConfig(temperature),
                    bundle.tokenizer.eos_token_id, torch.Generator().manual_seed(i),
                )  # fmt: skip
            data.append(prompt_inputs(recorder.parts))
        mode = "greedy" if temperature == 0 else "T=1"
        scores = analyse(data, args.bootstrap, seed=0)
        result["modes"][mode] = {
            "candidates": int(sum(len(d[1]) for d in data)),
            "seconds": time.perf_counter() - began,
            "scores": scores,
        }
        print(f"\n{mode}: {result['modes'][mode]['candidates']} candidates after each prompt's first round")
        print("| inputs | soft AUC | gain over log q [95%] | AUC accepted | gain [95%] |\n|---|---:|---|---:|---|")
        for name, s in scores.items():
            soft, acc = s["gain_soft_interval"], s["gain_accepted_interval"]
            print(
                f"| {name} | {s['auc_soft']:.4f} | {s['auc_soft'] - scores['log q']['auc_soft']:+.4f} "
                f"[{soft[0]:+.4f}, {soft[1]:+.4f}] | {s['auc_accepted']:.4f} | "
                f"{s['auc_accepted'] - scores['log q']['auc_accepted']:+.4f} [{acc[0]:+.4f}, {acc[1]:+.4f}] |"
            )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
