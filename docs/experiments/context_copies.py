"""What copying from the text would add to the draft's guesses, read from the rollout labels `make demo` writes.

The rollout labels (``python -m data_gen --config configs/data_gen/instructions-rollout.yaml``) hold, per prompt, the
target's response and every FixedK(4) round the bundle's draft ran on it: the drafted tokens, which were accepted
and the draft's numbers at each. Two questions, answered offline on those rounds (no model is run):

1. Rounds: how many tokens a round would accept from a row copied from the text itself
   (:class:`~accept_head.trees.context.ContextRow`, the continuation of the latest earlier occurrence of the last
   three, else two, tokens; ``--length`` tokens), against the draft's own four, and from the better of the two — a
   tree verifying both — and with a second copy below a chain the target accepted whole (copied after the text and
   the chain). Greedy labels only: there a token is accepted iff it is the target's argmax, which the
   response holds.
   And where a copy-aware stop rule could stop: at each accepted chain prefix a copy would follow, the tokens
   stopping would gain (the copy) against drafting on (the chain's later tokens and the copy below it).
2. Copy length (``--by_match true``): per round with a copy, the longest recurring suffix (2 to 12 tokens) it was
   found after, and the tokens a copy of 4, 8, 16 and 32 tokens from that suffix's latest earlier occurrence would
   have accepted — what ``LONG_MATCH`` and ``LONG_FACTOR`` of :mod:`accept_head.trees.context` were chosen from.
3. Ranking: does whether the candidate continues a recurring n-gram of the text rank acceptance beyond the draft's own
   log-probability? A logistic regression over log q alone against one that also reads copy features (for n = 1..4:
   the latest occurrence of the last n tokens was followed by the candidate / by another token; the share of
   occurrences followed by it), five folds grouped by prompt, AUC on the held-out folds.

    python docs/experiments/context_copies.py --labels data/labels/smollm2-feature-rollout-greedy
    python docs/experiments/context_copies.py --labels data/labels/smollm2-feature-rollout --rounds false
    python docs/experiments/context_copies.py --labels data/labels/smollm2-feature-rollout-greedy --by_match true
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold

from accept_head.trees.context import ContextRow


def round_starts(rounds: list[int], accepted: list[bool]) -> dict[int, int]:
    """Response index at which each round starts: a round commits its accepted candidates and the target's token."""
    starts, position = {}, 0
    for index in sorted(set(rounds)):
        starts[index] = position
        position += sum(a for r, a in zip(rounds, accepted) if r == index) + 1
    return starts


def copied_run(guess: list[int], response: list[int], start: int) -> int:
    """How many tokens of ``guess`` match ``response`` from ``start`` on."""
    n = 0
    while n < len(guess) and start + n < len(response) and guess[n] == response[start + n]:
        n += 1
    return n


