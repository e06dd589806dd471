"""The acceptance head: shapes, the residual maths, untied blocks, official-checkpoint import, save/load, and heads
that read scalar inputs besides the hidden state (standardised, optionally as a correction of logit(q))."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from accept_head import AcceptanceHead, from_official_state_dict
from accept_head.acceptance.head import HEAD_CONFIG, HEAD_WEIGHTS
from accept_head.acceptance.inputs import INPUTS


def seeded_head(hidden_size: int = 16, depth: int = 3, seed: int = 0) -> AcceptanceHead:
    torch.manual_seed(seed)
    return AcceptanceHead(hidden_size, depth).eval()


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_head_maps_hidden_states_to_one_logit_per_position(depth: int) -> None:
    head = seeded_head(depth=depth)
    hidden = torch.randn(2, 5, 16)
    assert head(hidden).shape == (2, 5)
    assert head(hidden[0, 0]).shape == ()
    probs = head.accept_prob(hidden)
    assert probs.shape == (2, 5) and bool(((probs > 0) & (probs < 1)).all())
    torch.testing.assert_close(probs, torch.sigmoid(head(hidden)))
    assert len(head.blocks) == depth
    assert sum(p.numel() for p in head.parameters()) == depth * (16 * 16 + 16) + 16 + 1


def test_head_computes_residual_silu_blocks_then_a_linear_logit() -> None:
    head = seeded_head(depth=2)
    x = torch.randn(7, 16)
    expected = x
    for block in head.blocks:
        expected = expected + nn.functional.silu(expected @ block.linear.weight.T + block.linear.bias)
    expected = (expected @ head.out.weight.T + head.out.bias).squeeze(-1)
    torch.testing.assert_close(head(x), expected)


def test_depth_zero_head_is_a_linear_probe() -> None:
    head = seeded_head(depth=0)
    x = torch.randn(4, 16)
    torch.testing.assert_close(head(x), (x @ head.out.weight.T + head.out.bias).squeeze(-1))


def test_residual_blocks_have_their_own_weights() -> None:
    head = seeded_head(depth=3)
    weights = [block.linear.weight for block in head.blocks]
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1])  # independently initialised
    with torch.no_grad():
        weights[0].zero_()
    assert not torch.equal(weights[1], torch.zeros_like(weights[1]))  # changing one block leaves the others


def test_single_vector_fast_path_equals_batched_accept_prob() -> None:
    head = seeded_head(depth=3)
    hidden = torch.randn(10, 16)
    with torch.inference_mode():  # how the decoder calls it
        batched = head.accept_prob(hidden)
        for row, expected in zip(hidden, batched):
            assert head.accept_prob_one(row) == pytest.approx(float(expected), abs=1e-6)


def test_head_reads_bfloat16_hidden_states_in_its_own_float32() -> None:
    """A bf16 draft's hidden states go through a float32 head: the logit is the residual maths written out by hand in
    float32 on the bf16 values (exactly representable in float32), for the batched and the single-vector paths."""
    head = seeded_head(depth=1)
    hidden = torch.randn(3, 16).bfloat16()
    x = hidden.float()
    block = head.blocks[0].linear
    x = x + nn.functional.silu(x @ block.weight.T + block.bias)
    expected = (x @ head.out.weight.T + head.out.bias).squeeze(-1)
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)
    with torch.inference_mode():
        assert head.accept_prob_one(hidden[0]) == pytest.approx(float(torch.sigmoid(expected[0])), abs=1e-6)


# ---- the official SpecDec++ checkpoint format ------------------------------------------------------------------------


class OfficialResBlock(nn.Module):
    """The official code's residual block: x + SiLU(Linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def official_head(hidden_size: int, depth: int, seed: int = 0) -> nn.Sequential:
    """The official head: one block object repeated ``depth`` times (one shared weight set), then 2 logits."""
    torch.manual_seed(seed)
    return nn.Sequential(*([OfficialResBlock(hidden_size)] * depth), nn.Linear(hidden_size, 2)).eval()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_official_checkpoint_converts_to_the_same_acceptance_probabilities(depth: int) -> None:
    official = official_head(16, depth)
    head = from_official_state_dict(official.state_dict(), depth)
    hidden = torch.randn(32, 16)
    with torch.no_grad():
        expected = official(hidden).softmax(-1)[:, 1]  # the official code reads P(accept) as softmax(l)[1]
        torch.testing.assert_close(head.accept_prob(hidden), expected)
    if depth > 1:  # converted blocks start equal but are untied
        assert head.blocks[0].linear.weight.data_ptr() != head.blocks[1].linear.weight.data_ptr()


