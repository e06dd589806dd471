"""``SpecDecPP``: a target, a draft, a trained acceptance head and its threshold, saved and loaded as one folder.

Layout (``save_pretrained`` / ``from_pretrained`` are exact inverses)::

    bundle/
      config.json        # sorted keys, format_version, target/draft specs, head config (depth, width, the inputs
                         # it reads: the hidden state and optionally the draft's log q, ...), threshold, min/max
                         # candidates, sampling temperature the head was trained for, calibration (per mode;
                         # per mode for trees too, `tree_calibration`), cost model, provenance
      head.safetensors   # the head's weights
      custom_generate/generate.py  # hub convention: `generate(model, ...)` runs SpecDec++ with this bundle
      README.md          # model card (optional, written by training)

Relative model paths in ``config.json`` are resolved against the bundle folder, so a bundle can be moved together
with its draft.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import operator
import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers.generation.utils import GenerationMixin

from ..acceptance.calibration import Calibration
from ..acceptance.head import HEAD_WEIGHTS, AcceptanceHead
from ..chain.decoding import DecodeStats, speculative_generate
from ..chain.policies import HeadThreshold, StopPolicy
from ..core.costs import CostModel
from ..core.prompts import chat_prompt_ids
from ..core.sampling import SamplingConfig
from ..models.loading import load_model, load_tokenizer
from ..models.pairs import (
    ModelSpec,
    check_same_tokenizer,
    check_same_vocab,
    eos_token_ids,
    local_path,
    normalize_device,
    normalize_dtype,
)
from ..trees.chain_copies import CopyingChain, chain_copy_generate
from ..trees.decoding import tree_generate
from ..trees.growth import HeadTree, TreeRule, check_context_row
from ..trees.labels import MODES, tree_mode
from .hf_generate import SpecDecGenerateOutput, run_custom_generate, streamer_ended_on_error

TREE_SETTINGS = ("width", "top_k", "max_depth", "min_depth", "max_nodes", "threshold", "siblings", "context_row")
"""What a bundle's ``tree`` settings may hold: keyword arguments of :class:`~accept_head.trees.growth.HeadTree`."""

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
CUSTOM_GENERATE = "custom_generate/generate.py"
KNOWN_KEYS = {
    "format_version",
    "target",
    "draft",
    "head",
    "threshold",
    "min_candidates",
    "max_candidates",
    "unscored",
    "greedy_threshold",
    "greedy_unscored",
    "temperature",
    "calibration",
    "greedy_calibration",
    "cost_model",
    "provenance",
    "tree",
    "tree_calibration",
    "context_row",
}


def _check_tree_modes(maps: dict) -> None:
    """ValueError naming the keys of a ``tree_calibration`` mapping that are not decoding modes (:data:`MODES`)."""
    unknown = sorted(set(maps) - set(MODES))
    if unknown:
        raise ValueError(f"tree_calibration modes {unknown} are unknown; use {' and '.join(MODES)}.")


@dataclass
class SpecDecOutput:
    """What :meth:`SpecDecPP.generate` returns."""

    text: str | None
    """The generated continuation, decoded (None when no tokenizer is known)."""
    sequences: torch.Tensor
    """(1, prompt_len + new_tokens) LongTensor."""
    new_token_ids: list[int]
    stats: DecodeStats


def portable_spec(spec: ModelSpec, folder: str | Path) -> ModelSpec:
    """``spec`` as the bundle in ``folder`` stores it: a local model inside the bundle or next to it (e.g. both under
    ``checkpoints/``) by its path relative to the bundle (``./draft``, ``../draft``), so the two can move together;
    another local model by its absolute path; a hub id or ``package:`` / ``hf:`` name unchanged."""
    local = local_path(spec)
    if local is None:
        return spec
    folder = Path(folder).expanduser().resolve()
    path = os.path.relpath(local, folder) if local.is_relative_to(folder.parent) else str(local)
    if local.is_relative_to(folder):  # "./draft", never "draft": a missing folder must not read as a hub id
        path = os.path.join(".", path)
    return dataclasses.replace(spec, path=path)


def _spec_to_config(spec: ModelSpec | None, folder: Path) -> dict | None:
    return None if spec is None else portable_spec(spec, folder).to_dict()


