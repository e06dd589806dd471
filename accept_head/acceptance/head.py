"""The acceptance head f_θ of SpecDec++ (Huang, Guo, Wang 2024, §3.2), and heads that read more than it.

The paper's head reads the draft's final hidden state e_i (the LM head's input) at the position whose input token is
y_i and predicts P(y_i is accepted | y_<i accepted) = sigmoid(f_θ(e_i)). Architecture: ``depth`` residual blocks
x ← x + SiLU(W_d x + b_d), each with its own weights, then a linear layer to one logit; depth 0 is a linear probe.

``inputs`` (:mod:`accept_head.acceptance.inputs`) adds scalars the draft computes anyway — log q(y), the entropy and
top-1 probability of q, the depth in the round, the path's log q — to the ResNet's input: x_0 = [e_i; z_i], z_i the
scalars standardised by a mean and standard deviation fitted on the training data and stored with the weights (the
``scalar_mean`` / ``scalar_std`` buffers). ``residual_on="logq"`` makes the logit logit(q(y_i)) + f_θ(x_0) with the
last layer zero at initialisation: the new head starts as the draft's own probability and learns a correction.
``hidden_dim`` feeds the hidden state through a learned projection to that many dimensions first (x_0 = [P e_i; z_i]):
a narrower ResNet, fewer weights to fit from the labelled rounds there are.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from operator import mul
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.tensor_keys import tensors_key
from .inputs import HIDDEN, SPREAD_INPUTS, check_inputs

RESIDUAL_ON = (None, "logq")
"""What the head's logit may be a correction of: nothing (the paper's head) or logit(q(y)) (``residual_on="logq"``)."""
LOGQ_CLIP = 1e-6
"""logit(q) is taken of q clipped to [1e-6, 1 − 1e-6] (q = 1 happens: a greedy draft's top-1 can round to 1)."""

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"
CONFIG_KEYS = frozenset({"hidden_size", "depth", "inputs", "residual_on", "hidden_dim"})
"""The keys of :attr:`AcceptanceHead.config`."""


class ResidualBlock(nn.Module):
    """x ← x + SiLU(W x + b)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def logit_of_logq(logq: torch.Tensor) -> torch.Tensor:
    """logit(q) = log q − log(1 − q) from log q (...) → (...), q clipped to [LOGQ_CLIP, 1 − LOGQ_CLIP]."""
    logq = logq.clamp(math.log(LOGQ_CLIP), math.log1p(-LOGQ_CLIP))
    return logq - torch.log(-torch.expm1(logq))


class AcceptanceHead(nn.Module):
    """(depth + 1)-layer SiLU ResNet from a hidden state (..., hidden_size) — and the scalar ``inputs`` it reads,
    (..., S) — to one acceptance logit (...)."""

    def __init__(
        self,
        hidden_size: int,
        depth: int = 3,
        inputs: Sequence[str] = (HIDDEN,),
        residual_on: str | None = None,
        hidden_dim: int | None = None,
    ) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size} must be >= 1 (the draft's hidden size).")
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0 (0 is a linear probe).")
        self.inputs = check_inputs(inputs)
        self.scalar_inputs = tuple(name for name in self.inputs if name != HIDDEN)
        """The scalar inputs, in the order of the last axis of ``scalars``."""
        self.reads_hidden = HIDDEN in self.inputs
        if hidden_dim is not None and (hidden_dim < 1 or not self.reads_hidden):
            raise ValueError(
                f"hidden_dim={hidden_dim} projects the hidden state: it must be >= 1 and the head must read "
                f"'hidden' (inputs {list(self.inputs)}); or leave it None (the hidden state read whole)."
            )
        if residual_on not in RESIDUAL_ON:
            raise ValueError(f"residual_on={residual_on!r} must be one of {RESIDUAL_ON}.")
        if residual_on is not None and residual_on not in self.scalar_inputs:
            raise ValueError(f"residual_on={residual_on!r} needs {residual_on!r} among the inputs {list(self.inputs)}.")
        self.hidden_size = hidden_size
        self.depth = depth
        self.residual_on = residual_on
        self.hidden_dim = hidden_dim
        # hidden_dim: the hidden state enters through a learned projection to that many dimensions (fewer weights
        # to fit from a few thousand labelled rounds); None keeps the paper's head, which reads it whole.
        self.hidden_proj = None if hidden_dim is None else nn.Linear(hidden_size, hidden_dim)
        width = (hidden_size if hidden_dim is None else hidden_dim) * self.reads_hidden + len(self.scalar_inputs)
        # Each block owns its weights (the official code repeated one block object, sharing a single weight set).
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        if self.scalar_inputs:  # identity until set_scalar_stats; saved with the weights
            self.register_buffer("scalar_mean", torch.zeros(len(self.scalar_inputs)))
            self.register_buffer("scalar_std", torch.ones(len(self.scalar_inputs)))
        if residual_on is not None:  # the correction starts at zero: the head starts as q itself
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def set_scalar_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardise the scalar inputs by ``mean`` and ``std`` (S,) from now on (fitted on the training data)."""
        if not self.scalar_inputs:
            raise ValueError("This head reads no scalar input: there is nothing to standardise.")
        if mean.shape != self.scalar_mean.shape or std.shape != self.scalar_std.shape or not bool((std > 0).all()):
            raise ValueError(
                f"need a mean and a positive std of shape ({len(self.scalar_inputs)},) for the inputs "
                f"{list(self.scalar_inputs)}, got {tuple(mean.shape)} and {tuple(std.shape)}."
            )
        with torch.no_grad():
            self.scalar_mean.copy_(mean)
            self.scalar_std.copy_(std)

    def _check_inputs(self, hidden: torch.Tensor | None, scalars: torch.Tensor | None) -> None:
        if self.reads_hidden and hidden is None:
            raise ValueError("This head reads the draft's hidden state: pass hidden=(..., hidden_size).")
        if self.scalar_inputs and (scalars is None or scalars.shape[-1] != len(self.scalar_inputs)):
            got = None if scalars is None else tuple(scalars.shape)
            raise ValueError(
                f"This head reads the scalar inputs {list(self.scalar_inputs)}: pass scalars=(..., "
                f"{len(self.scalar_inputs)}) in that order (got {got})."
            )

    def _input(self, hidden: torch.Tensor | None, scalars: torch.Tensor | None) -> torch.Tensor:
        """x_0 = [hidden; standardised scalars] (..., width)."""
        self._check_inputs(hidden, scalars)
        dtype = self.out.weight.dtype
        parts = [hidden.to(dtype)] if self.reads_hidden else []
        if self.hidden_proj is not None:
            parts = [self.hidden_proj(parts[0])]
        if self.scalar_inputs:
            parts.append((scalars.to(dtype) - self.scalar_mean.to(dtype)) / self.scalar_std.to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def _residual(self, scalars: torch.Tensor) -> torch.Tensor:
        """logit(q(y)) (...) from the raw scalars (..., S)."""
        return logit_of_logq(scalars[..., self.scalar_inputs.index(self.residual_on)].float())

    def forward(self, hidden: torch.Tensor | None, scalars: torch.Tensor | None = None) -> torch.Tensor:
        """Acceptance logits: hidden (..., hidden_size) (None for a head that does not read it) and the raw scalar
        inputs (..., S) in :attr:`scalar_inputs` order (None for the paper's head) → (...)."""
        x = self._input(hidden, scalars)
        for block in self.blocks:
            x = block(x)
        logits = self.out(x).squeeze(-1)
        return logits if self.residual_on is None else logits + self._residual(scalars).to(logits.dtype)

    def accept_prob(self, hidden: torch.Tensor | None, scalars: torch.Tensor | None = None) -> torch.Tensor:
        """sigmoid(logits): the predicted acceptance probability, (..., hidden_size) [+ (..., S)] → (...)."""
        return torch.sigmoid(self.forward(hidden, scalars))

    def accept_prob_one(self, hidden: torch.Tensor | None, scalars: Sequence[float] | None = None) -> float:
        """Fast path for decoding: one hidden state (hidden_size,) and the candidate's scalar inputs (S floats, in
        :attr:`scalar_inputs` order) → its acceptance probability as a float.

        Same maths as :meth:`accept_prob`, written with matrix-vector kernels because the decoder calls it once per
        drafted token and Python/kernel-launch overhead, not arithmetic, dominates at this size.
        """
        weight = self.out.weight
        if self.scores_in_floats:  # a few dozen multiply-adds: plain floats
            return _floats_head(self, scalars)
        raw = None if not self.scalar_inputs else torch.tensor(scalars, dtype=weight.dtype, device=weight.device)
        x = self._input(None if hidden is None else hidden.reshape(-1), raw)
        for block in self.blocks:
            x = x + nn.functional.silu(torch.addmv(block.linear.bias, block.linear.weight, x))
        logit = torch.dot(weight[0], x) + self.out.bias[0]
        if self.residual_on is not None:
            logit = logit + self._residual(raw).to(logit.dtype)
        return float(torch.sigmoid(logit))

    @property
    def scores_in_floats(self) -> bool:
        """Whether one candidate is scored in Python floats (:class:`ScalarHeadScorer`): a head on the CPU that reads
        scalars only."""
        return not self.reads_hidden and self.out.weight.device.type == "cpu"

    @property
    def reads_spread(self) -> bool:
        """Whether the head reads an input of q's whole distribution (:data:`~accept_head.acceptance.inputs.
        SPREAD_INPUTS`): a pass over the draft's vocabulary per drafted token."""
        return any(name in SPREAD_INPUTS for name in self.scalar_inputs)

    def scalar_scorer(self) -> ScalarHeadScorer:
        """:meth:`accept_prob_one` of a head that reads scalars only, frozen as Python floats (a snapshot of the
        weights now: take another after changing them). ValueError for a head that reads the hidden state."""
        return ScalarHeadScorer(self)

    @property
    def config(self) -> dict:
        """What rebuilds the head (:meth:`from_config`); the standardisation is saved with the weights."""
        return {
            "hidden_size": self.hidden_size,
            "depth": self.depth,
            "inputs": list(self.inputs),
            "residual_on": self.residual_on,
            **({} if self.hidden_dim is None else {"hidden_dim": self.hidden_dim}),
        }

    @classmethod
    def from_config(cls, config: dict) -> AcceptanceHead:
        """The (untrained) head a :attr:`config` describes; configs written before ``inputs`` existed describe the
        paper's hidden-only head."""
        unknown = sorted(set(config) - CONFIG_KEYS)
        if unknown:
            warnings.warn(f"head config: ignoring unknown keys {unknown} (known: {sorted(CONFIG_KEYS)})", stacklevel=2)
        inputs = config.get("inputs") or (HIDDEN,)
        return cls(
            int(config["hidden_size"]),
            int(config["depth"]),
            inputs,
            config.get("residual_on"),
            config.get("hidden_dim"),
        )

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(folder / HEAD_WEIGHTS), metadata={"format": "pt"})
        (folder / HEAD_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path, config: dict | None = None) -> AcceptanceHead:
        """Load a head saved with :meth:`save_pretrained` (``config`` overrides ``head_config.json``)."""
        folder = Path(folder)
        weights = folder / HEAD_WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} is missing: not an acceptance-head folder.")
        if config is None:
            config_path = folder / HEAD_CONFIG
            if not config_path.is_file():
                raise FileNotFoundError(f"{config_path} is missing: not an acceptance-head folder.")
            config = json.loads(config_path.read_text())
        head = cls.from_config(config)
        try:
            state = load_file(str(weights))
        except Exception as err:  # safetensors raises several types for truncated or foreign files
            raise ValueError(f"{weights} is not a readable safetensors file: {err}") from err
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match a depth-{head.depth}, width-{head.hidden_size} head reading "
                f"{list(head.inputs)}: "
                f"missing {missing}, unexpected {unexpected}."
            )
        return head