def test_official_checkpoint_saved_with_a_ddp_prefix_converts() -> None:
    official = official_head(16, 2)
    state = {f"module.{k}": v for k, v in official.state_dict().items()}
    hidden = torch.randn(4, 16)
    with torch.no_grad():
        expected = official(hidden).softmax(-1)[:, 1]
        torch.testing.assert_close(from_official_state_dict(state, 2).accept_prob(hidden), expected)


def test_official_checkpoint_with_a_different_depth_is_refused() -> None:
    state = official_head(16, 3).state_dict()
    with pytest.raises(ValueError, match="depth"):
        from_official_state_dict(state, 2)
    with pytest.raises(ValueError, match="depth"):
        from_official_state_dict(state, 0)
    deduplicated = {k: v for k, v in state.items() if not k.startswith(("1.", "2."))}  # as safetensors saves it
    with pytest.raises(ValueError, match="depth"):
        from_official_state_dict(deduplicated, 0)
    hidden = torch.randn(4, 16)
    torch.testing.assert_close(
        from_official_state_dict(deduplicated, 3).accept_prob(hidden),
        from_official_state_dict(state, 3).accept_prob(hidden),
    )


def test_checkpoint_with_distinct_block_weights_is_not_taken_for_the_official_format() -> None:
    torch.manual_seed(0)
    untied = nn.Sequential(OfficialResBlock(16), OfficialResBlock(16), nn.Linear(16, 2))
    with pytest.raises(ValueError, match="share"):
        from_official_state_dict(untied.state_dict(), 2)


def test_state_dict_without_a_two_logit_output_is_refused() -> None:
    with pytest.raises(ValueError, match="output weight"):
        from_official_state_dict(seeded_head(depth=1).state_dict(), 1)


# ---- save / load -----------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip_preserves_config_and_outputs(tmp_path) -> None:
    head = seeded_head(hidden_size=24, depth=2)
    head.save_pretrained(tmp_path)
    config = {"depth": 2, "hidden_size": 24, "inputs": ["hidden"], "residual_on": None}
    assert json.loads((tmp_path / HEAD_CONFIG).read_text()) == config
    loaded = AcceptanceHead.from_pretrained(tmp_path)
    assert (loaded.hidden_size, loaded.depth) == (24, 2)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    hidden = torch.randn(5, 24)
    torch.testing.assert_close(loaded(hidden), head(hidden), rtol=0, atol=0)


def test_loading_a_head_folder_without_weights_names_the_missing_file(tmp_path) -> None:
    seeded_head().save_pretrained(tmp_path)
    (tmp_path / HEAD_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=HEAD_WEIGHTS):
        AcceptanceHead.from_pretrained(tmp_path)


def test_loading_weights_of_another_shape_is_refused(tmp_path) -> None:
    seeded_head(hidden_size=16, depth=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="depth-3"):
        AcceptanceHead.from_pretrained(tmp_path, config={"hidden_size": 16, "depth": 3})


@pytest.mark.parametrize(("hidden_size", "depth"), [(0, 1), (16, -1)])
def test_invalid_head_shape_is_refused(hidden_size: int, depth: int) -> None:
    with pytest.raises(ValueError, match="hidden_size" if hidden_size < 1 else "depth"):
        AcceptanceHead(hidden_size, depth)


