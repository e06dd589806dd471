"""The Drafter interface and the feature draft (EAGLE-style, reading the target's final hidden states).

* Greedy speculative decoding through a :class:`FeatureDraft` or a pruned-vocabulary :class:`ModelDrafter` returns
  exactly the target's greedy continuation (1-token prompts included).
* At temperature 1 the output follows the target's exact distribution — also for tokens outside the pruned draft
  vocabulary, which the draft never proposes — checked by χ² against probabilities enumerated from the target, with
  broken verifiers as negative controls.
* After every round the drafter receives the target's final hidden states of exactly the accepted positions
  (compared with one full forward pass over the final sequence).
* Bad inputs (another target, a foreign vocabulary map, another width, corrupt folders, a head of another width)
  raise errors that name the value or file; a draft folder round-trips through ``save_pretrained`` / ``load_model``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from stats_helpers import ALPHA, accept_every_candidate, exact_joint, pair_p_values
from tiny_models import (
    distilled_feature_draft,
    draft_vocabulary,
    make_llama,
    make_tokenizer,
    perturbed_copy,
    save_bundle,
)

import accept_head.chain.decoding as decoding
from accept_head import AcceptanceHead, FixedK, HeadThreshold, autoregressive_generate, load_model, speculative_generate
from accept_head.chain.decoding import verify as correct_verify
from accept_head.chain.decoding import verify_argmax as correct_verify_argmax
from accept_head.core.sampling import sample
from accept_head.models.drafters import ModelDrafter
from accept_head.models.feature_draft import FeatureDraft, FeatureDrafter, Int8Linear, model_fingerprint
from accept_head.models.features import lm_head_input
from accept_head.models.quantized_linear import Int4Linear

# --- tiny models ----------------------------------------------------------------------------------------------------


def small_llama(seed: int, vocab: int = 8, hidden: int = 16, layers: int = 2):
    """A random float32 Llama over a vocabulary of ``vocab`` (small enough to enumerate its joint distribution)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def silence_layers(layers) -> None:
    """Zero every decoder layer's output projections: each layer becomes the identity on its residual stream."""
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def bigram_target(seed: int = 2):
    """A make_llama target whose layers are the identity: its final hidden state at t is norm(emb(x_t))."""
    target = make_llama(seed=seed)
    silence_layers(target.model.layers)
    return target


def exact_feature_draft(target, kept_ids: torch.Tensor) -> FeatureDraft:
    """For a :func:`bigram_target`: fc([f_t; e_{t+1}]) = e_{t+1} and an identity layer, so f̂_{t+1} = f_{t+1} exactly
    and q equals p on ``kept_ids`` — the draft's candidate is accepted whenever the target's token is kept."""
    draft = FeatureDraft.from_target(target, kept_ids)
    d = target.config.hidden_size
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], dim=1))
        draft.fc.bias.zero_()
    silence_layers(draft.decoder.layers)
    return draft