def _load_head(folder: Path, config: dict) -> AcceptanceHead:
    """The bundle's acceptance head (bundles from before head inputs: the hidden-only head) with its weights."""
    weights = folder / HEAD_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: the bundle has no head weights.")
    head = AcceptanceHead.from_config(config["head"])
    try:
        state = load_file(str(weights))
    except Exception as err:
        raise ValueError(f"{weights} is not a readable safetensors file ({err}); re-export the bundle.") from err
    head.load_state_dict(state)
    return head


_OBJECT, _NUMBER, _INTEGER, _STRING = (
    ((dict,), "an object"),
    ((int, float), "a number"),
    ((int,), "an integer"),
    ((str,), "a string"),
)
_KEY_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    **dict.fromkeys(("target", "draft", "head", "calibration", "greedy_calibration", "cost_model"), _OBJECT),
    **dict.fromkeys(("provenance", "tree", "tree_calibration"), _OBJECT),
    **dict.fromkeys(("threshold", "greedy_threshold", "temperature"), _NUMBER),
    **dict.fromkeys(("min_candidates", "max_candidates", "context_row"), _INTEGER),
    **dict.fromkeys(("unscored", "greedy_unscored"), _STRING),
}
"""JSON types of a bundle's ``config.json`` values (each may also be null, but ``head`` and ``threshold``)."""


def _check_config_types(config: dict, path: Path) -> None:
    """ValueError naming the first value of ``config`` (read from ``path``) whose JSON type is wrong, and a
    temperature that is not a finite number >= 0."""
    for key, (types, kind) in _KEY_TYPES.items():
        value = config.get(key)
        if value is None and key not in ("head", "threshold"):
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{path}: {key}={value!r} must be {kind}; re-export the bundle or correct the file.")
    if config.get("temperature") is not None:
        try:
            SamplingConfig(config["temperature"])
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err


def _spec_from_config(raw: dict | None, folder: Path) -> ModelSpec | None:
    if raw is None:
        return None
    spec = ModelSpec(**raw)
    if not spec.path.startswith(("package:", "hf:")) and not Path(spec.path).is_absolute():
        candidate = folder / spec.path
        if candidate.exists():
            spec.path = str(candidate.resolve())
        elif spec.path.startswith(("./", "../")):
            raise FileNotFoundError(
                f"{folder / CONFIG_NAME} names the model folder {spec.path!r}, relative to the bundle, but "
                f"{candidate} does not exist; move the model next to the bundle or pass target=/draft= explicitly."
            )
    return spec


ONE_PROMPT = "SpecDecPP.generate handles one prompt at a time (batch size 1)"


def _tensor_ids(prompt: torch.Tensor) -> list[int]:
    """The ids of a prompt tensor of shape (T,) or (1, T) holding integers."""
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise ValueError(f"a prompt tensor must hold integer token ids, not {prompt.dtype}: pass e.g. ids.long().")
    if prompt.ndim == 2 and prompt.shape[0] != 1:
        raise NotImplementedError(f"{ONE_PROMPT}; got a tensor of {prompt.shape[0]} rows.")
    if prompt.ndim > 2:
        raise ValueError(f"a prompt tensor must have shape (T,) or (1, T); got {tuple(prompt.shape)}.")
    return prompt.reshape(-1).tolist()


def _sequence_ids(prompt: Sequence) -> list[int]:
    """The ids of a prompt given as a sequence of ints (a sequence of sequences is a batch: refused)."""
    if prompt and isinstance(prompt[0], Sequence) and not isinstance(prompt[0], str):
        raise NotImplementedError(f"{ONE_PROMPT}.")
    try:
        return [operator.index(t) for t in prompt]
    except TypeError as err:
        bad = next(t for t in prompt if not hasattr(t, "__index__"))
        raise ValueError(f"a prompt of token ids must hold integers; got {bad!r} ({type(bad).__name__}).") from err