# ---- scalar inputs besides the hidden state --------------------------------------------------------------------------


def head_with_inputs(inputs=INPUTS, residual_on: str | None = None, seed: int = 0) -> AcceptanceHead:
    """A depth-2 head over hidden size 8 reading ``inputs``, with a non-trivial standardisation."""
    torch.manual_seed(seed)
    head = AcceptanceHead(8, 2, inputs, residual_on).eval()
    count = len(head.scalar_inputs)
    head.set_scalar_stats(torch.linspace(-2.0, 1.0, count), torch.linspace(0.5, 3.0, count))
    return head


def scalar_rows(n: int, seed: int = 1) -> torch.Tensor:
    """(n, 5) plausible raw scalar inputs: log q in (log 1e-3, log 0.999), entropy, top-1, depth, path log q."""
    g = torch.Generator().manual_seed(seed)
    logq = torch.empty(n).uniform_(-6.9, -0.001, generator=g)
    depth = torch.randint(1, 6, (n,), generator=g).float()
    return torch.stack([logq, torch.rand(n, generator=g) * 4, torch.rand(n, generator=g), depth, logq * depth], -1)


def test_scalar_inputs_are_standardised_and_concatenated_to_the_hidden_state() -> None:
    """x_0 = [e; (s − mean)/std], then the same residual maths; the decoder's single-vector path agrees."""
    head = head_with_inputs()
    assert head.inputs == INPUTS and head.scalar_inputs == INPUTS[1:] and head.blocks[0].linear.in_features == 8 + 5
    hidden, scalars = torch.randn(6, 8), scalar_rows(6)
    x = torch.cat([hidden, (scalars - head.scalar_mean) / head.scalar_std], -1)
    for block in head.blocks:
        x = x + nn.functional.silu(x @ block.linear.weight.T + block.linear.bias)
    expected = (x @ head.out.weight.T + head.out.bias).squeeze(-1)
    torch.testing.assert_close(head(hidden, scalars), expected)
    with torch.inference_mode():
        for h, s, logit in zip(hidden, scalars, expected):
            assert head.accept_prob_one(h, s.tolist()) == pytest.approx(float(torch.sigmoid(logit)), abs=1e-6)


def test_a_head_may_read_scalars_alone_in_the_order_of_inputs() -> None:
    head = head_with_inputs(["depth", "logq"])  # given in any order, read in the canonical one
    assert head.inputs == ("logq", "depth") and not head.reads_hidden and head.out.in_features == 2
    scalars = scalar_rows(4)[:, [0, 3]]
    assert head(None, scalars).shape == (4,)
    with torch.inference_mode():
        assert head.accept_prob_one(None, scalars[0].tolist()) == pytest.approx(
            float(head.accept_prob(None, scalars)[0])
        )