def random_kept(vocab: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


@pytest.fixture(scope="module")
def llama():
    return make_llama(seed=0)


@pytest.fixture(scope="module")
def kept(llama) -> torch.Tensor:
    return random_kept(llama.config.vocab_size, llama.config.vocab_size // 2, seed=0)


# --- 1. greedy equality ---------------------------------------------------------------------------------------------

GREEDY_PROMPTS = [[2], [2, 12, 40, 9], [5, 30, 31, 40, 8, 9, 20, 11, 50]]
GREEDY_NEW = 16


LEFT_OUT = 6
"""Tokens the target writes on GREEDY_PROMPTS that each greedy setting's draft vocabulary leaves out."""
MIN_ACCEPTED_SHARE = {"feature": 0.3, "feature-exact": 0.3, "model-pruned": 0.1}
"""Least share of proposed candidates each setting must get accepted (measured over k = 1, 3, 5: feature 0.63-0.80,
feature-exact 0.36-0.53, model-pruned — a perturbed copy — 0.18-0.44)."""


def greedy_texts(target) -> list[list[int]]:
    return [autoregressive_generate(target, p, GREEDY_NEW, temperature=0).sequences[0].tolist() for p in GREEDY_PROMPTS]


def written_kept(target, texts: list[list[int]]) -> torch.Tensor:
    """The draft vocabulary of a greedy setting: a random half plus the tokens the target writes on GREEDY_PROMPTS
    but the LEFT_OUT it writes least often (:func:`tiny_models.draft_vocabulary`)."""
    written = [t for text, prompt in zip(texts, GREEDY_PROMPTS) for t in text[len(prompt) :]]
    return draft_vocabulary(target.config.vocab_size, written, LEFT_OUT)


@pytest.fixture(scope="module")
def greedy_settings(llama) -> dict:
    """name → (target, a factory of drafts, the draft vocabulary). ``feature`` is distilled on the target's greedy
    text (it reads the target's features through every part of ``fc``); ``feature-exact`` copies a bigram target
    exactly on its kept tokens (its ``fc`` reads only the token); ``model-pruned`` is a perturbed copy."""
    bigram = bigram_target()
    texts = greedy_texts(llama)
    kept = written_kept(llama, texts)
    kept_bigram = written_kept(bigram, greedy_texts(bigram))
    distilled = distilled_feature_draft(llama, kept, texts, steps=100)
    return {
        "feature": (llama, lambda: distilled, kept),
        "feature-exact": (bigram, lambda: exact_feature_draft(bigram, kept_bigram), kept_bigram),
        "model-pruned": (llama, lambda: ModelDrafter(perturbed_copy(llama, 0.1), kept_ids=kept), kept),
    }


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("setting", ["feature", "feature-exact", "model-pruned"])
def test_greedy_speculative_equals_autoregressive(greedy_settings, setting, k) -> None:
    target, make_draft, kept = greedy_settings[setting]
    draft = make_draft()
    accepted, proposed, full_rounds, outside_kept = 0, 0, 0, 0
    for prompt in GREEDY_PROMPTS:
        expected = autoregressive_generate(target, prompt, GREEDY_NEW, temperature=0).sequences
        result = speculative_generate(target, draft, prompt, FixedK(k), GREEDY_NEW, temperature=0)
        assert torch.equal(result.sequences, expected), (prompt, result.sequences, expected)
        assert result.stats.generated == GREEDY_NEW
        accepted += sum(result.stats.accepted)
        proposed += sum(result.stats.proposed)
        full_rounds += sum(n > 1 and m == n for n, m in zip(result.stats.proposed, result.stats.accepted))
        generated = expected[0, len(prompt) :].tolist()
        outside_kept += sum(t not in kept.tolist() for t in generated)
        if setting == "feature-exact":  # q = p on kept: a round accepts exactly the run of kept target tokens
            position = 0
            for n, m in zip(result.stats.proposed, result.stats.accepted):
                window = generated[position : position + n]
                assert m == next((i for i, t in enumerate(window) if t not in kept.tolist()), n)
                position += m + 1
    assert outside_kept > 0  # the target writes tokens the pruned draft can never propose: rejections happen
    # The accept path ran, not only the rejection path: many candidates accepted, and whole multi-candidate rounds.
    assert accepted >= MIN_ACCEPTED_SHARE[setting] * proposed, (accepted, proposed)
    assert accepted < proposed
    if k > 1:
        assert full_rounds > 0


def argmax_bonus_from_the_last_candidates_position(logits, candidates):
    """The greedy verifier broken the same way: after a fully accepted round the bonus token is the target's argmax
    at the last candidate's row instead of the row after it."""
    m, token = correct_verify_argmax(logits, candidates)
    k = len(candidates)
    if m == k > 0:
        token = int(logits[k - 1].float().argmax())
    return m, token


@pytest.mark.parametrize("setting", ["feature", "feature-exact"])
def test_greedy_check_catches_a_broken_accept_path(greedy_settings, monkeypatch, setting) -> None:
    """The greedy equality check fails with a verifier that is wrong only after a fully accepted round — which a
    draft that never gets its candidates accepted cannot reveal. Greedy chain rounds verify from the argmax
    (``verify_argmax``): that is the verifier broken here."""
    target, make_draft, _ = greedy_settings[setting]
    monkeypatch.setattr(decoding, "verify_argmax", argmax_bonus_from_the_last_candidates_position)
    mismatches = 0
    for prompt in GREEDY_PROMPTS:
        expected = autoregressive_generate(target, prompt, GREEDY_NEW, temperature=0).sequences
        result = speculative_generate(target, make_draft(), prompt, FixedK(3), GREEDY_NEW, temperature=0)
        mismatches += not torch.equal(result.sequences, expected)
    assert mismatches > 0


def test_greedy_with_head_threshold_on_feature_draft(llama, kept) -> None:
    """An acceptance head reads the feature draft's predicted features (width d) and varies K per round."""
    head = AcceptanceHead(llama.config.hidden_size, depth=1)
    draft = FeatureDraft.from_target(llama, kept)
    for prompt in GREEDY_PROMPTS:
        expected = autoregressive_generate(llama, prompt, GREEDY_NEW, temperature=0).sequences
        result = speculative_generate(llama, draft, prompt, HeadThreshold(head, 0.5), GREEDY_NEW, temperature=0)
        assert torch.equal(result.sequences, expected)


# --- 2. the exact target distribution at temperature 1 --------------------------------------------------------------

VOCAB = 8
PROMPT = [0, 3, 5]
NEW_TOKENS = 4
SAMPLES = 2000
CONTROL_SAMPLES = 400
Z_LIMIT = 4.5
"""Binomial z-score bound on the frequency of tokens outside the draft vocabulary (seeds fixed: deterministic)."""


@pytest.fixture(scope="module")
def chi2_setup() -> tuple:
    """A target, its exact joint distribution of 4 tokens, and a draft vocabulary that leaves out the two likeliest
    first tokens (so a large share of the output must come from outside the draft vocabulary)."""
    target = small_llama(seed=3)
    joint = exact_joint(target, PROMPT, NEW_TOKENS)
    outside = joint.sum(dim=(1, 2, 3)).argsort(descending=True)[:2].tolist()
    kept = torch.tensor([t for t in range(VOCAB) if t not in outside])
    return target, joint, kept


def chi2_drafter(name: str, target, kept: torch.Tensor):
    if name.startswith("feature"):  # feature-int8: the same draft decoding with int8 weights
        draft = FeatureDraft.from_target(target, kept)
        return draft.quantize_("int8") if name == "feature-int8" else draft
    return ModelDrafter(perturbed_copy(target, 0.5, seed=1), kept_ids=kept)


def sample_outputs(target, draft, samples: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    rows = [
        speculative_generate(target, draft, PROMPT, FixedK(3), NEW_TOKENS, generator=generator).sequences[0]
        for _ in range(samples)
    ]
    return torch.stack(rows)[:, len(PROMPT) :]


def outside_z_scores(tokens: torch.Tensor, joint: torch.Tensor, kept: torch.Tensor) -> list[float]:
    """Per generated position: (observed − exact) frequency of tokens outside ``kept``, in binomial std units."""
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[kept] = False
    scores = []
    for position in range(NEW_TOKENS):
        others = tuple(d for d in range(NEW_TOKENS) if d != position)
        p = float(joint.sum(dim=others)[outside].sum())
        assert p > 0.1  # the target really puts mass outside the draft vocabulary
        observed = float(outside[tokens[:, position]].double().mean())
        scores.append((observed - p) / math.sqrt(p * (1 - p) / tokens.shape[0]))
    return scores


@pytest.mark.parametrize("drafter", ["feature", "feature-int8", "model-pruned"])
def test_sampling_matches_exact_target_distribution_with_pruned_vocabulary(chi2_setup, monkeypatch, drafter) -> None:
    target, joint, kept = chi2_setup
    rounds: list[tuple[list[int], int]] = []

    def recording_verify(p, q, candidates, generator):
        m, token = correct_verify(p, q, candidates, generator)
        rounds.append((candidates.tolist(), m))
        return m, token

    monkeypatch.setattr(decoding, "verify", recording_verify)
    # The int8 draft only moves q, which the verifier reads as it reads any draft's: a quarter of the samples.
    tokens = sample_outputs(target, chi2_drafter(drafter, target, kept), SAMPLES // 4 if "int8" in drafter else SAMPLES)
    p_values = pair_p_values(tokens, joint)
    assert min(p_values) > ALPHA, p_values
    z = outside_z_scores(tokens, joint, kept)
    assert max(abs(s) for s in z) < Z_LIMIT, z
    # Both paths of the verifier ran, and the draft never proposed a token outside its vocabulary.
    assert any(m > 0 for _, m in rounds) and any(m < len(c) for c, m in rounds)
    assert {t for c, _ in rounds for t in c} <= set(kept.tolist())


def residual_within_draft_vocabulary(p, q, candidates, generator):
    """A broken verifier for pruned drafts: right acceptance test, but the residual only covers tokens with q > 0."""
    m, token = correct_verify(p, q, candidates, generator)
    if m == candidates.shape[0]:
        return m, token
    residual = (p[m] - q[m]).clamp(min=0) * (q[m] > 0)
    residual = residual if residual.sum() > 0 else q[m]
    return m, int(sample((residual / residual.sum())[None], generator)[0])


@pytest.mark.parametrize("drafter", ["feature", "model-pruned"])
def test_distribution_checks_reject_broken_verifiers(chi2_setup, monkeypatch, drafter) -> None:
    target, joint, kept = chi2_setup
    draft = chi2_drafter(drafter, target, kept)
    monkeypatch.setattr(decoding, "verify", accept_every_candidate)
    assert min(pair_p_values(sample_outputs(target, draft, CONTROL_SAMPLES), joint)) < 1e-6
    monkeypatch.setattr(decoding, "verify", residual_within_draft_vocabulary)
    tokens = sample_outputs(target, draft, CONTROL_SAMPLES)
    assert max(abs(s) for s in outside_z_scores(tokens, joint, kept)) > 3 * Z_LIMIT


# --- 3. the drafter receives the target's features of exactly the accepted positions ------------------------------


class RecordingDrafter(FeatureDrafter):
    """Records what the decoder hands the drafter, and the logits of each round's first candidate together with the
    length of the sequence known when it was drafted."""

    def start(self, prompt, features) -> None:
        self.starts = [(list(prompt), features.clone())]
        self.commits: list[tuple[list[int], torch.Tensor]] = []
        self.first_steps: list[tuple[int, torch.Tensor]] = []
        self.known = len(prompt)
        super().start(prompt, features)

    def propose(self, token):
        step = super().propose(token)
        if token is None and step is not None:
            self.first_steps.append((self.known, step.logits.clone()))
        return step

    def commit(self, tokens, features) -> None:
        self.commits.append((list(tokens), features.clone()))
        self.known += len(tokens)
        super().commit(tokens, features)


def lively_feature_draft(target) -> FeatureDraft:
    """A feature draft whose layer weights are large enough that attention to a stale or missing position shows."""
    draft = FeatureDraft.from_target(target, torch.arange(VOCAB))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in [*draft.fc.parameters(), *draft.decoder.layers.parameters()]:
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return draft


@pytest.mark.parametrize("prompt", [[3], [0, 3, 5, 1]])
def test_drafter_receives_target_features_of_accepted_positions(monkeypatch, prompt) -> None:
    target, eos = small_llama(seed=5), 7
    drafter = RecordingDrafter(lively_feature_draft(target), target)
    rounds: list[tuple[list[int], int]] = []

    def recording_verify(p, q, candidates, generator):
        m, token = correct_verify(p, q, candidates, generator)
        rounds.append((candidates.tolist(), m))
        return m, token

    monkeypatch.setattr(decoding, "verify", recording_verify)
    for seed in range(300):  # the first seed whose generation has every kind of round
        rounds.clear()
        generator = torch.Generator().manual_seed(seed)
        result = speculative_generate(target, drafter, prompt, FixedK(3), 40, eos_token_id=eos, generator=generator)
        rejection = any(m < len(c) for c, m in rounds)
        bonus = any(m == len(c) > 0 for c, m in rounds)
        last_candidates, last_m = rounds[-1]
        eos_mid_round = eos in last_candidates[:last_m]  # tokens accepted after the EOS are dropped
        if rejection and bonus and eos_mid_round:
            break
    else:
        pytest.fail("no seed produced a rejection, a bonus token and an EOS inside the accepted candidates")

    sequence = result.sequences[0]
    generated = sequence[len(prompt) :].tolist()
    assert generated[-1] == eos and eos not in generated[:-1]
    states = lm_head_input(target, result.sequences)[0]  # (T, d): row t predicted token t + 1

    ((start_prompt, start_features),) = drafter.starts
    assert start_prompt == prompt
    assert start_features.shape[0] == len(prompt) - 1
    if len(prompt) > 1:
        assert torch.allclose(start_features, states[: len(prompt) - 1], atol=1e-4)
    assert len(drafter.commits) == len(rounds)
    assert [t for tokens, _ in drafter.commits for t in tokens] == generated
    position = len(prompt)
    for tokens, features in drafter.commits:
        assert features.shape == (len(tokens), target.config.hidden_size)
        assert tokens == sequence[position : position + len(tokens)].tolist()
        expected = states[position - 1 : position - 1 + len(tokens)]
        assert torch.allclose(features, expected, atol=1e-4), (position, tokens)
        position += len(tokens)
    # The drafter uses them right: each round's first candidate has the logits of a fresh, cache-free draft pass over
    # the pairs (f_t, x_{t+1}) of the whole known sequence — the target's true features, no stale candidate entries.
    assert len(drafter.first_steps) >= len(rounds) - 1
    with torch.no_grad():
        for known, logits in drafter.first_steps:
            predicted = drafter.model(states[None, : known - 1], sequence[None, 1:known])[0, -1]
            assert torch.allclose(drafter.model.full_logits(predicted), logits, atol=1e-4), known


# --- 4. bad inputs --------------------------------------------------------------------------------------------------


def test_feature_draft_for_another_target_is_refused(tmp_path, llama, kept) -> None:
    other = make_llama(seed=1)  # same shapes and tokenizer, other weights
    draft = FeatureDraft.from_target(llama, kept)
    with pytest.raises(ValueError, match="fingerprint"):
        speculative_generate(other, draft, [2, 5], FixedK(2), 4, temperature=0)
    loaded = FeatureDraft.from_pretrained(draft.save_pretrained(tmp_path / "draft"))
    with pytest.raises(
        ValueError, match=f"fingerprint {model_fingerprint(llama)}.*fingerprint {model_fingerprint(other)}"
    ):
        loaded.bind(other)
    loaded.bind(llama)  # its own target is accepted


def test_kept_ids_outside_the_vocabulary_are_refused(llama) -> None:
    vocab = llama.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab}, outside the tokenizer's vocabulary"):
        FeatureDraft.from_target(llama, torch.tensor([0, 1, vocab]))
    with pytest.raises(ValueError, match=f"token id {vocab + 5}, outside the tokenizer's vocabulary"):
        ModelDrafter(perturbed_copy(llama), kept_ids=[3, vocab + 5])
    with pytest.raises(ValueError, match="token id -1, outside the tokenizer's vocabulary"):
        ModelDrafter(perturbed_copy(llama), kept_ids=[-1, 3])


def test_feature_draft_for_another_width_is_refused(llama, kept) -> None:
    narrow = make_llama(seed=0, hidden_size=16)
    draft = FeatureDraft.from_target(llama, kept)
    with pytest.raises(ValueError, match="width 32 but the target's hidden size is 16"):
        speculative_generate(narrow, draft, [2, 5], FixedK(2), 4, temperature=0)


def test_corrupt_draft_folders_name_the_file(tmp_path, llama, kept) -> None:
    draft = FeatureDraft.from_target(llama, kept)

    bad_json = draft.save_pretrained(tmp_path / "bad-json")
    (bad_json / "config.json").write_text('{"format": "accept_head.feature_draft", ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        FeatureDraft.from_pretrained(bad_json)
    with pytest.raises((OSError, ValueError), match=r"bad-json/config\.json"):  # not recognised: HF's own message
        load_model({"path": str(bad_json), "dtype": "float32"})

    truncated = draft.save_pretrained(tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for load in (FeatureDraft.from_pretrained, lambda f: load_model({"path": str(f), "dtype": "float32"})):
        with pytest.raises(ValueError, match=r"truncated/model\.safetensors could not be read"):
            load(truncated)

    missing = draft.save_pretrained(tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    for load in (FeatureDraft.from_pretrained, lambda f: load_model({"path": str(f), "dtype": "float32"})):
        with pytest.raises(FileNotFoundError, match=r"missing/model\.safetensors is missing"):
            load(missing)

    foreign = draft.save_pretrained(tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "format": "something-else"}))
    with pytest.raises(ValueError, match=r"config\.json has format='something-else'"):
        FeatureDraft.from_pretrained(foreign)


def test_acceptance_head_of_another_width_is_refused(llama, kept) -> None:
    draft = FeatureDraft.from_target(llama, kept)
    head = AcceptanceHead(llama.config.hidden_size + 8, depth=1)
    with pytest.raises(ValueError, match="acceptance head expects hidden size 40 but the draft's is 32"):
        speculative_generate(llama, draft, [2, 5], HeadThreshold(head, 0.5), 4, temperature=0)


# --- 5. folders and fingerprints ------------------------------------------------------------------------------------


def perturbed_draft(target, kept: torch.Tensor) -> FeatureDraft:
    """A draft for ``target`` whose trainable weights are moved off their initial values (the LM head stays frozen
    at the target's rows), so a round trip has content."""
    draft = FeatureDraft.from_target(target, kept)
    with torch.no_grad():
        for param in draft.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    return draft


@pytest.mark.parametrize("slim", [True, False])
def test_save_load_round_trip(tmp_path, llama, kept, slim) -> None:
    draft = perturbed_draft(llama, kept)
    folder = draft.save_pretrained(tmp_path / "draft", slim=slim)
    loaded = FeatureDraft.from_pretrained(folder).bind(llama)
    via_spec = load_model({"path": str(folder), "dtype": "float32"}).bind(llama)
    assert isinstance(via_spec, FeatureDraft)
    # The layer stack's own 1-row embedding table is never read (inputs arrive as embeddings) and is not saved.
    reference = {k: v for k, v in draft.state_dict().items() if not k.startswith("decoder.embed")}
    for copy_ in (loaded, via_spec):
        assert copy_.config == dataclasses.replace(draft.config, lm_head_from_target=slim)
        assert torch.equal(copy_.kept_ids, kept)
        state = {k: v for k, v in copy_.state_dict().items() if not k.startswith("decoder.embed")}
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference)
    for prompt in GREEDY_PROMPTS:
        expected = speculative_generate(llama, draft, prompt, FixedK(3), GREEDY_NEW, temperature=0)
        sampled = speculative_generate(
            llama, draft, prompt, FixedK(3), GREEDY_NEW, generator=torch.Generator().manual_seed(7)
        )
        for copy_ in (loaded, via_spec):
            result = speculative_generate(llama, copy_, prompt, FixedK(3), GREEDY_NEW, temperature=0)
            assert torch.equal(result.sequences, expected.sequences)
            assert result.stats.accepted == expected.stats.accepted  # the same candidates were proposed
            again = speculative_generate(
                llama, copy_, prompt, FixedK(3), GREEDY_NEW, generator=torch.Generator().manual_seed(7)
            )
            assert torch.equal(again.sequences, sampled.sequences)


def test_slim_folder_stores_no_lm_head_and_gathers_it_from_its_target_only(tmp_path, llama, kept) -> None:
    """A slim folder holds the draft's own weights, the kept ids and its config; binding gathers the LM head rows
    from the target, and a target with another fingerprint is refused with both fingerprints named."""
    draft = perturbed_draft(llama, kept)
    slim = draft.save_pretrained(tmp_path / "slim")
    full = draft.save_pretrained(tmp_path / "full", slim=False)
    stored = load_file(str(slim / "model.safetensors"))
    assert "lm_head.weight" not in stored and torch.equal(stored["kept_ids"], kept)
    assert "lm_head.weight" in load_file(str(full / "model.safetensors"))
    config = json.loads((slim / "config.json").read_text())
    assert config["lm_head_from_target"] and config["format_version"] == 2
    assert json.loads((full / "config.json").read_text())["format_version"] == 1
    assert (slim / "model.safetensors").stat().st_size < (full / "model.safetensors").stat().st_size

    loaded = FeatureDraft.from_pretrained(slim, dtype=torch.bfloat16)
    other = make_llama(seed=1)
    with pytest.raises(ValueError) as refused:
        loaded.bind(other)
    assert model_fingerprint(llama) in str(refused.value) and model_fingerprint(other) in str(refused.value)
    loaded.bind(llama)
    assert torch.equal(loaded.lm_head.weight, llama.get_output_embeddings().weight[kept].to(torch.bfloat16))


def test_an_older_full_folder_still_loads(tmp_path, llama, kept) -> None:
    """A folder written before slim folders (format_version 1, no lm_head_from_target key) loads as it was."""
    draft = perturbed_draft(llama, kept)
    folder = draft.save_pretrained(tmp_path / "old", slim=False)
    config = json.loads((folder / "config.json").read_text())
    del config["lm_head_from_target"]
    (folder / "config.json").write_text(json.dumps(config))
    loaded = FeatureDraft.from_pretrained(folder)
    assert not loaded.config.lm_head_from_target
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
    result = speculative_generate(llama, loaded, [2, 12, 40], FixedK(3), 8, temperature=0)
    assert torch.equal(result.sequences, autoregressive_generate(llama, [2, 12, 40], 8, temperature=0).sequences)


def test_a_slim_folder_without_a_fingerprint_is_refused(tmp_path, llama, kept) -> None:
    folder = perturbed_draft(llama, kept).save_pretrained(tmp_path / "slim")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"target_fingerprint": None}))
    with pytest.raises(ValueError, match="no target fingerprint"):
        FeatureDraft.from_pretrained(folder)
    with pytest.raises(ValueError, match="slim=False"):
        FeatureDraft.from_target(llama, kept, train_lm_head=True).save_pretrained(tmp_path / "trained", slim=True)


