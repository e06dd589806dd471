"""A label-generation run from YAML files and flags: parse them into a :class:`DataGenConfig`, then generate or merge.

``python -m data_gen`` is this module behind a command line; head training calls it directly when its label dataset
does not exist yet (:func:`accept_head.training.data.run_data_gen`).

Under a multi-process launcher (``torchrun --nproc_per_node N -m data_gen ...``) each process reads its rank from the
launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), labels shard ``RANK/WORLD_SIZE`` on its own
device (``cuda:LOCAL_RANK`` where the config says ``cuda``) and, once every rank has finished, rank 0 merges the
shards: the same dataset as one process, in the same output folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any

from .config import DataGenConfig

BOOLEAN_FLAGS = ("--merge", "--overwrite", "--progress")
"""Flags that may stand alone on the command line (``--merge`` means ``--merge true``)."""


def build_parser(prog: str = "python -m data_gen"):
    """The argument parser: every :class:`DataGenConfig` field is a top-level flag / YAML key."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    # The field docstrings of the config dataclasses are the --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(
        prog=prog,
        description=(
            "Run a target/draft pair on prompt sets and write token-level acceptance labels (SpecDec++ §3.3) as a "
            "Hugging Face dataset with a meta.json. Every key can come from --config YAML files or the command line. "
            "`python -m data_gen join --help`: one dataset from several finished runs on disjoint prompts."
        ),
        default_config_files=None,
        allow_abbrev=False,  # a misspelt flag (--target.dtyp) must fail, not stand for the one it begins
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file (later flags override it).")
    parser.add_class_arguments(DataGenConfig, nested_key=None, as_group=False, fail_untyped=True)
    for flag in BOOLEAN_FLAGS:  # the value is optional: a flag alone takes ``const``
        action = parser._option_string_actions[flag]
        action.nargs, action.const = "?", True
    return parser


def parse_arguments(parser, argv: Sequence[str] | None):
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``parser``; return the instantiated namespace and its config.

    The config is validated; the namespace also holds any arguments the caller added to the parser.
    """
    namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
    init = parser.instantiate(namespace)
    cfg = DataGenConfig(**{name: init[name] for name in DataGenConfig.__dataclass_fields__})
    cfg.validate()
    return init, cfg


def parse_config(argv: Sequence[str] | None = None) -> DataGenConfig:
    """Parse command-line arguments (and config files) into a validated :class:`DataGenConfig`."""
    return parse_arguments(build_parser(), argv)[1]


def run(cfg: DataGenConfig) -> dict[str, Any]:
    """Merge shard outputs (``--merge true``) or generate labels; return the dataset's meta dict. Under a
    multi-process launcher, label this process's shard and merge on rank 0 (:func:`run_launched`)."""
    from .generate import generate
    from .merge import merge

    if cfg.merge:
        return merge(cfg)
    launch = launcher_ranks()
    return generate(cfg) if launch is None else run_launched(cfg, *launch)


LAUNCH_TIMEOUT = datetime.timedelta(days=7)
"""How long a finished rank waits for the others at the barrier before the merge (shards may take hours apart)."""


def launcher_ranks(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` from a multi-process launcher's environment (``torchrun``), or None when
    this process is alone (no ``WORLD_SIZE``, or 1)."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if "RANK" not in env:
        raise ValueError(f"WORLD_SIZE={world} but RANK is not set: launch with torchrun, which sets both.")
    rank = int(env["RANK"])
    return rank, world, int(env.get("LOCAL_RANK", rank))


def config_for_rank(cfg: DataGenConfig, rank: int, world: int, local_rank: int) -> DataGenConfig:
    """``cfg`` for one launched process: ``--shard rank/world``, and a model on ``cuda`` (any index) moved to
    ``cuda:local_rank`` so each process of a node uses its own GPU. Other devices (``cpu``) are kept."""
    if cfg.shard is not None:
        raise ValueError(
            f"--shard={cfg.shard} under a launcher with WORLD_SIZE={world}: the launcher assigns each process its "
            "shard (RANK/WORLD_SIZE); drop --shard, or run the shards as separate single processes."
        )

    def on_rank(spec):
        if "device_map" in spec.extra or not spec.device.startswith("cuda"):
            return spec
        return dataclasses.replace(spec, device=f"cuda:{local_rank}")

    return dataclasses.replace(cfg, shard=f"{rank}/{world}", target=on_rank(cfg.target), draft=on_rank(cfg.draft))


def run_launched(cfg: DataGenConfig, rank: int, world: int, local_rank: int) -> dict[str, Any]:
    """One process of a launched run: label shard ``rank/world`` (:func:`config_for_rank`), wait for every rank
    (a gloo barrier: no GPU collective needed), then rank 0 merges the shards into ``cfg.output_dir``. Returns the
    merged dataset's meta dict on rank 0 and this rank's shard meta dict elsewhere."""
    import torch.distributed as dist

    from .generate import generate
    from .merge import merge

    shard_cfg = config_for_rank(cfg, rank, world, local_rank)
    if any(spec.device.startswith("cuda") for spec in (shard_cfg.target, shard_cfg.draft)):
        import torch

        torch.cuda.set_device(local_rank)  # work without an explicit device stays on this rank's GPU
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", timeout=LAUNCH_TIMEOUT)
    try:
        meta = generate(shard_cfg)
        dist.barrier()  # every shard is written before rank 0 reads them
        if rank == 0:
            meta = merge(dataclasses.replace(cfg, merge=True))
        dist.barrier()  # no rank exits (ending the launch) before the merge is written
    finally:
        if owns_group:
            dist.destroy_process_group()
    return meta