def _checked_messages(messages: Sequence) -> list:
    """``messages`` as a list, each checked to be a mapping with a ``role`` and a ``content``."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"chat message {i} is {message!r}: each message needs a 'role' and a 'content', e.g. "
                "{'role': 'user', 'content': 'Hello'}."
            )
    return list(messages)


def _check_tree(tree: Any) -> None:
    """ValueError unless ``tree`` is a bool (a truthy string must not switch trees on)."""
    if not isinstance(tree, bool):
        raise ValueError(f"tree={tree!r} must be True (draft trees) or False (chains).")


class SpecDecPP:
    """Adaptive, lossless speculative decoding with a trained acceptance head (SpecDec++).

    Build it from loaded models (``SpecDecPP(target=..., draft=..., head=..., threshold=0.7)``) or from a bundle
    folder (``SpecDecPP.from_pretrained("checkpoints/smollm2-135m-specdecpp")``).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        head: AcceptanceHead,
        threshold: float,
        tokenizer=None,
        min_candidates: int = 2,
        max_candidates: int = 20,
        temperature: float = 1.0,
        calibration: Calibration | None = None,
        cost_model: dict | None = None,
        provenance: dict | None = None,
        target_spec: ModelSpec | None = None,
        draft_spec: ModelSpec | None = None,
        unscored: str | None = None,
        greedy_threshold: float | None = None,
        greedy_unscored: str | None = None,
        greedy_calibration: Calibration | None = None,
        tree: dict | None = None,
        tree_calibration: dict[str, Calibration] | None = None,
        context_row: int = 0,
    ) -> None:
        if head.hidden_size != draft.config.hidden_size:
            raise ValueError(
                f"head hidden_size={head.hidden_size} != draft hidden_size={draft.config.hidden_size}: "
                "the head must be trained on this draft's hidden states."
            )
        check_same_vocab(target, draft)
        # Validates threshold and candidate bounds with the same messages as the policy.
        HeadThreshold(head, threshold, min_candidates, max_candidates, unscored=unscored)
        if greedy_threshold is not None:
            HeadThreshold(head, greedy_threshold, min_candidates, max_candidates, unscored=greedy_unscored)
        self.target, self.draft, self.head, self.tokenizer = target, draft, head.eval(), tokenizer
        self.threshold = float(threshold)
        self.min_candidates, self.max_candidates = min_candidates, max_candidates
        self.unscored = unscored
        self.greedy_threshold = None if greedy_threshold is None else float(greedy_threshold)
        self.greedy_unscored = greedy_unscored if greedy_threshold is not None else None
        self.temperature = temperature
        self.calibration = calibration
        self.greedy_calibration = greedy_calibration
        self.cost_model = cost_model
        self.provenance = provenance or {}
        self.target_spec, self.draft_spec = target_spec, draft_spec
        self.context_row = check_context_row(context_row)
        """Tokens copied from the text verified beside each chain of :meth:`generate` (0: none; a tree's copies are
        its :attr:`tree` settings' ``context_row``); :meth:`custom_generate` copies the same way."""
        self.tree = dict(tree or {})
        """Keyword arguments of :class:`~accept_head.trees.growth.HeadTree` for ``generate(..., tree=True)``
        (``width``, ``top_k``, ``max_depth``, ``min_depth``, ``max_nodes``, ``threshold``, ``siblings``,
        ``context_row``); unset ones take HeadTree's defaults."""
        self.tree_calibration = dict(tree_calibration or {})
        """Per decoding mode (``greedy``, ``sampled``): the map from the head's probability to P(tree node accepted |
        parent accepted), fitted on tree-node labels by ``python -m train.trees --export_calibration true``. A tree
        node's label is not a chain candidate's (at T = 1 it is p(token), not min(1, p/q)), so :meth:`tree_rule`
        prefers it to the chain calibration of the mode."""
        _check_tree_modes(self.tree_calibration)
        if self.tree:
            self.tree_rule()  # validates the stored settings with HeadTree's messages
        self.last_stats: DecodeStats | None = None
        """Counters of the latest :meth:`custom_generate` call (``generate`` returns only token ids)."""

    def h_star(self, greedy: bool = False) -> tuple[float, str | None]:
        """(h*, unscored) for a decoding mode: the greedy h* when the bundle has one (greedy and sampling are
        different problems, so the sweep can choose h* for each), else the one h* the bundle was swept for."""
        if greedy and self.greedy_threshold is not None:
            return self.greedy_threshold, self.greedy_unscored
        return self.threshold, self.unscored

    def calibration_for(self, greedy: bool = False, tree: bool = False) -> Calibration | None:
        """The calibration map for a decoding mode: the one fitted on greedy labels when the bundle has one
        (greedy verification accepts by another rule than the sampling labels the head trains on). ``tree``: the
        map fitted on the mode's tree-node labels when the bundle has one (:attr:`tree_calibration`), else the
        chain's."""
        if tree and tree_mode(greedy) in self.tree_calibration:
            return self.tree_calibration[tree_mode(greedy)]
        return self.greedy_calibration if greedy and self.greedy_calibration is not None else self.calibration

    def policy(self, threshold: float | None = None, greedy: bool = False) -> HeadThreshold:
        """The stop policy this bundle decodes with in a mode (``greedy``): its h* for that mode
        (:meth:`h_star`); ``threshold`` overrides h* and keeps the mode's ``unscored`` setting."""
        h, unscored = self.h_star(greedy)
        return HeadThreshold(
            self.head,
            h if threshold is None else threshold,
            self.min_candidates,
            self.max_candidates,
            calibration=self.calibration_for(greedy),
            unscored=unscored,
        )

    def tree_rule(self, threshold: float | None = None, greedy: bool = False) -> HeadTree:
        """The tree growth rule of ``generate(..., tree=True)``: this bundle's head (with the mode's tree
        calibration, else its chain calibration: :meth:`calibration_for`) pricing every node under its cost model,
        with the stored :attr:`tree` settings; ``threshold`` overrides the stored one (a node needs P(reached and
        accepted) >= 1 − threshold). Unless the settings say otherwise, children at T > 0 are drawn from the draft
        (``siblings="sampled"``: on held-out prompts the head tree decoded 0.96× chain SpecDec++ at T = 1 with them
        and 0.74× with the draft's top-k, ``docs/findings.md`` §8)."""
        if not self.cost_model:
            raise ValueError(
                "This bundle has no cost model, which tree decoding needs to price nodes and depths: measure one "
                "with `python -m eval costs` and pass it as cost_model=, or use generate(..., tree=False)."
            )
        unknown = sorted(set(self.tree) - set(TREE_SETTINGS))
        if unknown:
            raise ValueError(f"tree settings {unknown} are unknown; use {', '.join(TREE_SETTINGS)}.")
        settings = {"siblings": "sampled", **self.tree}  # at T > 0 drawn children pay (findings §8); greedy: top-k
        if threshold is not None:
            settings["threshold"] = threshold
        # Drawn siblings (T > 0) are accepted as chain candidates are (min(1, p/q)): the chain's calibration fits.
        drawn = not greedy and settings["siblings"] == "sampled"
        calibration = self.calibration_for(greedy, tree=not drawn)
        return HeadTree(self.head, CostModel.from_dict(self.cost_model), calibration=calibration, **settings)

    def decoding_rule(
        self,
        tree: bool = False,
        threshold: float | None = None,
        greedy: bool = False,
        context_row: int | None = None,
        policy: StopPolicy | None = None,
        long_row: int = 0,
        padding_only: bool = False,
    ) -> StopPolicy | TreeRule | CopyingChain:
        """What :meth:`generate` and :meth:`custom_generate` decode with in a mode: the tree rule (``tree``, its copies
        the tree settings' unless ``context_row`` says otherwise), else the mode's stop policy (or ``policy``'s
        chains), wrapped as a :class:`~accept_head.trees.chain_copies.CopyingChain` when ``context_row`` (None:
        :attr:`context_row`) > 0, with its ``long_row`` and ``padding_only``
        (:class:`~accept_head.trees.chain_copies.CopyingChain`)."""
        _check_tree(tree)
        copies = self.context_row if context_row is None else check_context_row(context_row)
        for name, value in (("long_row", long_row), ("padding_only", padding_only)):
            if value and (tree or not copies):
                raise ValueError(
                    f"{name}={value!r} shapes the copies beside a chain: pass tree=False and a context_row > 0."
                )
        if tree:
            rule = self.tree_rule(threshold, greedy)
            if context_row is not None:
                rule.context_row = copies
            return rule
        policy = self.policy(threshold, greedy) if policy is None else policy
        return CopyingChain(policy, copies, long_row, padding_only) if copies else policy

    def encode(self, prompt: str | Sequence[dict] | Sequence[int] | torch.Tensor) -> list[int]:
        """Token ids for a string (chat template applied when the tokenizer has one), chat messages (each a dict with
        ``role`` and ``content``), or ids (a sequence of ints, or an integer tensor of shape (T,) or (1, T))."""
        if isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise ValueError("This SpecDecPP has no tokenizer: pass token ids or build it with tokenizer=...")
            if isinstance(prompt, str):
                return chat_prompt_ids(self.tokenizer, prompt)
            ids = self.tokenizer.apply_chat_template(
                _checked_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids)
        ids = _tensor_ids(prompt) if isinstance(prompt, torch.Tensor) else _sequence_ids(prompt)
        vocabulary = getattr(self.target.config, "vocab_size", None)
        outside = [t for t in ids if vocabulary is not None and not 0 <= t < vocabulary]
        if outside:
            raise ValueError(
                f"token id {outside[0]} is outside the target's vocabulary of {vocabulary} ids [0, {vocabulary}): "
                "pass ids from the pair's tokenizer."
            )
        return ids

    def generate(
        self,
        prompt: str | Sequence[dict] | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        threshold: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        tree: bool = False,
        target_runtime: str = "eager",
        context_row: int | None = None,
        long_row: int = 0,
        padding_only: bool = False,
    ) -> SpecDecOutput:
        """Generate a continuation of ``prompt`` (a string, chat messages, or token ids).

        ``temperature`` defaults to the one the head was trained for; ``temperature=0`` is greedy. ``tree=True``
        drafts a token tree each round, grown and pruned by the head under the bundle's cost model
        (:meth:`tree_rule`, :func:`~accept_head.trees.decoding.tree_generate`); ``stats`` then counts the tokens
        fed to the target per call (``stats.fed``) and the tree's leaves (``stats.rows``). ``target_runtime`` (chain
        decoding): ``eager``, ``static`` (a preallocated KV cache) or ``compiled`` (that cache under
        ``torch.compile``, each pass width compiled on its first use: slow first calls;
        :mod:`~accept_head.models.static_target`).

        ``context_row``: tokens copied from the text itself (the continuation of the latest earlier occurrence of the
        last three, else two, tokens) verified beside each round's chain or tree, at the root and below the draft's
        path (:func:`~accept_head.trees.chain_copies.chain_copy_generate`; exact in every mode). None: the bundle's
        own (:attr:`context_row` for chains, the ``tree`` settings' for trees); chains with copies take every
        ``target_runtime`` (a static or compiled target runs their tree passes over its preallocated cache).
        ``long_row`` (chains with copies, opt-in): copy that many tokens after a recurring suffix of five or more
        (:class:`~accept_head.trees.chain_copies.CopyingChain`; 16 sped HumanEval 1.10–1.15× eager, other text ~1.0×,
        and compiled decoding 0.96×). ``padding_only`` (chains with copies, opt-in): copy only into the positions a
        static or compiled target pads its pass to anyway (:class:`~accept_head.trees.chain_copies.CopyingChain`).
        """
        _check_tree(tree)
        if tree and target_runtime != "eager":
            raise ValueError(f"target_runtime={target_runtime!r} serves chain decoding; pass tree=False or 'eager'.")
        if seed is not None and generator is not None:
            raise ValueError(f"seed={seed!r} and generator= were both given: pass one of them.")
        ids = self.encode(prompt)
        if generator is None:
            generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**63)
        eos = self.eos_token_ids
        temperature = self.temperature if temperature is None else temperature
        SamplingConfig(temperature, top_k, top_p)  # the sampling options checked before any rule is built
        rule = self.decoding_rule(
            tree, threshold, temperature == 0, context_row, long_row=long_row, padding_only=padding_only
        )
        if isinstance(rule, CopyingChain):
            options = {"context_row": rule.context_row, "target_runtime": target_runtime, "long_row": rule.long_row}
            options["padding_only"] = rule.padding_only
            decode, rule = chain_copy_generate, rule.policy
        elif tree:
            decode, options = tree_generate, {}
        else:
            decode, options = speculative_generate, {"target_runtime": target_runtime}
        result = decode(
            self.target,
            self.draft,
            torch.tensor([ids]),
            rule,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos,
            generator=generator,
            **options,
        )
        new = result.sequences[0, len(ids) :].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
        return SpecDecOutput(text=text, sequences=result.sequences, new_token_ids=new, stats=result.stats)

    @property
    def eos_token_ids(self) -> list[int] | None:
        """Ids that end a response (:func:`~accept_head.models.pairs.eos_token_ids`; None when neither the tokenizer nor
        the target defines one)."""
        return eos_token_ids(self.tokenizer, self.target, required=False)

    def custom_generate(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer=None,
        threshold: float | None = None,
        policy: StopPolicy | TreeRule | CopyingChain | None = None,
        generator: torch.Generator | None = None,
        tree: bool = False,
        context_row: int | None = None,
        long_row: int = 0,
        **model_kwargs,
    ) -> torch.Tensor | SpecDecGenerateOutput:
        """SpecDec++ as the decoding loop of ``transformers`` ``generate``, bound to this bundle's draft and head::

            specdec.target.generate(**inputs, custom_generate=specdec.custom_generate, max_new_tokens=64,
                                    do_sample=True, temperature=0.7, top_p=0.9, streamer=streamer)

        transformers calls it with the prepared prompt ``input_ids`` (1, L), logits processors, stopping criteria
        and generation config (see :mod:`accept_head.specdecpp.hf_generate`); ``threshold=``, ``policy=`` (any stop
        policy
        instead of the head, or a :class:`~accept_head.trees.growth.TreeRule`), ``generator=`` and ``tree=True``
        (draft trees grown by the head under the bundle's cost model, :meth:`tree_rule`; ``threshold=`` then sets
        the tree's node floor) may be passed to ``generate`` as extra keyword arguments, and ``context_row=`` and
        ``long_row=`` as :meth:`generate` takes them (None: the bundle's own copies; a ``policy=`` given is decoded as
        it is). Returns (1, L + N) token ids, or a ``GenerateDecoderOnlyOutput`` with ``stats`` when
        ``return_dict_in_generate``.
        """
        greedy = not generation_config.do_sample
        with streamer_ended_on_error(streamer):
            _check_tree(tree)
            if tree and policy is not None and not isinstance(policy, TreeRule):
                raise ValueError(
                    f"tree=True but policy={policy.describe()} is a chain stop policy: pass a TreeRule as policy= "
                    "(e.g. ConfidenceTree()) or drop tree=True."
                )
            if policy is not None and (context_row is not None or long_row):
                raise ValueError(
                    f"context_row={context_row}, long_row={long_row} set the bundle's own rule's copies, but policy= "
                    "was given: wrap your policy as CopyingChain(policy, context_row, long_row) or leave them out."
                )
            if policy is None:
                policy = self.decoding_rule(tree, threshold, greedy, context_row, long_row=long_row)
        output, self.last_stats = run_custom_generate(
            model,
            self.draft,
            policy,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer=streamer,
            generator=generator,
            **model_kwargs,
        )
        return output

    # ---- persistence -------------------------------------------------------------------------------------------

    def to_config(self, folder: Path) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "target": _spec_to_config(self.target_spec, folder),
            "draft": _spec_to_config(self.draft_spec, folder),
            "head": self.head.config,
            "threshold": self.threshold,
            "min_candidates": self.min_candidates,
            "max_candidates": self.max_candidates,
            "unscored": self.unscored,
            "greedy_threshold": self.greedy_threshold,
            "greedy_unscored": self.greedy_unscored,
            "temperature": self.temperature,
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "greedy_calibration": self.greedy_calibration.to_dict() if self.greedy_calibration is not None else None,
            "cost_model": self.cost_model,
            "provenance": self.provenance,
            "tree": self.tree or None,
            "tree_calibration": {mode: c.to_dict() for mode, c in self.tree_calibration.items()} or None,
            "context_row": self.context_row,
        }

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``config.json``, ``head.safetensors`` and ``custom_generate/generate.py`` (models are referenced by
        their specs, not copied)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.to_config(folder)
        state = {k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()}
        tmp_weights, tmp_config = folder / (HEAD_WEIGHTS + ".tmp"), folder / (CONFIG_NAME + ".tmp")
        save_file(state, str(tmp_weights), metadata={"format": "pt"})
        tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp_weights.replace(folder / HEAD_WEIGHTS)
        tmp_config.replace(folder / CONFIG_NAME)
        custom = folder / CUSTOM_GENERATE
        custom.parent.mkdir(exist_ok=True)
        tmp_custom = custom.with_name(custom.name + ".tmp")
        tmp_custom.write_text(CUSTOM_GENERATE_SOURCE)
        tmp_custom.replace(custom)

    @classmethod
    def write_tree_calibration(
        cls, folder: str | Path, maps: dict[str, Calibration], record: dict, card: str | None = None
    ) -> None:
        """Store per-mode tree calibrations (:attr:`tree_calibration`) in the bundle at ``folder``: ``maps`` replace
        those of the same modes, ``record`` (how they were fitted and checked) goes to ``provenance.tree_calibration``
        and ``card`` (markdown) replaces the model card's tree-calibration section. Nothing else in the bundle
        changes; each file is replaced whole."""
        _check_tree_modes(maps)
        folder = Path(folder)
        config = cls.read_config(folder)
        config["tree_calibration"] = {**(config.get("tree_calibration") or {})}
        config["tree_calibration"] |= {mode: c.to_dict() for mode, c in maps.items()}
        config["provenance"] = {**(config.get("provenance") or {}), "tree_calibration": record}
        tmp = folder / (CONFIG_NAME + ".tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(folder / CONFIG_NAME)
        readme = folder / "README.md"
        if card is not None and readme.is_file():
            text = readme.read_text()
            start, end = "<!-- tree-calibration -->", "<!-- /tree-calibration -->"
            block = f"{start}\n{card.strip()}\n{end}"
            if start in text and end in text:
                text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
            else:
                text = text.rstrip("\n") + "\n\n" + block + "\n"
            tmp = readme.with_name("README.md.tmp")
            tmp.write_text(text)
            tmp.replace(readme)

    @staticmethod
    def read_config(folder: str | Path) -> dict:
        """Read and validate a bundle's ``config.json`` (unknown keys warn, unknown versions raise)."""
        folder = Path(folder)
        path = folder / CONFIG_NAME
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise FileNotFoundError(f"Bundle folder {folder} {what}: pass the folder that holds {CONFIG_NAME}.")
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {folder} is not a SpecDecPP bundle.")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); re-export the bundle.") from err
        if not isinstance(config, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}.")
        version = config.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            fix = "Upgrade accept_head or re-export the bundle"
            if str(version) == str(FORMAT_VERSION):
                fix = f"write it as the number {FORMAT_VERSION}"
            raise ValueError(
                f"{path} has format_version={version!r}; this version of accept_head reads format_version="
                f"{FORMAT_VERSION} (an integer). {fix}."
            )
        unknown = sorted(set(config) - KNOWN_KEYS)
        if unknown:
            warnings.warn(f"{path}: ignoring unknown keys {unknown}", stacklevel=2)
        for key in ("head", "threshold"):
            if key not in config:
                raise ValueError(f"{path} lacks the required key {key!r}.")
        _check_config_types(config, path)
        return config

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        target: torch.nn.Module | None = None,
        draft: torch.nn.Module | None = None,
        tokenizer: Any = None,
        device: str | torch.device | int | None = None,
        dtype: str | torch.dtype | None = None,
        device_map: str | dict | None = None,
        draft_quantize: str | None = None,
    ) -> SpecDecPP:
        """Load a bundle. Models are loaded from the stored specs unless passed in.

        ``dtype`` (a ``torch.dtype``, its name, or ``"auto"`` for the dtype stored with each model), ``device`` (a
        string, ``torch.device`` or accelerator index) and ``device_map`` (accelerate's placement, e.g. ``"auto"``; not
        together with ``device``) override the specs, as in transformers' ``from_pretrained``. ``draft_quantize``
        (``"int8"`` or ``"int4"``): the feature draft decodes with those weights (``ModelSpec.quantize``; lossless,
        a cheaper drafting step on a CPU — the bundle's cost model and h* still price the draft it was built with).
        A bundle whose stored draft spec says ``quantize: int8`` (the embedded pair's) was labelled, trained and
        priced with the int8 draft and loads it so; pass ``draft=`` to decode with another."""
        if device is not None and device_map is not None:
            raise ValueError("Pass device or device_map, not both (device_map places the weights itself).")
        if draft_quantize is not None and draft is not None:
            raise ValueError("draft_quantize applies to the bundle's own draft; a draft passed in is used as loaded.")
        device = None if device is None else normalize_device(device)
        dtype = None if dtype is None else normalize_dtype(dtype)
        folder = Path(folder)
        config = cls.read_config(folder)
        head = _load_head(folder, config)
        target_spec = _spec_from_config(config.get("target"), folder)
        draft_spec = _spec_from_config(config.get("draft"), folder)
        if draft_spec is not None and draft_quantize is not None:
            draft_spec.quantize = draft_quantize
        for spec in (target_spec, draft_spec):
            if spec is not None:
                spec.device = device or spec.device
                spec.dtype = dtype or spec.dtype
                if device_map is not None:
                    spec.extra = {**spec.extra, "device_map": device_map}
        if target is None and target_spec is None:
            raise ValueError(f"{folder / CONFIG_NAME} names no target model; pass target=... explicitly.")
        if draft is None and draft_spec is None:
            raise ValueError(f"{folder / CONFIG_NAME} names no draft model; pass draft=... explicitly.")
        # Check the tokenizers before loading any weights: a mismatched pair fails fast.
        if tokenizer is None and target_spec is not None:
            tokenizer = load_tokenizer(target_spec)
            if draft_spec is not None:
                check_same_tokenizer(tokenizer, load_tokenizer(draft_spec), target_spec.path, draft_spec.path)
        if target is None:
            target = load_model(target_spec)
        if draft is None:
            draft = load_model(draft_spec)
        head = head.to(next(draft.parameters()).device)
        calibration, greedy_calibration = (
            Calibration.from_dict(config[key]) if config.get(key) else None
            for key in ("calibration", "greedy_calibration")
        )
        tree_maps = config.get("tree_calibration") or {}
        return cls(
            target=target,
            draft=draft,
            head=head,
            threshold=config["threshold"],
            tokenizer=tokenizer,
            min_candidates=config.get("min_candidates", 2),
            max_candidates=config.get("max_candidates", 20),
            temperature=config.get("temperature", 1.0),
            calibration=calibration,
            cost_model=copy.deepcopy(config.get("cost_model")),
            provenance=config.get("provenance") or {},
            target_spec=target_spec,
            draft_spec=draft_spec,
            unscored=config.get("unscored"),
            greedy_threshold=config.get("greedy_threshold"),
            greedy_unscored=config.get("greedy_unscored"),
            greedy_calibration=greedy_calibration,
            tree=config.get("tree"),
            tree_calibration={mode: Calibration.from_dict(raw) for mode, raw in tree_maps.items()},
            context_row=config.get("context_row", 0),
        )