@pytest.mark.parametrize("inputs", [["hidden", "logq"], ["logq", "entropy", "depth"], list(INPUTS)])
def test_the_residual_head_starts_as_the_drafts_own_probability(inputs: list[str]) -> None:
    """residual_on="logq": logit = logit(q) + a correction whose last layer is zero at initialisation, so before
    training the head predicts q itself, whatever the hidden state, the other inputs or the standardisation."""
    head = head_with_inputs(inputs, residual_on="logq")
    scalars = scalar_rows(20)[:, [INPUTS.index(n) - 1 for n in head.scalar_inputs]]
    hidden = torch.randn(20, 8) if head.reads_hidden else None
    q = scalars[:, 0].exp()  # logq is the first scalar input
    torch.testing.assert_close(head.accept_prob(hidden, scalars), q, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        assert head.accept_prob_one(None if hidden is None else hidden[3], scalars[3].tolist()) == pytest.approx(
            float(q[3]), rel=1e-5
        )
    assert sum(p.abs().sum() for p in head.out.parameters()) == 0 and head.blocks[0].linear.weight.abs().sum() > 0


@pytest.mark.parametrize("residual_on", [None, "logq"])
def test_a_scalar_head_scores_one_candidate_in_floats_as_its_batch_path_does(residual_on) -> None:
    """A head reading scalars only scores one candidate in Python floats (the decoder's per-token path): it equals
    the tensor path, and follows the weights when training or loading changes them (no stale copy)."""
    head = head_with_inputs(["logq", "entropy", "top1", "depth", "path_logq"], residual_on=residual_on)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.5)  # the residual head's zero last layer made non-trivial
    scalars = scalar_rows(12)

    def agrees() -> None:
        with torch.inference_mode():
            expected = head.accept_prob(None, scalars)
            for row, prob in zip(scalars, expected):
                assert head.accept_prob_one(None, row.tolist()) == pytest.approx(float(prob), abs=1e-6)

    agrees()
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)  # an in-place update of every weight
    head.accept_prob(None, scalars).sum().backward()
    optimizer.step()
    agrees()
    other = head_with_inputs(["logq", "entropy", "top1", "depth", "path_logq"], residual_on=residual_on, seed=3)
    head.load_state_dict(other.state_dict())
    agrees()
    head.out.weight = nn.Parameter(head.out.weight.detach() + 1.0)  # a new parameter object
    agrees()


def test_a_scalar_heads_float_scorer_is_a_snapshot_a_policy_takes_per_generation() -> None:
    """The scorer a decoder takes once per generation gives the head's probability, keeps the weights it was made
    from (so no drafted token re-checks them), and ``HeadThreshold.reset`` takes a new one; a head that reads the
    hidden state has none."""
    from accept_head import HeadThreshold, RoundState

    head = head_with_inputs(["logq", "entropy", "top1", "depth", "path_logq"], residual_on="logq")
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.5)
    row = scalar_rows(1)[0].tolist()
    scorer = head.scalar_scorer()
    with torch.no_grad():
        assert scorer(row) == pytest.approx(float(head.accept_prob(None, torch.tensor([row]))[0]), abs=1e-6)
    before = scorer(row)
    with torch.no_grad():
        head.out.bias += 1.0
    assert scorer(row) == before  # a snapshot
    after = head.accept_prob_one(None, row)
    assert after != pytest.approx(before)
    policy = HeadThreshold(head, 0.5)
    state = RoundState(n=1, draft_logps=[row[0]], entropies=[row[1]], top1s=[row[2]])
    state_row = [row[0], row[1], row[2], 1.0, row[0]]  # depth 1; the path of a first candidate is its log q
    policy.reset()
    assert policy.score(None, state) == pytest.approx(head.accept_prob_one(None, state_row), abs=1e-12)
    with torch.no_grad():
        head.out.bias -= 2.0
    policy.reset()
    assert policy.score(None, state) == pytest.approx(head.accept_prob_one(None, state_row), abs=1e-12)
    with pytest.raises(ValueError, match="needs the hidden state"):
        AcceptanceHead(8, 1, ["hidden", "logq"]).scalar_scorer()


def test_the_residual_logit_is_finite_where_q_rounds_to_one() -> None:
    head = head_with_inputs(["hidden", "logq"], residual_on="logq")
    probs = head.accept_prob(torch.randn(2, 8), torch.tensor([[0.0], [-1e-9]]))
    assert torch.isfinite(torch.logit(probs.double())).all() and bool((probs > 0.999).all())


def test_a_head_with_inputs_round_trips_with_its_standardisation(tmp_path) -> None:
    head = head_with_inputs(residual_on="logq")
    with torch.no_grad():
        head.out.weight.normal_()  # trained, so the correction is not zero
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / HEAD_CONFIG).read_text())
    assert config == {"depth": 2, "hidden_size": 8, "inputs": list(INPUTS), "residual_on": "logq"}
    loaded = AcceptanceHead.from_pretrained(tmp_path)
    assert torch.equal(loaded.scalar_mean, head.scalar_mean) and torch.equal(loaded.scalar_std, head.scalar_std)
    hidden, scalars = torch.randn(5, 8), scalar_rows(5)
    torch.testing.assert_close(loaded(hidden, scalars), head(hidden, scalars), rtol=0, atol=0)


