"""``eval calibration``'s offline view scores the head on held-out rows only: the prompts in its bundle's split.json
``train`` list (what ``python -m train fit`` wrote when it exported the bundle) are left out, as ``eval predictors``
leaves them out, and a dataset of training prompts alone is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import make_llama, make_tokenizer, perturbed_copy, save_bundle

from accept_head.acceptance.labels import FORMAT, FORMAT_VERSION, label_features
from eval.__main__ import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny bundle (no split.json) and a token-level label dataset of four prompts, tiny:0 … tiny:3."""
    import datasets

    root = tmp_path_factory.mktemp("calibration-held-out")
    tokenizer = make_tokenizer()
    target = make_llama(root / "target", tokenizer=tokenizer, seed=0)
    draft = perturbed_copy(target, relative_noise=0.05, seed=1)
    draft.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    save_bundle(root / "bundle", target, draft, tokenizer, root / "target", root / "draft")
    generator = torch.Generator().manual_seed(0)
    rows = {name: [] for name in label_features()}
    for i in range(4):
        n = 6
        rows["prompt_id"].append(f"tiny:{i}")
        rows["source"].append("tiny")
        rows["prompt_ids"].append(tokenizer.encode(f"write a poem {i}"))
        rows["response_ids"].append(torch.randint(7, len(tokenizer), (n,), generator=generator).tolist())
        rows["draft_ids"].append(torch.randint(7, len(tokenizer), (n,), generator=generator).tolist())
        for column in ("target_logp", "draft_logp"):
            rows[column].append((-torch.rand(n, generator=generator)).tolist())
        for column in ("accept_prob", "expected_accept", "draft_top1"):
            rows[column].append(torch.rand(n, generator=generator).tolist())
        rows["draft_entropy"].append((2 * torch.rand(n, generator=generator)).tolist())
    datasets.Dataset.from_dict(rows, features=label_features()).save_to_disk(str(root / "labels"))
    (root / "labels" / "meta.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))
    return {"root": root, "bundle": root / "bundle", "labels": str(root / "labels")}


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
