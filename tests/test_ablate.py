"""``python -m eval ablate`` end to end on the tiny pair: one real ``train fit`` per variant, scored alike."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from train_helpers import REPO, train_config, write_config

import accept_head.evaluation.ablate as ablate_module
from eval.__main__ import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

VARIANTS = [
    {"name": "recipe"},
    # One run carries two kinds of override (the head's depth, the sweep's Alg. 2 setting): one fit fewer.
    {
        "name": "depth0-alg2",
        "args": ["--model.depth=0", "--sweep.min_candidates=2", "--sweep.unscored=[null]"],
        "note": "D = 0, Alg. 2",
    },
    {"name": "half", "args": ["--data.train_fraction=0.5"]},
]


@pytest.fixture(scope="module")
def ablation(train_setup, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ablate")
    config = write_config(train_config(train_setup, root / "base-run"), root / "train.yaml")
    costs = root / "costs.json"
    costs.write_text(json.dumps({"cost_model": {"t_draft": 0.002, "t_target_a": 0.02, "t_target_b": 0.001}}))
    ablate_config = root / "ablate.yaml"
    ablate_config.write_text(
        yaml.safe_dump(
            {
                "train_config": str(config),
                "variants": VARIANTS,
                "bundle": None,
                "cost_model": str(costs),
                "thresholds": [0.3, 0.7],
                "unscored": ["confidence"],
                "fixed_k": [1, 2],
                "prompts": 2,
                "max_new_tokens": 6,
                "output_dir": str(root / "out"),
                "markdown": str(root / "docs" / "ablations.md"),
            }
        )
    )
    main(["ablate", "--config", str(ablate_config)])
    return root, ablate_config


def test_ablate_trains_one_head_per_variant_and_scores_them_alike(ablation) -> None:
    root, _ = ablation
    payload = json.loads((root / "out" / "ablate.json").read_text())
    results = {r["name"]: r for r in payload["results"]}
    assert list(results) == [v["name"] for v in VARIANTS]
    fixed = {"t_draft": 0.002, "t_target_a": 0.02, "t_target_b": 0.001}
    assert payload["cost_model"] == fixed | {"t_draft_next": None, "t_head": None, "t_head_next": None}
    # Only the reference run decodes the baselines; every run sweeps its own head over the same h grid.
    families = {name: {row["family"] for row in r["rows"]} for name, r in results.items()}
    assert families["recipe"] == {"autoregressive", "fixed_k", "threshold", "ablated"}  # ablated: the head removed
    assert all(families[name] == {"threshold"} for name in ("depth0-alg2", "half"))
    for r in results.values():
        assert {row["param"] for row in r["rows"] if row["family"] == "threshold"} == {0.3, 0.7}
        assert r["best"]["modeled_tokens_per_second"] > 0 and 0.0 <= r["val"]["auc"] <= 1.0
        assert r["val_prompts"] == 6  # the validation split does not depend on the variant
    # The overrides reached the runs: depth, training-set size, the sweep's variant and minimum.
    hparams = yaml.safe_load((root / "out" / "runs" / "depth0-alg2" / "version_0" / "hparams.yaml").read_text())
    assert hparams["depth"] == 0
    assert results["half"]["train_prompts"] == results["recipe"]["train_prompts"] // 2
    assert results["half"]["train_positions"] < results["recipe"]["train_positions"]
    assert {row["variant"] for row in results["depth0-alg2"]["rows"]} == {None}
    assert {row["variant"] for row in results["recipe"]["rows"] if row["family"] == "threshold"} == {"confidence"}
    assert results["depth0-alg2"]["note"] == "D = 0, Alg. 2" and results["half"]["note"] == "--data.train_fraction=0.5"
    # Files: per-variant results, the figure, the page (its figure beside it).
    for name in results:
        assert (root / "out" / "variants" / f"{name}.json").is_file()
    assert (root / "out" / "ablate.png").stat().st_size > 0
    page = (root / "docs" / "ablations.md").read_text()
    assert f"`cpu_capability` {torch.backends.cpu.get_cpu_capability()}," in page  # the page names its CPU
    assert (
        "| depth0-alg2 | D = 0, Alg. 2 |" in page and "![modeled throughput per variant](ablations/ablate.png)" in page
    )
    best_ablated = max(
        (row for row in results["recipe"]["rows"] if row["family"] == "ablated"),
        key=lambda row: row["modeled_tokens_per_second"],
    )
    assert f"| {best_ablated['label']} | baseline (reference run): the head removed, its rule on q |" in page
    assert (root / "docs" / "ablations" / "ablate.png").is_file()
    assert not (root / "base-run" / "bundle").exists()  # the export stage is off in ablations


def test_ablate_resumes_without_retraining_finished_variants(ablation, monkeypatch, capsys) -> None:
    root, ablate_config = ablation
    before = json.loads((root / "out" / "ablate.json").read_text())["results"]

    def refuse(args):
        raise AssertionError(f"retrained a finished variant: {args}")

    monkeypatch.setattr(ablate_module, "run_variant", refuse)
    main(["ablate", "--config", str(ablate_config)])
    assert capsys.readouterr().out.count("already done") == len(VARIANTS)
    assert json.loads((root / "out" / "ablate.json").read_text())["results"] == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--variants", '[{"name": "a"}, {"name": "a"}]'], "variant names must be unique"),
        (["--variants", '[{"name": "../x"}]'], "cannot be file names"),
        (["--bundle", "null"], "needs a fixed cost model"),
        (["--train_config", "missing.yaml"], "does not exist"),
    ],
)
def test_ablate_refuses_bad_input_with_the_fix(flags, message, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["ablate", "--train_config", str(REPO / "configs" / "demo.yaml"), "--output_dir", str(tmp_path), *flags])
    assert message in capsys.readouterr().err


def test_shipped_ablation_config_parses(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ablate", "--config", str(REPO / "configs" / "eval" / "ablate.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["variants"][0]["name"] == "recipe" and len(printed["variants"]) >= 10


def test_shipped_input_ablation_config_removes_one_input_at_a_time(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ablate", "--config", str(REPO / "configs" / "eval" / "ablate-inputs.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    variants = {v["name"]: v["args"] for v in yaml.safe_load(capsys.readouterr().out)["variants"]}
    for name in ("logq", "entropy", "top1", "depth", "path_logq"):
        inputs = next(a for a in variants[f"no-{name}"] if a.startswith("--model.inputs="))
        assert name not in inputs.split("=", 1)[1].strip("[]").split(",")


def test_the_committed_heads_ablation_removes_each_of_its_inputs_and_adds_the_hidden_state(capsys) -> None:
    """configs/eval/ablate-inputs-committed.yaml follows the committed recipe: a `no-<input>` variant for every input
    the committed head reads (read from its train config), each without that input, and the hidden-state variants."""
    with pytest.raises(SystemExit) as exit_info:
        main(["ablate", "--config", str(REPO / "configs" / "eval" / "ablate-inputs-committed.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    recipe = yaml.safe_load((REPO / printed["train_config"]).read_text())["model"]["inputs"]
    variants = {v["name"]: v["args"] for v in printed["variants"]}

    def inputs(name: str) -> list[str]:
        flag = next(a for a in variants[name] if a.startswith("--model.inputs="))
        return flag.split("=", 1)[1].strip("[]").split(",")

    for name in recipe:
        assert sorted(inputs(f"no-{name}")) == sorted(set(recipe) - {name})
    assert inputs("hidden-only") == ["hidden"] and sorted(inputs("plus-hidden")) == sorted([*recipe, "hidden"])


def test_ablate_counts_labelled_positions_of_token_and_rollout_rows() -> None:
    """Token-level rows count their response, rollout rows their candidates (a rollout run once failed here)."""
    import torch

    from accept_head.training.data import HiddenRow, LabelRow

    token = LabelRow("a", torch.arange(3), torch.arange(5), torch.arange(5), torch.ones(5))
    rollout = HiddenRow("b", torch.arange(3), torch.zeros(4, 2), torch.ones(4), torch.zeros(4, 5))
    assert [ablate_module._labelled(token), ablate_module._labelled(rollout)] == [5, 4]