def test_a_head_config_from_before_inputs_is_the_hidden_only_head() -> None:
    head = AcceptanceHead.from_config({"depth": 1, "hidden_size": 8})
    assert head.inputs == ("hidden",) and head.scalar_inputs == () and head.residual_on is None
    assert sorted(head.state_dict()) == ["blocks.0.linear.bias", "blocks.0.linear.weight", "out.bias", "out.weight"]


@pytest.mark.parametrize(
    ("inputs", "residual_on", "match"),
    [
        (["hidden", "log_q"], None, r"unknown: \['log_q'\]"),
        ([], None, "non-empty subset"),
        (["hidden", "entropy"], "logq", "residual_on='logq' needs 'logq' among the inputs"),
        (["hidden", "logq"], "entropy", "must be one of"),
    ],
)
def test_bad_head_inputs_are_refused(inputs, residual_on, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AcceptanceHead(8, 1, inputs, residual_on)


def test_a_head_called_without_the_inputs_it_reads_names_them() -> None:
    head = head_with_inputs(["hidden", "logq", "depth"])
    with pytest.raises(ValueError, match=r"reads the scalar inputs \['logq', 'depth'\]: pass scalars=\(\.\.\., 2\)"):
        head(torch.randn(3, 8))
    with pytest.raises(ValueError, match="reads the draft's hidden state"):
        head(None, torch.zeros(3, 2))


def test_a_projected_hidden_state_enters_the_resnet_narrowed(tmp_path) -> None:
    """hidden_dim: x_0 = [P e; standardised scalars], P a learned (hidden_dim × hidden_size) projection; the
    single-vector path agrees, the folder round-trips it, and a projection without a hidden state is refused."""
    torch.manual_seed(0)
    head = AcceptanceHead(8, 2, INPUTS, "logq", hidden_dim=3).eval()
    head.set_scalar_stats(torch.linspace(-2.0, 1.0, 5), torch.linspace(0.5, 3.0, 5))
    with torch.no_grad():
        head.out.weight.normal_()
    assert head.blocks[0].linear.in_features == 3 + 5 and head.config["hidden_dim"] == 3
    hidden, scalars = torch.randn(6, 8), scalar_rows(6)
    x = torch.cat(
        [hidden @ head.hidden_proj.weight.T + head.hidden_proj.bias, (scalars - head.scalar_mean) / head.scalar_std], -1
    )
    for block in head.blocks:
        x = x + nn.functional.silu(x @ block.linear.weight.T + block.linear.bias)
    logq = scalars[:, 0].clamp(max=math.log1p(-1e-6))
    expected = (x @ head.out.weight.T + head.out.bias).squeeze(-1) + logq - torch.log(-torch.expm1(logq))
    torch.testing.assert_close(head(hidden, scalars), expected)
    with torch.inference_mode():
        assert head.accept_prob_one(hidden[2], scalars[2].tolist()) == pytest.approx(
            float(torch.sigmoid(expected[2])), abs=1e-6
        )
    head.save_pretrained(tmp_path)
    loaded = AcceptanceHead.from_pretrained(tmp_path)
    assert loaded.hidden_dim == 3 and torch.equal(loaded(hidden, scalars), head(hidden, scalars))
    assert "hidden_dim" not in AcceptanceHead(8, 1).config  # older configs stay as they were
    with pytest.raises(ValueError, match=r"hidden_dim=4 projects the hidden state.*inputs \['logq'\]"):
        AcceptanceHead(8, 1, ["logq"], hidden_dim=4)