def test_fingerprint_ignores_dtype_and_tells_models_apart(tmp_path, llama, kept) -> None:
    half = copy.deepcopy(llama).to(torch.bfloat16)
    assert model_fingerprint(half) == model_fingerprint(llama)
    assert model_fingerprint(make_llama(seed=1)) != model_fingerprint(llama)
    folder = FeatureDraft.from_target(llama, kept).save_pretrained(tmp_path / "draft")
    draft = load_model({"path": str(folder), "dtype": "bfloat16"})
    assert draft.fc.weight.dtype == torch.bfloat16
    result = speculative_generate(half, draft, [2, 12, 40], FixedK(3), 8, temperature=0)  # binds to the bf16 copy
    assert result.sequences.shape == (1, 11)


def test_fixed_k_ceiling_counts_the_accepted_run_plus_the_targets_token() -> None:
    """Eq. 2.1 with independent per-step acceptance: tokens per round 1 + Σ_j Π_{i≤j} α_i over k·t_draft + t(k)."""
    from accept_head.core.costs import CostModel, expected_fixed_k_speedup

    cost = CostModel(t_draft=0.1, t_target_a=1.0, t_target_b=0.05)
    # α = (0.5, 0.5): tokens = 1 + 0.5 + 0.25 = 1.75 per round of 2·0.1 + 1.1 = 1.3 s; the target alone: 1 token/s.
    assert expected_fixed_k_speedup([0.5, 0.5, 0.9], 2, cost) == pytest.approx(1.75 / 1.3)
    # A draft that is always right and free: k + 1 tokens per target call of cost t(k).
    free = CostModel(t_draft=0.0, t_target_a=1.0)
    assert expected_fixed_k_speedup([1.0] * 4, 4, free) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="k=5 needs 1..4"):
        expected_fixed_k_speedup([1.0] * 4, 5, free)
    # A round's later steps priced apart: 0.1 + 0.04 + 1.1 = 1.24 s for the same 1.75 tokens.
    warm = CostModel(t_draft=0.1, t_target_a=1.0, t_target_b=0.05, t_draft_next=0.04)
    assert expected_fixed_k_speedup([0.5, 0.5, 0.9], 2, warm) == pytest.approx(1.75 / 1.24)


