"""Every greedy chain stop rule on the same text and the same drafts, free of timing noise (issue 39).

    python docs/experiments/stop_rules_offline.py --output docs/experiments/stop_rules_offline.json

Greedy decoding is deterministic, so a stop rule's whole decode can be replayed offline. For each prompt the target's
greedy continuation is written once; then, from every position t of it, the bundle's draft drafts a chain of up to
10 candidates from the exact prefix (a fresh prefill, as a round starting at t sees it), recording each candidate's
draft probability (the untempered softmax), the entropy it came from, the head's calibrated score (one step late, as
decoding has it) and m_t, how many candidates the target's verification pass accepts. A rule then walks the text:
at t it submits K candidates (its own decisions on that chain), commits min(m_t, K) + 1 tokens and starts its next
round there — the decode it would have run, priced by the bundle's cost model (a round's first draft step apart from
the rest; the head's share only for rules that call it). Each rule's parameter is chosen on half of the prompts (even
positions) and reported on the other half, with the oracle that stops right at the first rejection beside them.

Prompts: 16 each of three ``head``-split sources, past every label set's offsets (they trained and chose nothing;
AlpacaEval's ``head`` split is used up by the label sets).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from accept_head.chain.baselines import ConfidenceThreshold, EntropyStop, PathConfidenceStop
from accept_head.chain.decoding import autoregressive_generate, speculative_generate
from accept_head.chain.policies import HeadThreshold, RoundState
from accept_head.core.costs import CostModel
from accept_head.core.prompts import PromptSource, load_prompts
from accept_head.core.records import machine_info, write_json
from accept_head.specdecpp.bundle import SpecDecPP

DATA = "../shared/data"
SOURCES = [
    PromptSource(f"{DATA}/gsm8k/train.jsonl", field="question", name="gsm8k", split="head", offset=400, limit=16),
    PromptSource(f"{DATA}/gpteacher/codegen-instruct.json", name="codegen", split="head", offset=500, limit=16),
    PromptSource(f"{DATA}/gpteacher/toolformer-instruct.json", name="toolformer", split="head", offset=300, limit=16),
]
K_MAX = 10
BETAS = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
"""Shifts of logit q toward the truth for :func:`informed` (0: q itself)."""
H_GRID = [0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98]


class RoundDone(Exception):
    """Raised after the first round: only the chain drafted from the prompt's end is wanted."""


class Recorder(HeadThreshold):
    """FixedK(K_MAX) that scores every candidate with the bundle's head and keeps its first round as drafted."""

    def __init__(self, base: HeadThreshold) -> None:
        super().__init__(base.head, 0.5, 1, K_MAX, calibration=base.calibration, unscored="confidence")
        self.rounds: list[dict] = []
        self.raw: list[float] = []

    def score(self, hidden: torch.Tensor, state: RoundState | None = None) -> float:
        """The calibrated score decoding uses; the head's raw probability kept beside it."""
        self.raw.append(self.head.accept_prob_one(hidden, self.head_inputs(state)))
        return float(self.calibration(self.raw[-1])) if self.calibration is not None else self.raw[-1]

    def should_stop(self, state: RoundState) -> bool:
        return state.n >= K_MAX

    def update(self, state: RoundState, accepted: int) -> None:
        q, entropy, score = list(state.token_probs), list(state.entropies), list(state.accept_probs)
        self.rounds.append({"q": q, "entropy": entropy, "score": score, "accepted": accepted})
        self.rounds[-1] |= {"candidates": list(state.candidates), "raw_score": list(self.raw)}
        raise RoundDone


def stop_after(rule, round_: dict) -> int:
    """How many candidates ``rule(n, round_)`` submits: it is asked after each candidate n = 1..K_MAX."""
    drafted = len(round_["q"])
    for n in range(1, drafted + 1):
        if n == drafted or rule(n, round_):
            return n
    return drafted


def specdec(h: float):
    """SpecDec++ with one unscored candidate: the head's scores of y_1..y_{n−1} times q_n(y_n)."""
    return lambda n, r: 1.0 - math.prod(r["score"][: n - 1]) * r["q"][n - 1] > h


def specdec_raw(h: float):
    """The same rule on the head's uncalibrated probabilities (the isotonic map is a step function)."""
    return lambda n, r: 1.0 - math.prod(r["raw_score"][: n - 1]) * r["q"][n - 1] > h


def by_policy(policy):
    """A training-free stop policy of the library asked about a recorded round after its candidate n."""
    return lambda n, r: policy.should_stop(RoundState(n=n, token_probs=r["q"][:n], entropies=r["entropy"][:n]))


def path_confidence(h: float):
    """The same product of the draft's own probabilities alone (EAGLE-2's path confidence: the head ablated)."""
    return by_policy(PathConfidenceStop(h, max_candidates=K_MAX))


def entropy_stop(lam: float, gamma: float = 0.2):
    return by_policy(EntropyStop(lam, gamma, max_candidates=K_MAX))


def confidence(tau: float):
    return by_policy(ConfidenceThreshold(tau, max_candidates=K_MAX))


