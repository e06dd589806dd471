"""A feature draft's drafting calls in fewer kernel calls: the maths of its Llama layer.

A drafting step feeds one token, so each of its kernels works on a single row and costs about what its launch costs.
On a CPU it also runs right after a target pass has swept the caches, so each call pays again for the code and
weights it pulls back in: on the AMD EPYC of docs/measurements.md the layer called through Hugging Face's modules
took 0.85–0.87 ms a step right after a target pass (0.35 ms back to back). :class:`LeanStep` computes the same layer
with the query, key and value projections as one product, gate and up as one, the rotary cosines read from a table
and no mask — for one position the same numbers bit for bit (tests compare them), ~0.15 ms less with int8 weights.
A round's first call feeds the tokens verification fixed (two to four, typically) and needs the output at the last
of them only; the lean layer computes just that row past the keys and values (~0.45 ms less than the modules).

It applies to the layer a :class:`~accept_head.models.feature_draft.FeatureDraft` builds (a Llama decoder layer on
SDPA attention, RoPE without a length-dependent rescaling); :func:`lean_step_applies` says when, and the draft falls
back to calling the layer otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..core.tensor_keys import tensors_key
from .quantized_linear import Int8Linear


def lean_step_applies(decoder: nn.Module) -> bool:
    """Whether :class:`LeanStep` computes ``decoder``'s (a one-layer ``LlamaModel``) step exactly: SDPA attention (the
    kernel it calls, the way Hugging Face calls it for one query: grouped heads, head size ≤ 256), RoPE over the
    whole head (an even head size, one frequency per pair) whose frequencies do not depend on the sequence length (a
    table holds them)."""
    rope = decoder.rotary_emb
    rope_type = str(getattr(rope, "rope_type", "default"))
    head_dim = decoder.layers[0].self_attn.head_dim if len(decoder.layers) == 1 else 0
    frequencies = getattr(rope, "inv_freq", None)
    return (
        len(decoder.layers) == 1
        and decoder.config._attn_implementation == "sdpa"
        and "dynamic" not in rope_type
        and rope_type != "longrope"
        and 0 < head_dim <= 256
        and frequencies is not None
        and 2 * frequencies.numel() == head_dim
    )


def fuse_linears(linears: list[nn.Module]) -> nn.Module:
    """One module computing ``linears`` (same input width) side by side: their outputs concatenated, bit for bit.
    Int8 layers become one :class:`Int8Linear` with their rows stacked (its kernel computes every output as its own
    dot product, so stacking changes no number); other layers are called one by one, because a float GEMM's
    blocking — hence its rounding — may depend on the output width."""
    if all(isinstance(linear, Int8Linear) for linear in linears):
        return Int8Linear.concatenated(linears)
    if all(isinstance(linear, nn.Linear) for linear in linears):
        return SideBySide(linears)
    raise TypeError(f"cannot fuse {[type(linear).__name__ for linear in linears]}: nn.Linear or Int8Linear only.")


class SideBySide(nn.Module):
    """x ↦ [l₁(x), l₂(x), …] concatenated on the last axis (the layers are the caller's, not copies)."""

    def __init__(self, linears: list[nn.Module]) -> None:
        super().__init__()
        self.linears = list(linears)  # a plain list: the layers stay registered where they live

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x) for linear in self.linears], -1)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm (float32 statistics, the weight applied in the input's dtype) in one fused normalisation."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (1, heads, T, head_dim): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-second, first), -1) * sin


class LeanStep:
    """A drafting step through ``decoder``'s single Llama layer (:meth:`__call__`), built from its current weights.

    Holds fused copies of int8 projections (``qkv``, ``gate_up``; :func:`fuse_linears`); :attr:`key` names the
    weights they were built from, so the owner builds a new one when any changes (training, ``load_state_dict``,
    :meth:`FeatureDraft.quantize_`).
    """

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.layer = layer = decoder.layers[0]
        attention, mlp = layer.self_attn, layer.mlp
        self.key = weights_key(decoder)
        self.qkv = fuse_linears([attention.q_proj, attention.k_proj, attention.v_proj])
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, x: torch.Tensor, position: int, count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1, 1, count, head_dim) of positions ``position``.. from a table the rotary embedding computed
        (elementwise per position, so the same numbers as computing those positions alone); the table doubles when
        outgrown."""
        table, end = self._rope, position + count
        if table is None or table[0].shape[2] < end or table[0].dtype != x.dtype:
            length = max(256, 2 * end)
            cos, sin = self.decoder.rotary_emb(x, torch.arange(length, device=x.device)[None])
            table = self._rope = (cos[:, None], sin[:, None])
        return table[0][:, :, position:end], table[1][:, :, position:end]

    def __call__(self, x: torch.Tensor, cache, position: int) -> torch.Tensor:
        """x (1, T, d), the layer's inputs at sequence positions ``position``..``position`` + T − 1 → the final-normed
        output at the last of them (d,); their keys and values appended to ``cache`` (layer 0).

        Only the last position's output is asked for, and in a one-layer draft nothing else depends on the others'
        (their keys and values do not): the last query alone attends, to every cached and new position — no mask."""
        layer, attention, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        count = x.shape[1]
        cos, sin = self.rope(x, position, count)
        projected = self.qkv(rms_norm(layer.input_layernorm, x)).view(1, count, -1, self.head_dim).transpose(1, 2)
        query_key, value = projected.split([self.heads + self.kv_heads, self.kv_heads], 1)
        query, key = _rotate(query_key, cos, sin).split([self.heads, self.kv_heads], 1)
        key, value = cache.update(key, value, 0)
        if count > 1:
            query, x = query[:, :, -1:], x[:, -1:]
        attended = F.scaled_dot_product_attention(
            query, key, value, scale=attention.scaling, enable_gqa=self.heads != self.kv_heads
        )
        x = x + attention.o_proj(attended.transpose(1, 2).reshape(1, 1, -1))
        gate, up = self.gate_up(rms_norm(layer.post_attention_layernorm, x)).split(self.intermediate, -1)
        x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        return rms_norm(self.decoder.norm, x)[0, -1]


def weights_key(decoder: nn.Module) -> tuple:
    """The identity and version of every tensor of ``decoder``: changes when any is replaced or updated in place."""
    return tensors_key([*decoder.parameters(), *decoder.buffers()])