# --- 5. training unrolls the steps as decoding runs them --------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
def test_unrolled_step_k_equals_the_drafters_kth_candidate(padded: bool) -> None:
    """For every round start t the training unroll's step-k prediction (k = 1..3) at pair t + k − 1 equals the k-th
    candidate :class:`FeatureDrafter` computes after the text up to x_{t+1} is committed with the target's own
    features, the candidates being the text's next tokens — also for a shorter, right-padded row of the batch."""
    from accept_head.training.feature_draft import unrolled_predictions

    target = small_llama(seed=5)
    draft = lively_feature_draft(target).eval()
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (12,), generator=generator), torch.randint(0, VOCAB, (9,), generator=generator)]
    rows = rows if padded else rows[:1]
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    with torch.no_grad():
        features = lm_head_input(target, tokens, mask)  # (B, T, d): the target's own final hidden states
        steps = unrolled_predictions(draft, {"tokens": tokens, "features": features, "mask": mask}, steps=3)
    drafter = FeatureDrafter(draft, target)
    checked = 0
    for b, row in enumerate(rows):
        for t in range(len(row) - 4):
            drafter.start(row[: t + 2].tolist(), features[b, : t + 1])
            with torch.no_grad():
                candidates = [drafter.propose(None).hidden]
                candidates += [drafter.propose(int(row[t + k])).hidden for k in (2, 3)]
            for k, candidate in enumerate(candidates, start=1):
                torch.testing.assert_close(steps[k - 1][b, t + k - 1], candidate, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == 3 * sum(len(r) - 4 for r in rows)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafting_step_is_the_forward_pass_of_one_position(dtype, quantize) -> None:
    """FeatureDraft.step (the drafter's one-token path: fused projections, a RoPE table, no mask building) gives
    the same f̂ as :meth:`FeatureDraft.forward` on that position, bit for bit, and leaves the same cache behind."""
    from transformers import DynamicCache

    target = small_llama(seed=5).to(dtype)
    draft = lively_feature_draft(target).to(dtype).eval()
    if quantize:
        draft.quantize_(quantize)
    assert draft.lean_step() is not None  # the fused path is the one compared
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (1, 7), generator=generator)
    features = torch.randn(1, 7, target.config.hidden_size, generator=generator).to(dtype)
    caches = [DynamicCache(), DynamicCache()]
    with torch.no_grad():
        for cache in caches:  # a prefix of 6 positions
            draft(features[:, :6], tokens[:, :6], cache, position_ids=torch.arange(6)[None], use_cache=True)
        whole = draft(features[:, 6:], tokens[:, 6:], caches[0], position_ids=torch.tensor([[6]]), use_cache=True)
        one = draft.step(features[0, 6], int(tokens[0, 6]), caches[1], 6)
    assert torch.equal(one, whole[0, -1])
    assert caches[1].get_seq_length() == 7
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extending_by_several_positions_is_the_forward_pass(dtype, quantize, monkeypatch) -> None:
    """FeatureDraft.extend (a round's first drafting call: the verified tokens fed at once; the lean layer computes
    the last position's output only) gives the forward pass's f̂ at the last position (to the dtype's rounding) and
    the same cache bit for bit; the modules' path (the lean step switched off) gives it bit for bit."""
    from transformers import DynamicCache

    import accept_head.models.feature_draft as feature_draft_module

    target = small_llama(seed=7).to(dtype)
    draft = lively_feature_draft(target).to(dtype).eval()
    if quantize:
        draft.quantize_(quantize)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (1, 9), generator=generator)
    features = torch.randn(1, 9, target.config.hidden_size, generator=generator).to(dtype)

    def extend_after_prefix() -> tuple[torch.Tensor, DynamicCache]:
        cache = DynamicCache()
        with torch.no_grad():  # a prefix of 5 positions, then 4 more at once
            draft(features[:, :5], tokens[:, :5], cache, position_ids=torch.arange(5)[None], use_cache=True)
            return draft.extend(features[0, 5:], tokens[0, 5:].tolist(), cache, 5), cache

    cache = DynamicCache()
    with torch.no_grad():
        draft(features[:, :5], tokens[:, :5], cache, position_ids=torch.arange(5)[None], use_cache=True)
        whole = draft(features[:, 5:], tokens[:, 5:], cache, position_ids=torch.arange(5, 9)[None], use_cache=True)
    assert draft.lean_step() is not None
    lean, lean_cache = extend_after_prefix()
    torch.testing.assert_close(lean, whole[0, -1])  # one row through o_proj and the MLP: last-bit rounding may move
    for a, b in zip(cache.layers, lean_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    monkeypatch.setattr(feature_draft_module, "lean_step_applies", lambda decoder: False)
    assert draft.lean_step() is None
    assert torch.equal(extend_after_prefix()[0], whole[0, -1])
    first_query = whole[0, 0]  # what a step answering for the wrong position would return
    assert not torch.allclose(lean.float(), first_query.float(), atol=1e-2)


def test_a_drafting_step_follows_weight_changes_and_positions_past_its_rope_table() -> None:
    """The fused int8 projections are copies: after an in-place update of the weights the step must use the new ones
    (the stale copy, kept on purpose, is the broken control), and positions past the RoPE table's first size read
    the rotary embedding of that position."""
    from transformers import DynamicCache

    target = small_llama(seed=6)
    draft = lively_feature_draft(target).eval().quantize_("int8")
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(1, 4, target.config.hidden_size, generator=generator)
    tokens = torch.randint(0, VOCAB, (1, 4), generator=generator)

    def step_and_forward(lean):
        caches = [DynamicCache(), DynamicCache()]
        with torch.no_grad():
            for cache in caches:
                draft(features[:, :3], tokens[:, :3], cache, position_ids=torch.arange(3)[None], use_cache=True)
            whole = draft(features[:, 3:], tokens[:, 3:], caches[0], position_ids=torch.tensor([[3]]), use_cache=True)
            emb = draft.embed.weight[int(tokens[0, 3])]
            x = draft.fc(torch.cat([features[0, 3], emb])[None, None])
            return lean(x, caches[1], 3), whole[0, -1]

    stale = draft.lean_step()
    with torch.no_grad():
        draft.decoder.layers[0].self_attn.k_proj.qweight.neg_()
        draft.decoder.layers[0].mlp.up_proj.qweight.div_(2, rounding_mode="trunc")
    fresh = draft.lean_step()
    assert fresh is not stale
    one, whole = step_and_forward(fresh)
    assert torch.equal(one, whole)
    one, whole = step_and_forward(stale)
    assert not torch.allclose(one, whole, atol=1e-4)

    x = torch.zeros(1, 1, target.config.hidden_size)
    for position in (0, 255, 256, 700):
        cos, sin = fresh.rope(x, position)
        expected = draft.decoder.rotary_emb(x, torch.tensor([[position]]))
        assert torch.equal(cos.flatten(), expected[0].flatten()) and torch.equal(sin.flatten(), expected[1].flatten())


@pytest.mark.parametrize("quantize", [False, True])
def test_fused_linears_compute_each_linear_side_by_side(quantize) -> None:
    """fuse_linears: the outputs of the separate layers, concatenated, bit for bit — biases where some layers have one
    and others not; mixing kinds is refused."""
    from accept_head.models.draft_step import fuse_linears

    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(64, 5), torch.nn.Linear(64, 3, bias=False)]
    if quantize:
        linears = [Int8Linear(linear.weight, linear.bias) for linear in linears]
    fused = fuse_linears(linears)
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([linear(x) for linear in linears], -1))
    with pytest.raises(TypeError, match="nn.Linear or Int8Linear"):
        fuse_linears([torch.nn.Linear(64, 8), Int8Linear(torch.randn(8, 64))])


