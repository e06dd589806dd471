"""``python -m train``: train a SpecDec++ acceptance head with LightningCLI, then calibrate, sweep h and export.

Examples::

    python -m train fit --config configs/demo.yaml
    python -m train fit --config configs/smollm2-135m-specdecpp.yaml --model.w_rej=3 --sweep.thresholds=[0.7]
    python -m train fit --config configs/demo.yaml --ckpt_path runs/demo/version_0/checkpoints/last.ckpt
    python -m train validate --config configs/demo.yaml --ckpt_path <checkpoint>
    python -m train fit --config configs/demo.yaml --print_config

The CLI is :func:`accept_head.training.cli.cli_main`; its YAML sections are described there.
"""

from __future__ import annotations

from accept_head.core.cli import user_errors
from accept_head.training.cli import cli_main


def main() -> None:
    """Run the subcommand given on the command line (``python -m train`` and the ``accept-head-train`` script); a
    user error (a bad value, a missing or mismatched dataset) exits with one line naming it, as data_gen and eval do."""
    with user_errors("python -m train"):
        cli_main()
