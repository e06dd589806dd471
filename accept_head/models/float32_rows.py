"""bf16 linears fed many rows, on a CPU without bf16 matrix units: a float32 copy of the weight, packed by oneDNN.

On an AVX2-only CPU (AMD Zen 3, for one) PyTorch multiplies bf16 matrices by emulation. Fed one row, a linear still
reads its weight at memory speed; every further row costs a good part of that again: a pass of the 135M target fed
16 tokens cost 6× a one-token pass, and a 128-token prefill 42× (docs/measurements.md, "A CPU without bf16 units").
oneDNN's float32 GEMM over a weight packed once costs little more for 16 rows than for 8, but streams twice the bytes.

:func:`use_float32_rows` gives every bf16 ``nn.Linear`` of a model a float32 copy of its weight, packed once, and
routes inputs of :data:`MIN_ROWS` rows or more (prefill, wide tree verification) through it: the input upcast
(exact), float32 products and sums, the output rounded to bf16 — what the emulated bf16 GEMM computes too, summed in
another order, so outputs differ by bf16 rounding. Fewer rows (autoregressive and drafting steps, chain verification)
keep the bf16 weight and PyTorch's own kernel, bit for bit. The copies cost twice the bf16 weights' memory; one is
made again when its weight changes in place.
"""

from __future__ import annotations

import functools
import platform

import torch

from ..core.tensor_keys import version as tensor_version

MIN_ROWS = 6
"""Inputs of at least this many rows take the float32 copy. Two float32 bytes a weight stream twice the memory of bf16:
on an AMD EPYC (Zen 3, 2 threads) a whole pass of the 135M target fed 4 / 5 / 6 / 7 / 8 tokens cost 105 / 126 / 144 /
169 / 184 ms in bf16 and 121 / 127 / 140 / 158 / 145 ms with its linears in float32: even at 6 rows, the copy ahead
from 7 (docs/measurements.md, "A CPU without bf16 units")."""
ATTRIBUTE = "_accept_head_float32_rows"
"""Where a wrapped linear keeps its packed copy and the weight version it was packed from."""


def bf16_emulated() -> bool:
    """Whether this machine multiplies bf16 matrices by emulation: an x86 CPU where oneDNN has no bf16 path (no
    AVX-512 BW/VL/DQ, no AVX-NE-CONVERT) but packs float32."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed(module: torch.nn.Linear) -> torch.Tensor:
    weight = module.weight
    kept = getattr(module, ATTRIBUTE, None)
    key = (weight.data_ptr(), tensor_version(weight))
    if kept is None or kept[0] != key:
        kept = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), 1))
        setattr(module, ATTRIBUTE, kept)
    return kept[1]


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    plain = x.dtype != torch.bfloat16 or x.device.type != "cpu" or module.weight.dtype != torch.bfloat16
    if plain or rows < MIN_ROWS or torch.compiler.is_compiling() or torch.is_grad_enabled():
        return torch.nn.functional.linear(x, module.weight, module.bias)
    bias = None if module.bias is None else module.bias.float()
    out = torch.ops.mkldnn._linear_pointwise(x.float(), _packed(module), bias, "none", [], "")
    return out.to(torch.bfloat16)


def use_float32_rows(model: torch.nn.Module) -> int:
    """Route the bf16 ``nn.Linear`` layers of ``model`` (on the CPU) fed :data:`MIN_ROWS` rows or more through packed
    float32 copies of their weights (module docstring). Only under ``torch.no_grad()`` / inference mode, and not inside
    a ``torch.compile`` trace (the compiled passes pack weights their own way); elsewhere the plain linear runs.
    Returns how many layers it wrapped; calling it again wraps nothing more. :func:`remove_float32_rows` undoes it."""
    wrapped = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.bfloat16:
            continue
        if module.weight.device.type != "cpu" or "forward" in module.__dict__:
            continue
        module.forward = functools.partial(_forward, module)
        wrapped += 1
    return wrapped


def remove_float32_rows(model: torch.nn.Module) -> int:
    """Undo :func:`use_float32_rows`: the plain linears again, packed copies dropped. Returns how many it unwrapped."""
    unwrapped = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _forward:
            del module.forward
            module.__dict__.pop(ATTRIBUTE, None)
            unwrapped += 1
    return unwrapped


def float32_rows_layers(model: torch.nn.Module) -> int:
    """How many linears of ``model`` run several rows through float32 copies."""
    return sum(
        isinstance(forward, functools.partial) and forward.func is _forward
        for forward in (module.__dict__.get("forward") for module in model.modules())
    )
