"""Measuring the cost model on this machine: one draft step, target calls verifying K candidates, tree-masked calls
(:class:`~accept_head.core.costs.CostModel`, :class:`~accept_head.core.costs.TreeCost`)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..acceptance.inputs import draft_step_stats
from ..chain.decoding import _crop, _forward, prefill
from ..chain.policies import RoundState, round_inputs
from ..core.costs import CostModel, TreeCost, fit_linear
from ..core.hf_compat import cache_kwargs, crop_cache
from ..core.timing import device_timer
from ..models.drafters import as_drafter
from ..models.static_target import target_cache as runtime_cache
from ..trees.verify import tree_forward


def _timed_interleaved(fns: dict, repeats: int, warmup: int, device: Any = None) -> dict:
    """Wall-clock seconds of ``repeats`` calls of each function after ``warmup``, called round-robin so that machine
    noise is shared; each call is timed by :func:`~accept_head.core.timing.device_timer` on ``device`` (one device or
    several), so the kernels it launched count, not just their launches."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            with device_timer(device) as watch:
                fn()
            out[key].append(watch.seconds)
    return out


@torch.inference_mode()
def measure_costs(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    head: torch.nn.Module | None = None,
    ks: Sequence[int] = tuple(range(1, 21)),
    context: int = 128,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
    target_runtime: str = "eager",
) -> CostModel:
    """Measure t_draft (one cached draft step right after a target pass, plus the head when given), t_draft_next (the
    same right after another draft step: the rest of a round), t_target(K) for each K and the one-token pass
    (``t_single``, an autoregressive step) on this machine.

    Each timing is a median over ``repeats`` after ``warmup`` runs, on a cache holding ``context`` tokens that is
    cropped back after every call, as the decoder does with ``target_runtime`` (a compiled target compiles in the
    warm-up)."""
    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prefix = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    drafter = as_drafter(draft, target)
    target_cache = runtime_cache(target, target_runtime, context + max(ks) + 1)
    prefill(target, drafter, prefix, target_cache)
    last = {"step": drafter.propose(None)}
    token = int(prefix[0, -1])

    def draft_step():  # one candidate (the drafter's cache grows by one position per call: negligible here)
        last["step"] = drafter.propose(token)

    scorer = head.scalar_scorer() if head is not None and head.scores_in_floats else None

    def head_step():
        _score(head, last["step"], scorer)

    # A round's first step follows a target pass that evicted the draft's weights from the caches; the steps after it
    # in the same round follow another step (t_draft_next): time both, as decoding alternates them.
    steps: dict = {"draft": draft_step}
    if head is not None:
        steps["head"] = head_step  # right after the draft step whose hidden state it reads
    steps["draft_next"] = draft_step
    if head is not None:
        steps["head_next"] = head_step
    for k in dict.fromkeys(int(k) for k in ks):
        ids = torch.randint(0, vocab, (1, k + 1), generator=gen).to(device)

        def target_step(ids=ids):  # a verification pass: every position's logits
            _forward(target, ids, target_cache, last_only=False)
            _crop(target_cache, context - 1)

        steps[k] = target_step
    one = torch.randint(0, vocab, (1, 1), generator=gen).to(device)

    def single_step():  # a one-token pass: an autoregressive step
        _forward(target, one, target_cache, last_only=True)
        _crop(target_cache, context - 1)

    steps["single"] = single_step
    # Round-robin (draft, head, draft_next, head_next, K = 1..20, single, then again): a burst of load from elsewhere
    # on a shared machine hits every measurement alike instead of bending the line fitted through them.
    times = _timed_interleaved(steps, repeats, warmup, {device, getattr(drafter, "device", device)})
    parts = {name: times.pop(name, [0.0]) for name in ("draft", "head", "draft_next", "head_next", "single")}
    per_k = {k: _summary(k_times) for k, k_times in times.items()}
    measured: dict = {name: _summary(part) for name, part in parts.items()} | {"target": per_k}
    a, b, r2 = fit_linear(list(per_k), [summary["median"] for summary in per_k.values()])
    median = {name: statistics.median(part) for name, part in parts.items()}
    return CostModel(
        t_draft=median["draft"] + median["head"],
        t_draft_next=median["draft_next"] + median["head_next"],
        t_target_a=max(a, 1e-9),
        t_target_b=b,
        r2=r2,
        measured=measured,
        t_single=median["single"],
        t_head=median["head"] if head is not None else None,  # priced apart: rules that never call it skip it
        t_head_next=median["head_next"] if head is not None else None,
    )


def _score(head: torch.nn.Module, step, scorer=None) -> None:
    """The head's share of a drafting step, as decoding spends it (``chain.decoding.draft_round``): for a head that
    reads the draft's numbers, its inputs from the drawn step's q (over the draft's support), then one score — by
    ``scorer``, the head read out as floats, for a head that reads scalars only (as ``HeadThreshold`` scores)."""
    if getattr(head, "scalar_inputs", ()):
        logits = step.logits if step.support is None else step.support_logits
        q = logits.float().softmax(-1)
        logq, entropy, top1 = draft_step_stats(logits, q, int(q.argmax()), greedy=False, spread=head.reads_spread)
        state = RoundState(n=1, draft_logps=[logq], entropies=[entropy], top1s=[top1])
        inputs = round_inputs(state, head.scalar_inputs)
        scorer(inputs) if scorer is not None else head.accept_prob_one(step.hidden, inputs)
    else:
        head.accept_prob_one(step.hidden)


def _summary(times: Sequence[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


@torch.inference_mode()
def measure_tree_costs(
    target: torch.nn.Module,
    sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 80),
    context: int = 128,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
) -> TreeCost:
    """Time one tree-masked target call (:func:`~accept_head.trees.verify.tree_forward`, as the tree decoders make it)
    fed each of ``sizes`` tokens on a cache of ``context`` positions, cropped back after every call; medians over
    ``repeats`` after ``warmup``, sizes timed round-robin; a median below a smaller size's (noise) is raised to it."""
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1 or context < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need sizes >= 1, context >= 1, repeats >= 1 and warmup >= 0 "
            f"(got {sizes}, {context}, {repeats}, {warmup})."
        )
    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    cache = DynamicCache()
    target(input_ids=torch.randint(0, vocab, (1, context), generator=gen).to(device), **cache_kwargs(target, cache))
    steps = {}
    for size in sizes:
        tokens = torch.randint(0, vocab, (size,), generator=gen).tolist()
        parents = list(range(-1, size - 1))  # one chain: the mask, not the tree's shape, is what costs

        def call(tokens=tokens, parents=parents):
            tree_forward(target, cache, tokens, parents)
            crop_cache(cache, context)

        steps[size] = call
    times = _timed_interleaved(steps, repeats, warmup, device)
    medians = list(itertools.accumulate((statistics.median(times[size]) for size in sizes), max))  # never falls
    return TreeCost(sizes, medians)
