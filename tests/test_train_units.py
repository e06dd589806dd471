"""Pure functions behind head training: loss, token mixing, metrics, calibration fitting, split and batching, and the
scalar head inputs read from rollout columns."""

from __future__ import annotations

import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from accept_head.acceptance.calibration import (
    Calibration,
    apply_calibration,
    choose_calibration,
    fit_isotonic,
    fit_temperature,
)
from accept_head.acceptance.inputs import dataset_inputs, standardisation, stored_inputs
from accept_head.acceptance.loss import weighted_bce
from accept_head.acceptance.metrics import (
    acceptance_metrics,
    binary_auc,
    brier_score,
    expected_calibration_error,
    soft_auc,
    soft_bce,
)
from accept_head.acceptance.mixing import mix_tokens
from accept_head.core.seeds import derive_seed
from accept_head.training.data import (
    BucketBatchSampler,
    EpochRandomSampler,
    HiddenRow,
    LabelRow,
    MixedTokenDataset,
    StoredHiddenDataset,
    collate,
    collate_hidden,
    prompt_split,
)

# ---- loss -----------------------------------------------------------------------------------------------------------


def test_weighted_bce_matches_hand_computation():
    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.5, 0.0])
    s = [0.5, 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0))]  # sigmoid of each logit
    w_acc, w_rej = 1.0, 3.0
    numerator = (
        w_acc * 1.0 * -math.log(s[0])  # accepted, label 1
        + w_acc * 0.5 * -math.log(s[1])
        + w_rej * 0.5 * -math.log(1 - s[1])  # half accepted, half rejected
        + w_rej * 1.0 * -math.log(1 - s[2])  # rejected, label 0
    )
    denominator = w_acc * (1.0 + 0.5) + w_rej * (0.5 + 1.0)
    expected = numerator / denominator
    assert expected == pytest.approx(0.81446, abs=1e-5)
    assert float(weighted_bce(logits, labels, w_acc, w_rej)) == pytest.approx(expected, rel=1e-6)


def test_weighted_bce_with_equal_weights_is_plain_soft_bce():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    labels = torch.rand(50, generator=torch.Generator().manual_seed(1))
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    assert float(weighted_bce(logits, labels, 1.0, 1.0)) == pytest.approx(float(plain), rel=1e-6)


def test_weighted_bce_is_stable_for_extreme_logits_and_empty_input():
    loss = weighted_bce(torch.tensor([80.0, -80.0]), torch.tensor([1.0, 0.0]), 1.0, 6.0)
    assert math.isfinite(float(loss)) and float(loss) < 1e-20
    empty = torch.zeros(0, requires_grad=True)
    out = weighted_bce(empty, torch.zeros(0), 1.0, 6.0)
    assert float(out.detach()) == 0.0 and out.requires_grad


@pytest.mark.parametrize(("w_acc", "w_rej", "flag"), [(0.0, 1.0, "w_acc"), (1.0, -2.0, "w_rej")])
def test_weighted_bce_rejects_non_positive_weights(w_acc, w_rej, flag):
    with pytest.raises(ValueError, match=rf"{flag}=.* must be > 0.*--model\.{flag}"):
        weighted_bce(torch.zeros(2), torch.ones(2), w_acc, w_rej)


# ---- token mixing -------------------------------------------------------------------------------------------------


def test_mixing_fraction_matches_ratio_and_draft_positions_hold_draft_tokens():
    n, ratio = 200_000, 0.15
    x = torch.zeros(n, dtype=torch.long)
    y = torch.ones(n, dtype=torch.long)
    z, from_draft = mix_tokens(x, y, ratio, torch.Generator().manual_seed(0))
    target_fraction = float((~from_draft).float().mean())
    assert abs(target_fraction - ratio) < 4 * math.sqrt(ratio * (1 - ratio) / n)
    assert torch.equal(z[from_draft], y[from_draft]) and torch.equal(z[~from_draft], x[~from_draft])


