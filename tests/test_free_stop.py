"""The adaptive stop for learning-free decoders (accept_head/engine/free_stop.py) and its benchmark.

Greedy output with the stop must equal autoregressive greedy decoding for N-Grammys and Lookahead, at every
threshold, with and without the cost curve; sampled output must keep the target's distribution (χ², slow); the
recorded labels must equal the target's probabilities recomputed by plain forward passes; the features must match a
hand computation; the predictor must be calibrated on synthetic data with a known answer and survive a JSON round
trip; the stop rule and the engine's tree-cost pricing must match hand-worked cases; bad inputs must fail with clear
errors; ``python -m eval free_stop`` must run end to end on a tiny target and print its table. Tiny float32 Llamas
only, no network.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from stats_helpers import ALPHA, accept_first_guess, exact_joint, pair_p_values, sampled_tokens
from tiny_models import make_llama, make_tokenizer, near_bigram, small_vocab_llama

from accept_head import ModelBigram, autoregressive_generate, lookahead_generate, ngrammys_generate
from accept_head.core.costs import TreeCost
from accept_head.core.sampling import SamplingConfig, probabilities
from accept_head.engine.free_stop import (
    FEATURE_NAMES,
    AdaptiveRowStop,
    GuessFeatures,
    GuessLabels,
    GuessPredictor,
    LabelRecorder,
    choose_lengths,
    collect_labels,
    match_length,
)
from accept_head.engine.measure import measure_tree_costs
from accept_head.trees.verify import RowOrigin

PROMPTS = [[1, 12, 40, 41, 9, 12, 40, 41, 9, 12, 40], [2, 30, 31, 32, 30, 31, 32, 30, 31], [5, 7, 7, 7, 7, 8, 9, 7]]
TRAINING = [[3, 20, 21, 22, 20, 21, 22, 20], [4, 50, 51, 50, 51, 52, 50, 51], [6, 60, 61, 62, 63, 60, 61], [8, 9, 10]]
MAX_NEW = 40


def hand_predictor(bigram: ModelBigram | None, seed: int = 0) -> GuessPredictor:
    """A predictor with seeded random coefficients (no fitting): its predictions vary with the features."""
    generator = torch.Generator().manual_seed(seed)
    coef = (torch.randn(len(FEATURE_NAMES), generator=generator) * 1.5).tolist()
    return GuessPredictor(coef, 1.0, feature_config=GuessFeatures(bigram).config)


# ``targets`` (random, near_bigram) and their ``bigrams`` are conftest fixtures.


@pytest.fixture(scope="module")
def references(targets) -> dict[str, list[list[int]]]:
    return {
        name: [autoregressive_generate(model, p, MAX_NEW, temperature=0).sequences[0].tolist() for p in PROMPTS]
        for name, model in targets.items()
    }


DECODERS = {
    "ngrammys mixed k=6 w=5": lambda t, ids, b, stop, **kw: ngrammys_generate(
        t, ids, bigram=b, k=6, w=5, stop=stop, **kw
    ),
    "ngrammys model k=4 w=4": lambda t, ids, b, stop, **kw: ngrammys_generate(
        t, ids, bigram=b, k=4, w=4, strategy="model", stop=stop, **kw
    ),
    "ngrammys context k=3 w=6 q=1": lambda t, ids, b, stop, **kw: ngrammys_generate(
        t, ids, k=3, w=6, q=1, strategy="context", stop=stop, **kw
    ),
    "lookahead W=3 N=4 G=5": lambda t, ids, b, stop, **kw: lookahead_generate(
        t, ids, window=3, ngram=4, guess_set=5, context_ngrams=True, stop=stop, **kw
    ),
}


@pytest.fixture(scope="module")
def fitted(targets, bigrams) -> dict[str, GuessPredictor]:
    """A predictor per decoder, fitted on greedy labels of the near-bigram target on the training prompts."""
    target, bigram = targets["near_bigram"], bigrams["near_bigram"]
    out = {}
    for name, decode in DECODERS.items():
        labels = collect_labels(
            lambda ids, stop, decode=decode: decode(target, ids, bigram, stop, max_new_tokens=MAX_NEW, temperature=0),
            TRAINING,
            GuessFeatures(bigram),
        )
        out[name] = GuessPredictor.fit(labels)
    return out


CURVE = TreeCost([1, 8, 16], [1.0, 1.0, 3.0])
"""Flat up to 8 tokens fed, then 0.25 per token: the cost cap matters for wide trees."""


# ----------------------------------------------------------------------------------------------------------------
# Lossless: greedy output equals the target's; a recorder changes nothing


@pytest.mark.parametrize(
    "threshold,cost", [(0.5, None), (0.9, CURVE), (1.0, CURVE)], ids=["h=0.5", "h=0.9+cost", "h=1+cost"]
)
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_adaptive_greedy_equals_autoregressive(
    targets, bigrams, references, fitted, decoder: str, threshold: float, cost
) -> None:
    fed = {"static": 0, "adaptive": 0}
    for name, target in targets.items():
        bigram = bigrams[name]
        predictor = fitted[decoder] if name == "near_bigram" else hand_predictor(bigram)
        stop = AdaptiveRowStop(predictor, threshold, bigram, cost)
        for prompt, reference in zip(PROMPTS, references[name]):
            result = DECODERS[decoder](target, prompt, bigram, stop, max_new_tokens=MAX_NEW, temperature=0)
            assert result.sequences[0].tolist() == reference, (name, prompt)
            stats = result.stats
            assert stats.generated == MAX_NEW == stats.target_calls + sum(stats.accepted)
            static = DECODERS[decoder](target, prompt, bigram, None, max_new_tokens=MAX_NEW, temperature=0)
            fed["adaptive"] += sum(stats.fed) - stats.target_calls
            fed["static"] += sum(static.stats.fed) - static.stats.target_calls
    if threshold < 1 or cost is not None:
        assert fed["adaptive"] < fed["static"], fed  # the stop did cut guesses


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_a_label_recorder_leaves_decoding_unchanged(targets, bigrams, decoder: str) -> None:
    target, bigram = targets["near_bigram"], bigrams["near_bigram"]
    for prompt in PROMPTS:
        plain = DECODERS[decoder](target, prompt, bigram, None, max_new_tokens=20, temperature=0)
        recorder = KeepingRecorder(GuessFeatures(bigram))
        recorded = DECODERS[decoder](target, prompt, bigram, recorder, max_new_tokens=20, temperature=0)
        assert torch.equal(plain.sequences, recorded.sequences)
        assert plain.stats.fed == recorded.stats.fed and plain.stats.accepted == recorded.stats.accepted
        guessed = sum(len(row) for _, rows in recorder.passes for row in rows)
        assert len(recorder.labels()) == guessed
        if decoder.startswith("ngrammys"):  # every fed token but the root is a guess
            assert guessed == sum(plain.stats.fed) - plain.stats.target_calls


# ----------------------------------------------------------------------------------------------------------------
# Labels: equal to the target's probabilities recomputed by plain forward passes


class KeepingRecorder(LabelRecorder):
    """A recorder that also keeps each pass's text and rows, for the independent recomputation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[list[int], list[list[int]]]] = []

    def observe(self, tokens, rows, origins, nodes, logits) -> None:
        super().observe(tokens, rows, origins, nodes, logits)
        if rows:
            self.passes.append((list(tokens), [list(row) for row in rows]))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T=1"])
