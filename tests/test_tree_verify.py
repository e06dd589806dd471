"""The exact output distribution of :func:`~accept_head.trees.verify.verify_sampled` (multi-candidate sample
verification, Fu et al. 2024 Alg. 4), computed by enumerating every branch of its randomness.

``verify_sampled`` draws two kinds of random numbers: a uniform u per candidate it tries (accept iff u is below a
threshold) and tokens from a distribution (the residual or the bonus position). The tests replace both sources by a
script and walk every branch: a token draw branches on every token of positive mass with that mass; a uniform
branches into "below the threshold" and "above it", whose probabilities are the threshold itself and its complement
— found by bisection on u, since the rest of the run is a deterministic function of which side u falls on. The
result is the exact distribution of the committed sequence (accepted tokens + the next token), to float64 rounding,
compared with the target's own distribution of that sequence: sample token by token from the target, go on while
the token extends a guessed row, stop after the first token that does not (or after the bonus token).

Two mutants must fail the same check: one that never removes a rejected candidate's mass from the residual (later
siblings are then accepted with p(c) instead of p(c) / (1 − Σ rejected), and the final draw can return a rejected
token), and one that only gets the siblings' acceptance wrong that way.
"""

from __future__ import annotations

import inspect
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence

import pytest
import torch

import accept_head.trees.verify as tree_verify
from accept_head.trees.verify import add_rows, verify_sampled

VOCAB = 5
TOLERANCE = 1e-9
"""Largest allowed |P_verify(sequence) − P_target(sequence)|: float64 rounding and the bisection's 2^-60."""

Prefix = tuple[int, ...]


class _NeedsChoice(Exception):
    """Raised by the script when the run asks for a random number the script does not hold yet."""

    def __init__(self, kind: str, payload: torch.Tensor | None) -> None:
        super().__init__(kind)
        self.kind, self.payload = kind, payload


class _Script:
    """The random numbers of one run: ``choices`` in call order (a float per uniform, a token id per token draw).

    Past the end of ``choices``, ``complete=False`` stops the run (:class:`_NeedsChoice`, saying what was asked
    for); ``complete=True`` goes on with a fixed default (u = 0.5; the first token of positive mass), so the run's
    output is a deterministic function of the choices.
    """

    def __init__(self, choices: Sequence[float | int], complete: bool) -> None:
        self.choices, self.complete, self.used = list(choices), complete, 0

    def _next(self, kind: str, payload: torch.Tensor | None, default: float | int) -> float | int:
        if self.used < len(self.choices):
            self.used += 1
            return self.choices[self.used - 1]
        if not self.complete:
            raise _NeedsChoice(kind, payload)
        return default

    def rand(self, *size, generator=None, dtype=None, device=None) -> torch.Tensor:
        assert size in ((1,), ((1,),)), size  # verify_sampled draws one uniform at a time
        return torch.tensor([float(self._next("uniform", None, 0.5))], dtype=torch.float64)

    def sample(self, probs: torch.Tensor, generator=None) -> torch.Tensor:
        assert probs.dim() == 2 and probs.shape[0] == 1, probs.shape
        weights = probs[0].double()
        first = int((weights > 0).nonzero()[0])
        return torch.tensor([int(self._next("token", weights, first))])

    def sample_one(self, probs: torch.Tensor, generator=None) -> int:
        return int(self.sample(probs[None], generator)[0])


class _ScriptedTorch:
    """``torch`` as the verifier's module sees it during a scripted run: ``rand`` comes from the script."""

    def __init__(self, script: _Script) -> None:
        self.rand = script.rand

    def __getattr__(self, name: str):
        return getattr(torch, name)


Verifier = Callable[..., tuple]


def run_scripted(
    verifier: Verifier, probs: torch.Tensor, rows, nodes, choices, complete: bool, monkeypatch: pytest.MonkeyPatch
):
    """One run of ``verifier`` on the script ``choices``: ('done', (row, m, next_token)) or ('needs', kind,
    payload) when it asked for a random number past the script (``complete=False``)."""
    script = _Script(choices, complete)
    with monkeypatch.context() as patch:
        patch.setattr(tree_verify, "torch", _ScriptedTorch(script))
        patch.setattr(tree_verify, "sample_one", script.sample_one)
        try:
            output = verifier(probs, rows, nodes, None)
        except _NeedsChoice as need:
            return ("needs", need.kind, need.payload)
    assert script.used == len(script.choices), "the run ignored part of its script"
    return ("done", tuple(int(x) for x in output))


