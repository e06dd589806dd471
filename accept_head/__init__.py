"""accept_head: SpecDec++ acceptance heads for adaptive, lossless speculative decoding with Hugging Face models."""

from .acceptance.calibration import Calibration
from .acceptance.head import AcceptanceHead, from_official_state_dict
from .chain.baselines import (
    ConfidenceThreshold,
    EntropyStop,
    Heuristic,
    Oracle,
    PathConfidenceStop,
    roc_threshold,
)
from .chain.decoding import DecodeStats, GenerationResult, autoregressive_generate, speculative_generate, verify
from .chain.hf_assisted import AssistedSettings, HFAssisted
from .chain.policies import FixedK, HeadThreshold, RoundState, StopPolicy
from .core import __version__ as __version__
from .core.moved import install as _install_moved_paths
from .core.sampling import SamplingConfig
from .learning_free.lookahead import NgramPool, lookahead_generate
from .learning_free.ngrammys import ModelBigram, ngrammys_generate
from .learning_free.ouroboros import OuroborosStats, PhrasePool, ouroboros_generate
from .models.drafters import Drafter, DraftStep, ModelDrafter
from .models.feature_draft import FeatureDraft, FeatureDrafter
from .models.loading import load_model, load_tokenizer
from .models.pairs import ModelSpec, check_same_tokenizer
from .specdecpp.bundle import SpecDecOutput, SpecDecPP
from .specdecpp.hf_generate import SpecDecGenerate, make_custom_generate
from .trees.chain_copies import CopyingChain, chain_copy_generate
from .trees.verify import TreeDecodeStats

__all__ = [
    "AcceptanceHead",
    "AssistedSettings",
    "Calibration",
    "ConfidenceThreshold",
    "CopyingChain",
    "DecodeStats",
    "DraftStep",
    "Drafter",
    "EntropyStop",
    "FeatureDraft",
    "FeatureDrafter",
    "FixedK",
    "GenerationResult",
    "HFAssisted",
    "HeadThreshold",
    "Heuristic",
    "ModelBigram",
    "ModelDrafter",
    "ModelSpec",
    "NgramPool",
    "Oracle",
    "OuroborosStats",
    "PathConfidenceStop",
    "PhrasePool",
    "RoundState",
    "SamplingConfig",
    "SpecDecGenerate",
    "SpecDecOutput",
    "SpecDecPP",
    "StopPolicy",
    "TreeDecodeStats",
    "autoregressive_generate",
    "chain_copy_generate",
    "check_same_tokenizer",
    "from_official_state_dict",
    "load_model",
    "load_tokenizer",
    "lookahead_generate",
    "make_custom_generate",
    "ngrammys_generate",
    "ouroboros_generate",
    "roc_threshold",
    "speculative_generate",
    "verify",
]

_install_moved_paths()  # old module paths (accept_head.decoding, ...) resolve for one release, with a warning
