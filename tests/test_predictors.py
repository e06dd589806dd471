"""``python -m eval predictors`` (:mod:`accept_head.evaluation.predictors`): every acceptance predictor on the same
held-out rollout candidates. A tiny pair (the draft a noisy copy of the target, so candidates are both accepted and
rejected) labelled by the real data_gen, a bundle head and a head checkpoint written by a real ``train fit``."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from sklearn.metrics import roc_auc_score
from tiny_models import make_llama, make_tokenizer, perturbed_copy
from train_helpers import TinySetup, run_data_gen, train_config, write_config, write_prompts

from accept_head.acceptance.calibration import Calibration
from accept_head.acceptance.head import AcceptanceHead
from accept_head.acceptance.inputs import SCALAR_INPUTS, stored_inputs
from accept_head.chain.baselines import EntropyStop
from accept_head.chain.rollout import read_hidden
from accept_head.evaluation import predictors as module
from accept_head.training.data import prompt_split

HELD_OUT = 6
"""Validation prompts of the seeded split, for the checkpoint's fit and the command alike."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Sampled and greedy rollout labels of 20 prompts, a bundle whose head reads the hidden state and three of the
    five scalars (with a sampling and a greedy calibration map) and the checkpoint of a one-epoch ``train fit`` on the
    sampled labels."""
    root = tmp_path_factory.mktemp("predictors")
    tokenizer = make_tokenizer()
    target = make_llama(root / "target", tokenizer=tokenizer, seed=0, hidden_size=16)
    draft = perturbed_copy(target, 0.3)
    draft.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    setup = TinySetup(root, root / "target", root / "draft", write_prompts(root / "prompts.jsonl", 20), root / "labels")
    rollout = {"label_mode": "rollout", "k_max": 4, "batch_size": 10, "max_new_tokens": 16}
    run_data_gen(setup.data_gen_config(**rollout), setup.labels)
    run_data_gen(setup.data_gen_config(**rollout, temperature=0), root / "greedy")
    bundle = root / "bundle"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(16, depth=1, inputs=("hidden", "logq", "depth", "path_logq"), residual_on="logq")
        torch.nn.init.normal_(head.out.weight, std=0.3)  # a correction of logit(q) that reads the hidden state
    from accept_head import SpecDecPP

    SpecDecPP(
        target,
        draft,
        head,
        threshold=0.5,
        calibration=Calibration("temperature", temperature=2.0),
        greedy_calibration=Calibration("isotonic", x=[0.0, 1.0], y=[0.2, 0.9]),
    ).save_pretrained(bundle)
    config = train_config(setup, root / "run", stages=False, trainer={"max_epochs": 1}, data={"val_size": HELD_OUT})
    config["model"] |= {"inputs": ["hidden", "logq", "entropy"], "residual_on": "logq"}
    from accept_head.training.cli import cli_main

    cli_main(["fit", "--config", str(write_config(config, root / "fit.yaml"))])
    (checkpoint,) = (root / "run").rglob("*.ckpt")
    return {"labels": setup.labels, "greedy": root / "greedy", "bundle": bundle, "checkpoint": checkpoint}


def run(tiny: dict[str, Path], tmp_path: Path, *extra: str) -> dict:
    """The command through its real command line, on the sampled labels with the seeded split the fit used."""
    from eval.__main__ import main

    argv = ["predictors", "--dataset", str(tiny["labels"]), "--val_size", str(HELD_OUT)]
    return main([*argv, "--output_dir", str(tmp_path / "out"), *extra])


def rows(path: Path) -> list[dict]:
    return datasets.load_from_disk(str(path)).to_list()


def held_out_ids(path: Path) -> set[str]:
    """The seeded split's held-out prompts, from the data module's own split function."""
    ids = [row["prompt_id"] for row in rows(path) if row["accept_prob"]]
    return set(prompt_split(ids, 0.1, HELD_OUT, 0)["val"])


def judged_candidates(row: dict) -> list[bool]:
    """Per candidate of a row: was it judged (a round's first, or right after an accepted one)?"""
    return [k == 0 or step == 1 or row["accepted"][k - 1] for k, step in enumerate(row["step"])]


def test_the_command_scores_every_predictor_and_head_on_held_out_candidates(tiny, tmp_path) -> None:
    heads = f"[{tiny['bundle']}, {tiny['checkpoint']}]"
    payload = run(tiny, tmp_path, "--heads", heads, "--greedy_dataset", str(tiny["greedy"]))
    written = json.loads((tmp_path / "out" / "predictors.json").read_text())
    assert written["machine"]["cpu_count"] and written["code"]["package"] == "accept-head"
    assert written["split"] == payload["split"] and payload["split"]["kind"] == "seeded"
    assert "| predictor | n | judged |" in (tmp_path / "out" / "predictors.md").read_text()
    sampled, greedy = payload["results"]["dataset"], payload["results"]["greedy_dataset"]
    bundle, checkpoint = f"head {tiny['bundle']}", f"head {tiny['checkpoint']}"
    for key in ("q", "eagle2", "adaedl", "c2t", bundle, checkpoint):
        assert {key, f"{key} + isotonic"} <= set(sampled["predictors"]) and key in greedy["predictors"]
    assert (
        f"{bundle} + bundle map" in sampled["predictors"] and f"{checkpoint} + bundle map" not in sampled["predictors"]
    )
    assert "temperature map for sampling" in sampled["predictors"][f"{bundle} + bundle map"]["description"]
    assert "isotonic map for greedy" in greedy["predictors"][f"{bundle} + bundle map"]["description"]
    assert sampled["heads"][str(tiny["checkpoint"])].startswith("checked")  # its run's split, recomputed
    assert sampled["heads"][str(tiny["bundle"])].startswith("unchecked")  # a bundle without split.json
    held = held_out_ids(tiny["labels"])
    assert sampled["prompts"] == {"train": 20 - HELD_OUT, "held_out": HELD_OUT}
    assert set(sampled["held_out_prompts"]) == held
    data = [row for row in rows(tiny["labels"]) if row["prompt_id"] in held]
    firsts = sum(step == 1 for row in data for step in row["step"])
    assert sampled["predictors"]["q"]["all"]["n"] == sum(len(row["step"]) for row in data)
    assert sampled["predictors"]["q"]["first"]["n"] == sampled["predictors"]["q"]["first"]["judged"] == firsts
    # The bundle's head, recomputed from the dataset's stored states and inputs, gives the AUC the command reports.
    states = torch.cat(read_hidden(datasets.Dataset.from_list(data), 16)).float()
    inputs = stored_inputs(
        {c: [x for row in data for x in row[c]] for c in ("draft_logp", "draft_entropy", "draft_top1", "step")}
    )
    head = module.load_head(str(tiny["bundle"])).head
    probs = head.accept_prob(states, inputs[:, [SCALAR_INPUTS.index(n) for n in head.scalar_inputs]]).detach()
    judged = torch.tensor([j for row in data for j in judged_candidates(row)])
    accepted = torch.tensor([a for row in data for a in row["accepted"]])
    expected = roc_auc_score(accepted[judged].numpy(), probs[judged].numpy())
    assert sampled["predictors"][bundle]["all"]["auc_accepted"] == pytest.approx(expected, abs=1e-6)


def test_q_alone_auc_equals_sklearn_on_the_held_out_judged_candidates(tiny, tmp_path) -> None:
    scores = run(tiny, tmp_path, "--baselines", "[q]", "--isotonic", "false")["results"]["dataset"]["predictors"]
    assert list(scores) == ["q"]
    held = held_out_ids(tiny["labels"])
    truth, q, labels, soft_q = [], [], [], []
    for row in rows(tiny["labels"]):
        if row["prompt_id"] not in held:
            continue
        for k, is_judged in enumerate(judged_candidates(row)):
            prob = float(torch.tensor(row["draft_logp"][k], dtype=torch.float64).exp())
            labels.append(row["accept_prob"][k])
            soft_q.append(prob)
            if is_judged:
                truth.append(row["accepted"][k])
                q.append(prob)
    assert 0 < sum(truth) < len(truth)  # both outcomes occur, so the AUC means something
    assert scores["q"]["all"]["auc_accepted"] == pytest.approx(roc_auc_score(truth, q), abs=1e-9)
    brier = sum((a - b) ** 2 for a, b in zip(soft_q, labels)) / len(labels)
    assert scores["q"]["all"]["brier"] == pytest.approx(brier, abs=1e-6)


def test_a_predictor_equal_to_the_outcome_has_auc_1_and_a_constant_one_auc_one_half(tiny) -> None:
    candidates = module.load_candidates(str(tiny["labels"]), with_hidden=False)
    held = ~candidates.among(set(candidates.prompt_ids[:40]))
    perfect = module.views(candidates.accepted.double(), candidates, held)
    constant = module.views(torch.full_like(candidates.labels, 0.5), candidates, held)
    for view in ("all", "first"):
        assert perfect[view]["auc_accepted"] == 1.0 and constant[view]["auc_accepted"] == 0.5
        assert constant[view]["auc_soft"] == 0.5
    mean_label = float(candidates.labels[held].mean())
    assert constant["all"]["ece"] == pytest.approx(abs(0.5 - mean_label))
    reversed_ = module.views(1.0 - candidates.accepted.double(), candidates, held)
    assert reversed_["all"]["auc_accepted"] == 0.0


def test_the_bootstrap_interval_compares_with_q_on_the_same_resampled_prompts(tiny, tmp_path) -> None:
    """q against itself: a zero gap on every resample; the outcome itself against q: the gap sklearn gives, and an
    interval above zero; through the command, a column beside each predictor but q."""
    candidates = module.load_candidates(str(tiny["labels"]), with_hidden=False)
    held = ~candidates.among(set(candidates.prompt_ids[:40]))
    q = candidates.column("logq").exp()
    same = module.auc_gap(q, q, candidates, held, resamples=40, seed=0)
    assert same["delta"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["resamples"] == 40
    perfect = module.auc_gap(candidates.accepted.double(), q, candidates, held, resamples=40, seed=0)
    judged = held & candidates.judged
    expected = 1.0 - roc_auc_score(candidates.accepted[judged].numpy(), q[judged].numpy())
    assert perfect["delta"] == pytest.approx(expected) and 0 < perfect["ci95"][0] <= perfect["ci95"][1]
    assert perfect["prompts"] == len({candidates.prompt_ids[i] for i in judged.nonzero().squeeze(-1).tolist()})

    scores = run(tiny, tmp_path, "--baselines", "[q, adaedl]", "--isotonic", "false", "--bootstrap", "30")
    predictors = scores["results"]["dataset"]["predictors"]
    assert "auc_vs_q" not in predictors["q"] and predictors["adaedl"]["auc_vs_q"]["resamples"] > 0
    gap = predictors["adaedl"]["auc_vs_q"]["delta"]
    assert gap == pytest.approx(predictors["adaedl"]["all"]["auc_accepted"] - predictors["q"]["all"]["auc_accepted"])
    assert "AUC − q [95% CI]" in (tmp_path / "out" / "predictors.md").read_text()


def test_the_c2t_classifier_is_fitted_on_the_training_prompts_only(tiny, tmp_path, monkeypatch) -> None:
    seen = {}

    class Spy(module.C2TClassifier):
        @classmethod
        def fit(cls, features, labels, **kwargs):
            seen["features"], seen["labels"] = features, labels
            return super().fit(features, labels, **kwargs)

    monkeypatch.setattr(module, "C2TClassifier", Spy)
    run(tiny, tmp_path, "--baselines", "[c2t]", "--isotonic", "false")
    held = held_out_ids(tiny["labels"])
    expected_features, expected_labels = [], []
    for row in rows(tiny["labels"]):
        if row["prompt_id"] in held:
            continue
        path = 0.0
        for logq, entropy, step, label in zip(row["draft_logp"], row["draft_entropy"], row["step"], row["accept_prob"]):
            path = logq if step == 1 else path + logq
            expected_features.append([path, entropy, float(step), logq])
            expected_labels.append(label)
    assert len(seen["features"]) == len(expected_features) < sum(len(r["step"]) for r in rows(tiny["labels"]))
    torch.testing.assert_close(torch.tensor(seen["features"]), torch.tensor(expected_features))
    assert seen["labels"] == pytest.approx(expected_labels)


def test_adaedl_is_entropy_stop_s_own_bound_at_its_default_gamma(tiny) -> None:
    candidates = module.load_candidates(str(tiny["labels"]), with_hidden=False)
    gamma = EntropyStop().gamma
    assert inspect.signature(module.predictors).parameters["entropy_gamma"].default == gamma
    probs = module.baseline_probs("adaedl", candidates, candidates.step > 0, gamma, 0)
    entropy = candidates.column("entropy")
    torch.testing.assert_close(probs, (1 - (gamma * entropy).sqrt()).clamp(0, 1))


def without(path: Path, folder: Path, columns: list[str], **meta) -> Path:
    """A copy of the dataset at ``path`` without ``columns`` and with ``meta`` merged into its meta.json."""
    data = datasets.load_from_disk(str(path)).remove_columns(columns)
    data.save_to_disk(str(folder))
    (folder / "meta.json").write_text(json.dumps(json.loads((path / "meta.json").read_text()) | meta))
    return folder


def test_bad_input_names_the_value_and_the_fix(tiny, tmp_path, capsys) -> None:
    no_scalars = without(tiny["labels"], tmp_path / "no-step", ["step", "accepted"])
    with pytest.raises(ValueError, match=r"lacks the columns \['accepted', 'step'\].*--label_mode rollout"):
        module.predictors(str(no_scalars), output_dir=str(tmp_path / "o"))
    token_level = without(tiny["labels"], tmp_path / "sample", [], label_mode="sample")
    with pytest.raises(ValueError, match=r"label_mode='sample' labels.*--label_mode rollout"):
        module.predictors(str(token_level), output_dir=str(tmp_path / "o"))
    with pytest.raises(SystemExit) as exit_info:
        run(tiny, tmp_path, "--baselines", "[q, confidence]")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown predictor name(s) ['confidence']" in err and "'eagle2'" in err
    with pytest.raises(ValueError, match=r"--greedy_dataset=.* temperature 1.0.*--temperature 0"):
        module.predictors(str(tiny["labels"]), greedy_dataset=str(tiny["labels"]), output_dir=str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match=r"--heads: 'nowhere' is neither a bundle folder"):
        module.predictors(str(tiny["labels"]), heads=["nowhere"], output_dir=str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match=r"--split='nowhere': there is no split.json"):
        module.predictors(str(tiny["labels"]), split="nowhere", output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"--bootstrap=-1 must be >= 0"):
        module.predictors(str(tiny["labels"]), bootstrap=-1, output_dir=str(tmp_path / "o"))
    other = Path(shutil.copytree(tiny["bundle"], tmp_path / "other-draft-bundle"))  # a head trained for the target
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"draft": {"path": str(tiny["labels"].parent / "target")}}))
    with pytest.raises(ValueError, match=r"--heads .* was trained for the draft .*target' but .* labelled with"):
        module.predictors(str(tiny["labels"]), heads=[str(other)], output_dir=str(tmp_path / "o"))


def test_a_head_is_refused_when_it_trained_on_a_held_out_prompt(tiny, tmp_path) -> None:
    bundle = Path(shutil.copytree(tiny["bundle"], tmp_path / "bundle"))
    trained = sorted(held_out_ids(tiny["labels"]))[:2]
    (bundle / "split.json").write_text(json.dumps({"train": trained, "val": []}))
    settings = {"heads": [str(bundle)], "val_size": HELD_OUT, "output_dir": str(tmp_path / "out")}
    with pytest.raises(ValueError, match=r"was trained on 2 of the 6 held-out prompts.*--split"):
        module.predictors(str(tiny["labels"]), **settings)
    (bundle / "split.json").write_text(json.dumps({"train": ["elsewhere:1"], "val": trained}))
    checks = module.predictors(str(tiny["labels"]), **settings)["results"]["dataset"]["heads"]
    assert "2 held-out prompts are its validation prompts" in checks[str(bundle)]
