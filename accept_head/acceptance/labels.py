"""Token-level acceptance labels for training an acceptance head (SpecDec++ §3.3), and the dataset that holds them.

For a prompt x and the target's response X = X_1..X_N, both models are teacher-forced on (x, X) in batched passes:
p_i = p(·|x, X_<i) and q_i = q(·|x, X_<i), both *after the sampling transform the decoder uses* (see
:mod:`accept_head.core.sampling`). A draft token Y_i ~ q_i is drawn with a seeded generator and labelled with the
probability that speculative sampling accepts it, min(1, p_i(Y_i)/q_i(Y_i)). In ``greedy`` mode the transform is
the argmax: Y_i = argmax q_i and the label is 1[Y_i = argmax p_i].

The same passes give, at no extra model cost, the features baseline stop rules need: the expected acceptance
Σ_x min(p_i(x), q_i(x)) (the acceptance probability averaged over Y_i), the draft's entropy and its top-1
probability. ``python -m data_gen`` writes them as a Hugging Face ``datasets`` dataset (one row per prompt, one list
entry per response token; see :data:`COLUMNS`) plus a ``meta.json``; :func:`load_label_dataset` reads it back.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.hf_compat import cache_kwargs
from ..core.sampling import SamplingConfig, inverse_cdf_sample, probabilities
from ..core.timing import device_timer
from ..models.batch_generate import left_pad
from .inputs import draft_stats

FORMAT = "accept_head.data_gen"
"""``meta.json["format"]`` of a label dataset."""
FORMAT_VERSION = 1
"""``meta.json["format_version"]``; bumped when the columns or their meaning change."""

LABEL_MODES = ("sample", "greedy")

COLUMNS: dict[str, str] = {
    "prompt_id": "string",
    "source": "string",
    "prompt_ids": "int32",
    "response_ids": "int32",
    "draft_ids": "int32",
    "target_logp": "float32",
    "draft_logp": "float32",
    "accept_prob": "float32",
    "expected_accept": "float32",
    "draft_entropy": "float32",
    "draft_top1": "float32",
}
"""Dataset columns and their value types; every column but ``prompt_id`` and ``source`` is a list.

Per-position lists all have ``len(response_ids)`` entries; entry i describes the distributions for response token i
given the prompt and ``response_ids[:i]``:

- ``response_ids``: X, the target's response (ends with EOS when one was produced).
- ``draft_ids``: Y_i ~ q_i (argmax q_i when the transform is greedy).
- ``target_logp`` / ``draft_logp``: log p_i(Y_i) / log q_i(Y_i). ``target_logp`` is -inf when a top-k/top-p filter
  removed Y_i from p_i (then ``accept_prob`` is 0).
- ``accept_prob``: min(1, p_i(Y_i)/q_i(Y_i)), the soft label; 1[Y_i = argmax p_i] when greedy.
- ``expected_accept``: Σ_x min(p_i(x), q_i(x)).
- ``draft_entropy`` (nats) and ``draft_top1`` (max_x q_i(x)): features of the draft's distribution.

When the transform is greedy (``label_mode: greedy`` or temperature 0), the transformed distributions are one-hot,
so ``target_logp``, ``draft_logp``, ``draft_entropy`` and ``draft_top1`` are taken from the untransformed softmax
(temperature 1, no filter) instead; ``meta.json["feature_transform"]`` records which one was used.
"""

PER_POSITION = (
    "draft_ids",
    "target_logp",
    "draft_logp",
    "accept_prob",
    "expected_accept",
    "draft_entropy",
    "draft_top1",
)
"""The per-position columns, in the order :class:`PositionLabels` holds them."""


def label_features():
    """The ``datasets.Features`` of a label dataset (see :data:`COLUMNS`)."""
    return _list_features(COLUMNS)


def _list_features(columns: dict[str, str]):
    """``datasets.Features`` of ``columns`` (name → value type): every column a list but ``prompt_id`` and
    ``source``."""
    import datasets

    values = {name: datasets.Value(dtype) for name, dtype in columns.items()}
    scalars = ("prompt_id", "source")
    return datasets.Features({name: v if name in scalars else datasets.List(v) for name, v in values.items()})


def label_transform(sampling: SamplingConfig, label_mode: str) -> SamplingConfig:
    """The transform p and q go through: ``sampling`` in sample mode, the argmax (temperature 0) in greedy mode."""
    if label_mode not in LABEL_MODES:
        raise ValueError(f"label_mode={label_mode!r} must be one of {LABEL_MODES}.")
    return SamplingConfig(temperature=0.0) if label_mode == "greedy" else sampling


def recorded_temperature(meta: dict) -> float | None:
    """The temperature a label dataset's meta.json says its labels were made at (0 for greedy labels)."""
    transform = meta.get("label_transform") or meta.get("sampling") or {}
    return transform.get("temperature")


