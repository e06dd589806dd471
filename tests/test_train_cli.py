"""``python -m train`` end to end through the real LightningCLI on a tiny random pair with data_gen labels."""

from __future__ import annotations

import csv
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.loggers import WandbLogger
from tiny_models import retrained_copy
from train_helpers import REPO, TinySetup, other_draft, train_config, write_config

from accept_head import SpecDecPP
from accept_head.training.cli import check_wandb_credentials, cli_main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def setup(train_setup: TinySetup) -> TinySetup:
    return train_setup  # conftest.py: shared with test_ablate


def fit(config: dict, tmp_path: Path, *extra: str, subcommand: str = "fit"):
    path = write_config(config, tmp_path / f"{subcommand}.yaml")
    return cli_main([subcommand, "--config", str(path), *extra])


def metrics_csv(log_dir: str | Path) -> dict[str, float]:
    """The last logged value of every metric in a CSVLogger's metrics.csv."""
    last: dict[str, float] = {}
    with (Path(log_dir) / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def test_fit_trains_calibrates_sweeps_and_exports_a_bundle_that_loads_and_generates(setup, tmp_path, capsys):
    cli = fit(train_config(setup, tmp_path), tmp_path, "--sweep.greedy=true", "--sweep.ablated=true")
    out = capsys.readouterr().out
    bundle_dir = tmp_path / "bundle"
    for name in ("config.json", "head.safetensors", "README.md", "split.json", "reliability.png", "pareto.png"):
        assert (bundle_dir / name).is_file(), name

    report = cli.model.fit_report
    assert report.threshold in (0.3, 0.7) and report.cost_model is not None and report.calibration_choice is not None
    assert [row.family for row in report.closing] == ["autoregressive", "fixed_k", "threshold", "ablated"]
    # sweep.ablated: the head's rule on the draft's own q decoded every h; the closing table holds it at its best h,
    # with the head's candidate bounds.
    ablated = report.sweep.family("ablated")
    assert [row.param for row in ablated] == [0.3, 0.7]
    assert report.closing[-1].param == report.sweep.best("ablated").param
    assert report.closing[-1].method.kind == "path_confidence"
    stage = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ThresholdSweep")
    assert report.closing[-1].candidates == (stage.min_candidates, stage.max_candidates)
    # The closing table's prompts chose nothing: calibration left them out (and only them) of its validation labels.
    sweep_stage = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ThresholdSweep")
    closing_ids = [pid for pid, _ in sweep_stage.held_out(cli.datamodule)]
    assert len(closing_ids) == 2 and report.calibration_excluded == sorted(closing_ids)
    calibrated = {row.prompt_id for row in cli.datamodule.calibration_dataloader(exclude=closing_ids).dataset.rows}
    assert calibrated == set(cli.datamodule.split["val"]) - set(closing_ids)
    assert "not used for training, calibration or choosing h*/K" in report.closing_prompts
    assert "SpecDec++ vs. baselines" in out and out.rstrip().endswith("-" * 10)  # the closing table is printed last

    logged = metrics_csv(cli.trainer.log_dir)
    for key in ("val/ece", "val/auc", "val/brier", "val/bce", "val/weighted_bce", "val/mean_pred", "val/mean_label"):
        assert math.isfinite(logged[key]), key
    for key in ("specdecpp/tokens_per_second", "specdecpp/modeled_tokens_per_second", "specdecpp/verification_rate"):
        assert key in logged
    assert logged["head_ablated/threshold"] == report.closing[-1].param and "head_ablated/speedup" in logged

    config = json.loads((bundle_dir / "config.json").read_text())
    provenance = config["provenance"]
    assert config["threshold"] == report.threshold
    assert config["head"] == {"hidden_size": 16, "depth": 1, "inputs": ["hidden"], "residual_on": None}
    # Both HeadThreshold variants were swept with every h; the bundle keeps the chosen one.
    swept = {(row.param, row.variant) for row in report.sweep.family("threshold")}
    assert swept == {(0.3, None), (0.7, None), (0.3, "confidence"), (0.7, "confidence")}
    assert config["unscored"] == report.unscored and report.closing[2].variant == report.unscored
    # sweep.greedy: the same grid decoded greedily chose the bundle's greedy h*.
    assert "greedy threshold sweep" in out and report.greedy_threshold in (0.3, 0.7)
    assert (config["greedy_threshold"], config["greedy_unscored"]) == (report.greedy_threshold, report.greedy_unscored)
    assert provenance["config"]["model"]["w_rej"] == 3.0 and provenance["data_meta"]["format"] == "accept_head.data_gen"
    split = json.loads((bundle_dir / "split.json").read_text())
    assert len(split["val"]) == 6 and set(split["val"]).isdisjoint(split["train"])
    card = (bundle_dir / "README.md").read_text()
    assert f"h\\* = {report.threshold:g}" in card and "ECE" in card and "| FixedK K=1 |" in card
    assert f"| head ablated (path confidence) h={report.closing[-1].param:g} |" in card

    # The bundle stands alone: models are loaded from the specs it stores (paths relative to the bundle).
    bundle = SpecDecPP.from_pretrained(bundle_dir)
    result = bundle.generate("write a short story", max_new_tokens=6, seed=0)
    assert bundle.threshold == report.threshold and 1 <= len(result.new_token_ids) <= 6
    assert bundle.h_star(greedy=True) == (report.greedy_threshold, report.greedy_unscored)
    assert bundle.policy(greedy=False).threshold == report.threshold
    assert bundle.calibration == report.calibration
    trained = cli.model.head.state_dict()
    assert all(torch.equal(v, trained[k].cpu()) for k, v in bundle.head.state_dict().items())


@pytest.fixture(scope="module")
def trained(setup: TinySetup, tmp_path_factory: pytest.TempPathFactory):
    """One fit without the end-of-fit stages (2 epochs, a checkpoint after each), shared by the checkpoint tests:
    its config and the finished CLI."""
    checkpoints = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"save_top_k": -1, "every_n_epochs": 1, "save_last": True},
    }
    mid_epoch = {  # also every 3 steps, mid-epoch ones included
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"save_top_k": -1, "every_n_train_steps": 3, "filename": "mid-{step}"},
    }
    run_dir = tmp_path_factory.mktemp("trained")
    config = train_config(setup, run_dir, stages=False, trainer={"callbacks": [checkpoints, mid_epoch]})
    return config, fit(config, run_dir)