def specdec_or_entropy(h: float, lam: float):
    a, b = specdec(h), entropy_stop(lam)
    return lambda n, r: a(n, r) or b(n, r)


def families() -> dict:
    """Rule family → {parameter label: (rule, reads the head)}."""
    hs = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98]
    lams = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    return {
        "FixedK": {f"K={k}": ((lambda k: lambda n, r: n >= k)(k), False) for k in range(1, K_MAX + 1)},
        "SpecDec++ (head, unscored=confidence)": {f"h={h}": (specdec(h), True) for h in hs},
        "SpecDec++ on the raw head": {f"h={h}": (specdec_raw(h), True) for h in hs},
        "path confidence (q only)": {f"h={h}": (path_confidence(h), False) for h in hs},
        # the same decisions priced as if the head were called: what the head's ranking adds, its cost aside
        "path confidence, priced with the head's call": {f"h={h}": (path_confidence(h), True) for h in hs},
        "EntropyStop (γ=0.2)": {f"λ={lam}": (entropy_stop(lam), False) for lam in lams},
        "ConfidenceThreshold (q)": {f"τ={t}": (confidence(t), False) for t in [0.05, 0.1, 0.2, 0.3, 0.4, 0.5]},
        "SpecDec++ or EntropyStop": {
            f"h={h}, λ={lam}": (specdec_or_entropy(h, lam), True) for h in [0.8, 0.9, 0.95] for lam in [0.2, 0.3, 0.4]
        },
    }


def informed(beta: float, h: float):
    """SpecDec++'s rule on a predictor that knows more than q: each candidate's score is sigmoid(logit q + beta) if
    the target accepts it and sigmoid(logit q − beta) if not (beta = 0: the draft's own q; large beta: the oracle)."""
    return lambda n, r: 1.0 - math.prod(informed_scores(r, beta)[:n]) > h


def informed_scores(r: dict, beta: float) -> list[float]:
    """The scores :func:`informed` reads for a recorded round (cached on the round per beta)."""
    cache = r.setdefault("_informed", {})
    if beta not in cache:
        logits = [math.log(q / (1 - q)) for q in (min(max(q, 1e-6), 1 - 1e-6) for q in r["q"])]
        shift = [beta if j < r["accepted"] else -beta for j in range(len(logits))]
        cache[beta] = [1.0 / (1.0 + math.exp(-(x + s))) for x, s in zip(logits, shift)]
    return cache[beta]


def judged_auc(chains: list[list[dict]], beta: float) -> float:
    """AUC of :func:`informed_scores` for ``accepted`` over the judged candidates (up to each round's first
    rejection), the way findings §9 scores predictors."""
    from sklearn.metrics import roc_auc_score

    labels, scores = [], []
    for text in chains:
        for r in text:
            judged = min(r["accepted"] + 1, len(r["q"]))
            labels += [j < r["accepted"] for j in range(judged)]
            scores += informed_scores(r, beta)[:judged]
    return float(roc_auc_score(labels, scores))


def walk(chains: list[list[dict]], choose, cost: CostModel) -> tuple[float, float, float]:
    """(tokens per second, candidates per round, tokens per round) of decoding every text with rounds of
    ``choose(chain)`` candidates: each round starts where the previous one's tokens end."""
    tokens = seconds = proposed = rounds = 0.0
    for text in chains:
        t = 0
        while t < len(text):
            chain = text[t]
            k = choose(chain)
            step = min(chain["accepted"], k) + 1
            tokens, seconds = tokens + step, seconds + cost.drafting(k) + cost.t_target(k)
            proposed, rounds, t = proposed + k, rounds + 1, t + step
    return tokens / seconds, proposed / rounds, tokens / rounds


def costs(bundle: SpecDecPP) -> dict[bool, CostModel]:
    """The bundle's cost model with the head (True) and without it (False): rules that read no head skip its call."""
    raw, parts = dict(bundle.cost_model), bundle.cost_model["measured"]
    with_head = CostModel.from_dict(raw)
    raw["t_draft"] -= parts["head"]["median"]
    raw["t_draft_next"] -= parts["head_next"]["median"]
    return {True: with_head, False: CostModel.from_dict(raw)}


def compare(chains: dict[str, list[list[dict]]], cost: dict[bool, CostModel]) -> dict:
    """Per family: the parameter that is fastest on the choosing half, and its speed on the reporting half."""
    out = {}
    for family, grid in families().items():
        scored = {}
        for label, (rule, head) in grid.items():
            scored[label] = walk(chains["choose"], lambda chain, rule=rule: stop_after(rule, chain), cost[head])[0]
        label = max(scored, key=scored.get)
        rule, head = grid[label]
        speed, proposed, tokens = walk(chains["report"], lambda chain: stop_after(rule, chain), cost[head])
        out[family] = {"chosen": label, "tokens_per_second": speed, "proposed": proposed, "tokens_per_round": tokens}
        out[family]["choosing_half"] = scored
    # Stops right at the first rejection (or at K_MAX): the most any rule could get from these drafts.
    speed, proposed, tokens = walk(chains["report"], lambda c: min(c["accepted"] + 1, len(c["q"])), cost[False])
    out["oracle (stop at the first rejection)"] = {"tokens_per_second": speed, "proposed": proposed}
    out["oracle (stop at the first rejection)"]["tokens_per_round"] = tokens
    out["autoregressive"] = {"tokens_per_second": 1.0 / cost[False].t_target(0)}
    return out