def uniform_threshold(verifier: Verifier, probs, rows, nodes, choices, monkeypatch) -> float | None:
    """P(the next uniform falls on the side of u = 0): the point where the run's outcome (with the default
    continuation) switches, by bisection; None when both ends give the same outcome (the uniform decides nothing)."""

    def outcome(u: float):
        return run_scripted(verifier, probs, rows, nodes, [*choices, u], True, monkeypatch)

    low_side, high_side = outcome(0.0), outcome(1.0 - 2**-53)
    if low_side == high_side:
        return None
    lo, hi = 0.0, 1.0 - 2**-53
    for _ in range(60):
        mid = (lo + hi) / 2
        side = outcome(mid)
        assert side in (low_side, high_side), "a uniform with more than two outcomes is not an accept test"
        lo, hi = (mid, hi) if side == low_side else (lo, mid)
    return hi


def exact_output_distribution(
    verifier: Verifier, probs: torch.Tensor, rows, nodes, monkeypatch: pytest.MonkeyPatch
) -> dict[Prefix, float]:
    """P(committed sequence) for one call of ``verifier``: every branch of its randomness, weighted exactly.

    The committed sequence is ``rows[row][:m] + [next_token]``.
    """
    distribution: dict[Prefix, float] = defaultdict(float)
    pending: list[tuple[list[float | int], float]] = [([], 1.0)]
    while pending:
        choices, weight = pending.pop()
        result = run_scripted(verifier, probs, rows, nodes, choices, False, monkeypatch)
        if result[0] == "done":
            row, m, next_token = result[1]
            distribution[(*(rows[row][:m] if m else []), next_token)] += weight
        elif result[1] == "token":
            mass = result[2] / result[2].sum()
            pending += [([*choices, t], weight * float(mass[t])) for t in range(len(mass)) if mass[t] > 0]
        else:
            t = uniform_threshold(verifier, probs, rows, nodes, choices, monkeypatch)
            if t is None:
                pending.append(([*choices, 0.0], weight))
                continue
            pending += [([*choices, t / 2], weight * t), ([*choices, (1 + t) / 2], weight * (1 - t))]
    return dict(distribution)


def target_output_distribution(target: Callable[[Prefix], torch.Tensor], rows) -> dict[Prefix, float]:
    """P(committed sequence) when every token is drawn from the target: draw x ~ p(·|prefix); go on while
    prefix + x is a prefix of a guessed row that still has a token to offer, else stop after x."""
    distribution: dict[Prefix, float] = {}

    def walk(prefix: Prefix, weight: float) -> None:
        depth = len(prefix)
        live = [row for row in rows if tuple(row[:depth]) == prefix and len(row) > depth]
        p = target(prefix).double()
        p = p / p.sum()  # float32 tables sum to 1 only up to rounding; the verifier's thresholds renormalise too
        for x in range(VOCAB):
            if p[x] == 0:
                continue
            if any(row[depth] == x for row in live):
                walk((*prefix, x), weight * float(p[x]))
            else:
                distribution[(*prefix, x)] = distribution.get((*prefix, x), 0.0) + weight * float(p[x])

    walk((), 1.0)
    return distribution


def random_target(seed: int, zeros: dict[Prefix, list[int]] | None = None) -> Callable[[Prefix], torch.Tensor]:
    """p(·|prefix) (VOCAB,) float32: seeded random distributions, one per prefix (so rows that share a prefix see the
    same distribution, as a real model's would); ``zeros[prefix]`` lists tokens of probability 0 there."""
    cache: dict[Prefix, torch.Tensor] = {}

    def p(prefix: Prefix) -> torch.Tensor:
        if prefix not in cache:
            code = sum((token + 1) * (VOCAB + 1) ** i for i, token in enumerate(prefix))  # one seed per prefix
            generator = torch.Generator().manual_seed(seed * 100_000 + code)
            weights = torch.rand(VOCAB, generator=generator) ** 3  # uneven: some tokens hold most of the mass
            for token in (zeros or {}).get(prefix, []):
                weights[token] = 0.0
            cache[prefix] = weights / weights.sum()
        return cache[prefix]

    return p


def tree_probs(target: Callable[[Prefix], torch.Tensor], rows) -> tuple[torch.Tensor, list[list[int]]]:
    """The ``probs`` (N, V) and ``nodes`` a decoder hands ``verify_sampled`` for ``rows`` hanging off the root."""
    tokens, parents = [0], [-1]  # the root's own token does not matter here
    nodes = add_rows(tokens, parents, 0, rows)
    prefixes: list[Prefix] = [()]
    for row, row_nodes in zip(rows, nodes):
        prefixes += [tuple(row[: j + 1]) for j in range(len(row_nodes))]
    return torch.stack([target(prefix) for prefix in prefixes]), nodes


