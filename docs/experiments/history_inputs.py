"""Does the round history rank acceptance beyond the draft's own probability?

Acceptance comes in runs (boilerplate, repeated names, code), and after each verification the decoder knows how the
last round went: how many candidates the target accepted and min(1, p/q) of every candidate it verified. HF's
heuristic schedule lives on that signal alone. This script asks whether it adds to what the draft already knows, on
the held-out prompts of rollout label datasets: a logistic regression on standardised scalar inputs, fitted with the
soft labels min(1, p/q) on the training prompts of a bundle's ``split.json`` (a dataset sharing no prompt with them,
such as the greedy labels a bundle calibrates on: the data module's seeded 75/25 split of its own prompts), scored by
soft AUC (and the AUC against the decode's outcome, on the candidates the decode reached) on the rest.

    python docs/experiments/history_inputs.py --datasets '[data/labels/smollm2-feature-rollout,
        data/labels/smollm2-feature-rollout-greedy]' --split checkpoints/smollm2-135m-specdecpp/split.json

Inputs per candidate: the draft's log q(y), entropy and top-1 probability, the step in the round, the draft's
log-probability of the round's earlier candidates (the path); history: candidates accepted in the previous round,
mean min(1, p/q) over the previous round's candidates, and an exponential average (0.7) of the rounds' first-candidate
min(1, p/q) so far. Offline: nothing decodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from sklearn.linear_model import LogisticRegression

from accept_head.acceptance.metrics import binary_auc, soft_auc
from accept_head.training.data import prompt_split

NAMES = ["log q", "entropy", "top-1", "step", "path log q", "prev accepted", "prev mean a", "first-a average"]
SETS = {
    "log q": [0],
    "draft-side (log q, entropy, top-1, step, path)": [0, 1, 2, 3, 4],
    "log q + previous round's accepted count": [0, 5],
    "log q + previous round's mean min(1, p/q)": [0, 6],
    "log q + average first-candidate min(1, p/q)": [0, 7],
    "draft-side + history": [0, 1, 2, 3, 4, 5, 6, 7],
    "history only": [5, 6, 7],
}


def candidate_inputs(row: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(C, 8) inputs, (C,) min(1, p/q), (C,) accepted and (C,) judged (every earlier candidate of its round accepted:
    the decode reached it) for one prompt's rollout rounds, in order."""
    a = np.asarray(row["accept_prob"], dtype=np.float64)
    rounds, steps = np.asarray(row["round"]), np.asarray(row["step"])
    logq = np.asarray(row["draft_logp"], dtype=np.float64)
    accepted = np.asarray(row["accepted"], dtype=bool)
    inputs, judged = np.zeros((len(a), len(NAMES))), np.zeros(len(a), dtype=bool)
    average, previous_count, previous_mean = 0.5, 0.0, 0.5
    for r in range(int(rounds.max()) + 1 if len(a) else 0):
        here = np.flatnonzero(rounds == r)
        for i in here:
            earlier = here[steps[here] < steps[i]]
            path, judged[i] = logq[earlier].sum(), accepted[earlier].all()
            inputs[i] = [logq[i], row["draft_entropy"][i], row["draft_top1"][i], steps[i], path, previous_count,
                         previous_mean, average]  # fmt: skip
        previous_count, previous_mean = float(accepted[here].sum()), float(a[here].mean())
        average = 0.7 * average + 0.3 * float(a[here[np.argmin(steps[here])]])
    return inputs, a, accepted, judged


def load(dataset: str, train_ids: set[str]) -> tuple[dict[str, tuple[np.ndarray, ...]], str]:
    rows = load_from_disk(dataset).remove_columns(["hidden"])
    ids = sorted(set(rows["prompt_id"]))
    split = "split.json"
    if not train_ids & set(ids):
        train_ids, split = set(prompt_split(ids, 0.25, None, 0)["train"]), "seeded 75/25 (seed 0)"
    parts: dict[str, list] = {"train": [], "held_out": []}
    for row in rows:
        parts["train" if row["prompt_id"] in train_ids else "held_out"].append(candidate_inputs(row))
    return {k: tuple(np.concatenate(cols) for cols in zip(*v)) for k, v in parts.items()}, split


def score(data: dict, columns: list[int]) -> dict:
    x, a, _, _ = data["train"]
    mu, sd = x[:, columns].mean(0), x[:, columns].std(0) + 1e-9
    both = np.concatenate([(x[:, columns] - mu) / sd] * 2)
    model = LogisticRegression(max_iter=2000).fit(
        both, np.r_[np.ones(len(a)), np.zeros(len(a))], sample_weight=np.r_[a, 1 - a]
    )
    xh, ah, accepted, judged = data["held_out"]
    p = torch.tensor(model.predict_proba((xh[:, columns] - mu) / sd)[:, 1])
    return {
        "auc_soft": float(soft_auc(p, torch.tensor(ah))),
        "auc_accepted": float(binary_auc(p[judged], torch.tensor(accepted[judged], dtype=torch.float64))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", required=True, help="JSON list of rollout label datasets")
    parser.add_argument("--split", required=True, help="a bundle's split.json (train and greedy prompt ids)")
    parser.add_argument("--output", default=None, help="write the results here as JSON")
    args = parser.parse_args()
    split = json.loads(Path(args.split).read_text())
    results = {}
    for dataset in json.loads(args.datasets):
        data, how = load(dataset, set(split["train"]))
        results[dataset] = {
            "split": how,
            "candidates": {k: len(v[1]) for k, v in data.items()},
            "scores": {name: score(data, cols) for name, cols in SETS.items()},
        }
        print(f"\n{dataset} ({how}): {results[dataset]['candidates']}")
        print("| inputs | soft AUC | AUC accepted |\n|---|---:|---:|")
        for name, s in results[dataset]["scores"].items():
            print(f"| {name} | {s['auc_soft']:.4f} | {s['auc_accepted']:.4f} |")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
