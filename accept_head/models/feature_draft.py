"""A draft that reads the target: one decoder layer over the target's own features (EAGLE, Li et al. 2024).

At sequence position t the draft reads the pair (f_t, x_{t+1}) — the target's final hidden state f_t (its LM head's
input, which already encodes the target's prediction of x_{t+1}) and the embedding of the token actually chosen
there — through ``fc([f_t; emb(x_{t+1})])`` and one Llama decoder layer, and predicts f̂_{t+1}; the LM head turns
f̂_{t+1} into q(x_{t+2}). The target's input embedding is reused frozen (read from the target at bind time, never
stored); the final norm starts as the target's and stays frozen; the LM head covers a pruned vocabulary
(``kept_ids``, the most frequent tokens: q = 0 elsewhere, lossless because verification still covers every token)
and starts from the target's own output rows.

While drafting, step k ≥ 2 feeds the draft's own f̂ back in place of the target's f. After verification the accepted
positions are re-read with the target's true features from the verification pass (:class:`FeatureDrafter`).

A draft folder holds ``config.json`` (with a fingerprint of the target it was trained for) and ``model.safetensors``;
binding it to a different target raises a ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache

from ..core.hf_compat import cache_kwargs, crop_cache
from ..core.tensor_keys import tensors_key
from .draft_step import LeanStep, lean_step_applies, weights_key
from .drafters import Drafter, DraftStep, check_kept_ids
from .quantized_linear import Int4Linear, Int8Linear, int4_group

FORMAT = "accept_head.feature_draft"
FORMAT_VERSION = 2
"""Version 2 adds slim folders (``lm_head_from_target``); full folders are still written as version 1."""
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's vocabulary, width and token embeddings (input and output, in bf16), the weights a
    feature draft depends on. The same model loaded in float32 or bfloat16 has the same fingerprint."""
    digest = hashlib.sha256()
    digest.update(f"{model.config.vocab_size}:{model.config.hidden_size}".encode())
    seen = set()
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = module.weight
        if weight.data_ptr() in seen:
            continue
        seen.add(weight.data_ptr())
        digest.update(weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class FeatureDraftConfig:
    """Shape of a feature draft. The attention/MLP shape defaults to the target's own layer shape."""

    hidden_size: int
    """The target's width d (features and token embeddings are both d-dimensional)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """The target's full vocabulary size (the draft's logits are returned over all of it)."""
    kept_vocab_size: int
    """Rows of the pruned LM head."""
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    rope_parameters: dict | None = None
    target_fingerprint: str | None = None
    """:func:`model_fingerprint` of the target this draft was trained for."""
    target_name: str | None = None
    """Where the target came from (informational)."""
    train_lm_head: bool = False
    """Whether training updated the LM head rows (else they stay the target's)."""
    lm_head_from_target: bool = False
    """A slim folder: the LM head rows are not stored but gathered from the target (its output rows of
    ``kept_ids``) when the draft is bound to it, after its fingerprint is checked."""
    extra: dict = field(default_factory=dict)
    """Free-form provenance (training recipe, data) written by the trainer."""

    @classmethod
    def for_target(cls, target: torch.nn.Module, kept_vocab_size: int, **overrides) -> FeatureDraftConfig:
        c = target.config
        heads = c.num_attention_heads
        values = dict(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            kept_vocab_size=kept_vocab_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-5),
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=_full_attention_rope(getattr(c, "rope_parameters", None)),
            target_fingerprint=model_fingerprint(target),
        )
        values.update(overrides)
        return cls(**values)


def _full_attention_rope(rope: dict | None) -> dict | None:
    """The target's RoPE parameters for the draft's one full-attention layer: Gemma-3 keys them by layer type
    (``{"full_attention": {...}, "sliding_attention": {...}}``), which a Llama layer does not read."""
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return dict(rope.get("full_attention") or next(iter(rope.values())))
    return rope


QUANTIZE_MODES = ("int8", "int4")
"""Weight formats a feature draft can decode with (:meth:`FeatureDraft.quantize_`; ``ModelSpec.quantize``): ``int8``
every linear layer in int8; ``int4`` the same with the LM head — most of a drafting step's bytes — in 4 bits."""