# --- 6. int8 weights for decoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 64])  # bf16: 40 columns take the dequantized path, 64 the int8 kernel
def test_int8_linear_is_the_product_with_its_dequantized_weight(dtype, width) -> None:
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, width, generator=generator), torch.randn(24, generator=generator)
    layer = Int8Linear(weight.to(dtype), bias.to(dtype))
    dequantized = layer.qweight.float() * layer.scale.float()[:, None]
    # Round to nearest with one scale per row: each weight within half a step (in bf16 the scale itself is rounded
    # to 8 bits, another half step at most), the row's largest at ±127 exactly.
    steps = 0.5 if dtype == torch.float32 else 1.0
    assert (dequantized - weight.to(dtype).float()).abs().le(steps * layer.scale.float()[:, None] + 1e-6).all()
    assert layer.qweight.abs().amax(dim=1).eq(127).all()
    x = torch.randn(3, 5, width, generator=generator)
    expected = x @ dequantized.T + bias
    tolerance = 1e-4 if dtype == torch.float32 else 0.3
    assert layer(x.to(dtype)).shape == (3, 5, 24)
    assert torch.allclose(layer(x.to(dtype)).float(), expected, atol=tolerance, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [32, 24])  # 32 rows run the 4-bit kernel, 24 (not a multiple of 16) the fallback
