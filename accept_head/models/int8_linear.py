"""Weight-only int8 linear layers for decoding on a CPU (a feature draft's ``quantize: int8``)."""

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