def test_validate_and_test_subcommands_restore_the_head_from_a_checkpoint(trained, tmp_path):
    config, full = trained
    ckpt = next(Path(full.trainer.log_dir, "checkpoints").glob("epoch=1-*.ckpt"))  # the last epoch: last val/ece
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert state and all(key.startswith("head.") for key in state)  # the frozen draft is not checkpointed
    expected = metrics_csv(full.trainer.log_dir)["val/ece"]
    validated = fit(config, tmp_path, "--ckpt_path", str(ckpt), subcommand="validate")
    assert validated.trainer.callback_metrics["val/ece"].item() == pytest.approx(expected, rel=1e-5)
    tested = fit(config, tmp_path, "--ckpt_path", str(ckpt), subcommand="test")
    assert tested.trainer.callback_metrics["test/ece"].item() == pytest.approx(expected, rel=1e-5)


def test_resuming_from_a_checkpoint_matches_uninterrupted_training(trained, tmp_path):
    config, full = trained
    after_first_epoch = next(Path(full.trainer.log_dir, "checkpoints").glob("epoch=0-*.ckpt"))
    resumed = fit(config, tmp_path, "--ckpt_path", str(after_first_epoch))
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 2
    a, b = full.model.head.state_dict(), resumed.model.head.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_mid_epoch_trains_on_the_rest_of_that_epochs_batches(trained, tmp_path):
    """A checkpoint saved inside an epoch resumes with the batches that epoch had left, in its own order: the head
    ends as the uninterrupted one (it fails if the resumed epoch starts its batches over)."""
    config, full = trained
    per_epoch = full.trainer.global_step // full.trainer.current_epoch
    saved = {int(p.stem.split("=")[1]): p for p in Path(full.trainer.log_dir, "checkpoints").glob("mid-step=*.ckpt")}
    inside = [step for step in saved if step % per_epoch and step > per_epoch]  # inside the second epoch
    assert per_epoch >= 4 and inside, (per_epoch, sorted(saved))
    resumed = fit(config, tmp_path, "--ckpt_path", str(saved[min(inside)]))
    assert resumed.trainer.global_step == full.trainer.global_step
    a, b = full.model.head.state_dict(), resumed.model.head.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    batches = resumed.datamodule.train_dataloader().batch_sampler  # after the fit: whole epochs again
    assert len(list(batches)) == len(batches) == per_epoch