def test_mixing_ratio_zero_keeps_every_draft_token():
    x, y = torch.arange(10), torch.arange(10, 20)
    z, from_draft = mix_tokens(x, y, 0.0, torch.Generator().manual_seed(3))
    assert from_draft.all() and torch.equal(z, y)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_mixing_ratio_outside_unit_interval_is_refused(ratio):
    with pytest.raises(ValueError, match=r"mix_ratio=.* must be in \[0, 1\).*--data\.mix_ratio"):
        mix_tokens(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long), ratio, torch.Generator())


def _rows(n: int, length: int = 40) -> list[LabelRow]:
    gen = torch.Generator().manual_seed(7)
    return [
        LabelRow(
            prompt_id=f"p:{i}",
            prompt_ids=torch.arange(3 + i % 5),
            response_ids=torch.zeros(length, dtype=torch.long),
            draft_ids=torch.ones(length, dtype=torch.long),
            accept_prob=torch.rand(length, generator=gen),
        )
        for i in range(n)
    ]


def test_mixing_is_resampled_per_epoch_and_reproducible_per_seed():
    rows = _rows(8)
    data = MixedTokenDataset(rows, mix_ratio=0.5, seed=0)
    epoch0 = [data[(i, 0)]["loss_mask"] for i in range(8)]
    again = [MixedTokenDataset(rows, 0.5, seed=0)[(i, 0)]["loss_mask"] for i in range(8)]
    epoch1 = [data[(i, 1)]["loss_mask"] for i in range(8)]
    other_seed = [MixedTokenDataset(rows, 0.5, seed=1)[(i, 0)]["loss_mask"] for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(epoch0, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, other_seed, strict=True))
    assert derive_seed(0, 0, "p:1") != derive_seed(0, 1, "p:1")


def test_derived_seeds_are_63_bit_reproducible_and_differ_per_key():
    seeds = {derive_seed(s, *keys) for s in (0, 1) for keys in [(), ("labels", 0), ("labels", 1), (-1, 0), (0, 0)]}
    assert len(seeds) == 10 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(3, "rollout", 7) == derive_seed(3, "rollout", 7)


def test_mixed_example_puts_labels_only_on_draft_positions_after_the_prompt():
    row = _rows(1)[0]
    item = MixedTokenDataset([row], mix_ratio=0.3, seed=0)[(0, 2)]
    prompt_len = len(row.prompt_ids)
    assert torch.equal(item["input_ids"][:prompt_len], row.prompt_ids)
    assert not item["loss_mask"][:prompt_len].any()
    mask = item["loss_mask"][prompt_len:]
    response = item["input_ids"][prompt_len:]
    assert torch.equal(response[mask], row.draft_ids[mask]) and torch.equal(response[~mask], row.response_ids[~mask])
    assert torch.equal(item["labels"][prompt_len:][mask], row.accept_prob[mask])


# ---- split, bucketing, collation ----------------------------------------------------------------------------------


def test_prompt_split_is_seeded_disjoint_and_complete():
    ids = [f"src:{i}" for i in range(50)]
    split = prompt_split(ids, val_fraction=0.2, val_size=None, seed=3)
    assert len(split["val"]) == 10 and len(split["train"]) == 40
    assert set(split["val"]).isdisjoint(split["train"]) and set(split["val"]) | set(split["train"]) == set(ids)
    assert prompt_split(list(reversed(ids)), 0.2, None, seed=3) == split
    assert prompt_split(ids, 0.2, None, seed=4)["val"] != split["val"]


def test_prompt_split_refuses_an_empty_validation_split():
    with pytest.raises(ValueError, match=r"validation split is empty.*--data\.val_fraction"):
        prompt_split(["a", "b", "c"], val_fraction=0.1, val_size=None, seed=0)


def test_prompt_split_train_fraction_subsets_training_prompts_only():
    ids = [f"src:{i}" for i in range(50)]
    full = prompt_split(ids, val_fraction=0.2, val_size=None, seed=3)
    half = prompt_split(ids, val_fraction=0.2, val_size=None, seed=3, train_fraction=0.5)
    assert half["val"] == full["val"]  # the same validation prompts, whatever the fraction
    assert len(half["train"]) == 20 and set(half["train"]) < set(full["train"])
    assert half == prompt_split(ids, 0.2, None, seed=3, train_fraction=0.5)
    with pytest.raises(ValueError, match=r"train_fraction=0 must be in \(0, 1\]"):
        prompt_split(ids, 0.2, None, seed=3, train_fraction=0)