class ScalarHeadScorer:
    """A head that reads scalars only, read out as Python floats: at width S ≈ 5 the whole head is ~100
    multiply-adds, which tensor calls would spend ~0.1 ms of dispatch on per drafted token. Calling it with the S raw
    scalar inputs gives :meth:`AcceptanceHead.accept_prob_one`'s probability.

    It is a snapshot: the weights as they were when it was made (:meth:`AcceptanceHead.scalar_scorer`). A decoder
    takes one when a generation starts, so that no drafted token pays for checking the weights are unchanged."""

    def __init__(self, head: AcceptanceHead) -> None:
        if head.reads_hidden:
            raise ValueError(f"a head reading {list(head.inputs)} needs the hidden state: it has no float scorer.")
        with torch.no_grad():
            self.mean = head.scalar_mean.tolist()
            self.std = head.scalar_std.tolist()
            self.blocks = [(block.linear.weight.tolist(), block.linear.bias.tolist()) for block in head.blocks]
            self.out_weight = head.out.weight[0].tolist()
            self.out_bias = float(head.out.bias[0])
        self.residual = None if head.residual_on is None else head.scalar_inputs.index(head.residual_on)

    def __call__(self, scalars: Sequence[float]) -> float:
        x = [(float(value) - m) / s for value, m, s in zip(scalars, self.mean, self.std)]
        for weight, bias in self.blocks:  # map(mul, ...) keeps the multiply-adds in C
            x = [v + _silu(b + sum(map(mul, row, x))) for v, row, b in zip(x, weight, bias)]
        logit = self.out_bias + sum(map(mul, self.out_weight, x))
        if self.residual is not None:
            logq = min(max(float(scalars[self.residual]), math.log(LOGQ_CLIP)), math.log1p(-LOGQ_CLIP))
            logit += logq - math.log(-math.expm1(logq))
        return _sigmoid(logit)