@pytest.mark.parametrize("decoder", ["ngrammys mixed k=6 w=5", "lookahead W=3 N=4 G=5"])
@torch.inference_mode()
def test_labels_equal_an_independent_recomputation(targets, bigrams, decoder: str, temperature: float) -> None:
    target, bigram = targets["near_bigram"], bigrams["near_bigram"]
    recorder = KeepingRecorder(GuessFeatures(bigram), temperature)
    generator = torch.Generator().manual_seed(0)
    DECODERS[decoder](
        target, PROMPTS[0], bigram, recorder, max_new_tokens=16, temperature=temperature, generator=generator
    )
    labels = recorder.labels()
    expected, depth, prefix = [], [], []
    for tokens, rows in recorder.passes:
        for row in rows:
            survival = 1.0
            for d, token in enumerate(row, 1):
                logits = target(input_ids=torch.tensor([tokens + row[: d - 1]])).logits[0, -1]
                p = float(probabilities(logits[None], SamplingConfig(temperature))[0, token])
                expected.append(p)
                depth.append(d)
                prefix.append(survival)
                survival *= p
    assert len(expected) == len(labels) > 5
    np.testing.assert_allclose(labels.labels, expected, atol=1e-5)
    np.testing.assert_allclose(labels.prefix, prefix, atol=1e-5)
    assert labels.depth.tolist() == depth
    if temperature == 0:
        assert set(labels.labels.tolist()) == {0.0, 1.0}  # greedy: accepted or not
        assert 0 < labels.labels.mean() < 1