def test_bucket_batches_cover_each_row_once_and_group_similar_lengths():
    lengths = [int(v) for v in torch.randint(5, 500, (103,), generator=torch.Generator().manual_seed(0))]
    sampler = EpochRandomSampler(range(103), seed=0)
    batches = list(BucketBatchSampler(sampler, batch_size=8, lengths=lengths, pool=4, shuffle=True, seed=0))
    flat = [i for batch in batches for i, _ in batch]
    assert sorted(flat) == list(range(103)) and len(batches) == len(BucketBatchSampler(sampler, 8, lengths=lengths))
    # Within a pool rows are sorted by length, so a batch's spread is far below the data's.
    spread = sum(max(lengths[i] for i, _ in b) - min(lengths[i] for i, _ in b) for b in batches) / len(batches)
    assert spread < 0.5 * (max(lengths) - min(lengths))
    sampler.set_epoch(1)
    epoch1 = list(BucketBatchSampler(sampler, batch_size=8, lengths=lengths, pool=4, seed=0))
    assert {e for b in epoch1 for _, e in b} == {1} and epoch1 != batches


def test_collate_right_pads_and_masks():
    data = MixedTokenDataset(_rows(3, length=5), mix_ratio=0.0, seed=0)
    batch = collate([data[(0, 0)], data[(2, 0)]])
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 5 + 5)
    assert batch["attention_mask"][0].sum() == 3 + 5 and batch["attention_mask"][1].sum() == 5 + 5
    assert not batch["loss_mask"][batch["attention_mask"] == 0].any()
    assert batch["row"].tolist() == [0, 2]


# ---- scalar head inputs --------------------------------------------------------------------------------------------


def test_stored_inputs_read_rollout_columns_and_sum_the_path_within_each_round():
    columns = {
        "draft_logp": [-0.5, -1.0, -2.0, -0.25, -0.75],
        "draft_entropy": [1.0, 2.0, 3.0, 4.0, 5.0],
        "draft_top1": [0.9, 0.8, 0.7, 0.6, 0.5],
        "step": [1, 2, 3, 1, 2],  # two rounds
    }
    expected = [
        [-0.5, 1.0, 0.9, 1, -0.5],
        [-1.0, 2.0, 0.8, 2, -1.5],
        [-2.0, 3.0, 0.7, 3, -3.5],
        [-0.25, 4.0, 0.6, 1, -0.25],  # a new round: the path restarts
        [-0.75, 5.0, 0.5, 2, -1.0],
    ]
    torch.testing.assert_close(stored_inputs(columns), torch.tensor(expected))
    without_step = stored_inputs({k: v for k, v in columns.items() if k != "step"})
    assert without_step[:, :3].isfinite().all() and without_step[:, 3:].isnan().all()
    assert dataset_inputs(True, list(columns)) == ("hidden", "logq", "entropy", "top1", "depth", "path_logq")
    assert dataset_inputs(True, ["draft_logp"]) == ("hidden", "logq")
    assert dataset_inputs(False, list(columns)) == ("hidden",)  # token-level labels: no rounds


def test_standardisation_is_per_column_and_leaves_constant_columns_unscaled():
    values = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    mean, std = standardisation(values)
    assert mean.tolist() == [2.0, 5.0] and std.tolist() == [1.0, 1.0]  # population std 1; constant column → 1
    with pytest.raises(ValueError, match="NaN or infinite"):
        standardisation(torch.tensor([[float("nan")]]))


