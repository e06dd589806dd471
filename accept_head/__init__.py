"""accept_head: SpecDec++ acceptance heads for adaptive, lossless speculative decoding with Hugging Face models."""

from .baselines import ConfidenceThreshold, EntropyStop, Heuristic, Oracle, roc_threshold
from .bundle import SpecDecOutput, SpecDecPP
from .calibration import Calibration
from .decoding import DecodeStats, GenerationResult, autoregressive_generate, speculative_generate, verify
from .drafters import Drafter, DraftStep, ModelDrafter
from .feature_draft import FeatureDraft, FeatureDrafter
from .head import AcceptanceHead, from_official_state_dict
from .hf_assisted import AssistedSettings, HFAssisted
from .hf_generate import SpecDecGenerate, make_custom_generate
from .loading import load_model, load_tokenizer
from .lookahead import NgramPool, lookahead_generate
from .ngrammys import ModelBigram, ngrammys_generate
from .ouroboros import OuroborosStats, PhrasePool, ouroboros_generate
from .pairs import ModelSpec, check_same_tokenizer
from .policies import FixedK, HeadThreshold, RoundState, StopPolicy
from .sampling import SamplingConfig
from .tree_verify import TreeDecodeStats

__all__ = [
    "AcceptanceHead",
    "AssistedSettings",
    "Calibration",
    "ConfidenceThreshold",
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
    "PhrasePool",
    "RoundState",
    "SamplingConfig",
    "SpecDecGenerate",
    "SpecDecOutput",
    "SpecDecPP",
    "StopPolicy",
    "TreeDecodeStats",
    "autoregressive_generate",
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
__version__ = "0.1.0"