class _Rows(nn.Module):
    """x ↦ x Wᵀ for a weight held outside the module tree (a sorted copy of the LM head's rows)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class FeatureDraft(nn.Module):
    """fc([f; emb(x)]) → one Llama decoder layer → norm → LM head over ``kept_ids``.

    Call :meth:`bind` with the target before use: it supplies the (frozen, shared) input embedding and checks the
    target's fingerprint.
    """

    def __init__(self, config: FeatureDraftConfig) -> None:
        from transformers import LlamaConfig, LlamaModel

        super().__init__()
        self.config = config
        llama = LlamaConfig(
            vocab_size=1,  # inputs arrive as embeddings: the layer stack's own embedding table is unused
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.decoder = LlamaModel(llama)
        self.lm_head = nn.Linear(config.hidden_size, config.kept_vocab_size, bias=False)
        self.register_buffer("kept_ids", torch.arange(config.kept_vocab_size), persistent=True)
        self.decoder.norm.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(config.train_lm_head)
        self._bound: tuple[nn.Embedding, ...] = ()  # a tuple, so the target's embedding is not registered here
        self.target_fingerprint: str | None = None
        self.quantized: str | None = None
        """None (the weights as trained) or a :data:`QUANTIZE_MODES` entry (:meth:`quantize_`)."""

    # --- building and binding -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: torch.nn.Module, kept_ids: torch.Tensor, **config_overrides) -> FeatureDraft:
        """A fresh draft for ``target``: LM head rows, final norm and embedding taken from the target."""
        kept_ids = check_kept_ids(kept_ids, target.config.vocab_size)
        config = FeatureDraftConfig.for_target(target, len(kept_ids), **config_overrides)
        draft = cls(config)
        with torch.no_grad():
            draft.kept_ids.copy_(kept_ids)
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[kept_ids].float())
            norm = _final_norm_weight(target)
            if norm is not None:
                draft.decoder.norm.weight.copy_(norm.float())
        draft.bind(target)
        return draft

    def bind(self, target: torch.nn.Module) -> FeatureDraft:
        """Attach the target's input embedding (shared, frozen) after checking this draft was trained for it."""
        expected = self.config.target_fingerprint
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(
                f"The feature draft reads features of width {self.config.hidden_size} but the target's hidden size is "
                f"{target.config.hidden_size}; train a draft for this target."
            )
        if target.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"The feature draft covers a vocabulary of {self.config.vocab_size} but the target's has "
                f"{target.config.vocab_size}; train a draft for this target."
            )
        if self._bound and self._bound[0] is target.get_input_embeddings():
            return self
        found = model_fingerprint(target)
        if expected is not None and found != expected:
            raise ValueError(
                f"This feature draft was trained for the target with fingerprint {expected} "
                f"({self.config.target_name or 'unknown'}), but the target given has fingerprint {found}; "
                "pair it with the model it was trained on or train a draft for this one."
            )
        if self.config.lm_head_from_target:  # a slim folder: the frozen LM head is the target's own rows
            with torch.no_grad():
                rows = target.get_output_embeddings().weight[self.kept_ids.to(target.device)]
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight))
        self._bound = (target.get_input_embeddings(),)
        self.target_fingerprint = found
        return self

    @property
    def embed(self) -> nn.Embedding:
        if not self._bound:
            raise RuntimeError("FeatureDraft is not bound to a target: call draft.bind(target) first.")
        return self._bound[0]

    def make_drafter(self, target: torch.nn.Module) -> FeatureDrafter:
        """The :class:`FeatureDrafter` that drafts with this model bound to ``target`` (what
        :func:`~accept_head.models.drafters.as_drafter` returns for a feature draft)."""
        return FeatureDrafter(self, target)

    # --- the model ------------------------------------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        past_key_values: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """features (B, T, d): f_t (the target's or the draft's own); next_tokens (B, T): x_{t+1}.
        Returns the predicted features f̂_{t+1}, (B, T, d) — feed them to :meth:`kept_logits`."""
        with torch.no_grad():
            emb = self.embed(next_tokens)
        dtype = self.decoder.norm.weight.dtype  # the draft's dtype (its linear layers may hold int8 weights)
        x = self.fc(torch.cat([features.to(dtype), emb.to(dtype)], dim=-1))
        out = self.decoder(
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(self.decoder, past_key_values, use_cache),
        )
        return out.last_hidden_state

    def step(
        self, feature: torch.Tensor, token: int, cache: DynamicCache, position: int, lean: LeanStep | None = None
    ) -> torch.Tensor:
        """One drafting step: f (d,) and the next token at sequence ``position`` → f̂ (d,), that position appended to
        ``cache`` (:meth:`extend` with one position)."""
        return self.extend(feature[None], [token], cache, position, lean)

    def extend(
        self,
        features: torch.Tensor,
        tokens: Sequence[int],
        cache: DynamicCache,
        position: int,
        lean: LeanStep | None = None,
    ) -> torch.Tensor:
        """Feed T positions on top of ``cache``: f (T, d) and the next tokens (T) at sequence positions ``position``..
        → f̂ (d,) at the last, the T positions appended to ``cache``. The maths of :meth:`forward` in fewer kernel
        calls: the layer runs as a :class:`~accept_head.models.draft_step.LeanStep` where that applies — bit for bit
        for one position, and for several the last one's output computed from its row alone (a float32 product of one
        row may round its last bit differently); on the EPYC of docs/measurements.md ~0.15 ms less a drafting step
        and ~0.45 ms less a round's first call than the modules called one by one, right after a target pass.
        ``lean``: the one to use, built from the current weights (a :class:`FeatureDrafter` builds it once); by
        default it is looked up, and built again when a weight changed."""
        device, count = features.device, len(tokens)
        with torch.no_grad():
            rows = self.embed.weight
            emb = rows[tokens[0]][None] if count == 1 else rows[torch.tensor(tokens, device=rows.device)]
        dtype = self.decoder.norm.weight.dtype
        x = self.fc(torch.cat([features.to(dtype), emb.to(device=device, dtype=dtype)], -1)[None])
        lean = lean or self.lean_step()
        if lean is not None:
            return lean(x, cache, position)
        positions = torch.arange(position, position + count, device=device)[None]
        if count > 1:
            out = self.decoder(inputs_embeds=x, position_ids=positions, **cache_kwargs(self.decoder, cache, True))
            return out.last_hidden_state[0, -1]
        rotary = self.decoder.rotary_emb(x, positions)  # one query attends to every cached position: no mask
        for layer in self.decoder.layers:
            x = layer(x, position_ids=positions, position_embeddings=rotary, **cache_kwargs(layer, cache))
        return self.decoder.norm(x)[0, -1]

    def lean_step(self) -> LeanStep | None:
        """The :class:`LeanStep` of the current weights (built again after any change), or None where it does not
        apply (:func:`lean_step_applies`)."""
        if not lean_step_applies(self.decoder):
            return None
        kept = self.__dict__.get("_lean_step_cache")
        if kept is None or kept.key != weights_key(self.decoder):
            kept = self.__dict__["_lean_step_cache"] = LeanStep(self.decoder)
        return kept

    def kept_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(…, d) predicted features → (…, kept_vocab_size) logits over ``kept_ids``."""
        if self.quantized is None:
            return self.lm_head(predicted)
        return self._head_rows(sort=False)[1](predicted)

    def support_logits(self, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(…, d) predicted features → ``kept_ids`` in ascending order (S,) and the logits over them (…, S): rows in
        that order keep a full-vocabulary argmax's tie-break (the smallest id) and a cumulative sum's order, so
        sampling there draws what sampling over the whole vocabulary draws."""
        support, rows = self.support_rows()
        return support, rows(predicted)

    def support_rows(self) -> tuple[torch.Tensor, nn.Module]:
        """``kept_ids`` ascending (S,) and the linear map from predicted features to their logits
        (:meth:`support_logits`), built from the current LM head."""
        return self._head_rows(sort=True)

    def _head_rows(self, sort: bool) -> tuple[torch.Tensor, nn.Module]:
        """The kept ids (ascending if ``sort``) and a linear map to their logits: the LM head's rows, in int8 when the
        draft is quantized (4 bits with ``int4``). Cached; built again when the head's weight changes (training,
        :meth:`bind`)."""
        weight = self.lm_head.weight
        key = (sort, *tensors_key([weight, self.kept_ids]), weight.device, self.quantized)
        cached = self.__dict__.setdefault("_head_rows_cache", {}).get(sort)
        if cached is None or cached[0] != key:
            order = self.kept_ids.argsort() if sort else torch.arange(len(self.kept_ids), device=weight.device)
            rows = weight.detach()[order].contiguous()
            if self.quantized == "int4":
                linear = Int4Linear(rows, group=int4_group(rows.shape[1]))
            else:
                linear = Int8Linear(rows) if self.quantized else _Rows(rows)
            cached = (key, self.kept_ids[order], linear)
            self.__dict__["_head_rows_cache"][sort] = cached
        return cached[1], cached[2]

    def quantize_(self, mode: str) -> FeatureDraft:
        """Decode with ``mode`` weights (:data:`QUANTIZE_MODES`), in place: ``int8``, :class:`Int8Linear` for the input
        projection, the decoder layer's linear layers and the LM head; ``int4``, the same but the LM head an
        :class:`Int4Linear` (groups of 32 inputs, or the largest size the hidden width allows). Decoding stays
        lossless — verification uses the q this draft computes — only q moves a little (docs/measurements.md); for
        decoding only: train and save the draft as trained."""
        if mode not in QUANTIZE_MODES:
            raise ValueError(
                f"quantize={mode!r} is not a weight format a feature draft decodes with; use one of "
                f"{list(QUANTIZE_MODES)} (or none)."
            )
        if self.quantized is not None:
            raise ValueError(f"This feature draft is already quantized ({self.quantized}).")
        if mode == "int4":
            int4_group(self.config.hidden_size)  # refuse before changing anything
        for parent in [self, *self.decoder.modules()]:
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child is not self.lm_head:
                    setattr(parent, name, Int8Linear(child.weight, child.bias))
        self.quantized = mode
        self.__dict__.pop("_head_rows_cache", None)
        return self

    def full_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(d,) → (V,) logits over the whole vocabulary, −inf outside ``kept_ids``."""
        kept = self.kept_logits(predicted)
        out = kept.new_full((*kept.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.kept_ids] = kept
        return out

    # --- folders --------------------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, slim: bool | None = None) -> Path:
        """Write ``config.json`` (sorted keys, format version) and ``model.safetensors``.

        ``slim`` (default: whenever the LM head was not trained and the target's fingerprint is known) leaves the LM
        head out: it is the target's own rows of ``kept_ids``, gathered again by :meth:`bind` — the folder keeps
        only the draft's own weights, the kept-token ids and its config."""
        if self.quantized is not None:
            raise ValueError(
                f"This feature draft decodes with {self.quantized} weights; save the draft as trained (load it again "
                "without quantize) — quantization is a loading option."
            )
        if slim is None:
            slim = not self.config.train_lm_head and self.config.target_fingerprint is not None
        if slim and (self.config.train_lm_head or self.config.target_fingerprint is None):
            raise ValueError(
                "A slim folder needs a frozen LM head and the target's fingerprint (train_lm_head="
                f"{self.config.train_lm_head}, target_fingerprint={self.config.target_fingerprint}); save with "
                "slim=False."
            )
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {**asdict(self.config), "lm_head_from_target": slim}
        config = {"format": FORMAT, "format_version": FORMAT_VERSION if slim else 1, **config}
        skip = ("decoder.embed", "lm_head.") if slim else ("decoder.embed",)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith(skip)}
        save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": FORMAT})
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return folder

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
    ) -> FeatureDraft:
        """Load a folder written by :meth:`save_pretrained` (bind it to its target before use); ``quantize``: decode
        with int8 weights (:meth:`quantize_`)."""
        folder = Path(folder)
        config = read_config(folder)
        weights = folder / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing: a feature draft folder needs {WEIGHTS_NAME}.")
        draft = cls(config)
        try:
            state = load_file(str(weights))
        except Exception as error:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"{weights} could not be read ({error}); the file is corrupt — re-export it.") from None
        if config.lm_head_from_target and config.target_fingerprint is None:
            raise ValueError(
                f"{folder / CONFIG_NAME} stores no LM head (lm_head_from_target) and no target fingerprint to check "
                "the target it would come from against; re-export the draft."
            )
        missing, unexpected = draft.load_state_dict(state, strict=False)
        from_target = ("decoder.embed", "lm_head.") if config.lm_head_from_target else ("decoder.embed",)
        missing = [k for k in missing if not k.startswith(from_target)]
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}."
            )
        check_kept_ids(draft.kept_ids, config.vocab_size)
        draft = draft.to(device=device, dtype=dtype).eval()
        return draft if quantize is None else draft.quantize_(quantize)


