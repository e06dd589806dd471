"""``python -m eval``: the cost-model arithmetic against the paper's numbers, method specs and helpers, and every
subcommand end to end through the real CLI on a tiny bundle (tiny random Llama pair, offline)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from tiny_models import make_llama, make_tokenizer, perturbed_copy, save_bundle

from accept_head import Calibration
from accept_head.acceptance.labels import FORMAT, FORMAT_VERSION, label_features
from accept_head.chain.decoding import DecodeStats
from accept_head.core.costs import CostModel, fit_decode_costs, latency_per_token
from accept_head.core.prompts import EncodedPrompt, round_robin
from accept_head.engine.runner import MethodSpec, PolicyGrid, expand_grids, headroom_share, run_interleaved
from accept_head.evaluation.report import _h_star_spec, head_sources
from accept_head.evaluation.report_page import render_markdown
from eval.__main__ import main

# SpecDec++ §2 measured these on 2×A100 for Llama-2-chat 7B (draft) / 70B (target).
PAPER_T_DRAFT, PAPER_T_TARGET = 0.0234, 0.112

WORDS = "write a short poem about the number two . explain why python code is fun please give me one answer".split()


# ---- the cost model (eq. 2.1-2.3) with the paper's numbers --------------------------------------------------------


def test_latency_per_token_reproduces_a_hand_computation_with_the_papers_costs() -> None:
    # Verification rate 0.25, discard rate 0.5:
    # 0.0234 + 0.0234·0.5 + (0.112 − 0.0234)·0.25 = 0.0234 + 0.0117 + 0.02215 = 0.05725 s per token.
    assert latency_per_token(PAPER_T_DRAFT, PAPER_T_TARGET, 0.25, 0.5) == pytest.approx(0.05725)
    # One target call per token and no discards: t_draft + (t_target − t_draft)·1 = t_target per token.
    assert latency_per_token(PAPER_T_DRAFT, PAPER_T_TARGET, 1.0, 0.0) == pytest.approx(PAPER_T_TARGET)


def test_modeled_tokens_per_second_is_the_inverse_of_eq_2_3_with_the_papers_costs() -> None:
    """N = 100 tokens in 25 rounds of 5 candidates, 50 of them discarded: N_draft = N − N_target + N_discarded."""
    n, rounds, discarded = 100, 25, 50
    proposed = [(n - rounds + discarded) // rounds] * rounds
    assert proposed[0] == 5
    model = CostModel(t_draft=PAPER_T_DRAFT, t_target_a=PAPER_T_TARGET)
    modeled = model.modeled_tokens_per_second(n, sum(proposed), proposed)
    # Eq. 2.3 with verification rate 0.25 and discard rate 0.5 is the first test's 0.05725 s per token.
    assert modeled == pytest.approx(1.0 / latency_per_token(PAPER_T_DRAFT, PAPER_T_TARGET, rounds / n, discarded / n))
    # By hand (eq. 2.1): T = 0.0234·125 + 0.112·25 = 2.925 + 2.8 = 5.725 s for 100 tokens.
    assert modeled == pytest.approx(100 / 5.725)


def test_a_measured_one_token_pass_prices_k_zero_and_nothing_else() -> None:
    line = CostModel(t_draft=0.01, t_target_a=0.130, t_target_b=0.002)
    measured = CostModel(t_draft=0.01, t_target_a=0.130, t_target_b=0.002, t_single=0.100)
    assert line.t_target(0) == pytest.approx(0.130)  # without it: the intercept, as bundles saved before hold
    assert measured.t_target(0) == 0.100 and measured.t_target(1) == pytest.approx(0.132)
    # The target alone: one one-token pass per token.
    from accept_head.chain.decoding import DecodeStats
    from accept_head.engine.runner import aggregate

    alone = DecodeStats(generated=10, target_calls=10)
    assert aggregate("AR", [alone], measured).modeled_tokens_per_second == pytest.approx(10.0)
    assert aggregate("AR", [alone], line).modeled_tokens_per_second == pytest.approx(1 / 0.130)
    assert CostModel.from_dict(measured.to_dict()) == measured
    assert CostModel.from_dict({"t_draft": 0.01, "t_target_a": 0.13}).t_single is None
    with pytest.raises(ValueError, match="t_single=0"):
        CostModel(t_draft=0.01, t_target_a=0.13, t_single=0.0)


def test_a_rounds_later_draft_steps_are_priced_at_t_draft_next() -> None:
    """Each round's first draft step follows a target pass (t_draft), the rest another draft step (t_draft_next)."""
    from accept_head.engine.runner import aggregate

    cost = CostModel(t_draft=0.010, t_target_a=0.100, t_target_b=0.002, t_draft_next=0.004)
    # Rounds of 3, 1 and 2 candidates: three first steps, three later ones, three target calls.
    seconds = 3 * 0.010 + 3 * 0.004 + (0.106 + 0.102 + 0.104)
    assert cost.drafting(6, rounds=3) == pytest.approx(3 * 0.010 + 3 * 0.004)
    assert cost.modeled_tokens_per_second(9, 6, [3, 1, 2]) == pytest.approx(9 / seconds)
    stats = DecodeStats(generated=9, target_calls=3, draft_calls=6, proposed=[3, 1, 2])
    assert aggregate("FixedK", [stats], cost).modeled_tokens_per_second == pytest.approx(9 / seconds)
    # Without it (cost models saved before it was measured) every step costs t_draft, as eq. 2.1 prices them.
    old = CostModel(t_draft=0.010, t_target_a=0.100, t_target_b=0.002)
    assert old.t_step == 0.010 and old.drafting(6, rounds=3) == pytest.approx(0.060)
    assert CostModel.from_dict(cost.to_dict()) == cost and CostModel.from_dict(old.to_dict()).t_draft_next is None
    assert cost.drafting(0) == 0.0 and cost.drafting(1) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="t_draft_next=-0.001"):
        CostModel(t_draft=0.01, t_target_a=0.1, t_draft_next=-0.001)


def test_fit_decode_costs_recovers_per_round_and_per_candidate_costs() -> None:
    # Two prompt sets with different prefill overheads; 30 ms per target call, 4 ms per drafted candidate.
    runs = []
    for group, intercept in (("a", 0.5), ("b", 1.5)):
        for calls, candidates in ((100, 0), (80, 79), (60, 150), (70, 120), (90, 40)):
            runs.append((group, intercept + 0.030 * calls + 0.004 * candidates, calls, candidates))
    fit = fit_decode_costs(runs)
    assert fit.per_round == pytest.approx(0.030) and fit.per_candidate == pytest.approx(0.004)
    assert fit.r2 == pytest.approx(1.0) and fit.runs == 10
    with pytest.raises(ValueError, match="needs at least 4 runs"):
        fit_decode_costs(runs[:3])


def test_oracle_headroom_share() -> None:
    assert headroom_share(policy=12.0, best_fixed_k=10.0, oracle=18.0) == pytest.approx(0.25)
    assert headroom_share(policy=9.0, best_fixed_k=10.0, oracle=18.0) == pytest.approx(-0.125)
    assert headroom_share(policy=12.0, best_fixed_k=10.0, oracle=10.0) is None


# ---- method specs and helpers -------------------------------------------------------------------------------------


def test_policy_grids_expand_to_named_specs_without_duplicates() -> None:
    specs = expand_grids(
        [
            {"kind": "fixed_k", "grid": {"k": [2, 4]}},
            PolicyGrid("entropy", {"threshold": [0.3], "gamma": [0.2, 0.4]}),
            {"kind": "fixed_k", "grid": {"k": [4]}},
            {"kind": "oracle"},
        ]
    )
    assert [s.name for s in specs] == [
        "FixedK k=2",
        "FixedK k=4",
        "EntropyStop λ=0.3 gamma=0.2",
        "EntropyStop λ=0.3 gamma=0.4",
        "Oracle",
    ]
    assert MethodSpec("hf_assisted", {"num_assistant_tokens": 20, "confidence_threshold": 0.4}).name == (
        "HF constant K=20 conf=0.4"
    )