def test_stored_hidden_batches_carry_the_scalar_inputs_zero_padded():
    rows = [
        HiddenRow(f"p{c}", torch.tensor([1, 2]), torch.randn(c, 4), torch.rand(c), torch.randn(c, 5)) for c in (2, 3)
    ]
    data = StoredHiddenDataset(rows)
    batch = collate_hidden([data[(0, 0)], data[(1, 0)]])
    assert batch["inputs"].shape == (2, 3, 5) and batch["hidden"].shape == (2, 3, 4)
    assert torch.equal(batch["inputs"][0, :2], rows[0].inputs) and not batch["inputs"][0, 2].any()
    assert torch.equal(batch["inputs"][batch["loss_mask"]], torch.cat([r.inputs for r in rows]))


# ---- metrics ------------------------------------------------------------------------------------------------------

PROBS = torch.tensor([0.1, 0.1, 0.9, 0.9])
LABELS = torch.tensor([0.0, 0.2, 1.0, 0.6])


def test_metrics_on_known_inputs():
    assert expected_calibration_error(PROBS, LABELS) == pytest.approx(0.5 * 0.0 + 0.5 * 0.1)
    assert brier_score(PROBS, LABELS) == pytest.approx((0.01 + 0.01 + 0.01 + 0.09) / 4)
    # Soft AUC by hand: positives weigh ℓ, negatives 1 − ℓ; ties count one half.
    wins = 1.6 * (1.0 + 0.8)  # positives at 0.9 over negatives at 0.1
    ties = 0.5 * (0.2 * (1.0 + 0.8) + 1.6 * 0.4)
    assert soft_auc(PROBS, LABELS) == pytest.approx((wins + ties) / (1.8 * 2.2))
    assert binary_auc(PROBS, LABELS) == 1.0
    expected_bce = (
        -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for p, y in zip(PROBS.tolist(), LABELS.tolist(), strict=True))
        / 4
    )
    assert soft_bce(PROBS, LABELS) == pytest.approx(expected_bce)


def test_acceptance_metrics_reports_means_and_handles_single_class():
    logits = torch.log(PROBS / (1 - PROBS))
    metrics = acceptance_metrics(logits, LABELS, w_acc=1.0, w_rej=1.0)
    assert metrics["mean_pred"] == pytest.approx(0.5) and metrics["mean_label"] == pytest.approx(0.45)
    assert metrics["bce"] == pytest.approx(metrics["weighted_bce"], rel=1e-5)
    assert metrics["positions"] == 4
    assert math.isnan(soft_auc(PROBS, torch.ones(4))) and math.isnan(binary_auc(PROBS, torch.ones(4)))


# ---- calibration fitting ------------------------------------------------------------------------------------------


def _overconfident(n: int = 20_000, sharpen: float = 3.0, seed: int = 0):
    """Soft labels equal to a true probability; the 'head' reports that probability sharpened (logit × 3)."""
    gen = torch.Generator().manual_seed(seed)
    true = 0.05 + 0.9 * torch.rand(n, generator=gen, dtype=torch.float64)
    logits = sharpen * torch.log(true / (1 - true))
    groups = torch.arange(n) // 10
    return logits, true, groups


def test_temperature_fit_recovers_the_sharpening_and_improves_ece():
    logits, labels, _ = _overconfident()
    calibration = fit_temperature(logits, labels)
    assert calibration.kind == "temperature" and calibration.temperature == pytest.approx(3.0, rel=0.02)
    raw = torch.sigmoid(logits)
    before = expected_calibration_error(raw, labels)
    after = expected_calibration_error(apply_calibration(calibration, raw), labels)
    assert before > 0.05 and after < 0.01


def test_isotonic_fit_improves_ece_and_matches_scalar_application():
    logits, labels, _ = _overconfident()
    raw = torch.sigmoid(logits)
    calibration = fit_isotonic(raw, labels)
    mapped = apply_calibration(calibration, raw)
    assert expected_calibration_error(mapped, labels) < 0.2 * expected_calibration_error(raw, labels)
    for p in (0.0, 0.03, 0.5, 0.97, 1.0):
        assert calibration(p) == pytest.approx(float(apply_calibration(calibration, torch.tensor([p]))[0]))
    assert Calibration.from_dict(calibration.to_dict()) == calibration


