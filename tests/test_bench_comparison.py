"""``python -m eval bench`` with a ``comparison_draft``: a standalone draft benchmarked beside the pair's own.

On tiny models, through the real CLI, for a bundle whose draft is a Hugging Face model and one whose draft is a
:class:`~accept_head.models.feature_draft.FeatureDraft`:

* FixedK rows with ``draft=standalone`` (and ``draft=standalone-pruned``, the standalone model restricted to the
  feature draft's kept vocabulary, for the feature-draft bundle) exist with the K chosen for that draft on validation;
* ``ratio_to_best_fixed_k`` is taken against the pair's own FixedK row, never a comparison row;
* HF assisted rows run with the pair's draft when it is an HF model and with the standalone draft otherwise;
* a method's ``draft`` parameter reaches the decoder (``Runner`` → ``Pair.draft_for``), and every comparison-draft
  method is lossless: its greedy output equals the target's autoregressive greedy output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import make_llama, make_tokenizer, perturbed_copy, save_bundle

import accept_head.engine.runner as engine
from accept_head.engine.pair_loading import load_pair
from accept_head.engine.runner import MethodSpec, Runner, greedy_identity
from accept_head.evaluation.bench import add_comparison_drafts
from accept_head.models.drafters import ModelDrafter
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.pairs import ModelSpec
from eval.__main__ import main

WORDS = "write a short poem about the number two . explain why python code is fun please give me one answer".split()
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A target; an HF draft (perturbed copy) and a feature draft, each bundled with a head; a standalone draft;
    test and validation prompts; a fixed cost model."""
    root = tmp_path_factory.mktemp("bench_comparison")
    tokenizer = make_tokenizer()
    target = make_llama(root / "target", tokenizer=tokenizer, seed=0)
    draft = perturbed_copy(target, relative_noise=0.05, seed=1)
    for name, model in (("draft", draft), ("standalone", perturbed_copy(target, relative_noise=0.2, seed=2))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    feature_draft = FeatureDraft.from_target(target, torch.arange(3, 60), target_name=str(root / "target"))
    feature_draft.save_pretrained(root / "feature_draft")
    for name, model, path in (("hf", draft, "draft"), ("feature", feature_draft, "feature_draft")):
        save_bundle(root / f"bundle_{name}", target, model, tokenizer, root / "target", root / path)
    generator = torch.Generator().manual_seed(0)
    for name in ("test", "val"):
        with (root / f"{name}.jsonl").open("w") as f:
            for i in range(2):
                picks = torch.randint(0, len(WORDS), (6,), generator=generator).tolist()
                f.write(json.dumps({"instruction": f"{name} {i} " + " ".join(WORDS[j] for j in picks)}) + "\n")
    (root / "costs.json").write_text(json.dumps({"cost_model": {"t_draft": 1e-3, "t_target_a": 1e-2}}))
    return {"root": root, "target": target, "feature_draft": feature_draft}


def run_bench(tiny: dict, bundle: str, tmp_path: Path, **overrides) -> dict:
    root = tiny["root"]
    config = {
        "bundle": str(root / f"bundle_{bundle}"),
        "prompts": [{"path": str(root / "test.jsonl")}],
        "validation_prompts": [{"path": str(root / "val.jsonl")}],
        "comparison_draft": {"path": str(root / "standalone"), "dtype": "float32"},
        "max_new_tokens": NEW_TOKENS,
        "temperatures": [0.0],
        "repeats": 1,
        "warmup": 0,
        "fixed_k": [1, 3],
        "entropy_thresholds": [0.5],
        "confidence_tau": 0.4,
        "hf_settings": [{"num_assistant_tokens": None, "schedule": "constant"}],
        "cost_model": str(root / "costs.json"),
        "output_dir": str(tmp_path / "bench"),
        "progress": False,
    } | overrides
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["bench", "--config", str(path)])
    return json.loads((tmp_path / "bench" / "bench.json").read_text())["results"]["greedy"]