@dataclass
class PositionLabels:
    """Labels and features at N response positions; every field is an (N,) tensor on the CPU."""

    draft_ids: torch.Tensor
    target_logp: torch.Tensor
    draft_logp: torch.Tensor
    accept_prob: torch.Tensor
    expected_accept: torch.Tensor
    draft_entropy: torch.Tensor
    draft_top1: torch.Tensor

    @classmethod
    def cat(cls, parts: Sequence[PositionLabels]) -> PositionLabels:
        return cls(**{name: torch.cat([getattr(p, name) for p in parts]) for name in PER_POSITION})


def draft_acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How well draft distributions q match target distributions p, per position: p, q (..., V) → two (...) tensors.

    The first is the expected acceptance Σ_x min(p(x), q(x)) = E_{Y~q}[min(1, p(Y)/q(Y))] (1 − TV(p, q)): the chance
    that a token drawn from q is accepted. The second says whether argmax q = argmax p (greedy acceptance).
    """
    return torch.minimum(p, q).sum(-1), q.argmax(-1) == p.argmax(-1)


def position_labels(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    *,
    transform: SamplingConfig,
    uniforms: torch.Tensor | None,
    draft_ids: torch.Tensor | None = None,
) -> PositionLabels:
    """Acceptance labels at N positions from the two models' logits there.

    Args:
        target_logits: (N, V) target logits, position i conditioned on the same context as ``draft_logits[i]``.
        draft_logits: (N, V) draft logits.
        transform: the sampling transform applied to both (see :func:`label_transform`).
        uniforms: (N,) uniforms in [0, 1) used to draw Y_i ~ q_i; ignored (may be None) when ``transform`` is greedy
            or ``draft_ids`` is given.
        draft_ids: (N,) LongTensor of tokens already drawn from q_i (e.g. the candidates of a speculative round,
            :mod:`accept_head.chain.rollout`) to label instead of drawing new ones; each must have q_i(Y_i) > 0.
    """
    if target_logits.shape != draft_logits.shape:
        raise ValueError(
            f"target logits {tuple(target_logits.shape)} and draft logits {tuple(draft_logits.shape)} "
            "differ in shape; the pair must share one vocabulary (see check_same_vocab)."
        )
    p = probabilities(target_logits, transform)  # (N, V) float32
    q = probabilities(draft_logits, transform)
    if draft_ids is not None:
        if draft_ids.shape != q.shape[:1]:
            raise ValueError(f"need one draft token per position ({q.shape[0]}), got {tuple(draft_ids.shape)}.")
        draft_ids = draft_ids.to(device=q.device, dtype=torch.long)
    elif transform.greedy:
        draft_ids = q.argmax(-1)
    else:
        if uniforms is None or uniforms.shape != q.shape[:1]:
            raise ValueError(
                f"need one uniform per position ({q.shape[0]}), got "
                f"{None if uniforms is None else tuple(uniforms.shape)}."
            )
        draft_ids = inverse_cdf_sample(q, uniforms.to(q.device))
    p_y = p.gather(-1, draft_ids[:, None]).squeeze(-1)
    q_y = q.gather(-1, draft_ids[:, None]).squeeze(-1)  # > 0: Y_i was drawn from q_i
    accept_prob = (p_y / q_y).clamp(max=1.0)  # q >= p: accept with p/q; q < p: always accept
    expected_accept, _ = draft_acceptance(p, q)
    # One-hot p and q carry no confidence information: when greedy, the features are the untransformed softmax's.
    # The draft's are computed by the function the decoder uses for a head's inputs (acceptance/inputs.py).
    draft_logp, draft_entropy, draft_top1 = draft_stats(draft_logits, q, draft_ids, transform.greedy)
    if transform.greedy:
        target_logp = target_logits.float().log_softmax(-1).gather(-1, draft_ids[:, None]).squeeze(-1)
    else:
        target_logp = p_y.log()
    return PositionLabels(
        draft_ids=draft_ids.cpu(),
        target_logp=target_logp.cpu(),
        draft_logp=draft_logp.cpu(),
        accept_prob=accept_prob.cpu(),
        expected_accept=expected_accept.cpu(),
        draft_entropy=draft_entropy.cpu(),
        draft_top1=draft_top1.cpu(),
    )


@torch.inference_mode()
def response_logits(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_token_id: int,
) -> torch.Tensor:
    """Teacher-forced logits at every response position of B sequences, in one left-padded forward pass.

    Row b is fed ``prompt_ids[b] + response_ids[b][:-1]``; its last ``len(response_ids[b])`` positions predict the
    response tokens. Returns (N, V) logits with N = Σ_b len(response_ids[b]), rows in order (row-major), entry
    ``offset_b + i`` conditioned on ``prompt_ids[b] + response_ids[b][:i]``.
    """
    if any(len(p) == 0 for p in prompt_ids) or any(len(r) == 0 for r in response_ids):
        raise ValueError("response_logits needs non-empty prompts and responses.")
    device = next(model.parameters()).device
    sequences = [list(p) + list(r[:-1]) for p, r in zip(prompt_ids, response_ids, strict=True)]
    ids, mask = left_pad(sequences, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = max(len(r) for r in response_ids)
    accepts_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"logits_to_keep": keep} if accepts_keep else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **kwargs).logits
    logits = logits[:, -keep:]  # (B, keep, V): left padding right-aligns every row's response positions
    return torch.cat([logits[b, keep - len(r) :] for b, r in enumerate(response_ids)])


def micro_batches(lengths: Sequence[int], budget: int) -> list[range]:
    """Split consecutive rows into groups whose (rows × longest response) stays within ``budget`` positions.

    The logits of one teacher-forced pass are (rows, longest response, V); this bounds their memory. A row longer
    than the budget gets a group of its own.
    """
    groups: list[range] = []
    start, longest = 0, 0
    for row, length in enumerate(lengths):
        new_longest = max(longest, length)
        if row > start and (row - start + 1) * new_longest > budget:
            groups.append(range(start, row))
            start, new_longest = row, length
        longest = new_longest
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


@torch.inference_mode()
def label_responses(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    sampling: SamplingConfig,
    label_mode: str,
    generator: torch.Generator | None,
    pad_token_id: int,
    score_tokens: int = 2048,
) -> list[dict[str, list]]:
    """Label every response token of a batch of (prompt, response) pairs; one dict of lists per row.

    Both models are teacher-forced on the same micro-batches (at most ``score_tokens`` response positions of logits
    each); p and q are transformed, compared and turned into labels ~16M logits at a time. One uniform per response
    position is drawn from ``generator`` up front, in row-major order, so the draws do not depend on ``score_tokens``
    or the chunking. Keys: :data:`PER_POSITION`.
    """
    transform = label_transform(sampling, label_mode)
    lengths = [len(r) for r in response_ids]
    uniforms = None if transform.greedy else torch.rand(sum(lengths), generator=generator, dtype=torch.float64)
    parts: list[PositionLabels] = []
    offset = 0
    for group in micro_batches(lengths, score_tokens):
        prompts = [prompt_ids[b] for b in group]
        responses = [response_ids[b] for b in group]
        p_logits = response_logits(target, prompts, responses, pad_token_id)  # (n, V)
        q_logits = response_logits(draft, prompts, responses, pad_token_id)
        n, vocab = p_logits.shape
        chunk = max(1, (1 << 24) // vocab)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            u = None if uniforms is None else uniforms[offset + lo : offset + hi]
            parts.append(position_labels(p_logits[lo:hi], q_logits[lo:hi], transform=transform, uniforms=u))
        offset += n
    labels = PositionLabels.cat(parts)
    columns = {name: getattr(labels, name).split(lengths) for name in PER_POSITION}
    return [{name: columns[name][row].tolist() for name in PER_POSITION} for row in range(len(lengths))]


class LockstepLabeller:
    """Labels a target's responses *while* :func:`~accept_head.models.batch_generate.sample_batch` samples them.

    The draft runs beside the target on the same inputs (its own KV cache), so at step i both p_i and q_i are at
    hand: Y_i ~ q_i is drawn and labelled right away, and the two teacher-forced scoring passes of
    :func:`label_responses` are not needed (their target pass costs as much as a second generation). The labels
    are those of :func:`label_responses` (same transform, same columns); the draws differ, because one uniform per
    (row, step) is drawn up front here, row-major over ``rows × max_new_tokens``.

    Use it as ``sample_batch(..., follower=labeller)`` and then ``labeller.rows(response_lengths)``;
    ``seconds`` is the time spent in the draft and the labelling.
    """

    def __init__(
        self,
        draft: torch.nn.Module,
        *,
        batch: int,
        max_new_tokens: int,
        sampling: SamplingConfig,
        label_mode: str,
        generator: torch.Generator | None,
    ) -> None:
        from transformers import DynamicCache

        self.draft = draft
        self.device = next(draft.parameters()).device
        self.transform = label_transform(sampling, label_mode)
        self.uniforms = (
            None
            if self.transform.greedy
            else torch.rand((batch, max_new_tokens), generator=generator, dtype=torch.float64)
        )
        self.cache = DynamicCache()
        self.values = {name: torch.zeros((batch, max_new_tokens), dtype=_DTYPES[name]) for name in PER_POSITION}
        self.seconds = 0.0

    @torch.inference_mode()
    def step(self, rows, step, input_ids, attention_mask, position_ids, logits) -> None:
        with device_timer({self.device, logits.device}) as watch:
            draft_logits = self.draft(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                **cache_kwargs(self.draft, self.cache),
                logits_to_keep=1,
            ).logits[:, -1, :]
            u = None if self.uniforms is None else self.uniforms[rows, step]
            labels = position_labels(logits, draft_logits.to(logits.device), transform=self.transform, uniforms=u)
            for name in PER_POSITION:
                self.values[name][rows, step] = getattr(labels, name).to(self.values[name].dtype)
        self.seconds += watch.seconds

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep.to(self.device))

    def rows(self, lengths: Sequence[int]) -> list[dict[str, list]]:
        """Per row, the per-position label lists (keys :data:`PER_POSITION`) of its first ``lengths[row]`` tokens."""
        return [
            {name: self.values[name][row, :length].tolist() for name in PER_POSITION}
            for row, length in enumerate(lengths)
        ]


_DTYPES = {name: torch.long if name == "draft_ids" else torch.float32 for name in PER_POSITION}


def load_label_dataset(path: str | Path):
    """Open a dataset written by ``python -m data_gen``: returns ``(datasets.Dataset, meta dict)``.

    Raises FileNotFoundError when ``path`` does not exist and ValueError when it is not a finished data_gen output
    (an interrupted run, unmerged shards, another kind of folder, or a newer format version).
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"No label dataset at {path}: create it with `python -m data_gen --config <config> --output_dir {path}`."
        )
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        if (path / "_work").is_dir():
            raise ValueError(f"{path} holds an unfinished data_gen run; rerun the same data_gen command to finish it.")
        if (path / "shards").is_dir():
            raise ValueError(
                f"{path} holds data_gen shard outputs but no merged dataset; merge them with "
                f"`python -m data_gen --config <config> --output_dir {path} --merge true`."
            )
        raise ValueError(f"{path} is not a data_gen label dataset (no meta.json).")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}); regenerate the dataset.") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_path} has format={found!r}, expected {FORMAT!r}: not a data_gen label dataset.")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version={version!r}; this accept-head reads versions up to {FORMAT_VERSION}: "
            "upgrade accept-head."
        )
    dataset = datasets.load_from_disk(str(path))
    missing = [name for name in COLUMNS if name not in dataset.column_names]
    if missing:
        raise ValueError(f"{path} lacks the label columns {missing}; regenerate it with python -m data_gen.")
    return dataset, meta