def test_choose_calibration_keeps_a_map_when_it_helps_and_none_when_it_does_not():
    logits, labels, groups = _overconfident()
    choice = choose_calibration(logits, labels, groups)
    assert choice.chosen in ("temperature", "isotonic") and choice.calibration is not None
    assert choice.scores[choice.chosen]["ece"] < choice.scores["raw"]["ece"]
    assert "cross-fitted" in choice.evaluation
    calibrated_logits = torch.log(labels / (1 - labels))  # already calibrated: raw should win or tie closely
    choice = choose_calibration(calibrated_logits, labels, groups, methods=["temperature"])
    assert choice.scores["temperature"]["ece"] >= choice.scores["raw"]["ece"] - 1e-3


def test_cosine_schedule_follows_the_steps_or_a_deadline_whichever_is_further() -> None:
    """Without a deadline the schedule is Hugging Face's cosine with warm-up and a floor; with one, a fit whose steps
    lag behind its time decays on the clock and reaches the floor at the deadline."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from accept_head.training.module import adamw_cosine

    def factors(schedule, steps, clock=None, ticks=()):
        """The learning-rate factor of steps 0..steps-1; step i's computed when the clock reads ticks[i]."""
        scheduler = schedule["lr_scheduler"]["scheduler"]
        out = [scheduler.optimizer.param_groups[0]["lr"] / 0.1]
        for step in range(1, steps):
            if ticks:
                clock[0] = ticks[step]
            scheduler.optimizer.step()
            scheduler.step()
            out.append(scheduler.optimizer.param_groups[0]["lr"] / 0.1)
        return out

    params = [torch.nn.Parameter(torch.zeros(2))]
    ours = factors(adamw_cosine(params, 0.1, 3, 20, 0.1), 21)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 3, 20, min_lr_rate=0.1)
    theirs = []
    for _ in range(21):
        theirs.append(optimizer.param_groups[0]["lr"] / 0.1)
        optimizer.step()
        reference.step()
    assert ours == pytest.approx(theirs, abs=1e-12) and ours[-1] == pytest.approx(0.1)

    clock = [0.0]  # 1,000 planned steps, a deadline at t = 100 s, one step every 10 s: time is further along
    timed = adamw_cosine(params, 0.1, 2, 1000, 0.0, deadline=100.0, clock=lambda: clock[0])
    got = factors(timed, 12, clock, ticks=[10.0 * i for i in range(12)])
    assert got[1] == pytest.approx(0.5)  # warm-up by steps
    assert got[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))  # t = 50 s of 100
    assert got[10] == pytest.approx(0.0, abs=1e-12) and got[11] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(got[2:], got[3:]))