@pytest.mark.parametrize("bundle", ["hf", "feature"])
def test_bench_adds_comparison_rows_and_ratios_use_the_pairs_own_fixed_k(tiny, tmp_path, bundle) -> None:
    greedy = run_bench(tiny, bundle, tmp_path)
    names = ["standalone", "standalone-pruned"] if bundle == "feature" else ["standalone"]
    by_draft = greedy["validation"]["best_k_by_draft"]
    assert sorted(by_draft) == sorted(names) and all(k in (1, 3) for k in by_draft.values())
    # Validation ran every K with every comparison draft.
    validated = [m["params"] for m in greedy["validation"]["methods"] if m["kind"] == "fixed_k"]
    assert [p for p in validated if "draft" in p] == [{"k": k, "draft": n} for n in names for k in (1, 3)]
    own = [m for m in greedy["methods"] if m["kind"] == "fixed_k" and "draft" not in m["params"]]
    assert len(own) == 1 and own[0]["params"] == {"k": greedy["validation"]["best_k"]}
    own = own[0]
    assert own["ratio_to_best_fixed_k"] == pytest.approx(1.0)
    assert own["modeled_ratio_to_best_fixed_k"] == pytest.approx(1.0)
    for name in names:
        (row,) = [m for m in greedy["methods"] if m["kind"] == "fixed_k" and m["params"].get("draft") == name]
        assert row["params"] == {"k": by_draft[name], "draft": name}
        assert row["generated"] > 0 and row["draft_calls"] > 0
        expected = row["tokens_per_second"]["median"] / own["tokens_per_second"]["median"]
        assert row["ratio_to_best_fixed_k"] == pytest.approx(expected)
    drafts_named = {m["params"].get("draft") for m in greedy["methods"]}
    assert drafts_named == {None, *names}
    (hf,) = [m for m in greedy["methods"] if m["kind"] == "hf_assisted"]
    if bundle == "hf":  # the pair's own HF draft, at the pair's best K
        assert hf["params"]["num_assistant_tokens"] == greedy["validation"]["best_k"] and "draft" not in hf["params"]
    else:  # a feature draft cannot run in HF's assisted generation: the standalone draft does, at its best K
        assert hf["params"]["draft"] == "standalone"
        assert hf["params"]["num_assistant_tokens"] == by_draft["standalone"]
        assert hf["name"] == f"HF constant K={by_draft['standalone']} draft=standalone"
    assert hf["generated"] > 0 and hf["ratio_to_best_fixed_k"] > 0
    # float32: every lossless method reproduces autoregressive greedy on every prompt.
    identity = greedy["greedy_identity"]
    assert sorted(identity) == sorted(m["name"] for m in greedy["methods"] if m["kind"] != "autoregressive")
    assert all(v["identical"] == v["decodes"] > 0 and v["first_divergence"] == [] for v in identity.values())


def test_specdec_thresholds_choose_h_on_validation_and_the_test_prompts_decode_at_it(tiny, tmp_path, capsys) -> None:
    """With ``specdec_thresholds`` SpecDec++ runs every h on validation and the test prompts at the winner (what a
    compiled target, whose costs the bundle's cost model does not describe, needs)."""
    greedy = run_bench(tiny, "feature", tmp_path, specdec_thresholds=[0.2, 0.8], select_by="measured")
    validated = [m for m in greedy["validation"]["methods"] if m["kind"] == "specdecpp"]
    assert sorted(m["params"]["threshold"] for m in validated) == [0.2, 0.8]
    best = max(validated, key=lambda m: m["selection_tokens_per_second"])
    assert greedy["validation"]["best_specdec_threshold"] == best["params"]["threshold"]
    (row,) = [m for m in greedy["methods"] if m["kind"] == "specdecpp"]
    assert row["params"]["threshold"] == best["params"]["threshold"] and "(validation)" in row["name"]
    identity = greedy["greedy_identity"][row["name"]]
    assert identity["identical"] == identity["decodes"] > 0
    with pytest.raises(SystemExit):
        run_bench(tiny, "feature", tmp_path, specdec_thresholds=[1.5])
    assert "specdec_thresholds=[1.5] must hold values in (0, 1)" in capsys.readouterr().err


def test_chain_context_row_adds_copying_chains_chosen_on_validation(tiny, tmp_path, capsys) -> None:
    """``chain_context_row``: FixedK and SpecDec++ also run with copied rows, K and h chosen among the copying chains
    on validation; they are lossless (float32 greedy identity) and paired with their plain twins."""
    greedy = run_bench(
        tiny, "feature", tmp_path, chain_context_row=4, specdec_thresholds=[0.2, 0.8], hf_settings=[], stop_rules=False
    )
    chosen = greedy["validation"]["chain_context_row"]
    copying = [m for m in greedy["validation"]["methods"] if m["params"].get("context_row")]
    assert sorted((m["kind"], m["params"].get("k")) for m in copying) == sorted(
        [("fixed_k", 1), ("fixed_k", 3), ("specdecpp", None), ("specdecpp", None)]
    )  # the pair's own draft only, never the comparison draft
    rows = [m for m in greedy["methods"] if m["params"].get("context_row") == 4]
    assert [(m["kind"], m["params"].get("k"), m["params"].get("threshold")) for m in rows] == [
        ("fixed_k", chosen["best_k"], None),
        ("specdecpp", None, chosen["best_specdec_threshold"]),
    ]
    identity = [greedy["greedy_identity"][m["name"]] for m in rows]
    assert all(v["identical"] == v["decodes"] > 0 and v["first_divergence"] == [] for v in identity)
    assert sorted(greedy["context_row_ratios"]) == ["fixed_k", "specdecpp"]
    assert greedy["copied_chain_ratio"]["name"] == rows[1]["name"]
    with pytest.raises(SystemExit):
        run_bench(tiny, "feature", tmp_path, chain_context_row=-1)
    assert "chain_context_row=-1 must be >= 0" in capsys.readouterr().err