def test_features_match_a_hand_computation() -> None:
    """Text 5 6 7 5 6 8 5 6; a bigram table where t is followed by t+1, t+2, t+3 (ranks 0, 1, 2)."""
    table = torch.tensor([[(t + 1) % 10, (t + 2) % 10, (t + 3) % 10] for t in range(10)])
    bigram = ModelBigram(table, "hand")
    tokens = [5, 6, 7, 5, 6, 8, 5, 6]
    assert match_length(tokens, 5) == 2 and match_length(tokens, 2) == 2 and match_length(tokens, 3) == 0
    features = GuessFeatures(bigram, q=2)
    features.start(tokens)
    rows = [[8, 5], [8, 9], [7]]
    origins = [RowOrigin("context", 0, 5), RowOrigin("model", 1), RowOrigin("pool", 5)]
    assert rows[1] == bigram.rows(6, 2, 2)[1]
    log1, log2 = np.log1p(1) / np.log1p(255), np.log1p(2) / np.log1p(255)
    # (6, 5 6) was followed by 8 (most recent) and 7; (6, 8) by 5.
    expected = [
        {"context:depth=1": 1, "rank=0": 1, "match=2": 1, "bigram_rank=1": 1}
        | {"ngram_seen": 1, "ngram_agree_frac": 0.5, "ngram_agree_last": 1, "ngram_log_count": log2},
        {"context:depth=2": 1, "rank=0": 1, "match=2": 1, "bigram_absent": 1}
        | {
            "ngram_seen": 1,
            "ngram_agree_frac": 1,
            "ngram_agree_last": 1,
            "ngram_log_count": log1,
            "prev_ngram_agree": 1,
        },
        {"model:depth=1": 1, "rank=1": 1, "bigram_rank=1": 1}
        | {"ngram_seen": 1, "ngram_agree_frac": 0.5, "ngram_agree_last": 1, "ngram_log_count": log2},
        {"model:depth=2": 1, "rank=1": 1, "bigram_rank=0": 1}
        | {"ngram_seen": 1, "ngram_agree_frac": 0, "ngram_log_count": log1, "prev_ngram_agree": 1},
        {"pool:depth=1": 1, "rank=4+": 1, "bigram_rank=0": 1}
        | {"ngram_seen": 1, "ngram_agree_frac": 0.5, "ngram_log_count": log2},
    ]
    got = features(tokens, rows, origins)
    assert got.shape == (5, len(FEATURE_NAMES))
    for row, want in zip(got, expected):
        dense = np.zeros(len(FEATURE_NAMES))
        for name, value in want.items():
            dense[FEATURE_NAMES.index(name)] = value
        np.testing.assert_allclose(row, dense, atol=1e-6)
    # Without a table every token reads bigram_unknown; the previous token's top-1 flag follows the chain.
    plain = GuessFeatures(None, q=2)
    plain.start(tokens)
    assert plain(tokens, rows, origins)[:, FEATURE_NAMES.index("bigram_unknown")].tolist() == [1] * 5
    chain = features(tokens, [[7, 8, 9]], [RowOrigin("model", 0)])
    assert chain[:, FEATURE_NAMES.index("prev_bigram_top1")].tolist() == [0, 1, 1]