def copy_rounds(labels: datasets.Dataset, length: int) -> dict[str, collections.Counter]:
    """Per source (and ``all``): rounds, tokens the draft's round accepted, tokens a copied row would have, the better
    of the two per round, and that with a second copy below a chain the target accepted whole (``leaf``); and the
    chain with only the copy below it, none at the root (``below_only``); and ``leaf`` plus a copy below every proper
    prefix of the chain where it differs from the chain's next token (``inner``; extra tokens fed: ``inner_fed``)."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for source, copy, text, response, start, path, drafted in labelled_rounds(labels, length):
        guess = copy(text)
        copied = copied_run(guess, response, start)
        below = 0
        if drafted == len(path):  # the whole chain accepted: what a copy after its path would add
            below = copied_run(copy(text, path=path), response, start + drafted)
        inner, inner_fed = max(drafted + below, copied), 0
        for j in range(1, len(path)):  # a copy after y_1..y_j, verified where it leaves the chain
            branch = copy(text, path=path[:j])
            if branch and branch[0] != path[j]:
                inner_fed += len(branch)
                if drafted >= j:
                    inner = max(inner, j + copied_run(branch, response, start + j))
        for key in (source, "all"):
            counts = out[key]
            counts["rounds"] += 1
            counts["draft"] += drafted
            counts["copy"] += copied
            counts["best"] += max(drafted, copied)
            counts["leaf"] += max(drafted + below, copied)
            counts["below_only"] += drafted + below
            counts["inner"] += inner
            counts["inner_fed"] += inner_fed
            counts["with_copy"] += bool(guess)
    return out


def labelled_rounds(labels: datasets.Dataset, length: int) -> Iterator[tuple]:
    """Every round of the labels in order, as (source, the prompt's ContextRow of ``length`` tokens, the text before
    the round, the response, the round's start in it, the drafted chain, how many of its candidates were accepted)."""
    for row in labels:
        response, starts = row["response_ids"], round_starts(row["round"], row["accepted"])
        copy = ContextRow(length)
        for index, start in starts.items():
            steps = [j for j, r in enumerate(row["round"]) if r == index]
            drafted = sum(row["accepted"][j] for j in steps)
            path, text = [row["draft_ids"][j] for j in steps], row["prompt_ids"] + response[:start]
            yield row["source"], copy, text, response, start, path, drafted


def copy_waits(labels: datasets.Dataset, length: int) -> collections.Counter:
    """At each point of a FixedK(4) round where the chain y_1..y_n (n < 4) was accepted and a copy would follow it —
    where a copy-aware rule (``FixedK(k, copy_k=n)``, ``HeadThreshold(copy_threshold=)``) could stop — the tokens the
    round gains after y_n by stopping (the copy below y_n) against drafting on to y_4 (the drafted tokens accepted
    after y_n, plus the copy below y_4 when all four were accepted), and whether y_{n+1} and the copy's first token
    were each right."""
    out: collections.Counter = collections.Counter()
    for _, copy, text, response, start, path, drafted in labelled_rounds(labels, length):
        for n in range(1, min(drafted, len(path) - 1) + 1):
            waiting = copy(text, path=path[:n])
            if not waiting:
                continue
            go_on = drafted - n
            if drafted == len(path):
                go_on += copied_run(copy(text, path=path), response, start + drafted)
            out["points"] += 1
            out["stop"] += copied_run(waiting, response, start + n)
            out["go_on"] += go_on
            out["steps_saved"] += len(path) - n
            out["next_drafted_right"] += drafted > n
            out["copy_first_right"] += start + n < len(response) and waiting[0] == response[start + n]
            out["agree"] += waiting[0] == path[n]
    return out


def runs_by_match(labels: datasets.Dataset, longest: int = 12, lengths=(4, 8, 16, 32)) -> dict[int, list[float]]:
    """Per length of the longest recurring suffix (2..``longest``) of the text before a round: [rounds, then the mean
    tokens a copy of each of ``lengths`` from that suffix's latest earlier occurrence would have accepted]."""
    runs: dict[int, list[int]] = collections.defaultdict(list)
    for _, _, text, response, start, _, _ in labelled_rounds(labels, 4):
        for q in range(longest, 1, -1):
            guess = ContextRow(max(lengths), shortest=q, longest=q)(text)
            if guess:
                runs[q].append(copied_run(guess, response, start))
                break
    return {q: [len(r), *(sum(min(n, cap) for n in r) / len(r) for cap in lengths)] for q, r in sorted(runs.items())}


def ngram_features(context: list[int], candidate: int) -> list[float]:
    """For n = 1..4: the latest earlier occurrence of the last n tokens was followed by ``candidate`` (1/0), by another
    token (1/0), and the share of all its earlier occurrences followed by ``candidate``."""
    features = []
    for n in (1, 2, 3, 4):
        suffix, latest, hits, total = context[-n:], 0, 0, 0
        for end in range(len(context) - 1, n - 1, -1):  # an occurrence ending before position ``end``
            if context[end - n : end] == suffix:
                total += 1
                hits += context[end] == candidate
                latest = latest or (1 if context[end] == candidate else -1)
        features += [float(latest == 1), float(latest == -1), hits / total if total else 0.0]
    return features


def ranking(labels: datasets.Dataset, greedy: bool, seed: int = 0) -> dict[str, float]:
    """Held-out AUC of log q alone and of log q with the copy features (five folds grouped by prompt)."""
    rng = np.random.default_rng(seed)
    rows, targets, groups = [], [], []
    for prompt, row in enumerate(labels):
        starts = round_starts(row["round"], row["accepted"])
        for j, (index, step) in enumerate(zip(row["round"], row["step"])):
            drafted = row["draft_ids"][j - step + 1 : j]  # the round's earlier candidates: the context it was drawn in
            context = row["prompt_ids"] + row["response_ids"][: starts[index]] + drafted
            rows.append([row["draft_logp"][j], *ngram_features(context, row["draft_ids"][j])])
            label = row["accept_prob"][j]  # greedy: 0/1; T = 1: min(1, p/q), drawn to a 0/1 outcome
            targets.append(label > 0.5 if greedy else label > rng.random())
            groups.append(prompt)
    x, y, g = np.array(rows), np.array(targets, dtype=int), np.array(groups)
    out = {"candidates": len(y), "accepted": float(y.mean())}
    for name, columns in (("logq", [0]), ("logq+copy", list(range(x.shape[1])))):
        scores = np.zeros(len(y))
        for train, test in GroupKFold(5).split(x, y, g):
            model = LogisticRegression(max_iter=3000).fit(x[train][:, columns], y[train])
            scores[test] = model.decision_function(x[test][:, columns])
        out[name] = float(roc_auc_score(y, scores))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", required=True, help="a rollout-label dataset folder (data_gen, label_mode rollout)")
    parser.add_argument("--length", type=int, default=4, help="tokens of the copied row")
    parser.add_argument("--rounds", type=lambda s: s.lower() == "true", default=True, help="part 1 (greedy labels)")
    parser.add_argument("--by_match", type=lambda s: s.lower() == "true", default=False, help="part 2 only")
    args = parser.parse_args()
    labels = datasets.load_from_disk(args.labels).remove_columns(["hidden"])
    meta = json.loads((Path(args.labels) / "meta.json").read_text())
    greedy = meta["config"]["temperature"] == 0
    print(f"{args.labels}: {len(labels)} prompts, {'greedy' if greedy else 'T = 1'}")
    if args.by_match:
        for q, (rounds, *accepted) in runs_by_match(labels).items():
            caps = ", ".join(f"{a:.2f}" for a in accepted)
            print(f"  longest recurring suffix {q:2d}: {rounds:4d} rounds; a copy of 4 / 8 / 16 / 32 accepts {caps}")
        return
    if args.rounds:
        for source, c in sorted(copy_rounds(labels, args.length).items()):
            keys = ("draft", "copy", "best", "leaf", "below_only", "inner", "inner_fed", "with_copy")
            per = {k: c[k] / c["rounds"] for k in keys}
            print(
                f"  {source:12s} {c['rounds']:5d} rounds; accepted a round: draft {per['draft']:.3f}, copy "
                f"{per['copy']:.3f}, better of both {per['best']:.3f}, with a copy below a whole chain "
                f"{per['leaf']:.3f} (the copy below it alone {per['below_only']:.3f}; with copies below every "
                f"prefix too {per['inner']:.3f}, for {per['inner_fed']:.2f} more tokens fed); rounds with a copy "
                f"{per['with_copy']:.2f}"
            )
    if args.rounds:
        w = copy_waits(labels, args.length)
        per = {k: w[k] / max(w["points"], 1) for k in w}
        print(
            f"  where a copy waits below an accepted chain prefix ({w['points']} points of FixedK(4) rounds): tokens "
            f"after it by stopping {per['stop']:.3f}, by drafting on {per['go_on']:.3f} ({per['steps_saved']:.2f} "
            f"draft steps more); next drafted token right {per['next_drafted_right']:.3f}, the copy's first "
            f"{per['copy_first_right']:.3f}, the two the same token {per['agree']:.3f}"
        )
    found = ranking(labels, greedy)
    print(
        f"  ranking over {found['candidates']} candidates ({found['accepted']:.3f} accepted): AUC log q "
        f"{found['logq']:.4f}, log q + copy features {found['logq+copy']:.4f}"
    )


if __name__ == "__main__":
    main()
