"""How much of a bundle's cross-fitted ECE is the estimate's own noise? Calibration with more folds and fold seeds.

A fit scores each calibration map by cross-fitting by prompt (``calibration.folds``, 2 by default): every position is
mapped by an isotonic (or temperature) map fitted on the other folds' prompts, and the ECE of those held-out
predictions goes on the model card. With two folds each map sees half of the ~28 calibration prompts, and an isotonic
map fitted on ~2,400 positions overfits its steps; the kept map is refitted on all of them. This script rebuilds the
fit's calibration set exactly (the bundle's validation split less the prompts its closing comparison reports on),
scores the bundle's head on it and prints the cross-fitted scores for several fold counts and fold seeds — with
``--folds 2 --seeds 0`` the numbers the card shows.

    python docs/experiments/calibration_folds.py --bundle checkpoints/smollm2-135m-specdecpp \
        --config configs/smollm2-135m-specdecpp.yaml --folds '[2,4,7]' --seeds '[0,1,2,3,4]'

Offline: nothing decodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import yaml

from accept_head.acceptance.calibration import choose_calibration
from accept_head.acceptance.head import AcceptanceHead
from accept_head.core.tables import text_table
from accept_head.training.data import AcceptanceDataModule
from accept_head.training.module import AcceptanceHeadModule


def _predictions(bundle: Path, config: dict, greedy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bundle head's logits, the soft labels and the row ids of the fit's calibration set (T = 1 or greedy)."""
    data = config["data"]
    keys = ("path", "draft", "val_fraction", "val_size", "split_seed", "mix_ratio", "mix_seed", "batch_size")
    dm = AcceptanceDataModule(**{key: data[key] for key in keys if key in data}, greedy_path=data.get("greedy_path"))
    dm.setup("fit")
    sweep = config.get("sweep", {})
    offset = len(dm.val_prompts(sweep.get("prompts", 8)))
    closing = {pid for pid, _ in dm.val_prompts(sweep.get("eval_prompts", 0), offset=offset)}
    head = AcceptanceHead.from_pretrained(bundle, json.loads((bundle / "config.json").read_text())["head"])
    module = AcceptanceHeadModule(dm.draft, head.hidden_size, head.depth, 1.0, 1e-3, inputs=list(head.inputs))
    module.head = head.eval()
    if head.reads_hidden:
        module.configure_model()
    with torch.inference_mode():
        return module.predict_loader(dm.calibration_dataloader(greedy=greedy, exclude=closing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="the train fit config the bundle was made with")
    parser.add_argument("--folds", type=json.loads, default=[2, 4, 7])
    parser.add_argument("--seeds", type=json.loads, default=[0, 1, 2, 3, 4])
    parser.add_argument("--n_bins", type=int, default=15)
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    for greedy in (False, True):
        logits, labels, rows = _predictions(args.bundle, config, greedy)
        table = []
        for folds in args.folds:
            scores = [
                choose_calibration(logits, labels, rows, ["temperature", "isotonic"], folds, seed, args.n_bins)
                for seed in args.seeds
            ]
            for method in ("raw", "temperature", "isotonic"):
                eces = [choice.scores[method]["ece"] for choice in scores]
                briers = [choice.scores[method]["brier"] for choice in scores]
                table.append(
                    [
                        str(folds),
                        method,
                        " ".join(f"{ece:.4f}" for ece in eces),
                        f"{statistics.median(eces):.4f}",
                        f"{statistics.median(briers):.4f}",
                    ]
                )
        mode = "greedy labels" if greedy else "T = 1 labels"
        print(f"\n{mode}: {len(labels)} positions of {len(rows.unique())} prompts, {args.n_bins} bins")
        print(text_table(["folds", "map", "ECE per fold seed", "median ECE", "median Brier"], table))


if __name__ == "__main__":
    main()
