"""The acceptance head f_θ of SpecDec++ (Huang, Guo, Wang 2024, §3.2).

It reads the draft's final hidden state e_i (the LM head's input) at the position whose input token is y_i and
predicts P(y_i is accepted | y_<i accepted) = sigmoid(f_θ(e_i)). Architecture: ``depth`` residual blocks
x ← x + SiLU(W_d x + b_d), each with its own weights, then a linear layer to one logit; depth 0 is a linear probe.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"


class ResidualBlock(nn.Module):
    """x ← x + SiLU(W x + b)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """(depth + 1)-layer SiLU ResNet from a hidden state (..., hidden_size) to one acceptance logit (...)."""

    def __init__(self, hidden_size: int, depth: int = 3) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size={hidden_size} must be >= 1 (the draft's hidden size).")
        if depth < 0:
            raise ValueError(f"depth={depth} must be >= 0 (0 is a linear probe).")
        self.hidden_size = hidden_size
        self.depth = depth
        # Each block owns its weights (the official code repeated one block object, sharing a single weight set).
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Acceptance logits: (..., hidden_size) → (...)."""
        x = hidden.to(self.out.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """sigmoid(logits): the predicted acceptance probability, (..., hidden_size) → (...)."""
        return torch.sigmoid(self.forward(hidden))

    def accept_prob_one(self, hidden: torch.Tensor) -> float:
        """Fast path for decoding: one hidden state (hidden_size,) → its acceptance probability as a float.

        Same maths as :meth:`accept_prob`, written with matrix-vector kernels because the decoder calls it once per
        drafted token and Python/kernel-launch overhead, not arithmetic, dominates at this size.
        """
        x = hidden.reshape(-1).to(self.out.weight.dtype)
        for block in self.blocks:
            x = x + nn.functional.silu(torch.addmv(block.linear.bias, block.linear.weight, x))
        return float(torch.sigmoid(torch.dot(self.out.weight[0], x) + self.out.bias[0]))

    @property
    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "depth": self.depth}

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
        head = cls(hidden_size=int(config["hidden_size"]), depth=int(config["depth"]))
        try:
            state = load_file(str(weights))
        except Exception as err:  # safetensors raises several types for truncated or foreign files
            raise ValueError(f"{weights} is not a readable safetensors file: {err}") from err
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match a depth-{head.depth}, width-{head.hidden_size} head: "
                f"missing {missing}, unexpected {unexpected}."
            )
        return head


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