def test_copy_aware_grids_compete_among_the_copying_chains(tiny, tmp_path, capsys) -> None:
    """``chain_copy_ks`` / ``chain_copy_thresholds``: each copying FixedK also runs with every ``copy_k`` and each
    copying SpecDec++ (at h* when no h grid is searched) with every ``copy_threshold``; the test prompts decode the
    setting validation chose, lossless; without copies the grids are refused, naming the fix."""
    greedy = run_bench(
        tiny,
        "feature",
        tmp_path,
        chain_context_row=4,
        chain_copy_ks=[1],
        chain_copy_thresholds=[0.3],
        hf_settings=[],
        stop_rules=False,
    )
    copying = [m["params"] for m in greedy["validation"]["methods"] if m["params"].get("context_row")]
    assert sorted((p.get("k", 0), p.get("copy_k", 0), p.get("copy_threshold", 0)) for p in copying) == [
        (0, 0, 0),
        (0, 0, 0.3),
        (1, 0, 0),
        (1, 1, 0),
        (3, 0, 0),
        (3, 1, 0),
    ]
    chosen = greedy["validation"]["chain_context_row"]
    rows = {m["kind"]: m["params"] for m in greedy["methods"] if m["params"].get("context_row")}
    assert rows["fixed_k"].get("copy_k") == chosen["best_copy_k"] and rows["fixed_k"]["k"] == chosen["best_k"]
    assert rows["specdecpp"].get("copy_threshold") == chosen["best_copy_threshold"]
    named = [m["name"] for m in greedy["methods"] if m["params"].get("context_row")]
    assert all(v["identical"] == v["decodes"] > 0 for v in (greedy["greedy_identity"][n] for n in named))
    with pytest.raises(SystemExit):
        run_bench(tiny, "feature", tmp_path, chain_context_row=0, chain_copy_ks=[1])
    assert "chain_context_row=0 copies none" in capsys.readouterr().err


def test_the_bench_copies_as_the_bundle_does_unless_told(tiny, tmp_path) -> None:
    """Without ``chain_context_row`` the bench runs the copying chains at the bundle's own ``context_row`` (what its
    ``generate`` decodes); 0 turns them off."""
    bundle = tiny["root"] / "bundle_copies"
    shutil.copytree(tiny["root"] / "bundle_feature", bundle, dirs_exist_ok=True)
    config = bundle / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"context_row": 2}))
    quick = {"fixed_k": [2], "hf_settings": [], "stop_rules": False}
    greedy = run_bench(tiny, "copies", tmp_path, **quick)
    assert greedy["validation"]["chain_context_row"]["context_row"] == 2
    assert sorted(m["kind"] for m in greedy["methods"] if m["params"].get("context_row") == 2) == [
        "fixed_k",
        "specdecpp",
    ]
    plain = run_bench(tiny, "copies", tmp_path, chain_context_row=0, **quick)
    assert not any(m["params"].get("context_row") for m in plain["methods"] + plain["validation"]["methods"])


def test_warmup_decodes_validation_prompts_untimed_too(tiny, tmp_path, monkeypatch) -> None:
    """``warmup`` prompts are decoded untimed before the validation runs as before the test runs, so a compiled target
    does not time its compilation where settings are chosen."""
    import accept_head.engine.runner as runner_module

    real, seen = runner_module.run_decoders, []

    def recording(decoders, prompts, seed=0, repeats=1, warmup=0, progress=True, desc="", outputs=None):
        seen.append((desc, warmup))
        return real(decoders, prompts, seed, repeats, warmup, progress, desc, outputs)

    monkeypatch.setattr(runner_module, "run_decoders", recording)
    run_bench(tiny, "feature", tmp_path, warmup=1, hf_settings=[], stop_rules=False)
    assert [desc for desc, _ in seen] == ["validation greedy", "bench greedy"]
    assert all(warmup == 1 for _, warmup in seen)


