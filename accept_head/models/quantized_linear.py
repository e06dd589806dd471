"""Weight-only quantized linear layers for decoding on a CPU (a feature draft's ``quantize``): int8 with one scale per
row (:class:`Int8Linear`), and 4 bits per weight with a scale and an offset per group of inputs (:class:`Int4Linear`).

A drafting step on a CPU streams its weights from memory after every target pass evicted them, so fewer bytes are a
faster step; what they cost is a draft distribution q a little further from the trained one (verification keeps
decoding lossless whatever q is)."""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """A decoding-only ``nn.Linear`` with weight-only int8: one scale per output row (symmetric, round to nearest),
    the product by ``torch._weight_int8pack_mm`` in the input's dtype. Half the bytes of bf16 weights — on a CPU, where
    a drafting step streams its weights from memory after every target pass evicted them, half its matmul time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.to(x.dtype)
        if x.dtype != torch.float32 and self.in_features % 32:  # the CPU kernel's reduced-precision path reads
            y = nn.functional.linear(x, self.qweight.to(x.dtype) * scale[:, None])  # 32 columns at a time
        else:
            flat = x.reshape(-1, self.in_features).contiguous()
            y = torch._weight_int8pack_mm(flat, self.qweight, scale).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def concatenated(cls, linears: list[Int8Linear]) -> Int8Linear:
        """One layer computing ``linears`` (same input width) side by side, their int8 rows and scales stacked: each
        output is the same product as in its own layer."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.register_buffer("qweight", torch.cat([linear.qweight for linear in linears]))
        fused.register_buffer("scale", torch.cat([linear.scale for linear in linears]))
        biases = None
        if any(linear.bias is not None for linear in linears):
            zeros = [linear.scale.new_zeros(linear.out_features) for linear in linears]
            biases = torch.cat([zero if linear.bias is None else linear.bias for linear, zero in zip(linears, zeros)])
        fused.register_buffer("bias", biases)
        fused.out_features, fused.in_features = fused.qweight.shape
        return fused


class Int4Linear(nn.Module):
    """A decoding-only ``nn.Linear`` with weights in 4 bits: each row's inputs in groups of ``group``, each group's
    weights rounded to 16 levels over its [min, max] (w = (level − 8)·scale + zero, the convention of
    ``torch._weight_int4pack_mm_for_cpu``, which computes the product from the packed levels). A quarter of the bytes
    of bf16 weights, half of :class:`Int8Linear`'s. Where that kernel does not apply (not a CPU tensor, or rows not a
    multiple of 16) the layer keeps the levels and multiplies by the dequantized weight."""

    GROUPS = (32, 64, 128, 256)
    """Group sizes the CPU kernel takes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32) -> None:
        super().__init__()
        rows, width = weight.shape
        if group not in self.GROUPS or width % group:
            raise ValueError(
                f"group={group} must be one of {list(self.GROUPS)} and divide the layer's {width} inputs; choose "
                "another group size or keep this layer in int8."
            )
        groups = weight.detach().float().reshape(rows, width // group, group)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low).clamp(min=torch.finfo(torch.float32).tiny) / 15
        levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        levels = levels.reshape(rows, width)
        # (groups, rows, 2): per group and row the scale and the value of level 8, as the kernel reads them.
        self.register_buffer("scales_zeros", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous())
        kernel = weight.device.type == "cpu" and rows % 16 == 0
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(levels, 1) if kernel else None)
        self.register_buffer("levels", None if kernel else levels.to(torch.uint8))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features, self.group = rows, width, group
        self.scales_zeros = self.scales_zeros.to(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ (no bias), in x's dtype."""
        if self.packed is None:
            return nn.functional.linear(x, self.dequantized().to(x.dtype))
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros.to(x.dtype))
        return y.reshape(*x.shape[:-1], -1)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies by, (out_features, in_features) float32."""
        if self.packed is not None:  # the kernel's own float32 product with the identity: the weight, transposed
            return self._product(torch.eye(self.in_features, device=self.packed.device)).T.contiguous()
        scale, zero = self.scales_zeros.float().unbind(-1)  # (groups, rows) each
        levels = self.levels.float().reshape(self.out_features, -1, self.group)
        weight = (levels - 8) * scale.T[..., None] + zero.T[..., None]
        return weight.reshape(self.out_features, self.in_features)


def int4_group(width: int) -> int:
    """The group size of an :class:`Int4Linear` over ``width`` inputs: 32 (the smallest the kernel takes, the
    closest to the trained weights); ValueError when it does not divide ``width``."""
    if width % 32:
        raise ValueError(
            f"4-bit weights group their inputs by 32 (or a multiple), which does not divide the width {width}; "
            "decode this draft with quantize='int8'."
        )
    return 32
