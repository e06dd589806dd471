"""Lightning training of acceptance heads: data module, module, end-of-fit stages (``python -m train``).

Imported explicitly (``from accept_head.training import ...``); ``import accept_head`` does not pull in Lightning.
"""

from .callbacks import CalibrateHead, EndOfFitStage, ExportBundle, MeasureCosts, ThresholdSweep
from .data import AcceptanceDataModule, BucketBatchSampler, MixedTokenDataset, prompt_split
from .module import AcceptanceHeadModule
from .report import FitReport

__all__ = [
    "AcceptanceDataModule",
    "AcceptanceHeadModule",
    "BucketBatchSampler",
    "CalibrateHead",
    "EndOfFitStage",
    "ExportBundle",
    "FitReport",
    "MeasureCosts",
    "MixedTokenDataset",
    "ThresholdSweep",
    "prompt_split",
]
