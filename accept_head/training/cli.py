"""The LightningCLI of head training (``python -m train``): the head width and the draft linked from the data module,
the end-of-fit stages as config sections, and the command line kept for the bundle's provenance.

The YAML sections are the ``__init__`` arguments of :class:`~accept_head.training.AcceptanceHeadModule`
(``model:``), :class:`~accept_head.training.AcceptanceDataModule` (``data:``), Lightning's ``trainer:`` and the
end-of-fit stages ``calibration:``, ``cost_model:``, ``sweep:`` and ``export:`` (each with ``enabled``).
:func:`cli_main` builds it; ``train/cli.py`` and ``eval ablate`` call it.
"""

from __future__ import annotations

import os
import shlex
import sys

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from .callbacks import CalibrateHead, ExportBundle, MeasureCosts, ThresholdSweep, closing_table
from .data import AcceptanceDataModule
from .module import AcceptanceHeadModule


class AcceptHeadCLI(LightningCLI):
    """LightningCLI with the head width and the draft linked from the data module and the end-of-fit stages."""

    argv: list[str] | None = None
    """The command-line arguments of this run (for the model card)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The draft is configured once, under data: (the data module checks it against the labels), and the head's
        # width is the draft's hidden size, read by the data module from the draft's config.
        parser.link_arguments("data.draft", "model.draft", apply_on="instantiate")
        parser.link_arguments("data.hidden_size", "model.hidden_size", apply_on="instantiate")
        parser.add_lightning_class_args(CalibrateHead, "calibration")
        parser.add_lightning_class_args(MeasureCosts, "cost_model")
        parser.add_lightning_class_args(ThresholdSweep, "sweep")
        parser.add_lightning_class_args(ExportBundle, "export")

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse as LightningCLI does, remembering the command line for the bundle's model card."""
        self.argv = list(args) if isinstance(args, list | tuple) else sys.argv[1:] if args is None else None
        super().parse_arguments(parser, args)

    def before_fit(self) -> None:
        """Refuse a W&B logger that cannot log before any data is written, and hand the parsed configuration and the
        command line to the export stage (bundle provenance)."""
        import yaml

        check_wandb_credentials(self.trainer.loggers)

        config = self.config[self.subcommand]
        dumped = yaml.safe_load(self._parser(self.subcommand).dump(config, skip_none=False, skip_check=True))
        for callback in self.trainer.callbacks:
            if isinstance(callback, ExportBundle):
                callback.run_config = dumped
                callback.command = "python -m train " + shlex.join(self.argv) if self.argv is not None else None

    def after_fit(self) -> None:
        """Print the closing comparison of the threshold sweep last, below Lightning's progress bar."""
        table = closing_table(self.model.fit_report)
        if table and self.trainer.is_global_zero:
            print("\n" + table, flush=True)


def check_wandb_credentials(loggers: list) -> None:
    """Raise if a ``WandbLogger`` would log online without W&B credentials. W&B itself fails only when the logger
    first starts its run — after ``prepare_data`` has written the label datasets, minutes into a fit — so say it
    before anything runs, with the ways out."""
    from lightning.pytorch.loggers import WandbLogger

    online = [
        logger
        for logger in loggers
        if isinstance(logger, WandbLogger)
        and not getattr(logger, "_offline", False)
        and logger._wandb_init.get("mode") not in ("offline", "disabled")
    ]
    if not online or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return
    import wandb

    if not wandb.login(prompt=False, verify=False):
        raise RuntimeError(
            f"The config logs to W&B (WandbLogger, project {online[0]._wandb_init.get('project')!r}) but this machine "
            "has no W&B credentials (no WANDB_API_KEY, no `wandb login`). Log in with `wandb login`, or run with "
            "WANDB_MODE=offline (the run is written under the logger's save_dir; `wandb sync` uploads it later), or "
            "drop the WandbLogger from trainer.logger."
        )


def cli_main(args: ArgsType = None, run: bool = True) -> AcceptHeadCLI:
    """Build the CLI and run its subcommand (``fit``, ``validate``, ``test``); ``args`` overrides ``sys.argv``."""
    import warnings

    from jsonargparse import lazy_instance
    from lightning.pytorch.loggers import CSVLogger

    # The frozen draft is in eval mode on purpose (no dropout); Lightning would warn about it at every fit.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

    return AcceptHeadCLI(
        AcceptanceHeadModule,
        AcceptanceDataModule,
        seed_everything_default=0,
        trainer_defaults={"logger": lazy_instance(CSVLogger, save_dir="runs", name="train")},
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"prog": "python -m train"},
        args=args,
        run=run,
    )