# ----------------------------------------------------------------------------------------------------------------
# The predictor: calibrated on synthetic data, JSON round trip


def synthetic(
    n: int, seed: int, link=lambda z: 1 / (1 + np.exp(-z)), soft: bool = False
) -> tuple[GuessLabels, np.ndarray]:
    """Guessed tokens with 12 random binary features and P(accepted) = link(x·w + b) for a fixed w, b."""
    rng = np.random.default_rng(seed)
    columns = np.random.default_rng(123).choice(len(FEATURE_NAMES), 12, replace=False)
    weights = np.random.default_rng(7).normal(0, 1.2, 12)
    x = np.zeros((n, len(FEATURE_NAMES)), np.float32)
    x[:, columns] = rng.integers(0, 2, (n, 12))
    p = link(x[:, columns] @ weights - 0.3)
    labels = p if soft else (rng.random(n) < p).astype(np.float64)
    groups = rng.integers(0, 20, n)
    return GuessLabels(x, labels, groups, np.ones(n, np.int64), np.ones(n)), p


@pytest.mark.parametrize(
    "link,soft",
    [
        (lambda z: 1 / (1 + np.exp(-z)), False),  # the model's own family
        (lambda z: 1 / (1 + np.exp(-z)) ** 2, False),  # a monotone distortion the calibration map must absorb
        (lambda z: 1 / (1 + np.exp(-z)), True),  # soft labels (temperature > 0)
    ],
    ids=["logistic", "distorted", "soft"],
)
def test_predictor_is_calibrated_on_synthetic_data(link, soft: bool) -> None:
    from accept_head.acceptance.metrics import expected_calibration_error

    train, _ = synthetic(8000, 0, link, soft)
    test, truth = synthetic(8000, 1, link)
    predictor = GuessPredictor.fit(train, seed=0)
    predicted = predictor.predict(test.features)
    assert np.abs(predicted - truth).mean() < 0.03
    assert expected_calibration_error(torch.from_numpy(predicted), torch.from_numpy(test.labels)) < 0.03
    assert predictor.provenance["out_of_fold"] and predictor.provenance["prompts"] == 20
    report = predictor.evaluate(test)
    assert report["n"] == 8000 and abs(report["mean_pred"] - report["mean_label"]) < 0.02 and report["auc"] > 0.7


