"""The learning-free tree decoders (N-Grammys, Lookahead, Ouroboros) as methods of ``python -m eval``.

On tiny random Llamas, offline:

* through :class:`~accept_head.engine.runner.Runner`, every kind decodes exactly the target's greedy output, and passes
the
  sampling setting through unchanged at temperature > 0;
* N-Grammys' model bigram is built once per target, when the decoder is built (before anything is timed), and read
  back from the disk cache by the next runner;
* summaries report tokens per target call, target and draft calls, and price a tree call by the tokens it feeds;
* ``python -m eval bench`` runs each grid on the validation prompts and reports on the test prompts only the setting
  that won there, by the same criterion as the other validation choices;
* the report finds the bundle's own policy by its role, ranks tree decoders as families;
* bad parameters fail with a ValueError naming the value, before any model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from tiny_models import make_llama, make_tokenizer, near_bigram, perturbed_copy, save_bundle

from accept_head import autoregressive_generate
from accept_head.chain.decoding import DecodeStats
from accept_head.core.costs import CostModel
from accept_head.engine.pair_loading import Pair
from accept_head.engine.runner import (
    TREE_DECODERS,
    MethodSpec,
    PolicyGrid,
    Runner,
    h_star_spec,
    summarize,
    throughput,
    tree_params,
)
from accept_head.evaluation.bench import tree_settings, tree_specs
from accept_head.evaluation.report import analyse
from accept_head.evaluation.report_page import _table_one
from accept_head.learning_free.ngrammys import ModelBigram
from accept_head.models.feature_draft import FeatureDraft
from accept_head.trees.verify import TreeDecodeStats
from eval.__main__ import main

WORDS = "write a short poem about the number two . explain why python code is fun please give me one answer".split()
TEXTS = ["write a short poem about the number two . write a short poem", "explain why python code is fun . explain"]
NEW_TOKENS = 16

SETTINGS = [
    MethodSpec("ngrammys", {"k": 1, "w": 3}),
    MethodSpec("ngrammys", {"k": 4, "w": 4, "q": 1, "strategy": "mixed"}),
    MethodSpec("ngrammys", {"k": 3, "w": 2, "strategy": "context"}),
    MethodSpec("ngrammys", {"k": 3, "w": 3, "strategy": "model"}),
    MethodSpec("lookahead", {"window": 2, "ngram": 3, "guess_set": 2}),
    MethodSpec("lookahead", {"window": 3, "ngram": 4, "guess_set": 3, "context_ngrams": True}),
    MethodSpec("ouroboros", {"gamma": 2, "phrase_length": 3, "phrases_per_token": 2, "candidates": 2}),
    MethodSpec("ouroboros", {"gamma": 4, "phrase_length": 4, "phrases_per_token": 4, "candidates": 4}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A near-bigram target, a perturbed copy as its HF draft (bundled with an untrained head), prompt files and a
    fixed cost model."""
    root = tmp_path_factory.mktemp("bench_learning_free")
    tokenizer = make_tokenizer()
    target = near_bigram(make_llama(tokenizer=tokenizer, seed=1))  # seed 0 ends chat prompts at once
    draft = perturbed_copy(target, relative_noise=0.05, seed=1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    save_bundle(root / "bundle", target, draft, tokenizer, root / "target", root / "draft")
    generator = torch.Generator().manual_seed(0)
    for name in ("test", "val"):
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(2):
                picks = torch.randint(0, len(WORDS), (4,), generator=generator).tolist()
                words = " ".join(WORDS[j] for j in picks)
                f.write(json.dumps({"instruction": f"{name} {i} {words} . {words}"}) + "\n")
    (root / "costs.json").write_text(
        json.dumps({"cost_model": {"t_draft": 1e-3, "t_target_a": 1e-2, "t_target_b": 1e-3}})
    )
    pair = Pair(target=target, draft=draft, tokenizer=tokenizer)
    return {"root": root, "pair": pair, "prompts": [tokenizer.encode(text) for text in TEXTS]}


# ---- decoding through the Runner ------------------------------------------------------------------------------------


def test_tree_methods_through_the_runner_decode_exactly_the_targets_greedy_output(tiny, tmp_path) -> None:
    pair = tiny["pair"]
    runner = Runner(pair, NEW_TOKENS, 0.0, bigram_cache=tmp_path)
    autoregressive = runner.decoder(MethodSpec("autoregressive"))
    accepted_any = {kind: False for kind in TREE_DECODERS}
    for ids in tiny["prompts"]:
        expected = autoregressive(ids, torch.Generator().manual_seed(0)).sequences
        for spec in SETTINGS:
            result = runner.decoder(spec)(ids, torch.Generator().manual_seed(0))
            assert torch.equal(result.sequences, expected), spec.name
            stats = result.stats
            assert isinstance(stats, TreeDecodeStats) and stats.target_calls == len(stats.fed) == len(stats.rows)
            assert (stats.draft_calls > 0) == (spec.kind == "ouroboros"), spec.name
            accepted_any[spec.kind] |= sum(stats.accepted) > 0
    # The tiny near-bigram pair lets every kind accept guesses, so the rows above went beyond the target's own token.
    assert all(accepted_any.values()), accepted_any


@pytest.mark.parametrize("kind", sorted(TREE_DECODERS))
def test_runner_hands_the_sampling_setting_to_the_decoder_unchanged(tiny, tmp_path, kind) -> None:
    pair, ids = tiny["pair"], tiny["prompts"][0]
    runner = Runner(pair, NEW_TOKENS, 0.8, top_k=20, top_p=0.9, bigram_cache=tmp_path)
    spec = next(s for s in SETTINGS if s.kind == kind)
    assert runner.supports(spec) is None  # lossless sample verification: no temperature is refused
    result = runner.decoder(spec)(ids, torch.Generator().manual_seed(3))
    params = tree_params(kind, spec.params)
    if kind == "ngrammys":
        params["bigram"] = runner.bigram()
    models = (pair.target, pair.draft) if kind == "ouroboros" else (pair.target,)
    direct = TREE_DECODERS[kind](
        *models,
        ids,
        NEW_TOKENS,
        0.8,
        top_k=20,
        top_p=0.9,
        eos_token_id=pair.eos_token_id,
        generator=torch.Generator().manual_seed(3),
        **params,
    )
    assert torch.equal(result.sequences, direct.sequences)


def test_model_bigram_is_built_once_per_target_when_the_decoder_is_built(tiny, tmp_path, monkeypatch) -> None:
    builds = []
    original = ModelBigram.build.__func__

    def counting_build(cls, model, *args, **kwargs):
        builds.append(model)
        return original(cls, model, *args, **kwargs)

    monkeypatch.setattr(ModelBigram, "build", classmethod(counting_build))
    pair = tiny["pair"]
    runner = Runner(pair, NEW_TOKENS, 0.0, bigram_cache=tmp_path)
    decoders = [runner.decoder(MethodSpec("ngrammys", {"k": k, "w": 3})) for k in (1, 5, 10)]
    assert builds == [pair.target]  # before any decoding, one table for every setting
    assert len(list(tmp_path.glob("bigram-*-top32.safetensors"))) == 1
    for decode in decoders:
        decode(tiny["prompts"][0], torch.Generator().manual_seed(0))
    assert len(builds) == 1
    later = Runner(pair, NEW_TOKENS, 1.0, bigram_cache=tmp_path)  # e.g. the next temperature: read from disk
    later.decoder(MethodSpec("ngrammys", {"k": 4, "w": 2}))
    later.decoder(MethodSpec("ngrammys", {"k": 4, "w": 2, "strategy": "context"}))  # needs no table
    assert len(builds) == 1


# ---- summaries ----------------------------------------------------------------------------------------------------


def test_summaries_report_tokens_per_target_call_and_price_a_tree_call_by_what_it_feeds() -> None:
    cost = CostModel(t_draft=1e-3, t_target_a=1e-2, t_target_b=1e-3)
    tree = TreeDecodeStats(generated=12, target_calls=4, proposed=[3, 2, 0, 4], accepted=[3, 1, 0, 4], discarded=1)
    tree.fed, tree.rows, tree.total_time = [7, 5, 1, 9], [2, 2, 0, 2], 0.5
    plain = DecodeStats(generated=12, target_calls=12, total_time=0.6)
    specs = [MethodSpec("ngrammys", {"k": 2, "w": 4}), MethodSpec("autoregressive")]
    ngrammys, ar = summarize(specs, {specs[0].name: [[tree]], specs[1].name: [[plain]]}, cost)
    row = ngrammys.to_dict()
    assert row["tokens_per_target_call"] == pytest.approx(3.0) and row["target_calls"] == 4
    assert row["draft_calls"] == 0 and row["tokens_per_second"]["median"] == pytest.approx(24.0)
    assert row["mean_fed"] == pytest.approx(5.5) and row["mean_rows"] == pytest.approx(1.5)
    # Each call costs t_target(fed − 1) = a + b (fed − 1): 4 a + b (6 + 4 + 0 + 8) = 0.04 + 0.018 s for 12 tokens.
    assert row["modeled_tokens_per_second"] == pytest.approx(12 / 0.058)
    assert ar.to_dict()["tokens_per_target_call"] == pytest.approx(1.0) and "mean_fed" not in ar.to_dict()


# ---- the bench ----------------------------------------------------------------------------------------------------

GRIDS = {
    "ngrammys": [{"k": 1, "w": 2}, {"k": 4, "w": 3, "strategy": "mixed"}],
    "lookahead": [{"window": 2, "ngram": 3, "guess_set": 2}, {"window": 3, "ngram": 3, "guess_set": 3}],
    "ouroboros": [
        {"gamma": 2, "phrase_length": 3, "phrases_per_token": 2, "candidates": 2},
        {"gamma": 3, "phrase_length": 3, "phrases_per_token": 3, "candidates": 3},
    ],
}


def bench_config(tiny: dict, tmp_path: Path, **overrides) -> str:
    root = tiny["root"]
    config = {
        "bundle": str(root / "bundle"),
        "prompts": [{"path": str(root / "test.jsonl")}],
        "validation_prompts": [{"path": str(root / "val.jsonl")}],
        "max_new_tokens": 12,
        "temperatures": [0.0, 1.0],
        "repeats": 1,
        "warmup": 0,
        "fixed_k": [2],
        "entropy_thresholds": [0.5],
        "confidence_tau": 0.4,
        "hf_settings": [],
        "oracle": False,
        "cost_model": str(root / "costs.json"),
        "bigram_cache": str(tmp_path / "bigrams"),
        "output_dir": str(tmp_path / "bench"),
        "progress": False,
        **GRIDS,
        **overrides,
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_bench_reports_each_tree_decoder_at_the_setting_chosen_on_validation(tiny, tmp_path) -> None:
    main(["bench", "--config", bench_config(tiny, tmp_path)])
    stored = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert stored["settings"]["tree_decoders"] == {kind: [tree_params(kind, p) for p in g] for kind, g in GRIDS.items()}
    assert len(list((tmp_path / "bigrams").glob("bigram-*.safetensors"))) == 1
    for key, result in stored["results"].items():
        validation, methods = result["validation"], result["methods"]
        assert validation["skipped"] == []
        for kind, grid in GRIDS.items():
            validated = [m for m in validation["methods"] if m["kind"] == kind]
            assert [m["params"] for m in validated] == [tree_params(kind, p) for p in grid], key
            # The criterion of the other validation choices: select_by (modeled here) for the pair's own models.
            assert all(m["selected_by"] == "modeled" for m in validated)
            best = max(validated, key=lambda m: m["selection_tokens_per_second"])
            chosen = validation["tree_decoders"][kind]
            assert chosen == {"kind": kind, "name": best["name"], "params": best["params"], "select_by": "modeled"}
            (row,) = [m for m in methods if m["kind"] == kind]  # only the chosen setting reaches the test prompts
            assert row["params"] == chosen["params"] and row["name"] == chosen["name"]
            assert row["tokens_per_target_call"] == pytest.approx(row["generated"] / row["target_calls"])
            assert row["target_calls"] > 0 and row["tokens_per_second"]["median"] > 0 and row["mean_fed"] >= 1
            assert (row["draft_calls"] > 0) == (kind == "ouroboros")
            assert row["ratio_to_autoregressive"] > 0 and row["ratio_to_best_fixed_k"] > 0
        if key == "greedy":  # lossless: every method generates the target's own greedy tokens
            assert len({m["generated"] for m in methods}) == 1


def test_tree_specs_draft_ouroboros_with_the_standalone_draft_beside_a_feature_draft(tiny) -> None:
    pair = tiny["pair"]
    feature = Pair(pair.target, FeatureDraft.from_target(pair.target, torch.arange(3, 60)), pair.tokenizer)
    settings = tree_settings(GRIDS)
    specs, skipped = tree_specs(feature, settings)
    assert [s.kind for s in specs] == ["ngrammys"] * 2 + ["lookahead"] * 2
    assert skipped == [{"kind": "ouroboros", "reason": skipped[0]["reason"]}]
    assert "Hugging Face draft" in skipped[0]["reason"] and "comparison_draft" in skipped[0]["reason"]
    feature.comparison_drafts["standalone"] = pair.draft
    specs, skipped = tree_specs(feature, settings)
    ouroboros = [s for s in specs if s.kind == "ouroboros"]
    assert skipped == [] and all(s.params["draft"] == "standalone" for s in ouroboros)
    runner = Runner(feature, NEW_TOKENS, 0.0)
    assert "Hugging Face draft" in runner.supports(MethodSpec("ouroboros"))
    assert runner.supports(ouroboros[0]) is None
    ids = tiny["prompts"][0]
    expected = autoregressive_generate(pair.target, ids, NEW_TOKENS, 0.0, eos_token_id=pair.eos_token_id).sequences
    assert torch.equal(runner.decoder(ouroboros[0])(ids, torch.Generator().manual_seed(0)).sequences, expected)


def test_tree_decoders_are_refused_for_a_target_that_ignores_4d_masks(tiny) -> None:
    target = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    runner = Runner(Pair(target, tiny["pair"].draft, tiny["pair"].tokenizer), NEW_TOKENS, 0.0)
    for kind in TREE_DECODERS:
        assert "flash_attention_2" in runner.supports(MethodSpec(kind))
        with pytest.raises(ValueError, match="cannot run at temperature=0.0: tree verification needs the target"):
            runner.decoder(MethodSpec(kind))


# ---- names, report, bad parameters --------------------------------------------------------------------------------


def test_tree_methods_have_names_that_state_their_setting() -> None:
    grids = [
        PolicyGrid("ngrammys", {"k": [10]}),
        PolicyGrid("lookahead", {"window": [4], "ngram": [3], "guess_set": [4]}),
        PolicyGrid("ouroboros", {"gamma": [4], "candidates": [3]}),
    ]
    names = [spec.name for grid in grids for spec in grid.expand()]
    assert names == ["N-Grammys k=10 w=4 q=2 mixed", "Lookahead W=4 N=3 G=4", "Ouroboros γ=4 β=4 W=5 K=3"]
    spec = MethodSpec("ouroboros", tree_params("ouroboros", {"draft": "standalone"}))
    assert spec.name == "Ouroboros γ=8 β=4 W=5 K=4 draft=standalone"


def test_report_finds_h_star_by_role_and_ranks_tree_decoders_as_families() -> None:
    bundle = SimpleNamespace(h_star=lambda greedy=False: (0.7, None))
    star = h_star_spec(bundle)
    decoy = MethodSpec("specdecpp", {"threshold": 0.3}, label="SpecDec++ h*=0.3 (a swept point)")
    specs = [MethodSpec("autoregressive"), MethodSpec("fixed_k", {"k": 2}), decoy, star]
    specs += [MethodSpec("ngrammys", {"k": k}) for k in (1, 5)] + [MethodSpec("lookahead", {"window": 2})]
    runs = {}
    for index, spec in enumerate(specs):
        stats = TreeDecodeStats() if spec.kind in TREE_DECODERS else DecodeStats()
        stats.generated, stats.target_calls, stats.total_time = 12, 6, 1.0 / (index + 1)
        stats.proposed, stats.accepted = [1] * 6, [1] * 6
        if isinstance(stats, TreeDecodeStats):
            stats.fed, stats.rows = [3] * 6, [1] * 6
        runs[spec.name] = [[stats]]
    summaries = summarize(specs, runs, None)
    analysis = analyse(summaries, "measured")
    assert analysis["h_star"] == star.name
    assert analysis["best"]["ngrammys"] == "N-Grammys k=5" and analysis["best"]["lookahead"] == "Lookahead W=2"
    assert [r["kind"] for r in analysis["rows"]][-2:] == ["ngrammys", "lookahead"]
    payload = {"results": {"set": {"greedy": {"analysis": analysis}}}}
    table = "\n".join(_table_one(payload))
    assert "Lookahead W=2" in table  # the fastest family here is the best other baseline
    assert throughput(summaries[-1], "measured") == max(throughput(s, "measured") for s in summaries)


BAD = [
    ("ngrammys", {"k": 0}, r"k=0 must be an integer >= 1"),
    ("ngrammys", {"w": 2.5}, r"w=2\.5 must be an integer"),
    ("ngrammys", {"strategy": "trie"}, r"strategy='trie' must be one of"),
    ("ngrammys", {"kk": 3}, r"'ngrammys' does not take parameters \['kk'\]"),
    ("ngrammys", {"draft": "standalone"}, r"does not take parameters \['draft'\]"),
    ("lookahead", {"ngram": 1}, r"ngram \(N\)=1 must be an integer >= 2"),
    ("lookahead", {"context_ngrams": "yes"}, r"context_ngrams='yes' must be true or false"),
    ("ouroboros", {"phrases_per_token": 4, "candidates": 9}, r"candidates \(K\)=9 must be an integer in \[1, "),
    ("ouroboros", {"phrase_length": 1}, r"phrase_length \(β\)=1 must be an integer >= 2"),
]


@pytest.mark.parametrize(("kind", "params", "match"), BAD, ids=[f"{k}-{sorted(p)}" for k, p, _ in BAD])
def test_bad_tree_parameters_raise_value_errors_naming_the_value(tiny, kind, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        Runner(tiny["pair"], NEW_TOKENS, 0.0).decoder(MethodSpec(kind, params))
    with pytest.raises(ValueError, match=match):
        PolicyGrid(kind, {key: [value] for key, value in params.items()}).expand()


def test_copy_aware_chains_without_copies_are_refused(tiny) -> None:
    """``copy_k`` (as ``copy_threshold``) reads the row copied below the chain: a chain without ``context_row`` would
    silently ignore it, so the runner refuses it and names the fix."""
    with pytest.raises(ValueError, match=r"\['copy_k'\] decide by .* chain copies none: give it context_row"):
        Runner(tiny["pair"], NEW_TOKENS, 0.0).decoder(MethodSpec("fixed_k", {"k": 3, "copy_k": 1}))
    assert Runner(tiny["pair"], NEW_TOKENS, 0.0).decoder(MethodSpec("fixed_k", {"k": 3, "copy_k": 1, "context_row": 4}))


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ([{"k": 5, "w": 4}, {"k": 0, "w": 4}], "ngrammys[1]: k=0 must be an integer >= 1"),
        # a tree decoder's stop is a RowStop object handed over from code, never a config value
        ([{"k": 2, "stop": 0.5}], "ngrammys[0]: ngrammys parameter stop=0.5 must be a RowStop object"),
    ],
)
def test_bench_refuses_a_bad_grid_entry_before_loading_any_model(tmp_path, capsys, grid, message) -> None:
    config = {
        "bundle": str(tmp_path / "no-such-bundle"),
        "prompts": [{"path": "humaneval"}],
        "validation_prompts": [{"path": "humaneval"}],
        "ngrammys": grid,
        "output_dir": str(tmp_path / "bench"),
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--config", str(path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
