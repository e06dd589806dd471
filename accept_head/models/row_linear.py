"""Decode passes' linears for CPU: a ``torch.compile`` backend that rewrites them where oneDNN's GEMM is slow.

A decode step feeds every linear of the target one row (a verification pass a few): its time is the time to read the
weights. On the CPUs of docs/measurements.md the bf16 GEMM PyTorch calls (oneDNN, re-laying the weight out every
call) reads them at 15–28 GB/s while two cores stream memory at ~60 GB/s. Two rewrites, each measured on a whole pass
of the 135M target (AMD EPYC, 2 threads):

* fed one row, a linear becomes an elementwise multiply and a float32 sum over the input dimension
  (:func:`rowwise_linear`), a reduction inductor compiles into one vectorised loop: 33–46 GB/s alone, a one-token pass
  2.2× the eager one. Fed two rows the same rewrite made a whole pass 5× slower, so only one-row linears
  (:data:`ROW_LIMIT`) take it;
* fed more rows, a linear runs oneDNN's GEMM on a copy of its weight packed once when the graph compiles
  (:func:`pack_linears`, bit for bit the same products as ``linear``): passes of 2–8 tokens 1.3–1.6× faster than the
  GEMM over the plain weight.

The sum runs in float32 and rounds once, like the GEMM's float32 accumulation, in another order: its outputs differ
from the GEMM's by rounding (bf16: about one unit in the last place).
"""

from __future__ import annotations

import weakref

import torch
from torch._dynamo.source import ConstantSource

from ..core.tensor_keys import version as tensor_version

ROW_LIMIT = 1
"""Linears fed at most this many rows are rewritten (the product of the input's leading dimensions)."""
DTYPES = (torch.bfloat16, torch.float16)
"""Weight dtypes rewritten: the half-precision ones, whose small-M GEMMs were measured slow. float32 linears keep
PyTorch's GEMM (a test may widen this to exercise the rewrite exactly)."""


def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs (and multiplies) weights of ``dtype`` on this CPU: bf16 needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, fp16 likewise its own units; on an AVX2-only CPU (AMD Zen 3, say) neither, and those linears keep
    PyTorch's GEMM over the plain weight."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
"""What a captured graph calls for ``nn.Linear`` / ``F.linear``."""


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` as a multiply and a float32 sum over the input dimension, each
    weight row read once for every row of ``x``; the result in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = (weight[:, None, :].float() * rows[None].float()).sum(-1).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _rewritable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _LINEARS:
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


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` with a weight oneDNN packed beforehand (``torch.ops.mkldnn._reorder_linear_weight``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(graph_module: torch.fx.GraphModule, example_inputs) -> list[tuple[torch.Tensor, int]]:
    """Hand every remaining ``linear`` of a :data:`DTYPES` weight on the CPU a copy of its weight packed by oneDNN
    where oneDNN handles that dtype on this CPU (:func:`packable`; kept in the graph module, one copy per weight,
    shared by every graph that reads it): the same products as
    ``linear``'s GEMM, bit for bit, without re-laying out the weight every call. ``example_inputs``: the graph's real
    inputs, the weights among them. Returns each packed weight with its version counter (what :func:`backend` checks
    before every call)."""
    real = dict(zip((node for node in graph_module.graph.nodes if node.op == "placeholder"), example_inputs))
    packed = []
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in _LINEARS:
            continue
        x, weight = node.args[0].meta.get("example_value"), real.get(node.args[1])
        if x is None or weight is None or x.device.type != "cpu" or weight.dtype not in DTYPES or x.dim() < 2:
            continue
        if not packable(weight.dtype):
            continue
        name = f"_accept_head_packed_{len(packed)}"
        graph_module.register_buffer(name, _packed_copy(weight))
        sources = getattr(graph_module, "_param_name_to_source", None)
        if sources is not None:  # a graph from Dynamo: AOTAutograd looks every buffer up there
            sources[name] = ConstantSource(name)
        with graph_module.graph.inserting_before(node):
            attribute = graph_module.graph.get_attr(name)
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        node.target, node.args, node.kwargs = packed_linear, (node.args[0], attribute, bias), {}
        packed.append((weight, tensor_version(weight)))
    if packed:
        graph_module.recompile()
    return packed


_PACKED: dict[int, tuple[weakref.ref, int | None, torch.Tensor]] = {}
"""Packed copies by ``id`` of the weight (tensors compare by value, so no ``WeakKeyDictionary``), each dropped with
its weight."""


def _packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed by oneDNN, one copy per weight (and version) for every graph that reads it: the packed
    layout does not depend on the rows fed (bf16: the same products bit for bit for any number of rows)."""
    key = id(weight)
    kept = _PACKED.get(key)
    if kept is None or kept[0]() is not weight or kept[1] != tensor_version(weight):
        owner = weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None))
        kept = _PACKED[key] = (
            owner,
            tensor_version(weight),
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
        )
    return kept[2]


def backend(options: dict | None = None, pack: bool = True):
    """A ``torch.compile`` backend: :func:`rewrite_linears`, then (``pack``) :func:`pack_linears` for the linears fed
    more rows, then inductor with ``options`` (its config patches, as ``torch.compile(options=...)`` takes them). A
    graph with packed weights refuses to run once any of them changed in place (train, then build a new compiled
    target)."""
    from torch._inductor.compile_fx import compile_fx

    patches = dict(options or {})

    def compile_graph(graph_module: torch.fx.GraphModule, example_inputs):
        rewrite_linears(graph_module)
        packed = pack_linears(graph_module, example_inputs) if pack else []
        # freezing: inductor takes the packed copies (buffers of the graph module) as constants, which its oneDNN
        # linear requires; the model's own weights reach the graph as inputs (Dynamo lifts them), not constants.
        compiled = compile_fx(
            graph_module, example_inputs, config_patches=patches | ({"freezing": True} if packed else {})
        )
        if not packed:
            return compiled
        weights = packed + [(t, tensor_version(t)) for t in example_inputs if isinstance(t, torch.nn.Parameter)]

        def run(*args):
            if any(tensor_version(weight) != version for weight, version in weights):
                raise RuntimeError(
                    "a weight changed in place since this pass was compiled with packed copies of the weights: "
                    "compile anew (torch._dynamo.reset(), or a new process) before decoding with the changed model."
                )
            return compiled(*args)

        return run

    return compile_graph
