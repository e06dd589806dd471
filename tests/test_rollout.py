"""On-policy rollout labels (:mod:`accept_head.chain.rollout`), ``data_gen --label_mode rollout`` and head training on
the
stored hidden states, on tiny random Llama pairs (and a tiny random feature draft)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from stats_helpers import ALPHA, exact_joint, goodness_of_fit, resample_from_target_on_rejection
from tiny_models import (
    TableLM,
    distilled_feature_draft,
    draft_vocabulary,
    make_llama,
    make_pair,
    make_tokenizer,
    perturbed_copy,
    small_vocab_llama,
)
from train_helpers import TinySetup, run_data_gen, train_config, write_config, write_prompts

from accept_head import AcceptanceHead, FixedK, HeadThreshold, autoregressive_generate, speculative_generate
from accept_head.acceptance.inputs import INPUTS
from accept_head.acceptance.labels import load_label_dataset
from accept_head.chain.rollout import read_hidden, rollout_labels
from accept_head.core.prompts import PromptOptions
from accept_head.core.sampling import SamplingConfig, probabilities
from accept_head.core.seeds import seeded_generator
from accept_head.engine.runner import h_star_label
from accept_head.labelgen import generate as generate_module
from accept_head.labelgen.run import parse_config
from accept_head.models.feature_draft import FeatureDraft
from accept_head.models.features import lm_head_input
from accept_head.models.loading import load_model
from data_gen.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

PROMPT = [2, 10, 11, 12, 13, 14]
SAMPLINGS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.8-top_k20-top_p0.9": SamplingConfig(temperature=0.8, top_k=20, top_p=0.9),
    "greedy": SamplingConfig(temperature=0.0),
}


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target and a draft that agrees with it often but not always (a perturbed copy)."""
    target = make_llama(tokenizer=make_tokenizer(), seed=0, num_layers=3)
    return target, perturbed_copy(target, relative_noise=0.3, seed=1)


@pytest.fixture(scope="module")
def feature_draft(models) -> FeatureDraft:
    """A feature draft distilled on the target's greedy text after PROMPT (so greedy rounds accept candidates), over
    a vocabulary that leaves out 2 of the tokens the target writes there."""
    target = models[0]
    text = autoregressive_generate(target, PROMPT, 24, temperature=0).sequences[0].tolist()
    kept = draft_vocabulary(target.config.vocab_size, text[len(PROMPT) :], leave_out=2)
    return distilled_feature_draft(target, kept, [text], steps=100)


# ---- the library ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_rollout_labels_equal_an_independent_recomputation(models, name: str) -> None:
    """Every candidate's label, features, head inputs and hidden state equal what the two models give on its prefix
    directly: the prompt, the text committed by earlier rounds and the round's earlier candidates."""
    target, draft = models
    sampling = SAMPLINGS[name]
    result = rollout_labels(target, draft, PROMPT, 18, 3, sampling, None, torch.Generator().manual_seed(0))
    inputs = result.inputs()  # what a head with scalar inputs trains on (acceptance/inputs.py), in INPUTS order
    stats = result.stats
    assert len(stats.proposed) >= 4 and sum(stats.proposed) == len(result.draft_ids)
    assert 0 < sum(stats.accepted) < sum(stats.proposed)  # both accept and reject paths ran
    assert len(result.response_ids) == 18 and result.hidden.shape == (len(result.draft_ids), 32)
    response = result.response_ids.tolist()
    start, c = 0, 0
    for r, (k, m) in enumerate(zip(stats.proposed, stats.accepted, strict=True)):
        candidates = result.draft_ids[c : c + k].tolist()
        assert result.round[c : c + k].tolist() == [r] * k and result.step[c : c + k].tolist() == list(range(1, k + 1))
        assert result.accepted[c : c + k].tolist() == [True] * m + [False] * (k - m)
        assert response[start : start + m] == candidates[:m]
        path = 0.0
        for j, y in enumerate(candidates):
            context = torch.tensor([PROMPT + response[:start] + candidates[:j]])
            with torch.no_grad():
                p_logits, q_logits = target(context).logits[0, -1], draft(context).logits[0, -1]
                hidden = lm_head_input(draft, torch.tensor([[*context[0].tolist(), y]]))[0, -1]
            p, q = probabilities(p_logits, sampling), probabilities(q_logits, sampling)
            assert q[y] > 0
            expected = min(1.0, float(p[y] / q[y]))
            if sampling.greedy:
                assert y == int(q_logits.argmax()) and expected == float(y == int(p_logits.argmax()))
                q = q_logits.float().softmax(-1)  # features of the untransformed softmax
            assert float(result.accept_prob[c + j]) == pytest.approx(expected, abs=1e-5)
            assert float(result.draft_logp[c + j]) == pytest.approx(float(q[y].log()), abs=1e-4)
            assert float(result.draft_entropy[c + j]) == pytest.approx(float(torch.special.entr(q).sum()), abs=1e-4)
            path += float(q[y].log())
            entropy = float(-(q * q.log()).nan_to_num().sum())
            expected_inputs = [float(q[y].log()), entropy, float(q.max()), j + 1, path]  # logq ... path_logq
            torch.testing.assert_close(inputs[c + j], torch.tensor(expected_inputs), atol=1e-4, rtol=1e-4)
            assert float(result.expected_accept[c + j]) == pytest.approx(
                float(torch.minimum(probabilities(p_logits, sampling), probabilities(q_logits, sampling)).sum()),
                abs=1e-5,
            )
            torch.testing.assert_close(result.hidden[c + j], hidden.float(), atol=1e-4, rtol=1e-4)
        start += m + 1
        c += k
    assert start == len(response)