def informed_rows(chains: dict[str, list[list[dict]]], cost: CostModel, best_fixed: float) -> list[dict]:
    """SpecDec++ on predictors of rising AUC (:func:`informed`), h chosen on the choosing half, priced with the
    head's call: how much ranking the 1.10×-the-best-fixed-K goal needs on these drafts."""
    rows = []
    for beta in BETAS:
        scored = {h: walk(chains["choose"], lambda c, h=h: stop_after(informed(beta, h), c), cost)[0] for h in H_GRID}
        h = max(scored, key=scored.get)
        speed, proposed, tokens = walk(chains["report"], lambda c: stop_after(informed(beta, h), c), cost)
        auc, auc_q = judged_auc(chains["report"], beta), judged_auc(chains["report"], 0.0)
        rows.append({"beta": beta, "auc": auc, "auc_minus_q": auc - auc_q, "chosen_h": h, "tokens_per_second": speed})
        rows[-1] |= {"times_best_fixed_k": speed / best_fixed, "proposed": proposed, "tokens_per_round": tokens}
    return rows


def chains_of(bundle: SpecDecPP, ids: list[int], tokens: int) -> tuple[list[dict], int]:
    """The target's greedy continuation of ``ids`` and, from each of its positions, the draft's chain (a Recorder
    round); also how many chains disagree with the text (bf16: a K-token pass can break a near-tie differently)."""
    text = autoregressive_generate(bundle.target, torch.tensor([ids]), tokens, temperature=0.0).sequences[0].tolist()
    chains, disagree = [], 0
    for t in range(len(ids), len(text)):
        recorder = Recorder(bundle.policy(None, greedy=True))
        room = min(K_MAX + 1, len(text) - t + 1)  # never a chain past the text's end
        try:
            speculative_generate(bundle.target, bundle.draft, torch.tensor([text[:t]]), recorder, room, 0.0)
        except RoundDone:
            pass
        chain = recorder.rounds[0]
        m = chain["accepted"]
        disagree += chain["candidates"][:m] != text[t : t + m]
        chains.append(chain)
    return chains, disagree


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--output", default="eval_out/stop_rules_offline.json")
    ap.add_argument("--chains", default="eval_out/stop_rules_chains.json", help="drafts kept for a later run")
    args = ap.parse_args()
    bundle = SpecDecPP.from_pretrained(args.bundle)
    prompts = load_prompts(SOURCES)
    cost = costs(bundle)
    chains: dict[str, list[list[dict]]] = {"choose": [], "report": []}
    disagree = 0
    saved = Path(args.chains)
    if saved.is_file():  # the drafts of an earlier run with the same bundle, prompts and length
        chains, disagree = (stored := json.loads(saved.read_text()))["chains"], stored["disagree"]
    for i, prompt in enumerate(prompts if not saved.is_file() else []):
        text_chains, wrong = chains_of(bundle, bundle.encode(prompt.text), args.tokens)
        chains["choose" if i % 2 == 0 else "report"].append(text_chains)
        disagree += wrong
        print(f"{i + 1}/{len(prompts)} {prompt.id}", flush=True)
    write_json(saved, {"chains": chains, "disagree": disagree, "bundle": args.bundle, "tokens": args.tokens})
    results = compare(chains, cost)
    print(f"greedy, {len(prompts)} prompts x {args.tokens} tokens ({disagree} chains part from the text)")
    for family, row in results.items():
        extra = f"  {row['chosen']:>14}" if "chosen" in row else ""
        extra += f"  {row['proposed']:.2f} proposed" if "proposed" in row else ""
        print(f"  {family:40s} {row['tokens_per_second']:7.1f} tok/s{extra}")
    rows = informed_rows(chains, cost[True], results["FixedK"]["tokens_per_second"])
    print("SpecDec++ on a predictor shifted toward the truth (priced with the head's call), second half:")
    for row in rows:
        print(
            f"  beta {row['beta']:4.2f}  AUC {row['auc']:.3f} (q {row['auc_minus_q']:+.3f})  h {row['chosen_h']:.2f}"
            f"  {row['tokens_per_second']:6.1f} tok/s  {row['times_best_fixed_k']:.3f}x best K"
            f"  {row['proposed']:.2f} proposed"
        )
    results["informed predictors"] = rows
    settings = {"bundle": args.bundle, "tokens": args.tokens, "prompts": len(prompts), "k_max": K_MAX}
    settings |= {"chains_parting_from_the_text": disagree}
    write_json(args.output, {"machine": machine_info(), "settings": settings, "results": {"greedy": results}})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