def test_int4_linear_is_the_product_with_its_dequantized_weight(dtype, rows) -> None:
    """Each weight within one level's step of the original (half a step of rounding, plus the scale and offset in
    bf16), the product that of the dequantized weight and the bias; a width no group divides is refused."""
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(rows, 64, generator=generator), torch.randn(rows, generator=generator)
    layer = Int4Linear(weight.to(dtype), bias.to(dtype))
    assert (layer.packed is not None) == (rows % 16 == 0)
    dequantized = layer.dequantized()
    groups = weight.to(dtype).float().reshape(rows, 2, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, 1)
    slack = 0.5 if dtype == torch.float32 else 1.0
    assert (dequantized - weight.to(dtype).float()).abs().le(slack * step + 1e-3).all()
    assert not torch.allclose(dequantized, weight.to(dtype).float(), atol=1e-3)  # 16 levels: the weights moved
    x = torch.randn(3, 5, 64, generator=generator)
    expected = x @ dequantized.T + bias.to(dtype).float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.3
    assert layer(x.to(dtype)).shape == (3, 5, rows) and layer(x.to(dtype)).dtype == dtype
    assert torch.allclose(layer(x.to(dtype)).float(), expected, atol=tolerance, rtol=0.02)
    with pytest.raises(ValueError, match="group=48 must be one of"):
        Int4Linear(weight, group=48)