@pytest.mark.parametrize(
    ("grid", "match"), [({"kind": "beam"}, "is not one of"), ({"kind": "fixed_k", "grid": {"k": []}}, "non-empty")]
)
def test_bad_policy_grids_are_rejected_with_the_offending_value(grid: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        expand_grids([grid])


def test_h_star_is_added_once_and_variants_of_it_are_kept() -> None:
    class Bundle:
        def h_star(self, greedy: bool = False):
            return (0.4, "confidence") if greedy else (0.7, None)

    class FakePair:
        bundle = Bundle()

    specs = [
        MethodSpec("specdecpp", {"threshold": 0.7}),
        MethodSpec("specdecpp", {"threshold": 0.3}),
        MethodSpec("specdecpp", {"calibrated": False}),
        MethodSpec("specdecpp", {"min_candidates": 2}),
        MethodSpec("specdecpp", {"threshold": 0.7, "unscored": None}),  # the same as h*
        MethodSpec("specdecpp", {"threshold": 0.7, "unscored": "confidence"}),
    ]
    out = _h_star_spec(FakePair(), specs, greedy=False)
    assert [s.params for s in out] == [
        {"threshold": 0.3},
        {"calibrated": False},
        {"min_candidates": 2},
        {"threshold": 0.7, "unscored": "confidence"},
        {"threshold": 0.7, "unscored": None},
    ]
    assert out[3].name == "SpecDec++ h=0.7 unscored=confidence" and specs[4].name == "SpecDec++ h=0.7"
    assert out[-1].label == "SpecDec++ h*=0.7" and out[-1].role == "h_star"
    # Greedy decoding gets the bundle's greedy h*: every sampling-mode grid point stays.
    greedy = _h_star_spec(FakePair(), specs, greedy=True)
    assert [s.params for s in greedy[:-1]] == [s.params for s in specs]
    assert greedy[-1].params == {"threshold": 0.4, "unscored": "confidence"}
    assert greedy[-1].label == "SpecDec++ h*=0.4 unscored=confidence"
    # A bundle that copies rows from the text also decodes h* as generate does, and a grid point equal to it goes.
    FakePair.bundle.context_row = 4
    copying = [*specs, MethodSpec("specdecpp", {"threshold": 0.7, "context_row": 4})]
    out = _h_star_spec(FakePair(), copying, greedy=False)
    assert [s.params for s in out[:-2]] == [specs[i].params for i in (1, 2, 3, 5)]
    assert [s.role for s in out[-2:]] == ["h_star", "h_star_copies"]
    assert out[-1].params == {"threshold": 0.7, "unscored": None, "context_row": 4}
    assert out[-1].label == "SpecDec++ h*=0.7 context_row=4"


def test_round_robin_keeps_every_source_represented() -> None:
    prompts = [EncodedPrompt(f"a:{i}", "a", [i]) for i in range(5)] + [EncodedPrompt("b:0", "b", [9])]
    assert [p.id for p in round_robin(prompts)[:3]] == ["a:0", "b:0", "a:1"]


def test_head_sources_are_read_from_provenance_and_moved_to_the_eval_split() -> None:
    config = {"data": {"prompts": [{"path": "other.jsonl"}]}}
    meta = {"split_seed": 3, "sources": [{"path": "x.jsonl", "name": "x", "split": "head", "limit": 5, "rows": 4}]}
    (source,), split_seed = head_sources({"config": config, "data_meta": meta})
    assert (source.path, source.name, source.split, source.limit, split_seed) == ("x.jsonl", "x", "eval", None, 3)
    (fallback,), _ = head_sources({"config": config})
    assert fallback.path == "other.jsonl"
    with pytest.raises(ValueError, match="--in_distribution"):
        head_sources({})


def test_run_interleaved_decodes_a_b_c_per_prompt_with_shared_seeds() -> None:
    calls: list[tuple[str, int, int]] = []

    class Recorder:
        def decoder(self, spec):
            def decode(ids, generator):
                calls.append((spec.name, ids[0], generator.initial_seed()))
                return type("Result", (), {"stats": DecodeStats(generated=1, total_time=1.0)})()

            return decode

        def oracle(self, ids):  # pragma: no cover - no oracle spec here
            raise AssertionError

    specs = [MethodSpec("fixed_k", {"k": k}) for k in (1, 2, 3)]
    prompts = [EncodedPrompt(f"p:{i}", "p", [i]) for i in range(2)]
    runs = run_interleaved(Recorder(), specs, prompts, seed=0, repeats=2, warmup=1, progress=False)
    names = [c[0] for c in calls]
    assert names == ["FixedK k=1", "FixedK k=2", "FixedK k=3"] * 5  # 1 warm-up + 2 repeats × 2 prompts
    recorded = calls[3:]
    for i in range(0, len(recorded), 3):  # every method of one (repeat, prompt) gets the same seed and prompt
        assert len({(c[1], c[2]) for c in recorded[i : i + 3]}) == 1
    assert all(len(per_repeat) == 2 for runs_of in runs.values() for per_repeat in runs_of)


# ---- end to end on a tiny bundle -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny target, a perturbed copy as draft, a random depth-1 head bundled with a calibration map, prompt files
    and a data_gen-format label dataset."""
    import datasets

    root = tmp_path_factory.mktemp("eval")
    tokenizer = make_tokenizer()
    target = make_llama(root / "target", tokenizer=tokenizer, seed=0)
    draft = perturbed_copy(target, relative_noise=0.05, seed=1)
    draft.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    save_bundle(
        root / "bundle",
        target,
        draft,
        tokenizer,
        root / "target",
        root / "draft",
        calibration=Calibration(kind="temperature", temperature=1.5),
        provenance={"data": {"sources": [{"path": str(root / "id.jsonl"), "name": "id"}]}},
    )
    generator = torch.Generator().manual_seed(0)
    for name, count in (("id", 40), ("val", 6), ("ood", 6)):
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(count):
                picks = torch.randint(0, len(WORDS), (6,), generator=generator).tolist()
                f.write(json.dumps({"instruction": f"{name} {i} " + " ".join(WORDS[j] for j in picks)}) + "\n")
    rows = {name: [] for name in label_features()}
    for i in range(4):
        n = 6
        prompt = tokenizer.encode(f"write a poem {i}")
        response = torch.randint(7, len(tokenizer), (n,), generator=generator).tolist()
        rows["prompt_id"].append(f"tiny:{i}")
        rows["source"].append("tiny")
        rows["prompt_ids"].append(prompt)
        rows["response_ids"].append(response)
        rows["draft_ids"].append(torch.randint(7, len(tokenizer), (n,), generator=generator).tolist())
        for column in ("target_logp", "draft_logp"):
            rows[column].append((-torch.rand(n, generator=generator)).tolist())
        for column in ("accept_prob", "expected_accept", "draft_top1"):
            rows[column].append(torch.rand(n, generator=generator).tolist())
        rows["draft_entropy"].append((2 * torch.rand(n, generator=generator)).tolist())
    datasets.Dataset.from_dict(rows, features=label_features()).save_to_disk(str(root / "labels"))
    (root / "labels" / "meta.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))
    return {"root": root, "bundle": str(root / "bundle"), "labels": str(root / "labels")}


def write_config(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_oracle_method_decodes_greedily_and_counts_what_decoding_with_the_oracle_counts(tiny) -> None:
    """The method reports Lemma 2.1's counts (``Oracle.limit_stats``), not the decoding loop's; in float32 nothing
    drifts, so they must equal the counters of a plain decoding with the prompt's oracle, and its output must be the
    target's greedy output. The times are the real decoding's."""
    from accept_head import autoregressive_generate, speculative_generate
    from accept_head.chain.baselines import Oracle
    from accept_head.engine.pair_loading import load_pair
    from accept_head.engine.runner import Runner

    pair = load_pair(tiny["bundle"])
    runner = Runner(pair, max_new_tokens=12, temperature=0.0)
    ids = pair.tokenizer.encode("write a short poem about two")
    result = runner.decoder(MethodSpec("oracle"))(ids, torch.Generator().manual_seed(0))
    target, draft, eos = pair.target, pair.draft, pair.eos_token_id
    reference = autoregressive_generate(target, ids, 12, temperature=0.0, eos_token_id=eos)
    assert result.sequences.tolist() == reference.sequences.tolist()
    oracle = Oracle.from_models(target, draft, ids, 12, eos_token_id=eos)
    counted = speculative_generate(target, draft, ids, oracle, 12, temperature=0.0, eos_token_id=eos).stats
    assert counted.target_calls == len(oracle.mismatches) + 1 > 1  # Lemma 2.1, on a pair that disagrees somewhere
    for name in ("generated", "target_calls", "draft_calls", "discarded", "proposed", "accepted"):
        assert getattr(result.stats, name) == getattr(counted, name), name
    assert result.stats.total_time > 0 and result.stats.target_time > 0


def test_rules_that_never_call_the_head_are_priced_without_its_measured_share() -> None:
    from accept_head.engine.runner import MethodSpec, summarize

    cost = CostModel(
        t_draft=0.010, t_target_a=0.100, t_target_b=0.002, t_draft_next=0.004, t_head=0.003, t_head_next=0.001
    )
    headless = cost.without_head()
    assert (headless.t_draft, headless.t_draft_next) == pytest.approx((0.007, 0.003))
    assert headless.t_target(2) == cost.t_target(2) and headless.without_head() == headless
    # Rounds of 3, 1 and 2 candidates (three first steps, three later ones): a rule without the head saves its calls.
    stats = DecodeStats(generated=9, target_calls=3, draft_calls=6, proposed=[3, 1, 2])
    verify = 0.106 + 0.102 + 0.104
    specs = [MethodSpec(kind, params) for kind, params in [("specdecpp", {"threshold": 0.5}), ("fixed_k", {"k": 3})]]
    runs = {spec.name: [[stats]] for spec in specs}
    head, fixed = (m.pooled.modeled_tokens_per_second for m in summarize(specs, runs, cost))
    assert head == pytest.approx(9 / (3 * 0.010 + 3 * 0.004 + verify))
    assert fixed == pytest.approx(9 / (3 * 0.007 + 3 * 0.003 + verify))
    # A cost model that never split the head off (older bundles) prices every rule with it, as before.
    old = CostModel(t_draft=0.010, t_target_a=0.100, t_target_b=0.002, t_draft_next=0.004)
    assert old.without_head() is old and CostModel.from_dict(cost.to_dict()) == cost
    with pytest.raises(ValueError, match="t_head=0.02 must lie in"):
        CostModel(t_draft=0.01, t_target_a=0.1, t_head=0.02)


def _prompt_runs(seconds: list[float], tokens: int = 10) -> list[DecodeStats]:
    """One decode per prompt, ``tokens`` long, taking ``seconds[i]`` on prompt i (rounds of one accepted token)."""
    return [
        DecodeStats(generated=tokens, target_calls=tokens // 2, total_time=t, proposed=[1] * (tokens // 2))
        for t in seconds
    ]


def test_ratio_intervals_resample_prompts_in_pairs() -> None:
    from accept_head.engine.runner import MethodSpec, summarize
    from accept_head.evaluation.common import paired_ratio_interval, ratios

    cost = CostModel(t_draft=0.01, t_target_a=0.1)
    base_seconds = [1.0, 2.0, 0.5, 1.5, 1.0, 3.0]
    specs = [MethodSpec("fixed_k", {"k": 1}), MethodSpec("specdecpp", {"threshold": 0.5})]

    def summaries(other: list[float], repeats: int = 1) -> tuple:
        runs = {specs[0].name: [_prompt_runs(base_seconds)] * repeats, specs[1].name: [_prompt_runs(other)] * repeats}
        return tuple(summarize(specs, runs, cost))

    # 10% faster on every prompt, however hard: every resample reads 1.1x, so the interval is a point.
    base, faster = summaries([t / 1.1 for t in base_seconds])
    assert paired_ratio_interval(faster, base, modeled=False) == pytest.approx([1.1, 1.1])
    # The same counts price the same under the cost model (a point at 1.0), and a method against itself is 1.0.
    assert paired_ratio_interval(faster, base, modeled=True) == pytest.approx([1.0, 1.0])
    assert ratios(base, None, base)["ratio_to_best_fixed_k_ci95"] == pytest.approx([1.0, 1.0])
    assert ratios(base, None, base)["ratio_to_autoregressive_ci95"] is None
    # Twice as fast on one prompt of six, the same elsewhere: the pooled ratio lies inside the interval, whose low end
    # is 1.0 (a third of the resamples leave that prompt out).
    _, lucky = summaries([base_seconds[0] / 2, *base_seconds[1:]])
    low, high = paired_ratio_interval(lucky, base, modeled=False)
    pooled = sum(base_seconds) / (sum(base_seconds) - base_seconds[0] / 2)
    assert low == pytest.approx(1.0) and low < pooled < high < 2.0
    # Pooled over repeats per prompt, in prompt order; one prompt gives no interval.
    base, faster = summaries([t / 1.1 for t in base_seconds], repeats=3)
    assert [r.generated for r in base.per_prompt] == [30] * 6
    assert base.to_dict()["per_prompt_tokens_per_second"] == pytest.approx([10 / t for t in base_seconds])
    one = summarize(specs[:1], {specs[0].name: [_prompt_runs([1.0])]}, cost)[0]
    assert paired_ratio_interval(one, one, modeled=False) is None


def test_the_head_tree_is_compared_with_the_chain_and_each_other_tree_in_pairs() -> None:
    from accept_head.engine.runner import MethodSpec, summarize
    from accept_head.evaluation.bench import head_tree_ratios

    cost = CostModel(t_draft=0.01, t_target_a=0.1)
    chain_seconds = [1.0, 2.0, 0.5, 1.5]
    specs = [
        MethodSpec("fixed_k", {"k": 2}),
        MethodSpec("specdecpp", {"threshold": 0.5}, role="h_star"),
        MethodSpec("head_tree", {}),
        MethodSpec("cost_tree", {}),
    ]
    seconds = [chain_seconds, chain_seconds, [t / 1.2 for t in chain_seconds], [t / 1.5 for t in chain_seconds]]
    runs = {spec.name: [_prompt_runs(times)] for spec, times in zip(specs, seconds)}
    found = head_tree_ratios(summarize(specs, runs, cost))
    # Only the rivals that ran, each by name: 1.2x the chain on every prompt, 1.2 / 1.5 the cost tree.
    assert list(found) == ["specdecpp", "cost_tree"] and found["specdecpp"]["name"] == specs[1].name
    assert found["specdecpp"]["ratio"] == pytest.approx(1.2)
    assert found["specdecpp"]["ratio_ci95"] == pytest.approx([1.2, 1.2])
    assert found["cost_tree"]["ratio_ci95"] == pytest.approx([0.8, 0.8])
    assert found["cost_tree"]["modeled_ratio"] == pytest.approx(1.0)  # the same counts, the same price
    assert head_tree_ratios(summarize(specs[:2], {k: runs[k] for k in list(runs)[:2]}, cost)) == {}


def test_trees_with_a_copied_row_are_chosen_and_compared_apart() -> None:
    from accept_head.engine.runner import MethodSpec, choose_settings, summarize
    from accept_head.evaluation.bench import context_row_ratios, head_tree_ratios

    cost = CostModel(t_draft=0.01, t_target_a=0.1)
    base = [1.0, 2.0, 0.5]
    specs = [
        MethodSpec("specdecpp", {"threshold": 0.5}, role="h_star"),
        MethodSpec("head_tree", {"threshold": 0.5}),
        MethodSpec("head_tree", {"threshold": 0.5, "context_row": 4}),
        MethodSpec("head_tree", {"threshold": 0.7, "context_row": 4}),
    ]
    seconds = [base, [t / 1.1 for t in base], [t / 1.3 for t in base], [t / 1.2 for t in base]]
    summaries = summarize(specs, {s.name: [_prompt_runs(t)] for s, t in zip(specs, seconds)}, cost)
    # The best head tree without a copied row and the best with one are both reported.
    assert choose_settings(summaries, "measured") == [specs[0], specs[1], specs[2]]
    # The head tree's rivals are met without copies; the copy's gain is its own ratio, over the same kind without.
    assert head_tree_ratios(summaries)["specdecpp"]["ratio"] == pytest.approx(1.1)
    found = context_row_ratios(summaries)
    assert list(found) == ["head_tree"] and found["head_tree"]["without"] == specs[1].name
    assert found["head_tree"]["name"] == specs[2].name and found["head_tree"]["ratio"] == pytest.approx(1.3 / 1.1)
    assert context_row_ratios(summaries[:2]) == {}


def test_chains_with_copied_rows_are_chosen_and_compared_apart() -> None:
    """``chain_context_row``: FixedK and SpecDec++ again with copies, their K chosen among the copying chains only;
    the plain best K stays the one every ratio is against, and the copies' gain is paired with its plain twin."""
    from types import SimpleNamespace

    from accept_head.engine.runner import MethodSpec, summarize
    from accept_head.evaluation.bench import (
        _with_ratios,
        best_copied_chains,
        context_row_ratios,
        copied_chain_methods,
        copied_chains,
    )

    cost = CostModel(t_draft=0.01, t_target_a=0.1)
    plain = [MethodSpec("fixed_k", {"k": 2}), MethodSpec("fixed_k", {"k": 4}), MethodSpec("specdecpp", {"h": 1})]
    plain.append(MethodSpec("fixed_k", {"k": 2, "draft": "standalone"}))
    copying = copied_chains(plain, 4)
    assert [s.params for s in copying] == [
        {"k": 2, "context_row": 4},
        {"k": 4, "context_row": 4},
        {"h": 1, "context_row": 4},
    ]  # never a comparison draft's
    assert copied_chains(plain, 0) == []
    base = [1.0, 2.0, 0.5]
    specs = [MethodSpec("autoregressive"), plain[0], plain[1], copying[0], copying[1]]
    seconds = [[t * 2 for t in base], [t / 1.1 for t in base], base, [t / 1.2 for t in base], [t / 1.5 for t in base]]
    summaries = summarize(specs, {s.name: [_prompt_runs(t)] for s, t in zip(specs, seconds)}, cost)
    assert best_copied_chains(summaries, "measured", searched_h=False) == {"context_row": 4, "best_k": 4}
    # The K validation chose for plain chains (4) is what ratios are against, never its copying twin of the same K.
    methods = _with_ratios(summaries, best_k=4)
    assert methods[4]["ratio_to_best_fixed_k"] == pytest.approx(1.5) and methods[2]["ratio_to_best_fixed_k"] == 1.0
    found = context_row_ratios([summaries[2], summaries[4]])
    assert found["fixed_k"]["ratio"] == pytest.approx(1.5) and found["fixed_k"]["without"] == specs[2].name
    bundle = SimpleNamespace(h_star=lambda greedy: (0.8, None))
    chosen = copied_chain_methods(
        SimpleNamespace(pair=SimpleNamespace(bundle=bundle)),
        0.0,
        {"chain_context_row": {"context_row": 4, "best_k": 3}},
    )
    assert [(s.kind, s.params) for s in chosen] == [
        ("fixed_k", {"k": 3, "context_row": 4}),
        ("specdecpp", {"threshold": 0.8, "unscored": None, "context_row": 4}),
    ]
    assert all(s.copies and s.role is None for s in chosen)
    assert copied_chain_methods(SimpleNamespace(pair=SimpleNamespace(bundle=bundle)), 0.0, {}) == []


def test_head_tree_settings_take_the_bundles_tree_settings_unless_they_say_otherwise() -> None:
    from types import SimpleNamespace

    from accept_head.engine.runner import MethodSpec
    from accept_head.evaluation.bench import with_bundle_tree_settings

    specs = [MethodSpec("head_tree", {"threshold": None}), MethodSpec("head_tree", {"context_row": 0})]
    specs.append(MethodSpec("cost_tree", {}))
    done = with_bundle_tree_settings(specs, SimpleNamespace(tree={"context_row": 4, "width": 2}))
    assert [s.params for s in done] == [
        {"context_row": 4, "width": 2, "threshold": None},
        {"context_row": 0, "width": 2},
        {},  # only the head tree is the bundle's
    ]
    assert done[0].name != done[1].name and with_bundle_tree_settings(specs, SimpleNamespace(tree=None)) == specs


def test_costs_command_writes_json_and_plot(tiny, tmp_path) -> None:
    out = tmp_path / "costs"
    payload = main(
        [
            "costs",
            "--bundle",
            tiny["bundle"],
            "--ks",
            "[1, 2, 4]",
            "--repeats",
            "3",
            "--warmup",
            "1",
            "--context",
            "16",
            "--output_dir",
            str(out),
        ]
    )
    stored = json.loads((out / "costs.json").read_text())
    assert (out / "costs.png").stat().st_size > 0
    assert stored["cost_model"]["t_draft"] > 0 and stored["cost_model"]["t_target_a"] > 0
    assert sorted(stored["cost_model"]["measured"]["target"]) == ["1", "2", "4"]
    assert payload["settings"]["ks"] == [1, 2, 4]
    # The one-token pass is measured, not read off the line: it prices the autoregressive step.
    single = stored["cost_model"]["measured"]["single"]
    assert single["n"] == 3 and stored["cost_model"]["t_single"] == single["median"] > 0
    cost = CostModel.from_dict(stored)
    assert cost.t_target(0) == single["median"]
    # A round's mean draft step against the one-token pass: the first step at t_draft, the rest at t_draft_next.
    for k in (1, 4):
        mean_step = (cost.t_draft + (k - 1) * cost.t_step) / k
        assert stored["round_draft_step_over_t_single"][str(k)] == pytest.approx(mean_step / single["median"])


def test_costs_command_times_a_fresh_head_of_a_given_depth_without_a_bundle(tiny, tmp_path) -> None:
    root = tiny["root"]
    pair = ["--target.path", str(root / "target"), "--draft.path", str(root / "draft"), "--dtype", "float32"]
    timing = ["--ks", "[1]", "--repeats", "2", "--warmup", "0", "--context", "8"]
    with_head = main(["costs", *pair, *timing, "--head_depth", "2", "--output_dir", str(tmp_path / "head")])
    measured = with_head["cost_model"]["measured"]
    assert measured["head"]["median"] > 0
    assert with_head["head_over_draft_step"] == measured["head"]["median"] / measured["draft"]["median"]
    without = main(["costs", *pair, *timing, "--output_dir", str(tmp_path / "none")])
    assert without["cost_model"]["measured"]["head"]["median"] == 0 and without["head_over_draft_step"] == 0


def test_costs_command_times_the_target_as_its_runtime_decodes(tiny, tmp_path, monkeypatch) -> None:
    """``--target_runtime static`` times every target pass through a :class:`StaticTarget` (what ``eval bench
    --target_runtime`` decodes with) and records the runtime; an unknown runtime is refused naming it."""
    from accept_head.models import static_target

    calls = []
    forward = static_target.StaticTarget.forward
    monkeypatch.setattr(
        static_target.StaticTarget, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
    )
    root = tiny["root"]
    pair = ["--target.path", str(root / "target"), "--draft.path", str(root / "draft"), "--dtype", "float32"]
    timing = ["--ks", "[1, 2]", "--repeats", "2", "--warmup", "1", "--context", "8"]
    payload = main(["costs", *pair, *timing, "--target_runtime", "static", "--output_dir", str(tmp_path / "static")])
    assert payload["settings"]["target_runtime"] == "static"
    assert len(calls) >= 1 + 3 * 3  # the prompt, then (warm-up + repeats) x (K = 1, K = 2, the one-token pass)
    from accept_head.evaluation.costs import costs

    with pytest.raises(ValueError, match=r"target_runtime='jit' must be one of \['eager', 'static', 'compiled'\]"):
        costs(target_runtime="jit", output_dir=str(tmp_path / "bad"))


def test_a_bench_prices_the_runtime_it_decodes_with(tiny, monkeypatch) -> None:
    """The bundle's cost model (measured with the eager target) used for another runtime comes with a warning naming
    the fix; ``measure`` times the passes through the runtime asked for."""
    import warnings

    import accept_head.evaluation.common as common
    from accept_head.engine.pair_loading import PairOptions

    pair = PairOptions(bundle=str(tiny["root"] / "bundle"), dtype="float32").load()
    if not pair.bundle.cost_model:
        pair.bundle.cost_model = CostModel(t_draft=1e-3, t_target_a=1e-2, t_target_b=1e-3).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.resolve_cost_model("bundle", pair)[1] == "bundle"
    with pytest.warns(UserWarning, match=r"--cost_model measure, or a costs.json from .*--target_runtime static"):
        assert common.resolve_cost_model("bundle", pair, target_runtime="static")[1] == "bundle"
    runtimes = []
    monkeypatch.setattr(
        common, "measure_costs", lambda *a, target_runtime, **k: runtimes.append(target_runtime) or "timed"
    )
    assert common.resolve_cost_model("measure", pair, target_runtime="compiled") == ("timed", "measured")
    assert runtimes == ["compiled"]


def test_sweep_command_runs_every_family_and_plots_pareto(tiny, tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    config = {
        "bundle": tiny["bundle"],
        "prompts": [{"path": str(tiny["root"] / "ood.jsonl"), "limit": 2}],
        "policies": [
            {"kind": "autoregressive"},
            {"kind": "fixed_k", "grid": {"k": [1, 3]}},
            {"kind": "specdecpp", "grid": {"threshold": [0.3, 0.7]}},
            {"kind": "heuristic"},
            {"kind": "confidence", "grid": {"tau": [0.3]}},
            {"kind": "entropy", "grid": {"threshold": [0.5]}},
            {"kind": "hf_assisted", "grid": {"num_assistant_tokens": [3]}},
            {"kind": "oracle"},
        ],
        "temperatures": [0.0, 1.0],
        "max_new_tokens": 10,
        "cost_model": "measure",
        "output_dir": str(out),
        "progress": False,
    }
    main(["sweep", "--config", write_config(tmp_path / "sweep.yaml", config)])
    stored = json.loads((out / "sweep.json").read_text())
    greedy, sampled = stored["results"]["greedy"], stored["results"]["T=1"]
    assert len(greedy["methods"]) == 10 and len(sampled["methods"]) == 9
    assert [s["kind"] for s in sampled["skipped"]] == ["oracle"]
    oracle = next(m for m in greedy["methods"] if m["kind"] == "oracle")
    assert oracle["discarded"] == 0
    for method in greedy["methods"]:
        assert method["modeled_tokens_per_second"] > 0 and 0 < method["verification_rate"] <= 1
    assert (out / "pareto_greedy.png").is_file() and (out / "pareto_T1.png").is_file()
    assert "FixedK k=3" in capsys.readouterr().out


def test_calibration_command_reports_offline_and_on_policy_views(tiny, tmp_path) -> None:
    out = tmp_path / "calibration"
    main(
        [
            "calibration",
            "--bundle",
            tiny["bundle"],
            "--dataset",
            tiny["labels"],
            "--prompts",
            json.dumps([{"path": str(tiny["root"] / "ood.jsonl"), "limit": 3}]),
            "--max_new_tokens",
            "12",
            "--output_dir",
            str(out),
        ]
    )
    stored = json.loads((out / "calibration.json").read_text())
    views = stored["views"]
    assert views["offline"]["raw"]["metrics"]["n"] > 0
    assert views["on_policy"]["raw"]["metrics"]["n"] > 0
    # The bundle's temperature map (T = 1.5) pulls every prediction towards 1/2.
    raw, calibrated = views["offline"]["raw"]["metrics"], views["offline"]["calibrated"]["metrics"]
    assert abs(calibrated["mean_pred"] - 0.5) < abs(raw["mean_pred"] - 0.5)
    positions = views["on_policy"]["by_position"]
    assert positions and positions[0]["candidate"] == 1
    assert (out / "reliability.png").is_file()
    # The draft's own q(y) is scored beside the head, on the same positions and labels.
    for view in ("offline", "on_policy"):
        confidence = views[view]["draft confidence"]["metrics"]
        assert confidence["n"] == views[view]["raw"]["metrics"]["n"]
        assert confidence["mean_label"] == pytest.approx(views[view]["raw"]["metrics"]["mean_label"])
        assert 0.0 < confidence["mean_pred"] <= 1.0


def test_offline_calibration_refuses_rollout_labels_and_labels_of_another_draft(tiny, tmp_path) -> None:
    from accept_head.evaluation.calibration import offline_predictions
    from accept_head.specdecpp.bundle import SpecDecPP

    bundle = SpecDecPP.from_pretrained(tiny["bundle"])
    pair = SimpleNamespace(bundle=bundle, draft=bundle.draft)
    for name, change in (("rollout", {"label_mode": "rollout"}), ("other", {"draft": {"path": str(tiny["root"])}})):
        copy = Path(shutil.copytree(tiny["labels"], tmp_path / name))
        meta = json.loads((copy / "meta.json").read_text())
        (copy / "meta.json").write_text(json.dumps(meta | change))
        message = "holds rollout labels.*leave out --dataset" if name == "rollout" else "was trained for the draft"
        with pytest.raises(ValueError, match=message):
            offline_predictions(pair, str(copy))


def test_a_trained_head_decodes_like_the_bundle_it_becomes(tiny) -> None:
    """The end-of-fit sweep runs before a bundle exists: a Runner given a TrainedHead (head, calibration, candidate
    bounds) and the pair's stop ids builds the same HeadThreshold and decodes the same tokens as a Runner reading the
    bundle; without an h* it asks for a threshold, and without any head it refuses SpecDec++."""
    from accept_head.engine.pair_loading import Pair, load_pair
    from accept_head.engine.runner import Runner, TrainedHead

    pair = load_pair(tiny["bundle"])
    bundle = pair.bundle
    bare = Pair(pair.target, pair.draft, tokenizer=None, stop_ids=pair.eos_token_id)
    trained = TrainedHead(bundle.head, bundle.calibration, bundle.min_candidates, bundle.max_candidates)
    method = MethodSpec("specdecpp", {"threshold": 0.3, "unscored": "confidence"})
    ids = pair.tokenizer.encode("write a short poem about two")
    decoded = []
    for runner in (Runner(pair, 12, 1.0), Runner(bare, 12, 1.0, head=trained)):
        policy = runner.policy(method)
        built = (policy.threshold, policy.min_candidates, policy.max_candidates, policy.calibration, policy.unscored)
        assert built == (0.3, bundle.min_candidates, bundle.max_candidates, bundle.calibration, "confidence")
        decoded.append(runner.decoder(method)(ids, torch.Generator().manual_seed(0)).sequences.tolist())
    assert decoded[0] == decoded[1]
    with pytest.raises(ValueError, match=r"no h\* yet"):
        Runner(bare, 12, 1.0, head=trained).policy(MethodSpec("specdecpp"))
    assert "needs a bundle" in Runner(bare, 12, 1.0).supports(method)


def test_on_policy_records_decode_with_the_bundles_own_policy(tiny) -> None:
    from accept_head.chain.policies import HeadThreshold
    from accept_head.engine.pair_loading import load_pair
    from accept_head.evaluation.calibration import RecordingHeadThreshold

    pair = load_pair(tiny["bundle"])
    base = HeadThreshold(pair.bundle.head, 0.4, 1, 7, calibration=pair.bundle.calibration, unscored="confidence")
    recorder = RecordingHeadThreshold(base)
    kept = ("threshold", "min_candidates", "max_candidates", "calibration", "unscored")
    assert all(getattr(recorder, name) == getattr(base, name) for name in kept)


@pytest.mark.slow
def test_bench_command_end_to_end(tiny, tmp_path, capsys) -> None:
    out = tmp_path / "bench"
    config = {
        "bundle": tiny["bundle"],
        "prompts": [{"path": str(tiny["root"] / "id.jsonl"), "limit": 2}],
        "validation_prompts": [{"path": str(tiny["root"] / "val.jsonl"), "limit": 2}],
        "max_new_tokens": 10,
        "repeats": 2,
        "warmup": 1,
        "fixed_k": [1, 2, 4],
        "entropy_thresholds": [0.3, 0.6],
        "path_confidence_thresholds": [0.5, 0.9],
        "cost_model": "measure",
        "output_dir": str(out),
        "progress": False,
        "hindsight_k": True,
    }
    main(["bench", "--config", write_config(tmp_path / "bench.yaml", config)])
    stored = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").is_file()
    greedy, sampled = stored["results"]["greedy"], stored["results"]["T=1"]
    kinds = [m["kind"] for m in greedy["methods"]]
    stop_rules = ["heuristic", "confidence", "confidence", "entropy", "path_confidence"]
    # The K grid's other settings decode on the test prompts too (hindsight_k), after everything else.
    assert (
        kinds
        == ["autoregressive", "fixed_k", "specdecpp", *stop_rules] + ["hf_assisted"] * 3 + ["oracle"] + ["fixed_k"] * 2
    )
    assert "oracle" not in [m["kind"] for m in sampled["methods"]]
    best_k = greedy["validation"]["best_k"]
    assert greedy["methods"][1]["params"] == {"k": best_k}
    assert sorted(m["params"]["k"] for m in greedy["methods"] if m["kind"] == "fixed_k") == [1, 2, 4]
    # Ratios to the best K stay against validation's K; the hindsight K is the test rows' best by modeled tok/s.
    assert greedy["methods"][1]["ratio_to_best_fixed_k"] == pytest.approx(1.0)
    fixed_rows = [m for m in greedy["methods"] if m["kind"] == "fixed_k"]
    hindsight = max(fixed_rows, key=lambda m: m["modeled_tokens_per_second"])
    assert greedy["hindsight_k"] == {"k": hindsight["params"]["k"], "select_by": "modeled"}
    assert hindsight["ratio_to_hindsight_fixed_k"] == pytest.approx(1.0)
    for m in greedy["methods"]:
        assert m["modeled_ratio_to_hindsight_fixed_k"] == pytest.approx(
            m["modeled_tokens_per_second"] / hindsight["modeled_tokens_per_second"]
        )
        assert m["modeled_ratio_to_hindsight_fixed_k"] <= 1.0 + 1e-9 or m["kind"] != "fixed_k"
    assert greedy["methods"][4]["params"] == {"tau": greedy["validation"]["confidence"]["tau"]}  # ROC on validation
    assert greedy["methods"][5]["params"] == {"tau": 0.4, "auto_tune": True}  # HF's online rule
    # SpecDec++'s rule with the head ablated, at the h whose validation run priced best.
    chosen = greedy["validation"]["best_path_confidence_threshold"]
    grid = [m for m in greedy["validation"]["methods"] if m["kind"] == "path_confidence"]
    assert [m["params"]["threshold"] for m in grid] == [0.5, 0.9]
    assert chosen == max(grid, key=lambda m: m["selection_tokens_per_second"])["params"]["threshold"]
    assert greedy["methods"][7]["params"] == {"threshold": chosen}
    assert greedy["methods"][8]["params"]["num_assistant_tokens"] == best_k  # HF constant at the best K
    for method in greedy["methods"] + sampled["methods"]:
        tps = method["tokens_per_second"]
        assert len(tps["per_repeat"]) == 2 and tps["min"] <= tps["median"] <= tps["max"]
        assert method["ratio_to_autoregressive"] > 0 and method["ratio_to_best_fixed_k"] > 0
        low, high = method["ratio_to_best_fixed_k_ci95"]  # two test prompts: a paired prompt bootstrap
        assert 0 < low <= high and len(method["per_prompt_tokens_per_second"]) == 2
    assert greedy["methods"][0]["ratio_to_autoregressive"] == pytest.approx(1.0)
    assert greedy["validation"]["confidence"]["source"].startswith("ROC on validation")
    printed = capsys.readouterr().out
    assert "vs best K" in printed and "95% (prompts)" in printed and "in hindsight: K=" in printed


@pytest.mark.slow
def test_an_interrupted_report_leaves_the_last_page_and_its_figures(tiny, tmp_path, monkeypatch) -> None:
    from accept_head.evaluation import report

    figures = tmp_path / "docs" / "results"
    figures.mkdir(parents=True)
    (figures / "pareto_old.png").write_bytes(b"old")
    (figures / "results.json").write_text("{}")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "calibration_views", interrupted)  # after every sweep has drawn its figure
    config = {
        "bundle": tiny["bundle"],
        "out_of_distribution": [{"path": str(tiny["root"] / "ood.jsonl")}],
        "validation_prompts": [{"path": str(tiny["root"] / "val.jsonl")}],
        "validation_limit": 1,
        "limit": 1,
        "temperatures": [0],
        "policies": [{"kind": "autoregressive"}, {"kind": "fixed_k", "grid": {"k": [2]}}],
        "max_new_tokens": 4,
        "cost_model": "bundle",
        "output": str(tmp_path / "docs" / "results.md"),
        "progress": False,
    }
    with pytest.raises(KeyboardInterrupt):
        main(["report", "--config", write_config(tmp_path / "report.yaml", config)])
    assert sorted(p.name for p in figures.iterdir()) == ["pareto_old.png", "results.json"]
    assert (figures / "results.json").read_text() == "{}" and not (tmp_path / "docs" / "results.md").exists()


def small_report(tiny: dict, tmp_path: Path, bundle: str, page: Path) -> dict:
    """A report config over 2 prompts per set of the tiny pair, writing ``page``. A fixed cost model (draft 10x
    cheaper than the target, as on the real pair) keeps the modeled numbers exact."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"cost_model": {"t_draft": 0.001, "t_target_a": 0.01, "t_target_b": 0.0005}}))
    return {
        "bundle": bundle,
        "out_of_distribution": [{"path": str(tiny["root"] / "ood.jsonl")}],
        "validation_prompts": [{"path": str(tiny["root"] / "val.jsonl")}],
        "validation_limit": 2,
        "limit": 2,
        "cost_model": str(costs),
        "output": str(page),
        "progress": False,
    }


def test_report_command_regenerates_the_page_from_scratch(tiny, tmp_path) -> None:
    page = tmp_path / "docs" / "results.md"
    figures = tmp_path / "docs" / "results"
    figures.mkdir(parents=True)
    (figures / "stale.png").write_bytes(b"old")
    config = small_report(tiny, tmp_path, tiny["bundle"], page)
    costs = config["cost_model"]
    config |= {
        "policies": [
            {"kind": "autoregressive"},
            {"kind": "fixed_k", "grid": {"k": [1, 3]}},
            {"kind": "specdecpp", "grid": {"threshold": [0.3]}},
            {"kind": "heuristic"},
            {"kind": "confidence", "grid": {"tau": [0.3]}},
            {"kind": "entropy", "grid": {"threshold": [0.5]}},
            {"kind": "hf_assisted", "grid": {"num_assistant_tokens": [3], "schedule": ["heuristic"]}},
            {"kind": "ngrammys", "grid": {"k": [1, 3], "w": [2]}},
            {"kind": "head_tree", "grid": {"threshold": [None, 0.5], "max_nodes": [6]}},
            {"kind": "confidence_tree", "grid": {"max_depth": [3], "max_nodes": [6]}},
            {"kind": "c2t_tree"},  # no tree_models: skipped, with the reason
            {"kind": "oracle"},
        ],
        "bigram_cache": str(tmp_path / "bigram"),
        "max_new_tokens": 10,
        "dataset": tiny["labels"],
    }
    main(["report", "--config", write_config(tmp_path / "report.yaml", config)])
    assert not (figures / "stale.png").exists() and not (tmp_path / "docs" / "results.partial").exists()
    stored = json.loads((figures / "results.json").read_text())
    text = page.read_text()
    # In-distribution prompts come from the bundle's provenance (eval split of id.jsonl).
    assert list(stored["results"]) == ["in-distribution", "out-of-distribution"]
    assert all(s.startswith("id:") for s in stored["prompt_sets"]["in-distribution"]["ids"])
    # Settings are chosen on the validation prompts: each grid's winner there, and only it, runs on the test sets.
    for key in ("greedy", "T=1"):
        searched = stored["validation"][key]["methods"]
        assert [s["kind"] for s in stored["validation"][key]["skipped"] if s["kind"] != "oracle"] == ["c2t_tree"]
        assert "python -m train.trees" in stored["validation"][key]["skipped"][0]["reason"]
        for kind in ("fixed_k", "ngrammys", "head_tree"):
            grid = [m for m in searched if m["kind"] == kind]
            assert len(grid) == 2
            best = max(grid, key=lambda m: m["modeled_tokens_per_second"])
            for set_name in stored["results"]:
                reported = [m["name"] for m in stored["results"][set_name][key]["methods"] if m["kind"] == kind]
                assert reported == [best["name"]]
    assert stored["validation_prompts"]["ids"] and not set(stored["validation_prompts"]["ids"]) & {
        i for s in stored["prompt_sets"].values() for i in s["ids"]
    }
    assert "Which method wins" in text and "Validation: how each setting was chosen" in text
    assert "h* + copies rank" not in text and "Rows copied from the text" not in text  # the bundle copies nothing
    for name in stored["figures"].values():
        assert (figures / name).is_file()
        assert f"results/{name}" in text
    for heading in ("Table 1", "Goals of the evaluation", "Calibration of the head", "Diagnostics"):
        assert heading in text
    greedy = stored["results"]["in-distribution"]["greedy"]
    star = next(r for r in greedy["analysis"]["rows"] if r["name"].startswith("SpecDec++ h*"))
    assert star["oracle_headroom_share"] is not None
    oracle = next(r for r in greedy["analysis"]["rows"] if r["kind"] == "oracle")
    fixed = next(r for r in greedy["analysis"]["rows"] if r["kind"] == "fixed_k")
    assert oracle["modeled_tokens_per_second"] > fixed["modeled_tokens_per_second"]
    assert stored["cost_model"]["source"] == str(costs)
    assert f"{star['tokens_per_second']['median']:.1f}" in text  # numbers in the page come from results.json
    # EOS is ignored for timing: every method wrote exactly max_new_tokens on each of the 2 prompts of every set.
    assert stored["settings"]["ignore_eos"] is True
    written = {m["generated_per_repeat"] for r in stored["results"].values() for t in r.values() for m in t["methods"]}
    assert written == {2 * 10}
    assert render_markdown(stored, figures.name) == text  # results.json alone re-renders the page, row order included
    goals = {g["goal"] for g in stored["goals"]}
    assert any("oracle headroom" in g for g in goals) and any("best FixedK" in g for g in goals)
    # Each greedy goal row carries the oracle's own ratio against the same baseline: the limit for this draft.
    vs_fixed = next(
        g
        for g in stored["goals"]
        if "best FixedK" in g["goal"] and g["set"] == "in-distribution" and g["temperature"] == "greedy"
    )
    assert vs_fixed["oracle_modeled"] == pytest.approx(
        oracle["modeled_tokens_per_second"] / fixed["modeled_tokens_per_second"]
    )
    assert stored["calibration"]["offline"]["raw"]["metrics"]["n"] > 0
    # Greedy outputs are compared with autoregressive decoding's on every test set: in float32 all are identical.
    for set_name, by_key in stored["results"].items():
        identity = by_key["greedy"]["greedy_identity"]
        others = {m["name"] for m in by_key["greedy"]["methods"] if m["kind"] != "autoregressive"}
        assert set(identity) == others and "T=1" in by_key and "greedy_identity" not in by_key["T=1"]
        assert all(v["identical"] == v["decodes"] == 2 and v["first_divergence"] == [] for v in identity.values())
    assert "Greedy outputs against autoregressive decoding" in text


def test_report_shows_a_copying_bundle_beside_its_plain_chain(tiny, tmp_path) -> None:
    """A bundle with ``context_row`` is reported as ``generate`` decodes it (h* with copies) and as the plain chain;
    FixedK with copies is chosen apart from plain FixedK, and "best FixedK" stays the plain one."""
    bundle = Path(tiny["root"]) / "bundle-copies"  # beside the models its config names by relative path
    shutil.copytree(tiny["bundle"], bundle, dirs_exist_ok=True)
    config_file = bundle / "config.json"
    costs = {"t_draft": 0.001, "t_target_a": 0.01, "t_target_b": 0.0005}  # tree settings need a cost model
    copying = {"context_row": 2, "tree": {"context_row": 2}, "cost_model": costs}
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | copying))
    page = tmp_path / "results.md"
    config = small_report(tiny, tmp_path, str(bundle), page) | {
        "policies": [
            {"kind": "autoregressive"},
            {"kind": "fixed_k", "grid": {"k": [1, 3]}},
            {"kind": "fixed_k", "grid": {"k": [1, 3], "context_row": [2]}},
            {"kind": "head_tree", "grid": {"max_nodes": [6]}},  # takes the bundle's tree settings: its copies
        ],
        "temperatures": [0.0],
        "max_new_tokens": 10,
        "out_of_distribution": [],  # none: the page reports the in-distribution set alone
    }
    main(["report", "--config", write_config(tmp_path / "report.yaml", config)])
    stored = json.loads((tmp_path / "results" / "results.json").read_text())
    assert list(stored["results"]) == list(stored["prompt_sets"]) == ["in-distribution"]
    searched = stored["validation"]["greedy"]["methods"]
    for copies in (False, True):
        grid = [m for m in searched if m["kind"] == "fixed_k" and bool(m["params"].get("context_row")) == copies]
        best = max(grid, key=lambda m: m["modeled_tokens_per_second"])
        assert len(grid) == 2 and best["name"] in stored["validation"]["greedy"]["chosen"]
    for set_name, by_key in stored["results"].items():
        rows = by_key["greedy"]["analysis"]["rows"]
        star, copying = (next(r for r in rows if r.get("role") == role) for role in ("h_star", "h_star_copies"))
        assert "context_row" not in star["params"] and copying["params"]["context_row"] == 2
        fixed = next(
            r for r in rows if r["kind"] == "fixed_k" and r["best_of_family"] and "context_row" not in r["params"]
        )
        fixed_copies = next(r for r in rows if r["kind"] == "fixed_k" and r["params"].get("context_row"))
        median = copying["tokens_per_second"]["median"]
        assert copying["ratio_to_best_fixed_k"] == pytest.approx(median / fixed["tokens_per_second"]["median"])
        assert copying["ratio_to_best_fixed_k_copies"] == pytest.approx(
            median / fixed_copies["tokens_per_second"]["median"]
        )
        assert copying["ratio_to_h_star"] == pytest.approx(median / star["tokens_per_second"]["median"])
        # Greedy in float32, the copying chains write the target's own tokens.
        identity = by_key["greedy"]["greedy_identity"]
        assert identity[copying["name"]]["identical"] == identity[fixed_copies["name"]]["identical"] == 2
    (tree,) = [m for m in searched if m["kind"] == "head_tree"]
    assert tree["params"]["context_row"] == 2 and "context_row=2" in tree["name"]
    text = page.read_text()
    assert "Rows copied from the text beside the chain" in text and "with 2 tokens copied from the text" in text
    assert "h* + copies rank" in text  # where generate's decoder ranks among the methods
    assert f"{copying['tokens_per_second']['median']:.1f}" in text


@pytest.mark.parametrize("config", sorted(Path("configs/eval").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_eval_configs_parse_through_the_real_cli(config: Path, capsys) -> None:
    command = config.stem.split("-")[0]
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["bundle"] == "checkpoints/smollm2-135m-specdecpp"
    assert not math.isnan(float(printed["max_new_tokens"]))


PROMPTED = {"bench", "report", "sweep", "calibration", "free_stop"}  # commands taking PromptOptions


@pytest.mark.parametrize("command", ["bench", "report", "sweep", "calibration", "free_stop", "costs", "ablate"])
def test_every_subcommand_lists_the_shared_options_as_flat_flags(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code in (0, None)
    flags = set(re.findall(r"--[\w.]+", capsys.readouterr().out))
    assert "--bundle" in flags  # ablate's own bundle (its cost model) included
    assert ("--prompt_mode" in flags) == ("--split_seed" in flags) == (command in PROMPTED)
    assert ("--draft.help" in flags) == (command not in ("free_stop", "ablate"))  # free_stop decodes the target alone
    assert not [f for f in flags if f.startswith(("--pair", "--prompt_options"))]


@pytest.mark.parametrize("command", ["report", "calibration", "bench"])
def test_a_command_that_needs_a_bundle_names_the_flag_in_one_line(command: str, capsys) -> None:
    argv = [command, "--prompts", "[{path: humaneval}]", "--validation_prompts", "[{path: humaneval}]"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv if command == "bench" else [command])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("python -m eval: error: ") and "--bundle" in err


def test_the_cost_model_prices_a_scalar_head_as_decoding_calls_it(monkeypatch) -> None:
    """measure_costs times the head of a bundle that reads the draft's numbers the way a drafting step pays for them:
    one candidate's inputs computed from the step's q, in the head's own order, then one score by the float scorer
    a decoder takes per generation."""
    from accept_head import AcceptanceHead
    from accept_head.engine.measure import measure_costs

    target = make_llama(seed=0, num_layers=1)
    draft = perturbed_copy(target, relative_noise=0.2, seed=1)
    head = AcceptanceHead(target.config.hidden_size, 1, ["depth", "logq", "entropy"], residual_on="logq").eval()
    seen = []
    make_scorer = head.scalar_scorer

    def recording_scorer():
        scorer = make_scorer()
        return lambda scalars: seen.append(scalars) or scorer(scalars)

    monkeypatch.setattr(head, "scalar_scorer", recording_scorer)
    costs = measure_costs(target, draft, head, ks=[1], context=8, repeats=2, warmup=1)
    assert costs.measured["head"]["n"] == 2 and costs.measured["head"]["median"] > 0
    assert costs.measured["head_next"]["n"] == 2 and len(seen) == 6  # after a round's first step and after a later one
    step = costs.measured["draft_next"]["median"] + costs.measured["head_next"]["median"]
    assert costs.t_draft_next == pytest.approx(step) and costs.t_step == costs.t_draft_next
    # The head's share is kept apart, for the rules that never call it.
    assert costs.t_head == costs.measured["head"]["median"]
    assert costs.t_head_next == costs.measured["head_next"]["median"]
    logq, entropy, depth = seen[0]  # the head's canonical order, whatever order it was configured in
    assert head.scalar_inputs == ("logq", "entropy", "depth") and depth == 1.0
    assert math.isfinite(logq) and logq <= 0 and entropy >= 0


def test_the_command_list_reads_without_rst_markup(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "accept_head.evaluation" in out and ":mod:" not in out and "``" not in out and ":func:" not in out


# ---- the offline calibration view scores held-out rows only ---------------------------------------------------
# The prompts in the bundle's split.json `train` list (what `python -m train fit` wrote) are left out, as `eval
# predictors` leaves them out; a dataset of training prompts alone is refused by name.


def offline_n(bundle: Path, labels: str, out: Path) -> int:
    main(["calibration", "--bundle", str(bundle), "--dataset", labels, "--output_dir", str(out)])
    return json.loads((out / "calibration.json").read_text())["views"]["offline"]["raw"]["metrics"]["n"]


def test_the_offline_view_leaves_out_the_prompts_the_head_trained_on(tiny, tmp_path) -> None:
    every = offline_n(tiny["bundle"], tiny["labels"], tmp_path / "all")
    bundle = Path(shutil.copytree(tiny["bundle"], tiny["root"] / "bundle-trained-on-3"))  # beside its models
    (bundle / "split.json").write_text(json.dumps({"train": ["tiny:0", "tiny:1", "tiny:2"], "val": ["tiny:3"]}))
    held_out = offline_n(bundle, tiny["labels"], tmp_path / "held-out")
    assert 0 < held_out < every  # only tiny:3's drafted positions are scored


def test_a_dataset_of_training_prompts_alone_is_refused(tiny, tmp_path, capsys) -> None:
    bundle = Path(shutil.copytree(tiny["bundle"], tiny["root"] / "bundle-trained-on-4"))
    (bundle / "split.json").write_text(json.dumps({"train": [f"tiny:{i}" for i in range(4)], "val": []}))
    with pytest.raises(SystemExit) as exit_info:
        main(["calibration", "--bundle", str(bundle), "--dataset", tiny["labels"], "--output_dir", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "is one the bundle's head trained on" in capsys.readouterr().err