CASES = {
    "three siblings, depth 2": ([[0, 1], [2, 3], [4, 0]], None),
    "shared first token, siblings at depth 2": ([[1, 2], [1, 3], [0, 4]], None),
    "duplicates, a row inside another, lengths 1-3": ([[3], [3, 1, 2], [2, 4], [2, 4], [4, 4, 0]], None),
    "candidates of probability 0": ([[0, 1], [2, 3], [1, 2]], {(): [2], (0,): [1]}),
    "one certain candidate": ([[1, 0], [3, 2]], {(): [0, 2, 3, 4]}),
    "no rows: the bonus token only": ([], None),
}


MUTATIONS = {
    # A rejected candidate's mass stays everywhere: later siblings are tried against p, the final draw is from p.
    "keeps rejected mass": ("residual[token] = 0.0", "pass"),
    # Subtler: the final draw excludes the rejected candidates, but each later sibling is still accepted with
    # probability p(c) instead of p(c) / (1 − Σ rejected).
    "accepts siblings with p(c)": ("u * float(residual.sum())", "u * float(probs[node].double().sum())"),
}


def mutant(name: str) -> Verifier:
    """``verify_sampled`` with one source fragment replaced (:data:`MUTATIONS`), run in the module's namespace."""
    original, replacement = MUTATIONS[name]
    source = inspect.getsource(verify_sampled)
    assert source.count(original) == 1, f"verify_sampled no longer contains {original!r}: update this mutant"
    namespace: dict = {}
    code = compile(source.replace(original, replacement), "<mutant>", "exec")
    exec(code, tree_verify.__dict__, namespace)  # globals: the module's, so the scripted randomness applies
    return namespace["verify_sampled"]


def total_variation(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in a.keys() | b.keys())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_verification_is_exactly_the_target_distribution(case: str, seed: int, monkeypatch) -> None:
    rows, zeros = CASES[case]
    target = random_target(seed, zeros)
    probs, nodes = tree_probs(target, rows)
    ours = exact_output_distribution(verify_sampled, probs, rows, nodes, monkeypatch)
    expected = target_output_distribution(target, rows)
    assert sum(ours.values()) == pytest.approx(1.0, abs=TOLERANCE)
    assert ours.keys() <= expected.keys(), sorted(ours.keys() - expected.keys())  # nothing the target cannot write
    for sequence, probability in expected.items():
        assert abs(ours.get(sequence, 0.0) - probability) < TOLERANCE, (sequence, ours.get(sequence), probability)


MUTANT_CASES = [
    (case, mutation)
    for case, (rows, _) in CASES.items()
    for mutation in MUTATIONS
    # With a certain first candidate no sibling is ever tried after a rejection: the sibling mutant is exact there.
    if rows and not (case == "one certain candidate" and mutation == "accepts siblings with p(c)")
]


@pytest.mark.parametrize("case,mutation", MUTANT_CASES)
def test_mutants_of_the_rule_fail_the_exact_check(case: str, mutation: str, monkeypatch) -> None:
    """Negative controls: each mutant is off the target by a visible total variation (measured 0.25-0.42 keeping
    the rejected mass, 0.05-0.17 for the siblings' acceptance alone: the largest of three seeds per case)."""
    rows, zeros = CASES[case]
    broken = mutant(mutation)
    distances = []
    for seed in range(3):
        target = random_target(seed, zeros)
        probs, nodes = tree_probs(target, rows)
        expected = target_output_distribution(target, rows)
        distances.append(total_variation(exact_output_distribution(broken, probs, rows, nodes, monkeypatch), expected))
        # Through the same machinery the real verifier is exact: the check, not the enumeration, tells them apart.
        real = exact_output_distribution(verify_sampled, probs, rows, nodes, monkeypatch)
        assert total_variation(real, expected) < TOLERANCE
    assert max(distances) > 0.01, distances


def test_the_enumeration_sees_every_branch(monkeypatch) -> None:
    """The enumerator itself: with a single row [a] the verifier accepts a with probability p(a) exactly (then
    draws the bonus token), else draws from the residual p without a — checked against the closed form."""
    target = random_target(7)
    rows = [[2]]
    probs, nodes = tree_probs(target, rows)
    ours = exact_output_distribution(verify_sampled, probs, rows, nodes, monkeypatch)
    p0, p1 = (p / p.sum() for p in (target(()).double(), target((2,)).double()))
    for x, y in itertools.product(range(VOCAB), range(VOCAB)):
        assert ours.get((2, y), 0.0) == pytest.approx(float(p0[2] * p1[y]), abs=1e-12)
        if x != 2:
            assert ours.get((x,), 0.0) == pytest.approx(float(p0[x]), abs=1e-12)
    assert (2,) not in ours