def test_prepare_data_runs_data_gen_when_the_dataset_is_absent(setup, tmp_path):
    labels = tmp_path / "generated-labels"
    data_gen = setup.data_gen_config()
    del data_gen["draft"]  # inherited from data.draft
    config = train_config(setup, tmp_path, stages=False, data={"path": str(labels), "data_gen": data_gen})
    cli = fit(config, tmp_path, "--trainer.max_epochs=1")
    assert (labels / "meta.json").is_file() and cli.trainer.global_step > 0
    assert json.loads((labels / "meta.json").read_text())["draft"]["path"] == str(setup.draft)


def test_prepare_data_refuses_labels_of_a_draft_retrained_since(setup, tmp_path):
    """Labels record a digest of the draft's weights: the same folder's weights pass, changed weights (a draft
    retrained in place) are refused by name before any training, labels without a digest (older) pass, and labels of
    another draft are refused as such (the digest is only compared for the folder the labels name)."""
    from accept_head.models.pairs import ModelSpec
    from accept_head.training.data import AcceptanceDataModule

    meta = json.loads((setup.labels / "meta.json").read_text())
    assert meta["draft_weights"] is not None and meta["draft"]["path"] == str(setup.draft)
    AcceptanceDataModule(path=str(setup.labels), draft=ModelSpec(path=str(setup.draft))).prepare_data()
    retrained = retrained_copy(setup.draft, tmp_path / "draft")  # a folder the labels below say made them

    def labels(name: str, **changes) -> str:
        folder = tmp_path / name
        folder.mkdir()
        stale = {**meta, "draft": {**meta["draft"], "path": str(retrained)}, **changes}
        (folder / "meta.json").write_text(json.dumps({k: v for k, v in stale.items() if v is not None}))
        return str(folder)

    stale = labels("stale")
    with pytest.raises(ValueError, match=r"other weights of the draft .*retrained in place"):
        AcceptanceDataModule(path=stale, draft=ModelSpec(path=str(retrained))).prepare_data()
    with pytest.raises(ValueError, match=r"labelled with draft .*but data.draft is"):
        AcceptanceDataModule(path=stale, draft=ModelSpec(path=str(setup.draft))).prepare_data()
    AcceptanceDataModule(path=labels("older", draft_weights=None), draft=ModelSpec(path=str(retrained))).prepare_data()


# ---- W&B sweep -----------------------------------------------------------------------------------------------------