def test_greedy_identity_counts_differing_decodes_and_where_they_part() -> None:
    outputs = {
        "AR": [[(1, 2, 3), (4, 5)], [(1, 2, 3), (4, 5)]],
        "A": [[(1, 2, 3), (4, 6)], [(1, 9, 3), (4, 5)]],
        "B": [[(1, 2, 3), (4, 5, 7)], [(1, 2, 3), (4, 5)]],
    }
    report = greedy_identity(outputs, "AR")
    assert report == {
        "A": {"identical": 2, "decodes": 4, "first_divergence": [1, 1]},
        "B": {"identical": 3, "decodes": 4, "first_divergence": [2]},  # a longer output parts where the shorter ends
    }


def test_comparison_drafts_reach_the_decoder_and_decode_losslessly(tiny, monkeypatch) -> None:
    pair = load_pair(str(tiny["root"] / "bundle_feature"))
    assert isinstance(pair.draft, FeatureDraft)
    add_comparison_drafts(pair, ModelSpec(path=str(tiny["root"] / "standalone"), dtype="float32"))
    standalone, pruned = pair.comparison_drafts["standalone"], pair.comparison_drafts["standalone-pruned"]
    assert isinstance(pruned, ModelDrafter) and pruned.model is standalone
    assert torch.equal(pruned.kept_ids.cpu(), pair.draft.kept_ids.cpu())
    used = []
    original = engine.speculative_generate

    def spy(target, draft, *args, **kwargs):
        used.append(draft)
        return original(target, draft, *args, **kwargs)

    monkeypatch.setattr(engine, "speculative_generate", spy)
    runner = Runner(pair, NEW_TOKENS, 0.0)
    autoregressive = runner.decoder(MethodSpec("autoregressive"))
    specs = {
        None: MethodSpec("fixed_k", {"k": 3}),
        "standalone": MethodSpec("fixed_k", {"k": 3, "draft": "standalone"}),
        "standalone-pruned": MethodSpec("fixed_k", {"k": 2, "draft": "standalone-pruned"}),
    }
    hf = runner.decoder(MethodSpec("hf_assisted", {"num_assistant_tokens": 3, "draft": "standalone"}))
    prompts = [pair.tokenizer.encode(text) for text in ("write a short poem", "explain why python code is fun")]
    for ids in prompts:
        expected = autoregressive(ids, torch.Generator().manual_seed(0)).sequences
        for name, spec in specs.items():
            used.clear()
            result = runner.decoder(spec)(ids, torch.Generator().manual_seed(0))
            assert used == [pair.draft_for(name)]
            assert torch.equal(result.sequences, expected), (name, ids)
            assert result.stats.draft_calls > 0
        assert torch.equal(hf(ids, torch.Generator().manual_seed(0)).sequences, expected)
    with pytest.raises(ValueError, match="no comparison draft named 'other'"):
        runner.decoder(MethodSpec("fixed_k", {"k": 2, "draft": "other"}))
    # A feature draft is not an HF model: HF assisted generation needs a comparison draft named.
    assert "Hugging Face draft" in runner.supports(MethodSpec("hf_assisted", {"num_assistant_tokens": 3}))


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_runner_ignore_eos_makes_every_method_write_the_whole_budget(ignore_eos: bool) -> None:
    """With an EOS the target writes early, decoders stop there unless the runner ignores EOS; then every method,
    HF's assisted generation included, writes exactly max_new_tokens (outputs of one length for tokens/s)."""
    from accept_head.engine.pair_loading import Pair

    tokenizer = make_tokenizer()
    target = make_llama(tokenizer=tokenizer, seed=0)
    draft = perturbed_copy(target, relative_noise=0.05, seed=1)
    prompt = [2, 10, 11, 12]
    greedy = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4)[0, len(prompt) :].tolist()
    pair = Pair(target, draft, tokenizer, stop_ids=[greedy[1]])  # the target's second greedy token ends the text
    runner = Runner(pair, max_new_tokens=12, temperature=0, ignore_eos=ignore_eos)
    specs = [MethodSpec("autoregressive"), MethodSpec("fixed_k", {"k": 3}), MethodSpec("hf_assisted", {})]
    for spec in specs:
        result = runner.decoder(spec)(prompt, torch.Generator().manual_seed(0))
        expected = 12 if ignore_eos else greedy.index(greedy[1]) + 1
        assert result.stats.generated == expected, spec.name