# ---- the hub's custom_generate entry point -------------------------------------------------------------------------

_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""target model → {bundle folder: SpecDecPP} built around it (the hub entry point loads each bundle once)."""


def bundle_generate(folder: str | Path, model: torch.nn.Module, *args: Any, **generate_kwargs: Any) -> Any:
    """The hub ``custom_generate/generate.py`` entry point: SpecDec++ with the bundle in ``folder`` around ``model``
    (the target), called with ``generate``'s own arguments plus those of :meth:`SpecDecPP.custom_generate`
    (``tree=True``, ``threshold=``, ``policy=``, ``generator=``), which ``generate`` hands to it."""
    folder = Path(folder).resolve()
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"{folder} is not a SpecDecPP bundle folder. transformers copies custom_generate/generate.py into its "
            "module cache when loading it by name; pass bundle='<bundle folder>' to generate()."
        )
    per_model = _LOADED.setdefault(model, {})
    if folder not in per_model:
        device = str(next(model.parameters()).device)
        per_model[folder] = SpecDecPP.from_pretrained(folder, target=model, device=device)
    specdec = per_model[folder]
    # The class's own generate, never an instance override (which would recurse when the hub convention replaced it).
    return GenerationMixin.generate(model, *args, custom_generate=specdec.custom_generate, **generate_kwargs)


CUSTOM_GENERATE_SOURCE = '''"""SpecDec++ decoding with the bundle in the folder above (hub ``custom_generate`` layout).

Written by ``accept_head.SpecDecPP.save_pretrained``; needs ``pip install accept-head``. Loading it through
transformers (``custom_generate=<this folder>``) runs this file and therefore needs your explicit
``trust_remote_code=True``; nothing in accept_head turns that on. transformers copies this file into its module cache,
so pass ``bundle=<folder>`` to ``generate`` when loading it that way.
"""

from pathlib import Path

from accept_head.specdecpp.bundle import bundle_generate


def generate(model, *args, bundle=None, **kwargs):
    """``model.generate(...)`` (the target) with SpecDec++ as the decoding loop; takes ``generate``'s arguments."""
    folder = Path(bundle) if bundle is not None else Path(__file__).resolve().parent.parent
    return bundle_generate(folder, model, *args, **kwargs)
'''
"""The ``custom_generate/generate.py`` a bundle ships (see :meth:`SpecDecPP.save_pretrained`)."""