@pytest.mark.parametrize(("mode", "head", "moved_at_most"), [("int8", Int8Linear, 0.05), ("int4", Int4Linear, 0.25)])
def test_a_quantized_feature_draft_decodes_greedy_output_exactly(greedy_settings, mode, head, moved_at_most) -> None:
    """The int8 (int4: its LM head in 4 bits) draft proposes from a q close to, but not equal to, the trained draft's;
    greedy decoding with it still returns the target's own continuation, with most candidates accepted (the accept
    path runs)."""
    target, make_draft, _ = greedy_settings["feature"]
    draft = make_draft()
    quantized = copy.deepcopy(draft).quantize_(mode)
    assert isinstance(quantized.fc, Int8Linear) and isinstance(quantized.decoder.layers[0].mlp.up_proj, Int8Linear)
    assert isinstance(quantized.support_rows()[1], head)
    features = torch.randn(1, 6, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[2, 12, 40, 9, 5, 30]])
    with torch.no_grad():
        exact = draft.support_logits(draft(features, tokens))[1]
        moved = quantized.support_logits(quantized(features, tokens))[1]
    assert 0 < (exact - moved).abs().max() < moved_at_most * exact.abs().max()
    accepted, proposed = 0, 0
    for prompt in GREEDY_PROMPTS:
        expected = autoregressive_generate(target, prompt, GREEDY_NEW, temperature=0).sequences
        result = speculative_generate(target, quantized, prompt, FixedK(3), GREEDY_NEW, temperature=0)
        assert torch.equal(result.sequences, expected)
        accepted, proposed = accepted + sum(result.stats.accepted), proposed + sum(result.stats.proposed)
    assert accepted >= MIN_ACCEPTED_SHARE["feature"] * proposed