def test_predictor_save_load_round_trip(tmp_path, bigrams) -> None:
    train, _ = synthetic(2000, 0, lambda z: 1 / (1 + np.exp(-z)) ** 2)
    train.feature_config = GuessFeatures(bigrams["random"], q=3).config
    predictor = GuessPredictor.fit(train)
    path = predictor.save(tmp_path / "predictor.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "accept_head.free_stop.predictor/1" and list(raw) == sorted(raw)
    loaded = GuessPredictor.load(path)
    assert loaded.to_dict() == predictor.to_dict()
    np.testing.assert_array_equal(loaded.predict(train.features), predictor.predict(train.features))
    assert loaded.features_for(bigrams["random"]).q == 3


# ----------------------------------------------------------------------------------------------------------------
# The stop rule as a pure function

ROWS = [[1, 2, 3], [4, 5], [1, 2, 9]]
ACCEPT = [0.9, 0.8, 0.5, 0.3, 0.9, 0.9, 0.8, 0.6]
# Survival: row 0: .9 .72 .36; row 1: .3 .27; row 2: .9 .72 .432 (its first two tokens repeat row 0's prefix).


def test_choose_lengths_by_hand() -> None:
    assert choose_lengths(ROWS, ACCEPT, threshold=0.7) == [3, 1, 3]  # keep survival >= 0.3
    assert choose_lengths(ROWS, ACCEPT, threshold=0.5) == [2, 0, 0]  # row 2 = row 0's prefix: dropped
    assert choose_lengths(ROWS, ACCEPT, threshold=1.0) == [3, 2, 3]
    assert choose_lengths(ROWS, ACCEPT, threshold=0.0) == [0, 0, 0]
    # Cost: flat up to 4 tokens fed, then +0.25 per token. Taken by survival (.9 .9 .72 .72 .432 .36 .3 .27), the
    # rate (1 + value) / cost peaks at 3 tokens (2.62 / 1.0); the kept [1] of row 2 is row 0's prefix.
    assert choose_lengths(ROWS, ACCEPT, threshold=1.0, cost=TreeCost([1, 4, 8], [1.0, 1.0, 2.0])) == [2, 0, 0]
    # A flat curve takes everything; a steep one nothing.
    assert choose_lengths(ROWS, ACCEPT, 1.0, TreeCost([1, 100], [1.0, 1.0])) == [3, 2, 3]
    assert choose_lengths(ROWS, ACCEPT, 1.0, TreeCost([1, 2], [1.0, 10.0])) == [0, 0, 0]
    # Lookahead feeds its window too: with 4 tokens already fed the flat part is used up.
    assert choose_lengths(ROWS, ACCEPT, 1.0, TreeCost([1, 4, 8], [1.0, 1.0, 2.0]), fed=4) == [1, 0, 0]


def test_tree_cost_curve() -> None:
    curve = TreeCost([1, 4, 8], [1.0, 1.0, 2.0])
    assert [curve(n) for n in (0, 1, 3, 4, 6, 8, 12)] == [1.0, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0]
    assert TreeCost.from_dict(curve.to_dict()) == curve
    assert TreeCost([2], [0.5])(40) == 0.5


def test_the_engine_prices_each_target_call_at_the_tokens_it_fed() -> None:
    """``aggregate`` under a TreeCost (how ``eval free_stop`` models tokens/s): Σ cost(fed) + draft_time per run."""
    from accept_head.chain.decoding import DecodeStats
    from accept_head.engine.runner import aggregate
    from accept_head.trees.verify import TreeDecodeStats

    tree = TreeDecodeStats(generated=6, target_calls=2, draft_time=0.5, fed=[1, 16])  # 1 + 3 + 0.5 seconds
    assert aggregate("tree", [tree, tree], CURVE).modeled_tokens_per_second == pytest.approx(12 / 9)
    assert aggregate("target alone", [DecodeStats(generated=3, target_calls=3)], CURVE).modeled_tokens_per_second == 1
    speculative = DecodeStats(generated=5, target_calls=2, proposed=[3, 7])  # fed 4 and 8: 1 + 1 seconds
    assert aggregate("speculative", [speculative], CURVE).modeled_tokens_per_second == pytest.approx(2.5)


@torch.inference_mode()
def test_measure_tree_costs_times_each_size(targets) -> None:
    curve = measure_tree_costs(targets["random"], sizes=(4, 1, 4), context=8, repeats=1, warmup=0)
    assert curve.sizes == [1, 4] and 0 < curve.seconds[0] <= curve.seconds[1]  # sorted, deduplicated, never falling


# ----------------------------------------------------------------------------------------------------------------
# Sampling keeps the target's distribution (χ² as in test_learning_free.py)

NEW_TOKENS, SAMPLES = 4, 1500
SMALL_PROMPT = [0, 3, 5, 0, 3, 5, 0]


def adaptive_sampled_tokens(samples: int) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``samples`` seeded runs of N-Grammys at T = 1 under an :class:`AdaptiveRowStop`: the tokens (samples, 4),
    the share of runs that accepted a guess, and the exact joint (V,)*4 of the target's first four tokens."""
    model = small_vocab_llama(seed=0)
    joint = exact_joint(model, SMALL_PROMPT, NEW_TOKENS)
    bigram = ModelBigram.build(model, top=3)
    stop = AdaptiveRowStop(hand_predictor(bigram, seed=3), 0.8, bigram)
    tokens, hit_rate = sampled_tokens(
        lambda generator: ngrammys_generate(
            model, SMALL_PROMPT, NEW_TOKENS, 1.0, generator=generator, k=3, w=3, q=1, bigram=bigram, stop=stop
        ),
        samples,
        len(SMALL_PROMPT),
    )
    return tokens, hit_rate, joint


@pytest.mark.slow
@torch.inference_mode()
def test_adaptive_sampling_keeps_the_target_distribution() -> None:
    tokens, hit_rate, joint = adaptive_sampled_tokens(SAMPLES)
    assert hit_rate > 0.1
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA
    assert p_second > ALPHA


@pytest.mark.slow
@torch.inference_mode()
def test_broken_verification_under_adaptive_stop_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check with a verifier that accepts the first selected guess unconditionally must fail."""
    monkeypatch.setattr("accept_head.learning_free.ngrammys.verify_sampled", accept_first_guess)
    tokens, _, joint = adaptive_sampled_tokens(300)
    assert max(pair_p_values(tokens, joint)) < 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_fail_with_clear_errors(tmp_path, targets, bigrams) -> None:
    bigram = bigrams["random"]
    predictor = hand_predictor(bigram)
    for threshold in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="threshold=.* must be a number in \\[0, 1\\]"):
            AdaptiveRowStop(predictor, threshold, bigram)
    with pytest.raises(ValueError, match="cost must be a TreeCost"):
        AdaptiveRowStop(predictor, 0.5, bigram, cost=0.03)
    with pytest.raises(ValueError, match="fitted with model-bigram features: pass the same table"):
        AdaptiveRowStop(predictor, 0.5, None)
    for other in (
        ModelBigram(bigram.next_tokens, "another"),
        ModelBigram(bigram.next_tokens[:, :5], bigram.fingerprint),
    ):
        with pytest.raises(ValueError, match="bigram table of model .* not this one"):
            AdaptiveRowStop(predictor, 0.5, other)
    with pytest.raises(ValueError, match="fitted without model-bigram features"):
        AdaptiveRowStop(hand_predictor(None), 0.5, bigram)
    with pytest.raises(ValueError, match="coef has 3 entries"):
        GuessPredictor([0.0] * 3, 0.0)
    with pytest.raises(ValueError, match="q=0 must be an integer >= 1"):
        GuessFeatures(bigram, q=0)
    with pytest.raises(ValueError, match="row source 'draft' has no features"):
        GuessFeatures(bigram)([1, 2], [[3]], [RowOrigin("draft", 0)])
    # Fitting needs accepted and rejected guesses.
    empty = GuessLabels.empty()
    with pytest.raises(ValueError, match="no guessed tokens to fit on"):
        GuessPredictor.fit(empty)
    zeros, _ = synthetic(50, 0)
    zeros.labels[:] = 0
    with pytest.raises(ValueError, match="all 50 labels are 0"):
        GuessPredictor.fit(zeros)
    with pytest.raises(ValueError, match=r"features \(3, .*\) must be \(2,"):
        GuessLabels(np.zeros((3, len(FEATURE_NAMES))), np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2))
    # Files: missing, not a predictor, other features, missing keys.
    with pytest.raises(FileNotFoundError, match="no guess predictor at"):
        GuessPredictor.load(tmp_path / "missing.json")
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "something/1"}))
    with pytest.raises(ValueError, match="is not a guess predictor"):
        GuessPredictor.load(path)
    raw = predictor.to_dict()
    path.write_text(json.dumps(raw | {"feature_names": raw["feature_names"][:-1]}))
    with pytest.raises(ValueError, match="fitted on other features.*refit"):
        GuessPredictor.load(path)
    path.write_text(json.dumps({"format": raw["format"], "coef": raw["coef"]}))
    with pytest.raises(ValueError, match=r"lacks \['feature_names', 'intercept'\]"):
        GuessPredictor.load(path)
    # The cost curve and the pure stop rule.
    with pytest.raises(ValueError, match="strictly increasing"):
        TreeCost([4, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="must all be > 0"):
        TreeCost([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="3 acceptance values for 8 guessed tokens"):
        choose_lengths(ROWS, [0.5] * 3, 0.5)

    # A stop that returns lengths the decoder cannot use is refused, naming it.
    class Broken(LabelRecorder):
        def select(self, tokens, rows, origins, fed):
            return [len(row) + 1 for row in rows]

    with pytest.raises(ValueError, match="Broken.select returned lengths .* one length in \\[0, len\\(row\\)\\]"):
        ngrammys_generate(targets["random"], PROMPTS[0], 8, 0, bigram=bigram, k=2, w=2, stop=Broken(GuessFeatures()))


# ----------------------------------------------------------------------------------------------------------------
# The benchmark end to end on a tiny target


def test_free_stop_command_prints_its_table(tmp_path, capsys) -> None:
    import yaml

    from eval.__main__ import main

    tokenizer = make_tokenizer()
    folder = tmp_path / "target"
    target = near_bigram(make_llama(tokenizer=tokenizer, seed=0))
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    words = "write a short poem about the number two and the number three and the number two".split()
    for name, lead, count in (("test", "explain", 3), ("val", "give me", 2), ("train", "please", 4)):
        with (tmp_path / f"{name}.jsonl").open("w") as f:
            for i in range(count):
                f.write(json.dumps({"instruction": f"{lead} {' '.join(words[i:] + words[:i])}"}) + "\n")
    out = tmp_path / "out"
    config = {
        "target": {"path": str(folder), "dtype": "float32"},
        "prompts": [{"path": str(tmp_path / "test.jsonl")}],
        "validation_prompts": [{"path": str(tmp_path / "val.jsonl")}],
        "training_prompts": [{"path": str(tmp_path / "train.jsonl")}],
        "ngrammys_settings": [{"k": 2, "w": 2}, {"k": 3, "w": 3}],
        "ngrammys_pool": {"k": 4, "w": 4},
        "lookahead_settings": [{"window": 2, "ngram": 3, "guess_set": 2}],
        "lookahead_pool": {"window": 2, "ngram": 4, "guess_set": 4, "context_ngrams": True},
        "thresholds": [0.7, 1.0],
        "max_new_tokens": 12,
        "repeats": 2,
        "tree_cost_sizes": [1, 8, 16],
        "cost_repeats": 1,
        "bigram_top": 8,
        "bigram_cache": str(tmp_path / "bigram"),
        "output_dir": str(out),
    }
    (tmp_path / "free_stop.yaml").write_text(yaml.safe_dump(config))
    main(["free_stop", "--config", str(tmp_path / "free_stop.yaml")])
    printed = capsys.readouterr().out
    assert "tok/call" in printed and "vs static" in printed and "autoregressive" in printed
    assert "+ stop h=" in printed and "N-Grammys k=" in printed and "Lookahead W=" in printed
    stored = json.loads((out / "free_stop.json").read_text())
    rows = stored["results"]["greedy"]["methods"]
    assert [(r["decoder"], r["adaptive"]) for r in rows] == [("autoregressive", False)] + [
        (d, a) for d in ("ngrammys", "lookahead") for a in (False, True)
    ]
    for decoder in ("ngrammys", "lookahead"):
        chosen = stored["results"]["greedy"]["decoders"][decoder]
        assert GuessPredictor.load(chosen["predictor"]).provenance["labels"] == chosen["training_labels"] > 0
        assert len(chosen["validation"]) == len(config[f"{decoder}_settings"]) + 2 * 2  # statics + h x cost cap
    assert stored["tree_cost"]["sizes"][-1] >= 1 + 4 * 4
    # A second run reads the curve the first wrote instead of measuring it.
    config |= {"tree_costs": str(out / "tree_costs.json"), "decoders": ["ngrammys"], "output_dir": str(tmp_path / "o2")}
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(config))
    main(["free_stop", "--config", str(tmp_path / "again.yaml")])
    assert json.loads((tmp_path / "o2" / "free_stop.json").read_text())["tree_cost"]["source"].endswith("json")
