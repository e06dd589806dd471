"""A loaded pair: a SpecDecPP bundle's target, draft and head, or a bare target/draft pair.

:func:`load_pair` loads either into a :class:`Pair`, what :class:`accept_head.engine.runner.Runner` decodes with;
:class:`PairOptions` holds its arguments (the ``python -m eval`` commands share it). This is the layer above the
bundle: :mod:`accept_head.specdecpp.bundle` loads a bundle's models through :mod:`accept_head.models.loading`, and
neither imports
this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models.loading import load_model, load_tokenizer
from ..models.pairs import ModelSpec, check_same_tokenizer, eos_token_ids
from ..specdecpp.bundle import SpecDecPP


@dataclass
class Pair:
    """A loaded target/draft pair, with the bundle it came from when there is one."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    bundle: SpecDecPP | None = None
    bundle_path: str | None = None
    target_spec: ModelSpec | None = None
    draft_spec: ModelSpec | None = None
    comparison_drafts: dict[str, Any] = field(default_factory=dict)
    """Further drafts (HF models or :class:`~accept_head.models.drafters.Drafter` objects) that methods name with a
    ``draft: <name>`` parameter, e.g. the standalone draft beside a feature draft."""
    stop_ids: list[int] | None = None
    """The ids to stop on when they are known without the tokenizer (the end-of-fit sweep: the label dataset's);
    ``[]`` stops on none. None: :attr:`eos_token_id` reads them from the tokenizer and the target."""

    def draft_for(self, name: str | None):
        """The pair's own draft (``name`` None) or the comparison draft called ``name``."""
        if name is None:
            return self.draft
        if name not in self.comparison_drafts:
            raise ValueError(f"no comparison draft named {name!r}; known: {sorted(self.comparison_drafts)}.")
        return self.comparison_drafts[name]

    @property
    def eos_token_id(self) -> list[int] | None:
        """EOS ids: :attr:`stop_ids` when set, else the tokenizer's and the target's generation config's
        (:func:`eos_token_ids`)."""
        if self.stop_ids is not None:
            return list(self.stop_ids)
        return eos_token_ids(self.tokenizer, self.target, required=False)

    def describe(self) -> dict:
        out: dict[str, Any] = {
            "bundle": self.bundle_path,
            "target": _portable(self.target_spec.to_dict()) if self.target_spec else None,
            "draft": _portable(self.draft_spec.to_dict()) if self.draft_spec else None,
            "target_parameters": sum(p.numel() for p in self.target.parameters()),
            "draft_parameters": sum(p.numel() for p in self.draft.parameters()),
        }
        if self.bundle is not None:
            out.update(
                threshold=self.bundle.threshold,
                unscored=self.bundle.unscored,
                greedy_threshold=self.bundle.h_star(greedy=True)[0],
                greedy_unscored=self.bundle.h_star(greedy=True)[1],
                head=self.bundle.head.config,
                min_candidates=self.bundle.min_candidates,
                max_candidates=self.bundle.max_candidates,
                temperature=self.bundle.temperature,
                calibration=self.bundle.calibration.kind if self.bundle.calibration is not None else None,
                greedy_calibration=getattr(self.bundle.greedy_calibration, "kind", None),
                tree_calibration=sorted(getattr(self.bundle, "tree_calibration", {})),
                context_row=getattr(self.bundle, "context_row", 0),
            )
        return out


def _portable(spec: dict) -> dict:
    """A model spec dict whose path is relative to the working directory when it lies below it, so pages and JSON
    written from a checkout read the same on every machine."""
    path = spec.get("path")
    if isinstance(path, str) and os.path.isabs(path) and Path(path).is_relative_to(Path.cwd()):
        spec = {**spec, "path": os.path.relpath(path)}
    return spec


def load_pair(
    bundle: str | None = None,
    target: ModelSpec | None = None,
    draft: ModelSpec | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> Pair:
    """Load a ``SpecDecPP`` bundle (its target and draft specs) or a bare target/draft pair.

    ``target`` / ``draft`` override the bundle's specs; ``device`` / ``dtype`` override every spec.
    """
    specs = {}
    for name, spec in (("target", target), ("draft", draft)):
        if spec is not None:
            spec = ModelSpec.coerce(spec)
            spec.device = device or spec.device
            spec.dtype = dtype or spec.dtype
            specs[name] = spec
    if bundle is not None:
        target_model = load_model(specs["target"]) if "target" in specs else None
        draft_model = load_model(specs["draft"]) if "draft" in specs else None
        loaded = SpecDecPP.from_pretrained(bundle, target=target_model, draft=draft_model, device=device, dtype=dtype)
        return Pair(
            target=loaded.target,
            draft=loaded.draft,
            tokenizer=loaded.tokenizer,
            bundle=loaded,
            bundle_path=str(bundle),
            target_spec=specs.get("target", loaded.target_spec),
            draft_spec=specs.get("draft", loaded.draft_spec),
        )
    if "target" not in specs or "draft" not in specs:
        raise ValueError("Pass --bundle PATH, or both --target.path and --draft.path for a pair without a head.")
    tokenizer = load_tokenizer(specs["target"])
    check_same_tokenizer(tokenizer, load_tokenizer(specs["draft"]), specs["target"].path, specs["draft"].path)
    return Pair(
        target=load_model(specs["target"]),
        draft=load_model(specs["draft"]),
        tokenizer=tokenizer,
        target_spec=specs["target"],
        draft_spec=specs["draft"],
    )


@dataclass
class PairOptions:
    """The pair to load (a SpecDecPP bundle, or a target and a draft)."""

    bundle: str | None = None
    """SpecDecPP bundle folder (its pair, head and h*); or give target and draft."""
    target: ModelSpec | None = None
    """Target model spec (overrides the bundle's)."""
    draft: ModelSpec | None = None
    """Draft model spec (overrides the bundle's)."""
    device: str | None = None
    """Device for both models (overrides the specs), e.g. cpu or cuda:0."""
    dtype: str | None = None
    """float32, bfloat16 or float16 (overrides the specs)."""

    def load(self) -> Pair:
        """The loaded pair (:func:`load_pair`)."""
        return load_pair(self.bundle, self.target, self.draft, self.device, self.dtype)

    def require_bundle(self, command: str) -> str:
        """The bundle path; a ValueError naming ``--bundle`` when ``command`` was given none."""
        if self.bundle is None:
            raise ValueError(f"{command} needs --bundle PATH, a SpecDecPP bundle folder (its head and h*).")
        return self.bundle