def test_int8_is_a_loading_option_of_feature_drafts_only(tmp_path, llama, kept) -> None:
    """``quantize: int8`` in a model spec or a bundle's ``draft_quantize`` loads the draft with int8 weights; a bad
    mode, a quantized target, and saving a quantized draft are refused with the value and the fix."""
    tokenizer = make_tokenizer()
    target = make_llama(tmp_path / "target", tokenizer=tokenizer)
    folder = perturbed_draft(target, kept).save_pretrained(tmp_path / "draft")
    spec = {"path": str(folder), "dtype": "float32"}
    draft = load_model({**spec, "quantize": "int8"})
    assert draft.quantized == "int8" and isinstance(draft.decoder.layers[0].self_attn.q_proj, Int8Linear)
    assert load_model(spec).quantized is None
    with pytest.raises(ValueError, match=r"quantize='int2' is not a weight format .* use one of \['int8', 'int4'\]"):
        load_model({**spec, "quantize": "int2"})
    with pytest.raises(ValueError, match=r"quantize='int8' applies to feature drafts only"):
        load_model({"path": str(tmp_path / "target"), "dtype": "float32", "quantize": "int8"})
    with pytest.raises(ValueError, match="save the draft as trained"):
        draft.save_pretrained(tmp_path / "again")
    save_bundle(tmp_path / "bundle", target, load_model(spec), tokenizer, tmp_path / "target", folder)
    from accept_head import SpecDecPP

    bundle = SpecDecPP.from_pretrained(tmp_path / "bundle", tokenizer=tokenizer, draft_quantize="int8")
    assert bundle.draft.quantized == "int8"
    prompt = [2, 12, 40, 9]
    result = bundle.generate(prompt, max_new_tokens=8, temperature=0).sequences  # stops at the tokenizer's EOS
    expected = autoregressive_generate(target, prompt, 8, temperature=0).sequences
    assert result.shape[1] > len(prompt) and torch.equal(result, expected[:, : result.shape[1]])