def agent_command(sweep_file: Path, point: dict) -> list[str]:
    """The command a ``wandb agent`` runs for one grid point of ``sweep_file`` (wandb's own expansion code)."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    sweep = yaml.safe_load(sweep_file.read_text())
    assert set(point) == set(sweep["parameters"])
    for name, value in point.items():
        assert value in sweep["parameters"][name]["values"], (name, value)
    variables = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    variables.update(env=["/usr/bin/env"], interpreter=["python"], program=[sweep["program"]])
    command = []
    for item in sweep_utils.create_sweep_command(sweep["command"]):
        command += variables[item[2:-1]] if item.startswith("${") and item.endswith("}") else [item]
    return command


def tiny_overrides(setup: TinySetup) -> list[str]:
    """Command-line overrides that run a shipped config (CSV + W&B loggers) with the tiny pair and a tiny budget."""
    return [
        f"--data.path={setup.labels}",
        f"--data.draft.path={setup.draft}",
        "--data.draft.dtype=float32",
        "--data.draft.quantize=null",  # the tiny draft is a Hugging Face model (int8 weights are feature drafts' only)
        "--data.data_gen=null",
        "--data.greedy_path=null",  # the shipped greedy labels belong to the embedded pair, not the tiny one
        "--data.greedy_data_gen=null",
        "--data.val_size=4",
        "--data.batch_size=8",
        "--model.inputs=[hidden]",  # the tiny labels are token-level: they hold the hidden state only
        "--model.residual_on=null",
        "--trainer.max_epochs=1",
        "--trainer.log_every_n_steps=1",
        "--cost_model.ks=[1,2]",
        "--cost_model.repeats=2",
        "--cost_model.context=8",
        "--sweep.prompts=2",
        "--sweep.eval_prompts=0",
        "--sweep.max_new_tokens=6",
    ]


def test_a_wandb_logger_without_credentials_is_refused_before_any_data_is_written(setup, tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_CONFIG_DIR", "WANDB_DIR"):  # no netrc, no settings file with a key
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.chdir(tmp_path)
    try:
        args = ["fit", "--config", str(REPO / "configs/smollm2-135m-specdecpp.yaml"), *tiny_overrides(setup)]
        with pytest.raises(RuntimeError, match=r"no W&B credentials.*WANDB_MODE=offline") as refused:
            cli_main(args)
        assert "`wandb login`" in str(refused.value)
        assert not (tmp_path / "runs").exists()  # refused before the trainer logged or wrote anything
        # Not refused: an offline logger, or W&B switched off (test_a_wandb_sweep_point_runs_offline_through_the_cli
        # runs the shipped config to the end with WANDB_MODE=offline).
        check_wandb_credentials([WandbLogger(project="p", offline=True, save_dir=str(tmp_path))])
        monkeypatch.setenv("WANDB_MODE", "disabled")
        check_wandb_credentials([WandbLogger(project="p", save_dir=str(tmp_path))])
    finally:
        wandb.teardown()  # W&B keeps its settings per process: the next test must read its own environment


def test_a_wandb_sweep_point_runs_offline_through_the_cli(setup, tmp_path, monkeypatch):
    import wandb

    command = agent_command(
        REPO / "configs/sweeps/smollm2-135m-specdecpp.yaml",
        {"model.w_rej": 12, "model.depth": 0, "sweep.thresholds": [0.7]},
    )
    assert command[:5] == ["/usr/bin/env", "python", "-m", "train", "fit"] and "--model.w_rej=12" in command
    args = command[4:]
    args[args.index("--config") + 1] = str(REPO / args[args.index("--config") + 1])
    tiny = tiny_overrides(setup)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        cli = cli_main(args + tiny)
    finally:
        wandb.finish()
        wandb.teardown()  # stop wandb's service process, which writes the offline run file
    assert cli.model.hparams.w_rej == 12 and cli.model.hparams.depth == 0
    assert cli.model.fit_report.threshold == 0.7 and not (tmp_path / "checkpoints").exists()  # export off
    assert [type(logger).__name__ for logger in cli.trainer.loggers] == ["CSVLogger", "WandbLogger"]
    logged = metrics_csv(cli.trainer.loggers[0].log_dir)
    for key in ("tokens_per_second", "modeled_tokens_per_second", "verification_rate", "discard_rate"):
        assert math.isfinite(logged[f"specdecpp/{key}"]), key
    runs = list(tmp_path.rglob("offline-run-*/run-*.wandb"))  # the offline run's record log, synced later
    assert len(runs) == 1
    deadline = time.monotonic() + 30  # the service may still be flushing the file when teardown returns
    while b"specdecpp/modeled_tokens_per_second" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"specdecpp/modeled_tokens_per_second" in runs[0].read_bytes()


# ---- every shipped config parses -----------------------------------------------------------------------------------

TRAIN_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml"))
SWEEP_CONFIGS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_train_config_parses_through_the_cli(path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(path.relative_to(REPO)), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["depth"] >= 0 and printed["data"]["path"] and printed["export"]["dir"]


@pytest.mark.parametrize("path", SWEEP_CONFIGS, ids=lambda p: p.name)
def test_every_point_of_a_shipped_sweep_parses_through_the_cli(path, capsys, monkeypatch):
    import itertools

    monkeypatch.chdir(REPO)
    sweep = yaml.safe_load(path.read_text())
    assert sweep["metric"]["name"] == "specdecpp/modeled_tokens_per_second"
    names = list(sweep["parameters"])
    grid = list(itertools.product(*(sweep["parameters"][n]["values"] for n in names)))
    assert len(grid) == 4 * 5 * 5
    for values in (grid[0], grid[-1]):  # the corners of the grid
        point = dict(zip(names, values, strict=True))
        with pytest.raises(SystemExit):
            cli_main(agent_command(path, point)[4:] + ["--print_config"])
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["model"]["w_rej"] == point["model.w_rej"] and printed["model"]["depth"] == point["model.depth"]
        assert printed["sweep"]["thresholds"] == point["sweep.thresholds"] and printed["sweep"]["fixed_k"] == []


def test_gpu_config_selects_a_distributed_strategy(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "configs/llama2-7b-70b-specdecpp.yaml", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"] == "ddp" and printed["trainer"]["accelerator"] == "gpu"
    assert printed["data"]["draft"]["path"] == "meta-llama/Llama-2-7b-chat-hf" and printed["model"]["w_rej"] == 6.0


def test_gpu_recipe_is_the_cpu_recipe_on_two_gpus_with_bf16_autocast(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", "configs/smollm2-135m-specdecpp-gpu.yaml", "--print_config"])
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["strategy"]) == ("gpu", 2, "ddp")
    assert trainer["precision"] == "bf16-mixed"
    gpu, cpu = (yaml.safe_load((REPO / "configs" / name).read_text()) for name in GPU_AND_CPU_RECIPES)
    for section in ("model", "calibration", "cost_model", "sweep"):
        assert gpu[section] == cpu[section], section  # the same recipe, not a drifted copy
    for key in ("tree", "context_row"):  # and a bundle that decodes alike
        assert gpu["export"].get(key) == cpu["export"].get(key), key
    assert gpu["data"]["batch_size"] * trainer["devices"] == cpu["data"]["batch_size"]  # the same global batch
    # The same draft on the GPU, in bf16: int8 weights pay where a drafting step streams them from a CPU's memory.
    cpu_draft = {k: v for k, v in cpu["data"]["draft"].items() if k != "quantize"}
    assert gpu["data"]["draft"] == {**cpu_draft, "device": "cuda"}


def test_bf16_mixed_precision_trains_the_head_on_the_cpu(setup, tmp_path):
    """The GPU recipe's precision, run where there is no GPU: the head trains under bf16 autocast, weights in fp32."""
    cli = fit(train_config(setup, tmp_path, stages=False, trainer={"precision": "bf16-mixed"}), tmp_path)
    assert cli.trainer.precision == "bf16-mixed" and cli.trainer.global_step > 0
    assert {p.dtype for p in cli.model.head.parameters()} == {torch.float32}
    assert math.isfinite(metrics_csv(cli.trainer.log_dir)["val/weighted_bce"])


