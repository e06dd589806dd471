"""Linears fed one or two rows compiled as a multiply and a float32 sum (:mod:`accept_head.models.row_linear`).

* :func:`rowwise_linear` equals ``torch.nn.functional.linear`` (float32 to rounding, bf16 within its rounding, bias or
  not, any leading shape), eager and compiled through the backend.
* The rewrite touches exactly the half-precision linears fed one row on the CPU, and a broken rewrite (the
  weight read transposed) is caught by the same comparison.
* Linears fed more rows get oneDNN-packed weights: the same outputs as ``linear``; a graph refuses to run once a
  packed weight changed in place. Where oneDNN cannot pack bf16 (an AVX2-only CPU) those tests run in float32, and a
  weight oneDNN cannot pack keeps the plain GEMM.
* A compiled :class:`StaticTarget` whose every linear is rewritten or packed (float32 admitted) decodes the eager
  greedy text.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llama

import accept_head.models.row_linear as row_linear
import accept_head.models.static_target as static_target
from accept_head import autoregressive_generate
from accept_head.models.row_linear import backend, pack_linears, rewrite_linears, rowwise_linear

PACKED = torch.bfloat16 if row_linear.packable(torch.bfloat16) else torch.float32
"""The dtype the packing tests run in: bf16 where oneDNN packs it on this CPU, else float32."""


@pytest.fixture
def packed_dtype(monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """:data:`PACKED`, admitted to the rewritten dtypes."""
    monkeypatch.setattr(row_linear, "DTYPES", tuple({*row_linear.DTYPES, PACKED}))
    return PACKED


def _assert_same_products(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: oneDNN's products with packed weights bit for bit; float32: PyTorch's GEMM is MKL's, equal to rounding."""
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (1, 1, 16), (1, 2, 16), (3, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_rowwise_linear_equals_linear(shape, bias) -> None:
    generator = torch.Generator().manual_seed(len(shape) + shape[-2])
    x = torch.randn(shape, generator=generator)
    weight = torch.randn(24, 16, generator=generator)
    b = torch.randn(24, generator=generator) if bias else None
    torch.testing.assert_close(rowwise_linear(x, weight, b), torch.nn.functional.linear(x, weight, b))
    half = rowwise_linear(x.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16())
    assert half.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16())
    torch.testing.assert_close(half.float(), want.float(), atol=0.05, rtol=0.02)


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 40, bias=False), torch.nn.Linear(40, 16, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


def _rewritten(module: torch.nn.Module, x: torch.Tensor) -> int:
    counts = []

    def capture(graph_module, example_inputs):
        counts.append(rewrite_linears(graph_module))
        return graph_module.forward

    with torch.no_grad():
        torch.compile(module, backend=capture, dynamic=False)(x)
    return counts[0]


def test_the_rewrite_takes_half_precision_linears_fed_one_row() -> None:
    module = _Two().bfloat16()
    assert _rewritten(module, torch.randn(1, 1, 16, dtype=torch.bfloat16)) == 2
    assert _rewritten(module, torch.randn(1, 2, 16, dtype=torch.bfloat16)) == 0  # the GEMM is as fast or faster
    assert _rewritten(module, torch.randn(2, 16, dtype=torch.bfloat16)) == 0
    assert _rewritten(_Two(), torch.randn(1, 1, 16)) == 0  # float32 keeps its GEMM


def _compiled(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.compile(module, backend=backend(), dynamic=False)(x).float()


def test_the_compiled_backend_computes_the_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    module, x = _Two().bfloat16(), torch.randn(1, 1, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        want = module(x).float()
    torch.testing.assert_close(_compiled(module, x), want, atol=0.05, rtol=0.02)
    # The control: a rewrite that reads the weight's rows in reverse order fails the same comparison.
    monkeypatch.setattr(row_linear, "rowwise_linear", lambda x, w, b=None: rowwise_linear(x, w.flip(0), b))
    torch._dynamo.reset()  # compile anew, through the broken rewrite
    assert not torch.allclose(_compiled(module, x), want, atol=0.05, rtol=0.02)
    torch._dynamo.reset()


def test_linears_fed_more_rows_run_on_packed_weights(monkeypatch: pytest.MonkeyPatch, packed_dtype) -> None:
    torch.manual_seed(0)
    module, x = _Two().to(packed_dtype), torch.randn(1, 4, 16, dtype=packed_dtype)
    counts = []
    pack = row_linear.pack_linears
    monkeypatch.setattr(row_linear, "pack_linears", lambda gm, inputs: counts.append(pack(gm, inputs)) or counts[-1])
    with torch.no_grad():
        want = module(x).float()
        torch.testing.assert_close(_compiled(module, x), want, atol=0.05, rtol=0.02)
    assert [len(packed) for packed in counts] == [2]
    # A packed weight is a copy: once the model's weight changes in place the compiled graph refuses to run.
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend(), dynamic=False)
    with torch.no_grad():
        compiled(x)
        module.up.weight.mul_(2)
        with pytest.raises(RuntimeError, match="a weight changed in place since this pass was compiled"):
            compiled(x)
    torch._dynamo.reset()


def test_packed_linear_equals_linear(packed_dtype) -> None:
    module, x = _Two().to(packed_dtype), torch.randn(3, 16, dtype=packed_dtype)

    def capture(graph_module, example_inputs):
        assert len(pack_linears(graph_module, example_inputs)) == 2
        return graph_module.forward

    with torch.no_grad():
        got = torch.compile(module, backend=capture, dynamic=False)(x)  # the rewritten graph run eagerly
        _assert_same_products(got, module(x))
    torch._dynamo.reset()


def test_weights_onednn_cannot_pack_keep_the_plain_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without bf16 support in oneDNN (AVX2 only) packing a bf16 weight raises; the backend leaves those
    linears to PyTorch's GEMM and still computes them."""
    monkeypatch.setattr(row_linear, "packable", lambda dtype: False)
    torch.manual_seed(0)
    module, x = _Two().bfloat16(), torch.randn(1, 4, 16, dtype=torch.bfloat16)
    counts = []
    pack = row_linear.pack_linears
    monkeypatch.setattr(row_linear, "pack_linears", lambda gm, inputs: counts.append(pack(gm, inputs)) or counts[-1])
    with torch.no_grad():
        torch.testing.assert_close(_compiled(module, x), module(x).float(), atol=0.05, rtol=0.02)
    assert counts == [[]]
    torch._dynamo.reset()


def test_packable_says_what_onednn_packs() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(8, 16, dtype=dtype)
        if row_linear.packable(dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            x = torch.randn(2, 16, dtype=dtype)
            _assert_same_products(row_linear.packed_linear(x, packed), torch.nn.functional.linear(x, weight))
        else:
            with pytest.raises(RuntimeError):
                torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def test_a_compiled_target_with_every_linear_rewritten_decodes_the_eager_greedy_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = make_llama(seed=0, num_layers=2)
    reference = autoregressive_generate(target, [2, 10, 11, 12], 10, temperature=0).sequences
    monkeypatch.setattr(row_linear, "DTYPES", (torch.float32,))  # every linear of the float32 model fed one row
    monkeypatch.setattr(static_target, "_compiled_passes", {})  # fresh compiled passes, not ones cached by another test
    counts = []
    rewrite = row_linear.rewrite_linears
    monkeypatch.setattr(row_linear, "rewrite_linears", lambda gm: counts.append(rewrite(gm)) or counts[-1])
    monkeypatch.setitem(target.__dict__, "_accept_head_static_targets", {})
    out = autoregressive_generate(target, [2, 10, 11, 12], 10, temperature=0, target_runtime="compiled")
    assert torch.equal(out.sequences, reference)
    # The prompt's 4-token pass runs on packed weights; the one-token passes ran seven linears a layer and the LM head
    # as rowwise_linear.
    assert counts == [0, 2 * 7 + 1], counts


def test_one_packed_copy_serves_every_graph_that_reads_a_weight() -> None:
    weight = torch.randn(40, 16, dtype=PACKED)
    first = row_linear._packed_copy(weight)
    assert row_linear._packed_copy(weight) is first  # widths compiled later share it
    x = torch.randn(5, 16, dtype=PACKED)
    _assert_same_products(row_linear.packed_linear(x, first), torch.nn.functional.linear(x, weight))  # any row count
    weight.mul_(2)  # changed in place: packed anew
    second = row_linear._packed_copy(weight)
    assert second is not first
    _assert_same_products(row_linear.packed_linear(x, second), torch.nn.functional.linear(x, weight))
    key = id(weight)
    del weight
    assert key not in row_linear._PACKED  # dropped with its weight