def test_a_save_that_fails_midway_leaves_the_target_path_as_it_was(tmp_path) -> None:
    """``save_atomic`` writes beside its target and renames: a save that fails halfway through its bytes leaves no
    file at a new path and an earlier file untouched; the half-written bytes stay in ``<path>.tmp``."""
    from accept_head.training.draft_recipe import save_atomic

    def half_then_fails(obj, name: str) -> None:
        torch.save(obj, name)
        os.truncate(name, os.path.getsize(name) // 2)
        raise OSError("No space left on device")

    new, old = tmp_path / "new.pt", tmp_path / "old.pt"
    save_atomic({"x": torch.arange(3)}, old)
    before = old.read_bytes()
    for path in (new, old):
        with pytest.raises(OSError, match="No space left"):
            save_atomic({"x": torch.arange(1000)}, path, half_then_fails)
    assert not new.exists() and old.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.pt.tmp", "old.pt", "old.pt.tmp"]
    save_atomic({"x": torch.arange(1000)}, old)  # the next save replaces the stray temporary and the file whole
    assert torch.equal(torch.load(old, weights_only=True)["x"], torch.arange(1000))
    assert not (tmp_path / "old.pt.tmp").exists()


@pytest.mark.parametrize("inputs", [["logq", "entropy", "depth"], ["hidden", "logq"]])
def test_the_sweep_decodes_each_unscored_setting_only_for_a_head_that_scores_late(inputs) -> None:
    """A head of the draft's numbers scores every candidate as it is drawn, so ``unscored`` changes nothing: the
    sweep decodes its thresholds once. A head reading the hidden state leaves the newest candidate unscored: every
    setting is decoded."""
    from tiny_models import make_llama, perturbed_copy

    from accept_head import AcceptanceHead
    from accept_head.core.sampling import SamplingConfig
    from accept_head.engine.sweep import run_sweep

    target = make_llama(seed=0).eval()
    head = AcceptanceHead(target.config.hidden_size, 1, inputs).eval()
    result = run_sweep(
        target,
        perturbed_copy(target, seed=1).eval(),
        head,
        [[1, 5, 9, 4]],
        thresholds=[0.5],
        fixed_k=[1],
        max_new_tokens=3,
        sampling=SamplingConfig(1.0),
        eos_token_id=None,
        unscored=[None, "confidence"],
        autoregressive=False,
    )
    variants = [row.variant for row in result.family("threshold")]
    assert variants == ([None] if "hidden" not in inputs else [None, "confidence"])


def test_a_sweep_with_context_row_decodes_every_chain_with_copies_as_generate_would() -> None:
    """``context_row``: FixedK, SpecDec++ and the ablated rule of the sweep decode with copied rows — the same rounds
    as :func:`chain_copy_generate` with that policy — and the export stage's ``context_row`` is the stage's default."""
    from types import SimpleNamespace

    from tiny_models import make_llama, perturbed_copy

    from accept_head import AcceptanceHead
    from accept_head.chain.policies import FixedK
    from accept_head.core.sampling import SamplingConfig
    from accept_head.engine.sweep import run_sweep
    from accept_head.training.callbacks import ExportBundle, ThresholdSweep, _export_context_row
    from accept_head.trees.chain_copies import chain_copy_generate

    target = make_llama(seed=0).eval()
    draft = perturbed_copy(target, relative_noise=0.3, seed=1).eval()
    head = AcceptanceHead(target.config.hidden_size, 1, ["logq", "depth"]).eval()
    prompt = [1, 5, 9, 4, 7, 1, 5, 9, 4, 7, 1, 5]  # repeats itself: copies exist from the first round
    common = dict(max_new_tokens=10, sampling=SamplingConfig(0.0), eos_token_id=None, autoregressive=False)
    result = run_sweep(
        target, draft, head, [prompt], thresholds=[0.5], fixed_k=[2], ablated=[0.5], context_row=3, **common
    )
    assert all(row.method.params["context_row"] == 3 for row in result.rows)
    (fixed,) = result.family("fixed_k")
    reference = chain_copy_generate(target, draft, prompt, FixedK(2), 10, context_row=3, temperature=0.0).stats
    assert (fixed.result.rounds, fixed.result.target_calls) == (len(reference.accepted), reference.target_calls)
    plain = run_sweep(target, draft, head, [prompt], thresholds=[0.5], fixed_k=[2], **common)
    assert all("context_row" not in row.method.params for row in plain.rows)
    (plain_fixed,) = plain.family("fixed_k")
    assert fixed.result.rounds < plain_fixed.result.rounds  # on this repeating text the copies are accepted
    with pytest.raises(ValueError, match="context_row=-1"):
        run_sweep(target, draft, head, [prompt], context_row=-1, **common)
    trainer = SimpleNamespace(callbacks=[ThresholdSweep(), ExportBundle(enabled=False, context_row=4)])
    assert _export_context_row(trainer) == 4 and ThresholdSweep().context_row is None
    assert _export_context_row(SimpleNamespace(callbacks=[])) == 0


def test_a_closing_comparison_on_fewer_prompts_than_asked_says_so() -> None:
    from accept_head.training.callbacks import ThresholdSweep

    val = [(f"p{i}", [i]) for i in range(12)]
    dm = SimpleNamespace(val_prompts=lambda n, offset=0: val[offset : offset + n])
    with pytest.warns(UserWarning, match=r"sweep.eval_prompts=8 but only 2 validation prompts remain"):
        assert ThresholdSweep(prompts=10, eval_prompts=8).held_out(dm) == val[10:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exactly enough: no word
        assert ThresholdSweep(prompts=4, eval_prompts=8).held_out(dm) == val[4:]