GPU_AND_CPU_RECIPES = ("smollm2-135m-specdecpp-gpu.yaml", "smollm2-135m-specdecpp.yaml")


# ---- bad input -----------------------------------------------------------------------------------------------------


def _bad(setup: TinySetup, tmp_path: Path, **sections) -> dict:
    return train_config(setup, tmp_path, stages=False, **sections)


def test_missing_dataset_is_reported_with_the_fix(setup, tmp_path):
    config = _bad(setup, tmp_path, data={"path": str(tmp_path / "nowhere")})
    with pytest.raises(FileNotFoundError, match=r"nowhere.* does not exist.*--data\.data_gen"):
        fit(config, tmp_path)


def test_a_folder_that_is_not_a_data_gen_dataset_is_refused(setup, tmp_path):
    folder = tmp_path / "not-labels"
    folder.mkdir()
    (folder / "something.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"not a data_gen label dataset"):
        fit(_bad(setup, tmp_path, data={"path": str(folder)}), tmp_path)


def test_a_dataset_labelled_for_another_draft_is_refused(setup, tmp_path):
    other = other_draft(setup.root)
    config = _bad(setup, tmp_path, data={"draft": {"path": str(other), "dtype": "float32"}})
    with pytest.raises(ValueError, match=r"labelled with draft .*draft'.* but data\.draft is .*other-draft"):
        fit(config, tmp_path)


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("model", {"depth": -1}, r"depth=-1 must be >= 0.*--model\.depth"),
        ("model", {"w_rej": 0.0}, r"w_rej=0\.0 must be > 0.*--model\.w_rej"),
        ("model", {"w_acc": -1.0}, r"w_acc=-1\.0 must be > 0.*--model\.w_acc"),
        ("data", {"mix_ratio": 1.0}, r"mix_ratio=1\.0 must be in \[0, 1\).*--data\.mix_ratio"),
        ("data", {"mix_ratio": -0.2}, r"mix_ratio=-0\.2 must be in \[0, 1\)"),
        ("data", {"val_size": None, "val_fraction": 0.01}, r"validation split is empty.*val_fraction=0\.01"),
        ("data", {"val_size": 0}, r"val_size=0.*validation split would be empty"),
        ("sweep", {"enabled": True, "thresholds": [0.5, 1.0]}, r"threshold h=1\.0 is outside \(0, 1\)"),
        ("sweep", {"enabled": True, "thresholds": [0.0]}, r"threshold h=0\.0 is outside \(0, 1\)"),
    ],
)
def test_bad_values_fail_with_a_message_naming_value_and_fix(setup, tmp_path, section, values, message):
    with pytest.raises(ValueError, match=message):
        fit(_bad(setup, tmp_path, **{section: values}), tmp_path)