def is_feature_draft_folder(folder: str | Path) -> bool:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except json.JSONDecodeError:
        return False


def read_config(folder: Path) -> FeatureDraftConfig:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {folder} is not a feature draft folder.")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); the draft folder is corrupt.") from None
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path} has format={raw.get('format')!r}, expected {FORMAT!r}.")
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {raw['format_version']}; this accept_head reads up to {FORMAT_VERSION}. "
            "Upgrade accept_head."
        )
    known = {f.name for f in fields(FeatureDraftConfig)}
    unknown = sorted(set(raw) - known - {"format", "format_version"})
    if unknown:
        warnings.warn(f"{path}: ignoring unknown keys {unknown}", stacklevel=3)
    return FeatureDraftConfig(**{k: v for k, v in raw.items() if k in known})


def _final_norm_weight(target: torch.nn.Module) -> torch.Tensor | None:
    base = getattr(target, "base_model", None)
    norm = getattr(base, "norm", None)
    return getattr(norm, "weight", None)


class FeatureDrafter(Drafter):
    """Drafts with a :class:`FeatureDraft`: the target's true features for committed positions, its own for the
    candidates of the current round. Reads the draft's weights as they are when it is made: make a new drafter after
    training the draft further."""

    needs_target_features = True

    def __init__(self, draft: FeatureDraft, target: torch.nn.Module) -> None:
        self.model = draft.bind(target)
        self.vocab_size = draft.config.vocab_size
        self.hidden_size = draft.config.hidden_size
        self.context_limit = draft.config.max_position_embeddings
        self.device = draft.kept_ids.device
        self.cache = DynamicCache()
        self.pending_features: torch.Tensor | None = None
        self.pending_tokens: list[int] = []
        self.committed_length = 0  # pairs in the cache that carry the target's true features
        self.last_predicted: torch.Tensor | None = None
        # Built once from the draft's current weights (re-create the drafter if the draft is trained further): a
        # drafting step then spends nothing on checking them.
        self.lean = draft.lean_step()
        self.support, self.rows = draft.support_rows()

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        if features is None or features.shape[0] != len(prompt) - 1:
            raise ValueError(
                f"FeatureDrafter.start needs the target's features of prompt positions 0..{len(prompt) - 2}, "
                f"got {None if features is None else tuple(features.shape)}."
            )
        self.cache = DynamicCache()
        self.committed_length = 0
        self.pending_features, self.pending_tokens = features, list(prompt[1:])
        self.last_predicted = None

    def _run(self, features: torch.Tensor, tokens: list[int]) -> DraftStep:
        start = self.cache.get_seq_length()
        self.last_predicted = self.model.extend(features.to(self.device), tokens, self.cache, start, self.lean)
        logits = self.rows(self.last_predicted)
        return DraftStep(
            None, self.last_predicted, support=self.support, support_logits=logits, vocab_size=self.vocab_size
        )

    def propose(self, token: int | None) -> DraftStep | None:
        if token is None:
            if not self.pending_tokens:
                return None  # a one-token prompt: no target feature yet, the target writes the first token alone
            step = self._run(self.pending_features, self.pending_tokens)
            self.committed_length += len(self.pending_tokens)
            self.pending_features, self.pending_tokens = None, []
            return step
        return self._run(self.last_predicted[None], [token])

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        # Candidate positions were read with predicted features: drop them and re-read with the target's own.
        crop_cache(self.cache, self.committed_length)
        assert features is not None and features.shape[0] == len(tokens)
        if self.pending_tokens:  # the draft did not run this round: keep what it has not read yet
            features = torch.cat([self.pending_features.to(features), features])
            tokens = [*self.pending_tokens, *tokens]
        self.pending_features, self.pending_tokens = features, list(tokens)
