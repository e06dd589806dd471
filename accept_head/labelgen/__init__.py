"""Label generation: run a target/draft pair on prompt sets and write acceptance labels (``python -m data_gen``).

Modules: :mod:`.config` (the run's dataclass), :mod:`.run` (YAML/flags → config → generate or merge),
:mod:`.generate` (the resumable pipeline), :mod:`.output` (the output folder), :mod:`.merge` (join shards),
:mod:`.bench` (labelled tokens/s against a naive loop). Only the config is exported here; functions are imported
from their modules (``from accept_head.labelgen.run import parse_config, run``), so no function shadows a module.
"""

from .config import DataGenConfig

__all__ = ["DataGenConfig"]
