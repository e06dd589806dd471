"""bf16 linears fed several rows run through packed float32 copies (:mod:`accept_head.models.float32_rows`).

* :data:`MIN_ROWS` rows or more: the float32 product of the bf16 values rounded once to bf16; fewer rows: PyTorch's
  own bf16 linear, bit for bit; with gradients on (training) the plain linear.
* A weight changed in place is packed again; :func:`remove_float32_rows` restores the plain layers.
* A whole tiny model: every bf16 linear wrapped, one-token logits unchanged, several-token logits within bf16 rounding.
* ``load_model`` turns it on where bf16 is emulated (or when asked) and warns only where bf16 is emulated and it is off.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llama

from accept_head.models import float32_rows, loading
from accept_head.models.float32_rows import MIN_ROWS, float32_rows_layers, remove_float32_rows, use_float32_rows
from accept_head.models.pairs import ModelSpec


def _linear(bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, 40, bias=bias).bfloat16()


def _reference(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The float32 product of the bf16 values, rounded once (float64 sums: the order does not matter)."""
    out = x.double() @ layer.weight.double().t()
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_take_float32_products_and_fewer_the_bf16_kernel(bias: bool) -> None:
    layer = _linear(bias)
    assert use_float32_rows(layer) == 1
    x = torch.randn(2, MIN_ROWS, 48).bfloat16()
    with torch.no_grad():
        layer(x[:, :1])
        assert float32_rows.ATTRIBUTE not in layer.__dict__  # one row: no float32 copy made
        got = layer(x)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert float32_rows.ATTRIBUTE in layer.__dict__  # the packed copy served it
    assert got.dtype == torch.bfloat16 and got.shape == (2, MIN_ROWS, 40)
    # Rounded once from float32 sums: within half a bf16 unit of the exact value (plus float32 summation error).
    exact = _reference(layer, x)
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-4).all()
    assert not torch.equal(layer.weight.float(), layer.weight.float().flip(0))  # the control below reads another row
    broken = x.double() @ layer.weight.double().flip(0).t()
    assert not ((got.double() - broken).abs() <= broken.abs() * 2.0**-8 + 1e-4).all()
    torch.testing.assert_close(got.float(), plain.float(), atol=0.05, rtol=0.02)
    for rows in (1, MIN_ROWS - 1):
        few = torch.randn(1, rows, 48).bfloat16()
        with torch.no_grad():
            assert torch.equal(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias))
    # Training: gradients flow through the plain linear.
    assert torch.equal(layer(x), plain) and layer(x).requires_grad


def test_a_weight_changed_in_place_is_packed_again_and_removal_restores_the_layer() -> None:
    layer = _linear()
    use_float32_rows(layer)
    assert use_float32_rows(layer) == 0  # already wrapped
    x = torch.randn(MIN_ROWS, 48).bfloat16()
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    assert ((after.double() - _reference(layer, x)).abs() <= _reference(layer, x).abs() * 2.0**-8 + 1e-4).all()
    assert not torch.allclose(after.float(), before.float())
    assert float32_rows_layers(layer) == 1
    assert remove_float32_rows(layer) == 1 and float32_rows_layers(layer) == 0
    assert "forward" not in layer.__dict__ and float32_rows.ATTRIBUTE not in layer.__dict__


def test_a_whole_model_keeps_its_one_token_logits_and_rounds_wider_passes() -> None:
    model = make_llama(seed=0, num_layers=2).bfloat16().eval()
    ids = torch.tensor([[2, *range(10, 10 + MIN_ROWS + 2)]])
    with torch.no_grad():
        want_wide = model(ids).logits.float()
        want_one = model(ids[:, :1]).logits
        assert use_float32_rows(model) == 2 * 7 + 1  # seven linears a layer and the LM head
        got_wide = model(ids).logits.float()
        assert torch.equal(model(ids[:, :1]).logits, want_one)
    torch.testing.assert_close(got_wide, want_wide, atol=0.1, rtol=0.05)
    assert (got_wide.argmax(-1) == want_wide.argmax(-1)).float().mean() >= 0.8


def test_load_model_turns_it_on_where_bf16_is_emulated(tmp_path, monkeypatch) -> None:
    make_llama(tmp_path / "model")
    path = str(tmp_path / "model")
    monkeypatch.setattr(loading, "bf16_emulated", lambda: True)
    assert float32_rows_layers(loading.load_model(ModelSpec(path=path, dtype="bfloat16"))) == 2 * 7 + 1
    assert float32_rows_layers(loading.load_model(ModelSpec(path=path, dtype="float32"))) == 0
    assert float32_rows_layers(loading.load_model(ModelSpec(path=path, dtype="bfloat16", float32_rows=False))) == 0
    monkeypatch.setattr(loading, "bf16_emulated", lambda: False)
    assert float32_rows_layers(loading.load_model(ModelSpec(path=path, dtype="bfloat16"))) == 0
    assert float32_rows_layers(loading.load_model(ModelSpec(path=path, dtype="bfloat16", float32_rows=True))) == 15