def _floats_head(head: AcceptanceHead, scalars: Sequence[float]) -> float:
    """:class:`ScalarHeadScorer`'s probability, its snapshot taken again whenever a parameter or buffer changes
    (training, ``load_state_dict``)."""
    linears = [block.linear for block in head.blocks] + [head.out]
    tensors = [t for linear in linears for t in (linear.weight, linear.bias)] + [head.scalar_mean, head.scalar_std]
    key = tensors_key(tensors)
    cached = head.__dict__.get("_floats_cache")
    if cached is None or cached[0] != key:
        cached = head.__dict__["_floats_cache"] = (key, ScalarHeadScorer(head))
    return cached[1](scalars)


def _silu(z: float) -> float:
    return z * _sigmoid(z)


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def from_official_state_dict(state: dict[str, torch.Tensor], depth: int) -> AcceptanceHead:
    """Convert a checkpoint of the official SpecDec++ head into an :class:`AcceptanceHead`.

    The official head is ``nn.Sequential(*([ResBlock(h)] * depth), nn.Linear(h, 2))``: every block is the same
    object, so the state dict holds ``{i}.linear.weight/bias`` entries that are all equal, and the output has two
    logits (reject, accept). The accept logit of our binary head is logit[1] − logit[0], which gives the same
    probability: softmax(l)[1] = sigmoid(l[1] − l[0]).
    """
    state = {k.removeprefix("module.").removeprefix("head."): v for k, v in state.items()}
    out_keys = sorted(k for k in state if k.endswith(".weight") and state[k].ndim == 2 and state[k].shape[0] == 2)
    if len(out_keys) != 1:
        raise ValueError(f"Expected exactly one (2, hidden) output weight in the official head, found {out_keys}.")
    out_prefix = out_keys[0].removesuffix(".weight")
    out_w, out_b = state[f"{out_prefix}.weight"], state[f"{out_prefix}.bias"]
    hidden = out_w.shape[1]
    block_keys = sorted(k for k in state if k.endswith("linear.weight"))
    if depth > 0 and not block_keys:
        raise ValueError(f"depth={depth} but the checkpoint holds no residual-block weights (keys: {sorted(state)}).")
    # A plain state_dict lists the repeated block once per use (0..depth-1); a deduplicating save keeps one entry.
    if block_keys and (depth == 0 or len(block_keys) not in (1, depth)):
        raise ValueError(f"The checkpoint applies its residual block {len(block_keys)} times but depth={depth}.")
    if any(not torch.equal(state[k], state[block_keys[0]]) for k in block_keys):
        raise ValueError(
            f"The residual blocks {block_keys} hold different weights: not the official format, whose blocks share "
            "one weight set. Load such a checkpoint with AcceptanceHead.load_state_dict instead."
        )
    head = AcceptanceHead(hidden, depth)
    with torch.no_grad():
        if depth:
            w = state[block_keys[0]]
            b = state[block_keys[0].removesuffix("weight") + "bias"]
            for block in head.blocks:  # untie: every block gets its own copy of the shared weights
                block.linear.weight.copy_(w)
                block.linear.bias.copy_(b)
        head.out.weight.copy_((out_w[1] - out_w[0])[None, :])
        head.out.bias.copy_((out_b[1] - out_b[0])[None])
    return head