class RecordingHeadThreshold(HeadThreshold):
    """SpecDec++'s policy with ``k`` candidates a round, keeping what the decoder hands the head for each scored
    candidate: (round, candidate index in the round, scalar inputs, hidden state)."""

    def __init__(self, head: AcceptanceHead, k: int) -> None:
        super().__init__(head, 0.5, min_candidates=k, max_candidates=k)
        self.seen: list[tuple[int, int, list[float], torch.Tensor]] = []
        self.rounds = 0

    def score(self, hidden: torch.Tensor, state=None) -> float:
        self.seen.append((self.rounds, state.n, self.head_inputs(state), hidden.float().clone()))
        return super().score(hidden, state)

    def update(self, state, accepted: int) -> None:
        self.rounds += 1


@pytest.mark.parametrize("name", ["t0.8-top_k20-top_p0.9", "greedy"])
def test_the_decoder_hands_a_head_the_inputs_its_rollout_labels_store(models, name: str) -> None:
    """Decoding with a head that reads every input and a rollout with the same generator run the same rounds; each
    candidate the decoder scores gets exactly the inputs (and hidden state) the rollout stored for it to train on —
    matched by round and by index in the round, so an off-by-one in position or depth fails."""
    target, draft = models
    sampling = SAMPLINGS[name]
    policy = RecordingHeadThreshold(AcceptanceHead(32, 1, INPUTS), 3)
    decoded = speculative_generate(
        target, draft, PROMPT, policy, 18, sampling.temperature, sampling.top_k, sampling.top_p,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    stored = rollout_labels(target, draft, PROMPT, 18, 3, sampling, None, torch.Generator().manual_seed(0))
    assert decoded.sequences[0, len(PROMPT) :].tolist() == stored.response_ids.tolist()
    assert decoded.stats.proposed == stored.stats.proposed and decoded.stats.accepted == stored.stats.accepted
    row = {(int(r), int(k)): c for c, (r, k) in enumerate(zip(stored.round, stored.step))}
    inputs = stored.inputs()
    assert len(policy.seen) == sum(max(k - 1, 0) for k in stored.stats.proposed) >= 8  # y_K of a round is unscored
    for round_index, depth, scalars, hidden in policy.seen:
        c = row[(round_index, depth)]
        torch.testing.assert_close(torch.tensor(scalars), inputs[c], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden, stored.hidden[c], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_greedy_rollout_writes_the_targets_greedy_text(models, feature_draft, drafter: str) -> None:
    target = models[0]
    # A closer copy than models' draft, whose greedy candidates on PROMPT are accepted 2 times in 62.
    draft = perturbed_copy(target, relative_noise=0.01, seed=1) if drafter == "model" else feature_draft
    result = rollout_labels(target, draft, PROMPT, 20, 4, SamplingConfig(temperature=0.0), None, None)
    reference = autoregressive_generate(target, PROMPT, 20, temperature=0)
    assert result.response_ids.tolist() == reference.sequences[0, len(PROMPT) :].tolist()
    assert len(result.draft_ids) == sum(result.stats.proposed) > 0
    # The accept path ran: candidates accepted often, a whole round of 4 at least once, and rejections too.
    accepted, proposed = sum(result.stats.accepted), sum(result.stats.proposed)
    assert 0.3 * proposed <= accepted < proposed, (accepted, proposed)
    assert any(m == n == 4 for n, m in zip(result.stats.proposed, result.stats.accepted))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_candidates_after_a_drafted_eos_are_neither_labelled_nor_accepted(temperature: float) -> None:
    """Draft and target agree on every token and the second candidate is the EOS (5): the round accepts it and the
    decode ends, so the two candidates drafted after it — read in a context holding an accepted EOS, which decoding
    never reaches — carry no label and do not count as accepted."""
    script = [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    target, draft = TableLM.scripted(script, 8), TableLM.scripted(script, 8)
    sampling = SamplingConfig(temperature=temperature)
    result = rollout_labels(target, draft, script[:4], 8, 4, sampling, [5], torch.Generator().manual_seed(0))
    assert result.response_ids.tolist() == [4, 5]
    assert result.stats.proposed == [4] and result.stats.accepted == [2]
    assert result.draft_ids.tolist() == [4, 5] and result.step.tolist() == [1, 2]
    assert result.accepted.tolist() == [True, True] and result.accept_prob.tolist() == [1.0, 1.0]
    assert result.hidden.shape == (2, draft.config.hidden_size)


@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_a_draft_with_a_shorter_context_does_not_shorten_a_rollout(models, feature_draft, drafter: str) -> None:
    """Rollouts are bounded by the target's context alone: with a draft that reads 16 positions the rollout still
    writes the target's 30 greedy tokens, drafting while the draft has room."""
    target = models[0]
    draft = copy.deepcopy(models[1] if drafter == "model" else feature_draft)
    draft.config.max_position_embeddings = 16
    result = rollout_labels(target, draft, PROMPT, 30, 4, SamplingConfig(temperature=0.0), None, None)
    reference = autoregressive_generate(target, PROMPT, 30, temperature=0)
    assert result.response_ids.tolist() == reference.sequences[0, len(PROMPT) :].tolist()
    assert 0 < len(result.draft_ids) == sum(result.stats.proposed)


@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_sampled_rollout_is_speculative_decoding_with_fixed_k(models, feature_draft, drafter: str) -> None:
    """Same generator, same sequence as speculative_generate(FixedK(k_max)): the extra propose(y_K) per round
    leaves the drafter's state exactly as the decoder expects it after commit."""
    target = models[0]
    draft = models[1] if drafter == "model" else feature_draft
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    result = rollout_labels(target, draft, PROMPT, 24, 3, sampling, [3], torch.Generator().manual_seed(7))
    reference = speculative_generate(
        target, draft, PROMPT, FixedK(3), 24, temperature=0.9, top_p=0.95, eos_token_id=3,
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    assert result.response_ids.tolist() == reference.sequences[0, len(PROMPT) :].tolist()
    assert result.stats.proposed == reference.stats.proposed and result.stats.accepted == reference.stats.accepted
    width = feature_draft.config.hidden_size if drafter == "feature" else 32
    assert len(result.draft_ids) <= sum(result.stats.proposed)  # fewer when a round drafted an EOS
    assert result.hidden.shape == (len(result.draft_ids), width) and torch.isfinite(result.hidden).all()


@pytest.mark.parametrize("name", ["t0.9-top_p0.95", "greedy"])
def test_feature_rollout_labels_equal_an_independent_recomputation(models, feature_draft, name: str) -> None:
    """The feature draft's rollout, recomputed without the decoder's code (no ``draft_round``, ``verify``,
    ``FeatureDrafter`` or KV cache): for each round, the target's features of the committed text from one fresh pass,
    then per candidate one fresh, uncached draft pass over the whole sequence of pairs — the target's features for
    committed positions, the draft's own predictions for the round's earlier candidates — gives q_k and the hidden
    state, and a fresh target pass gives p_k; the labels, ``accepted`` flags and text must follow from them."""
    target = models[0]
    sampling = SamplingConfig(temperature=0.9, top_p=0.95) if name != "greedy" else SamplingConfig(temperature=0.0)
    result = rollout_labels(target, feature_draft, PROMPT, 18, 3, sampling, None, torch.Generator().manual_seed(7))
    stats = result.stats
    assert 0 < sum(stats.accepted) < sum(stats.proposed)  # both paths ran
    response = result.response_ids.tolist()
    assert len(response) == 18
    start, c = 0, 0
    for k, m in zip(stats.proposed, stats.accepted, strict=True):
        committed = PROMPT + response[:start]
        candidates = result.draft_ids[c : c + k].tolist()
        assert result.accepted[c : c + k].tolist() == [True] * m + [False] * (k - m)
        assert response[start : start + m] == candidates[:m]
        with torch.no_grad():
            true_features = lm_head_input(target, torch.tensor([committed]))[0]  # (n, d): f_t after x_0..x_t
            features, tokens = true_features[:-1], committed[1:]  # pairs (f_t, x_{t+1}) the draft knows
            predicted = feature_draft(features[None], torch.tensor([tokens]))[0, -1]  # f̂ predicting y_1
            for j, y in enumerate(candidates):
                p_logits = target(torch.tensor([committed + candidates[:j]])).logits[0, -1]
                q_logits = feature_draft.full_logits(predicted)
                p, q = probabilities(p_logits, sampling), probabilities(q_logits, sampling)
                assert q[y] > 0
                if sampling.greedy:
                    assert y == int(q_logits.argmax())
                    expected = float(y == int(p_logits.argmax()))
                    q = q_logits.float().softmax(-1)  # features of the untransformed softmax
                else:
                    expected = min(1.0, float(p[y] / q[y]))
                assert float(result.accept_prob[c + j]) == pytest.approx(expected, abs=1e-5)
                assert float(result.draft_logp[c + j]) == pytest.approx(float(q[y].log()), abs=1e-4)
                assert float(result.draft_entropy[c + j]) == pytest.approx(float(torch.special.entr(q).sum()), abs=1e-4)
                # Feed (f̂, y): the state whose input is y is candidate j's hidden state and predicts y_{j+1}.
                features, tokens = torch.cat([features, predicted[None]]), [*tokens, y]
                predicted = feature_draft(features[None], torch.tensor([tokens]))[0, -1]
                torch.testing.assert_close(result.hidden[c + j], predicted.float(), atol=1e-4, rtol=1e-4)
        start += m + 1
        c += k
    assert start == len(response) and c == len(result.draft_ids)


# ---- the joint distribution of the first tokens (χ² over every cell, not pair marginals) ---------------------------

JOINT_VOCAB, JOINT_PROMPT, JOINT_TOKENS = 4, [0, 3, 1], 3
"""A vocabulary of 4 and 3 tokens: the joint has 64 cells, few enough for one χ² over all of them; with k_max = 2
a round boundary falls inside the horizon whenever a candidate is rejected, so the cross-round dependence counts."""


@pytest.fixture(scope="module")
def joint_setup() -> tuple[torch.nn.Module, dict[str, torch.nn.Module], torch.Tensor]:
    """A vocabulary-4 target, a standalone and a feature draft for it, and the exact joint (4, 4, 4) of its first
    three tokens at T = 1."""
    target = small_vocab_llama(seed=1, vocab_size=JOINT_VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the feature draft's fresh layers: the same weights whatever ran before
        feature = FeatureDraft.from_target(target, torch.arange(JOINT_VOCAB))
    drafts = {"model": perturbed_copy(target, relative_noise=0.5, seed=1), "feature": feature}
    return target, drafts, exact_joint(target, JOINT_PROMPT, JOINT_TOKENS)


def joint_counts(target, draft, samples: int) -> tuple[torch.Tensor, float]:
    """Counts (V,)*3 of the first three tokens of ``samples`` seeded rollouts (k_max 2, T = 1), and the share of
    rollouts that accepted a candidate."""
    generator = torch.Generator().manual_seed(0)
    counts, hits = torch.zeros([JOINT_VOCAB] * JOINT_TOKENS, dtype=torch.long), 0
    for _ in range(samples):
        result = rollout_labels(target, draft, JOINT_PROMPT, JOINT_TOKENS, 2, SamplingConfig(1.0), None, generator)
        counts[tuple(result.response_ids.tolist())] += 1
        hits += sum(result.stats.accepted) > 0
    return counts, hits / samples


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_sampled_rollout_keeps_the_targets_joint_distribution(joint_setup, drafter: str) -> None:
    target, drafts, joint = joint_setup
    counts, hit_rate = joint_counts(target, drafts[drafter], 800)
    assert hit_rate > 0.2, hit_rate  # candidates were accepted: the accept rule is under test
    p_value = goodness_of_fit(counts, joint)
    assert p_value > ALPHA, p_value


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "feature"])
def test_joint_check_rejects_a_broken_verifier(joint_setup, monkeypatch: pytest.MonkeyPatch, drafter: str) -> None:
    """Redrawing a rejected position from p instead of the residual (p − q)+ must fail the same joint χ² (measured
    with 400 runs: p = 1e-11 with the standalone draft, 4e-5 with the feature draft)."""
    target, drafts, joint = joint_setup
    monkeypatch.setattr("accept_head.chain.rollout.verify", resample_from_target_on_rejection)
    counts, _ = joint_counts(target, drafts[drafter], 400)
    assert goodness_of_fit(counts, joint) < ALPHA


def test_bad_k_max_is_refused(models) -> None:
    with pytest.raises(ValueError, match=r"k_max=0 must be an integer >= 1"):
        rollout_labels(*models, PROMPT, 8, 0, SamplingConfig(), None, None)


# ---- data_gen ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinySetup:
    """The tiny pair of the train tests, 16 prompts and their rollout labels (k_max 3)."""
    root = tmp_path_factory.mktemp("rollout")
    target, draft = make_pair(root)
    prompts = write_prompts(root / "prompts.jsonl", 16)
    setup = TinySetup(root=root, target=target, draft=draft, prompts=prompts, labels=root / "rollout-labels")
    run_data_gen(rollout_config(setup), setup.labels)
    return setup


def rollout_config(setup: TinySetup, **overrides) -> dict:
    return setup.data_gen_config(label_mode="rollout", k_max=3, batch_size=5, max_new_tokens=12, **overrides)


def test_data_gen_rollout_writes_a_dataset_whose_rows_are_the_library_rollouts(tiny: TinySetup) -> None:
    dataset, meta = load_label_dataset(tiny.labels)
    assert meta["label_mode"] == "rollout" and len(dataset) == 16
    assert meta["rollout"]["k_max"] == 3 and meta["rollout"]["hidden_size"] == 16
    assert meta["rollout"]["hidden_dtype"] == "float16" and meta["config"]["k_max"] == 3
    assert meta["stats"]["candidates"] == sum(len(r) for r in dataset["accept_prob"]) > 0
    hidden = read_hidden(dataset, 16)
    for row, states in zip(dataset, hidden, strict=True):
        assert states.shape == (len(row["draft_ids"]), 16) and states.dtype == torch.float16
        assert all(len(row[name]) == len(row["draft_ids"]) for name in ("step", "round", "accepted", "accept_prob"))
    # Row i is rollout_labels on its prompt with the generator seeded from (seed, "rollout", i).
    target = load_model({"path": str(tiny.target), "dtype": "float32"})
    draft = load_model({"path": str(tiny.draft), "dtype": "float32"})
    for i in (0, 7):
        row = dataset[i]
        generator = seeded_generator(0, "rollout", i)
        eos = meta["tokenizer"]["eos_token_ids"]
        expected = rollout_labels(target, draft, row["prompt_ids"], 12, 3, SamplingConfig(), eos, generator)
        assert row["response_ids"] == expected.response_ids.tolist()
        assert row["draft_ids"] == expected.draft_ids.tolist()
        torch.testing.assert_close(torch.tensor(row["accept_prob"]), expected.accept_prob)
        torch.testing.assert_close(hidden[i].float(), expected.hidden, atol=2e-3, rtol=2e-3)


def test_interrupted_rollout_run_resumes_to_the_uninterrupted_dataset(tiny: TinySetup, tmp_path, monkeypatch) -> None:
    real_write, calls = generate_module._write_batch, []

    def crash_on_second(batch_root: Path, b: int, *a, **k) -> None:
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_write(batch_root, b, *a, **k)

    monkeypatch.setattr(generate_module, "_write_batch", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_data_gen(rollout_config(tiny), tmp_path / "resumed")
    monkeypatch.setattr(generate_module, "_write_batch", real_write)
    assert sorted(p.name for p in (tmp_path / "resumed" / "_work" / "batches").iterdir()) == ["000000"]
    run_data_gen(rollout_config(tiny), tmp_path / "resumed")
    full, _ = load_label_dataset(tiny.labels)
    resumed, _ = load_label_dataset(tmp_path / "resumed")
    assert full.to_list() == resumed.to_list()


def test_k_max_is_only_in_the_fingerprint_of_rollout_runs(tiny: TinySetup, tmp_path) -> None:
    argv = ["--config", json.dumps({**tiny.data_gen_config(), "output_dir": str(tmp_path / "o")})]
    assert "k_max" not in parse_config(argv).fingerprint()  # datasets made before rollout keep their fingerprint
    assert parse_config([*argv, "--label_mode", "rollout"]).fingerprint()["k_max"] == 8


@pytest.mark.parametrize("value", ["0", "-2"])
def test_bad_k_max_names_the_flag(tiny: TinySetup, tmp_path, value: str, capsys) -> None:
    argv = ["--config", json.dumps({**rollout_config(tiny), "output_dir": str(tmp_path / "o")}), "--k_max", value]
    with pytest.raises(ValueError, match=rf"--k_max={value} must be an integer >= 1"):
        parse_config(argv)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "--k_max" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def feature_setup(tiny: TinySetup) -> TinySetup:
    """A feature draft for the tiny target (its folder has no tokenizer) and its rollout labels."""
    folder = tiny.root / "feature-draft"
    target = load_model({"path": str(tiny.target), "dtype": "float32"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        FeatureDraft.from_target(target, torch.arange(60)).save_pretrained(folder)
    setup = TinySetup(tiny.root, tiny.target, folder, tiny.prompts, tiny.root / "feature-rollout-labels")
    run_data_gen(rollout_config(setup), setup.labels)
    return setup


def test_data_gen_rollout_with_a_feature_draft(feature_setup: TinySetup, tmp_path) -> None:
    dataset, meta = load_label_dataset(feature_setup.labels)
    assert meta["rollout"]["drafter"] == "FeatureDraft" and meta["rollout"]["hidden_size"] == 32
    assert [h.shape[0] for h in read_hidden(dataset, 32)] == [len(r) for r in dataset["draft_ids"]]
    with pytest.raises(ValueError, match=r"is a feature draft .*--label_mode rollout"):
        run_data_gen(feature_setup.data_gen_config(), tmp_path / "token-labels")
    assert not (tmp_path / "token-labels").exists()


# ---- head training on stored hidden states -------------------------------------------------------------------------


def fit(config: dict, tmp_path: Path):
    from accept_head.training.cli import cli_main

    return cli_main(["fit", "--config", str(write_config(config, tmp_path / "fit.yaml"))])


def test_train_fit_on_rollout_labels_trains_on_stored_hidden_states(tiny: TinySetup, tmp_path, monkeypatch) -> None:
    import accept_head.training.module as module

    def no_draft_forward(*args, **kwargs):
        raise AssertionError("the draft must not run on rollout data")

    monkeypatch.setattr(module, "final_hidden_states", no_draft_forward)
    config = train_config(tiny, tmp_path, stages=True, trainer={"max_epochs": 2})
    cli = fit(config, tmp_path)
    dm = cli.datamodule
    assert dm.rollout and cli.trainer.global_step == 2 * 3  # 10 training prompts in batches of 4, two epochs
    split = dm.split_record()
    assert split["rollout"] and len(split["val"]) == 6 and set(split["val"]).isdisjoint(split["train"])
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/weighted_bce"]) and torch.isfinite(metrics["train/loss"])
    report = cli.model.fit_report
    assert report.calibration_choice is not None  # calibration read the stored-state batches
    assert report.threshold in (0.3, 0.7) and (tmp_path / "bundle" / "head.safetensors").is_file()
    card = (tmp_path / "bundle" / "README.md").read_text()
    assert "On-policy rollout labels" in card and "labelled candidates" in card

    # `python -m eval label_modes` scores the exported head on the stored states of a rollout dataset, raw and
    # calibrated.
    from accept_head import SpecDecPP
    from accept_head.acceptance.calibration import apply_calibration
    from accept_head.acceptance.metrics import acceptance_metrics
    from accept_head.evaluation import label_modes

    scores = label_modes.label_modes(dataset=str(tiny.labels), bundles=[str(tmp_path / "bundle")])
    dataset, _ = load_label_dataset(tiny.labels)
    states = torch.cat(read_hidden(dataset, 16)).float()
    labels = torch.tensor([x for row in dataset["accept_prob"] for x in row])
    bundle = SpecDecPP.from_pretrained(tmp_path / "bundle")
    logits = bundle.head(states.to(next(bundle.head.parameters()).dtype)).float()
    ours = scores["heads"][str(tmp_path / "bundle")]
    assert ours["label_mode"] == "rollout" and scores["candidates"] == labels.numel()
    assert ours["raw"]["auc"] == pytest.approx(acceptance_metrics(logits, labels)["auc"], abs=1e-6)
    calibrated = apply_calibration(bundle.calibration, torch.sigmoid(logits)).clamp(1e-6, 1 - 1e-6)
    assert ours["calibrated"]["ece"] == pytest.approx(acceptance_metrics(torch.logit(calibrated), labels)["ece"])
    with pytest.raises(ValueError, match="width 7 but the head reads 16"):
        label_modes.score(bundle, torch.zeros(3, 7), torch.ones(3))

    # With test prompts, every bundle also decodes them at its h*, interleaved with the target alone and FixedK.
    # Two copies of one bundle decide alike, so their greedy rows count the same rounds and tokens.
    import shutil

    twin = shutil.copytree(tmp_path / "bundle", tmp_path / "twin")
    first = str(tmp_path / "bundle")
    paths = [first, str(twin)]
    greedy = label_modes.label_modes(
        dataset=str(tiny.labels),
        bundles=paths,
        prompts=[{"path": str(tiny.prompts), "limit": 3}],
        temperatures=[0, 1],
        max_new_tokens=6,
        repeats=2,
        warmup=0,
        fixed_k=[2],
        progress=False,
    )["throughput"]
    assert set(greedy) == {"greedy", "T=1"}
    rows = {m["name"]: m for m in greedy["greedy"]["methods"]}
    h_star = rows[f"{h_star_label(bundle, greedy=True)} ({first})"]
    twin_row = rows[f"{h_star_label(bundle, greedy=True)} ({twin})"]
    assert list(rows)[:2] == ["Autoregressive", "FixedK k=2"] and len(rows) == 4
    assert 0 < rows["Autoregressive"]["generated"] == h_star["generated"] <= 2 * 3 * 6  # greedy: the same text
    for key in ("rounds", "generated", "target_calls", "mean_accepted"):
        assert h_star[key] == twin_row[key]
    assert h_star["ratio_to_autoregressive"] > 0 and len(greedy["greedy"]["prompts"]) == 3
    config = json.loads((twin / "config.json").read_text())
    config["draft"]["path"] = "elsewhere"
    (twin / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"was trained for draft .* pass bundles of the same target and draft"):
        label_modes.decode_throughput(paths, [{"path": str(tiny.prompts)}], PromptOptions(), [0], 4, 1, 0, [], 0, False)


def test_train_fit_on_feature_draft_rollout_labels(feature_setup: TinySetup, tmp_path) -> None:
    """A head for a feature draft trains on its rollout labels, and the end-of-fit stages (cost model, sweep, bundle
    export with its from_pretrained + generate check) run with the feature draft."""
    config = train_config(feature_setup, tmp_path, stages=True, trainer={"max_epochs": 1})
    cli = fit(config, tmp_path)
    assert cli.datamodule.rollout and cli.model.head.hidden_size == 32 and cli.trainer.global_step > 0
    assert (tmp_path / "bundle" / "head.safetensors").is_file() and cli.model.fit_report.threshold is not None


def test_train_fit_on_rollout_labels_with_scalar_inputs(tiny: TinySetup, tmp_path) -> None:
    """A head reading every input, as a correction of logit(q), trains on rollout labels end to end: it standardises
    the scalar inputs by the training candidates' statistics, the end-of-fit stages decode with it (cost model,
    sweep), and the exported bundle records its inputs, decodes chains and trees (the target's greedy text) and is
    scored by `eval label_modes` on the stored inputs — refusing a dataset without one of them."""
    from accept_head import SpecDecPP
    from accept_head.acceptance.metrics import acceptance_metrics
    from accept_head.evaluation import label_modes

    model = {"inputs": list(INPUTS), "residual_on": "logq"}
    cli = fit(train_config(tiny, tmp_path, stages=True, trainer={"max_epochs": 1}, model=model), tmp_path)
    head = cli.model.head
    dataset, meta = load_label_dataset(tiny.labels)
    assert meta["head_inputs"] == list(INPUTS) and head.inputs == INPUTS and cli.trainer.global_step > 0
    rows = [row for row in dataset if row["prompt_id"] in set(cli.datamodule.split["train"])]
    values = []  # the training candidates' inputs, recomputed from the dataset's columns
    for row in rows:
        path = 0.0
        for logp, entropy, top1, step in zip(row["draft_logp"], row["draft_entropy"], row["draft_top1"], row["step"]):
            path = logp if step == 1 else path + logp
            values.append([logp, entropy, top1, step, path])
    values = torch.tensor(values, dtype=torch.float64)
    torch.testing.assert_close(head.scalar_mean, values.mean(0).float())
    torch.testing.assert_close(head.scalar_std, values.std(0, unbiased=False).float())

    bundle = SpecDecPP.from_pretrained(tmp_path / "bundle")
    config = json.loads((tmp_path / "bundle" / "config.json").read_text())["head"]
    assert config == {"depth": 1, "hidden_size": 16, "inputs": list(INPUTS), "residual_on": "logq"}
    assert torch.equal(bundle.head.scalar_mean, head.scalar_mean.cpu())
    prompt = cli.datamodule.val_prompts(1)[0][1]
    reference = autoregressive_generate(bundle.target, prompt, 8, temperature=0)
    assert bundle.generate(prompt, max_new_tokens=8, temperature=0).sequences.tolist() == reference.sequences.tolist()
    # The same head drafts trees (each node's inputs: tests/test_tree_inputs.py), under the bundle's cost model.
    tree = bundle.generate(prompt, max_new_tokens=8, temperature=0, tree=True)
    assert tree.sequences.tolist() == reference.sequences.tolist()

    hidden, labels, inputs, _ = label_modes.held_out_states(str(tiny.labels))
    scores = label_modes.score(bundle, hidden, labels, inputs=inputs)
    with torch.no_grad():
        logits = bundle.head(hidden.float(), inputs)
    assert scores["raw"]["auc"] == pytest.approx(acceptance_metrics(logits, labels)["auc"], abs=1e-6)
    inputs[:, INPUTS.index("path_logq") - 1] = float("nan")  # a dataset without path_logq
    with pytest.raises(ValueError, match=r"The head reads \['path_logq'\] but the held-out dataset holds only"):
        label_modes.score(bundle, hidden, labels, inputs=inputs)


@pytest.fixture(scope="module")
def token_labels(tiny: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token-level (``label_mode: sample``) labels of the tiny pair."""
    output = tmp_path_factory.mktemp("token-labels") / "sample"
    return run_data_gen(tiny.data_gen_config(label_mode="sample", batch_size=8, max_new_tokens=6), output)


def test_a_head_reading_inputs_token_level_labels_lack_is_refused(
    tiny: TinySetup, token_labels: Path, tmp_path
) -> None:
    _, meta = load_label_dataset(token_labels)
    assert meta["head_inputs"] == ["hidden"]
    model = {"inputs": ["hidden", "logq", "depth"]}
    config = train_config(tiny, tmp_path, stages=False, data={"path": str(token_labels)}, model=model)
    missing = (
        r"The head reads \['logq', 'depth'\] but the token-level \('sample'\) label data .* holds only \['hidden'\]"
    )
    with pytest.raises(
        ValueError, match=missing + r": regenerate the labels with `python -m data_gen .*--label_mode rollout"
    ):
        fit(config, tmp_path)


def test_label_mode_scoring_refuses_token_mixing_labels(token_labels: Path) -> None:
    from accept_head.evaluation import label_modes

    with pytest.raises(ValueError, match="label_mode='sample' labels; scoring needs on-policy rollout labels"):
        label_modes.held_out_states(str(token_labels))


def test_train_fit_with_greedy_labels_fits_a_greedy_calibration(tiny: TinySetup, tmp_path) -> None:
    """``data.greedy_path`` (greedy rollout labels) gives the bundle a second calibration map for greedy decoding,
    fitted only on prompts the head did not train on; the bundle decodes greedily with it and samples with the
    other."""
    from accept_head import SpecDecPP
    from accept_head.acceptance.calibration import apply_calibration, choose_calibration
    from accept_head.acceptance.metrics import acceptance_metrics

    greedy = tmp_path / "greedy-labels"
    run_data_gen(rollout_config(tiny, temperature=0.0), greedy)  # the head's prompts, so the filter has work to do
    config = train_config(
        tiny, tmp_path, trainer={"max_epochs": 1}, data={"greedy_path": str(greedy)}, sweep={"greedy": True}
    )
    cli = fit(config, tmp_path)
    dm, report = cli.datamodule, cli.model.fit_report
    assert sorted(dm.split["greedy"]) == sorted(dm.split["val"])  # the training prompts are left out

    # Independent recomputation: the exported head's probabilities on those prompts' stored states and labels.
    dataset, meta = load_label_dataset(greedy)
    assert meta["label_transform"]["temperature"] == 0
    bundle = SpecDecPP.from_pretrained(tmp_path / "bundle")
    hidden = read_hidden(dataset, 16)
    # The prompts the closing comparison reports on are left out of calibration (they choose nothing).
    calibrated = set(dm.split["val"]) - set(report.calibration_excluded)
    assert report.calibration_excluded and calibrated
    held = [i for i, pid in enumerate(dataset["prompt_id"]) if pid in calibrated]
    states = torch.cat([hidden[i] for i in held]).float()
    labels = torch.tensor([x for i in held for x in dataset[i]["accept_prob"]])
    assert set(labels.tolist()) <= {0.0, 1.0}  # greedy verification accepts exactly the target's argmax
    groups = torch.cat([torch.full((len(hidden[i]),), rank) for rank, i in enumerate(held)])
    with torch.no_grad():
        logits = bundle.head(states).float()
    expected = choose_calibration(logits, labels, groups, ["temperature", "isotonic"], 2, 0)
    assert report.greedy_calibration_choice.chosen == expected.chosen
    for name, scores in expected.scores.items():
        assert report.greedy_calibration_choice.scores[name]["ece"] == pytest.approx(scores["ece"], abs=1e-4)

    assert bundle.greedy_calibration == report.greedy_calibration
    assert bundle.policy(greedy=True).calibration == bundle.greedy_calibration
    assert bundle.policy().calibration == bundle.calibration == report.calibration
    assert "with the greedy calibration" in report.greedy_threshold_selection
    assert "Greedy decoding uses a second map" in (tmp_path / "bundle" / "README.md").read_text()
    assert bundle.provenance["greedy_calibration"]["prompts"] == len(held)

    # `python -m eval label_modes` scores greedy labels with the greedy map.
    from accept_head.evaluation.label_modes import label_modes

    scored = label_modes(dataset=str(greedy), bundles=[str(tmp_path / "bundle")])["heads"][str(tmp_path / "bundle")]
    everything = torch.cat(hidden).float()
    all_labels = torch.tensor([x for row in dataset["accept_prob"] for x in row])
    with torch.no_grad():
        probs = torch.sigmoid(bundle.head(everything).float())
    mapped = apply_calibration(bundle.greedy_calibration, probs).clamp(1e-6, 1 - 1e-6)
    assert scored["calibrated"]["ece"] == pytest.approx(acceptance_metrics(torch.logit(mapped), all_labels)["ece"])
    other = apply_calibration(bundle.calibration, probs).clamp(1e-6, 1 - 1e-6)  # the sampling map, for comparison
    assert scored["other map"]["ece"] == pytest.approx(acceptance_metrics(torch.logit(other), all_labels)["ece"])


def test_greedy_path_must_hold_greedy_labels(tiny: TinySetup, tmp_path) -> None:
    config = train_config(tiny, tmp_path, stages=False, data={"greedy_path": str(tiny.labels)})
    with pytest.raises(ValueError, match=r"labels made at temperature 1\.0; greedy calibration needs data_gen"):
        fit(config, tmp_path)