# ---- scale ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_with_two_cpu_processes_trains_and_exports(setup, tmp_path):
    """``strategy: ddp`` on 2 CPU processes (gloo): Lightning relaunches ``python -m train`` for rank 1, the
    validation metrics are gathered across ranks and the end-of-fit stages run on rank 0 only."""
    import os
    import subprocess
    import sys

    config = train_config(setup, tmp_path, trainer={"devices": 2, "strategy": "ddp"})
    path = write_config(config, tmp_path / "ddp.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "train", "fit", "--config", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in done.stderr
    assert done.stdout.count("SpecDec++ vs. baselines") == 1  # printed by rank 0 only
    bundle = SpecDecPP.from_pretrained(tmp_path / "bundle")
    assert len(bundle.generate("write code", max_new_tokens=4, seed=0).new_token_ids) >= 1
    split = json.loads((tmp_path / "bundle" / "split.json").read_text())
    assert len(split["train"]) == 18 and len(split["val"]) == 6


def test_the_model_card_names_a_draft_that_decodes_with_int8_weights(tmp_path) -> None:
    from accept_head.models.pairs import ModelSpec
    from accept_head.training.model_card import _spec

    bundle = tmp_path / "checkpoints" / "bundle"
    draft = {"path": str(tmp_path / "checkpoints" / "draft"), "dtype": "bfloat16"}
    (tmp_path / "checkpoints" / "draft").mkdir(parents=True)  # a local draft: the card names it beside the bundle
    assert _spec(ModelSpec(**draft), str(bundle)) == "`../draft` (bfloat16)"
    quantized = _spec(ModelSpec(**draft, quantize="int8"), str(bundle))
    assert quantized == "`../draft` (bfloat16, decoding with int8 weights)"


def test_export_never_writes_into_a_model_folder_and_replaces_an_earlier_bundle_whole(setup, tmp_path):
    """A model (or any non-bundle) folder named as export.dir is refused before training; an earlier bundle there is
    replaced, the figures of stages this run skipped removed."""
    model_dir = tmp_path / "bundle"
    shutil.copytree(setup.draft, model_dir)
    before = sorted(p.name for p in model_dir.iterdir())
    export = {"enabled": True, "threshold": 0.5}
    with pytest.raises(ValueError, match=r"export.dir=.* is not empty and holds no SpecDec\+\+ bundle"):
        fit(train_config(setup, tmp_path, stages=False, export=export), tmp_path)
    assert sorted(p.name for p in model_dir.iterdir()) == before
    shutil.rmtree(model_dir)
    model_dir.mkdir()
    for name in ("sweep.csv", "pareto.png", "reliability.png"):  # an earlier export's figures
        (model_dir / name).write_text("old")
    (model_dir / "config.json").write_text(json.dumps({"format_version": 1, "head": {}, "threshold": 0.9}))
    fit(train_config(setup, tmp_path, stages=False, export=export), tmp_path)
    assert json.loads((model_dir / "config.json").read_text())["threshold"] == 0.5
    assert not [name for name in ("sweep.csv", "pareto.png", "reliability.png") if (model_dir / name).exists()]


def test_the_command_line_reports_a_user_error_in_one_line(setup, tmp_path, monkeypatch, capsys):
    from train.cli import main

    config = write_config(_bad(setup, tmp_path, data={"path": str(tmp_path / "nowhere")}), tmp_path / "bad.yaml")
    monkeypatch.setattr("sys.argv", ["python -m train", "fit", "--config", str(config)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m train: error: data.path=" in err and "Traceback" not in err
