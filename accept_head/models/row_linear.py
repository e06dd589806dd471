"""Linears fed one or two rows, compiled as a multiply and a float32 sum: the compiler backend of CPU decode passes.

A decode step feeds every linear of the target one row (a verification pass a few): a matrix-vector product, whose
time is the time to read the weights. On the CPUs of docs/measurements.md the bf16 GEMM PyTorch calls for it (oneDNN)
reads them at 15–28 GB/s while two cores stream memory at ~60 GB/s. The same product written as an elementwise
multiply and a sum over the input dimension in float32 — ``(W[:, None, :] · x[None]).sum(-1)``, each weight row read
once for all rows of ``x`` — is a reduction inductor compiles into one vectorised loop: 33–46 GB/s for one row, ~1.5–2×
oneDNN's speed; for four rows and more it is slower than the GEMM, so only passes of up to :data:`ROW_LIMIT` rows are
rewritten.

:func:`backend` is a ``torch.compile`` backend: it rewrites every such ``linear`` of the captured graph into
:func:`rowwise_linear` and hands the graph to inductor. The sum runs in float32 and rounds once, like the GEMM's float32
accumulation, but in another order: outputs differ from the GEMM's by rounding (bf16: about one unit in the last place).
"""

from __future__ import annotations

import torch

ROW_LIMIT = 2
"""Linears fed at most this many rows are rewritten (the product of the input's leading dimensions)."""
DTYPES = (torch.bfloat16, torch.float16)
"""Weight dtypes rewritten: the half-precision ones, whose small-M GEMMs were measured slow. float32 linears keep
PyTorch's GEMM (a test may widen this to exercise the rewrite exactly)."""


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` as a multiply and a float32 sum over the input dimension, each
    weight row read once for every row of ``x``; the result in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = (weight[:, None, :].float() * rows[None].float()).sum(-1).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _rewritable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.linear):
        return False
    x, weight = (arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    if x is None or weight is None or x.device.type != "cpu" or weight.dtype not in DTYPES:
        return False
    return x.numel() // max(x.shape[-1], 1) <= ROW_LIMIT


def rewrite_linears(graph_module: torch.fx.GraphModule) -> int:
    """Point every ``linear`` of ``graph_module`` fed at most :data:`ROW_LIMIT` rows of a :data:`DTYPES` weight on the
    CPU at :func:`rowwise_linear` (same arguments). Returns how many were rewritten."""
    rewritten = 0
    for node in graph_module.graph.nodes:
        if _rewritable(node):
            node.target = rowwise_linear
            rewritten += 1
    if rewritten:
        graph_module.recompile()
    return rewritten


def backend(options: dict | None = None):
    """A ``torch.compile`` backend: :func:`rewrite_linears`, then inductor with ``options`` (its config patches, as
    ``torch.compile(options=...)`` takes them)."""
    from torch._inductor.compile_fx import compile_fx

    patches = dict(options or {})

    def compile_graph(graph_module: torch.fx.GraphModule, example_inputs):
        rewrite_linears(graph_module)
        return compile_fx(graph_module, example_inputs, config_patches=patches)

    return compile_graph
