"""The toolkit on an accelerator: decoders, labels, a head training step, the bundle and ``generate(custom_generate)``
on tiny models placed on ``cuda``.

Every test runs once per device: on ``cpu`` always (so the bodies are exercised by the default suite), and on
``cuda`` where a CUDA device is present (``pytest -m cuda`` selects those alone; elsewhere they are skipped). Outputs
are compared with a reference decoded on the *same* device, since kernels may round differently across devices.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tiny_models import make_llama, make_pair, make_tokenizer, near_bigram, perturbed_copy, save_bundle

from accept_head import (
    AcceptanceHead,
    FeatureDraft,
    FixedK,
    HeadThreshold,
    ModelBigram,
    SamplingConfig,
    SpecDecPP,
    autoregressive_generate,
    lookahead_generate,
    make_custom_generate,
    ngrammys_generate,
    ouroboros_generate,
    speculative_generate,
)
from accept_head.acceptance.loss import weighted_bce
from accept_head.chain.rollout import rollout_labels
from accept_head.models.loading import load_model
from accept_head.models.pairs import ModelSpec

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]
PROMPTS = [[2, 10, 11, 12, 13], [2, 40, 41, 9, 20, 21, 22]]
NEW = 20


def on(device: str, model: torch.nn.Module) -> torch.nn.Module:
    return model.to(device).eval()


@pytest.fixture(scope="module")
def cpu_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target and a noisy copy of it as the draft (accepts some candidates, rejects others), on the CPU."""
    target = make_llama(seed=0)
    return target, perturbed_copy(target, relative_noise=0.3, seed=1)


def pair_on(device: str, cpu_pair) -> tuple[torch.nn.Module, torch.nn.Module]:
    import copy

    target, draft = cpu_pair
    return on(device, copy.deepcopy(target)), on(device, copy.deepcopy(draft))


def reference(target: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    return autoregressive_generate(target, prompt, new, temperature=0).sequences[0].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_chain_decoders_greedy_equal_autoregressive_on_device(device: str, cpu_pair) -> None:
    target, draft = pair_on(device, cpu_pair)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, depth=1).to(device)
        feature_draft = FeatureDraft.from_target(target, torch.arange(0, target.config.vocab_size, 2)).to(device)
    drafters = {"model": draft, "feature": feature_draft.eval()}
    policies = {"fixed": lambda: FixedK(3), "head": lambda: HeadThreshold(head, 0.6, max_candidates=6)}
    accepted = 0
    for prompt in PROMPTS:
        expected = reference(target, prompt)
        for (drafter_name, drafter), (policy_name, policy) in itertools.product(drafters.items(), policies.items()):
            result = speculative_generate(target, drafter, prompt, policy(), NEW, temperature=0)
            assert result.sequences.device.type == "cpu"
            assert result.sequences[0].tolist() == expected, (drafter_name, policy_name, prompt)
            accepted += sum(result.stats.accepted)
    assert accepted > 0


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_decoding_on_device_is_reproducible_for_a_seed(device: str, cpu_pair) -> None:
    target, draft = pair_on(device, cpu_pair)

    def run(seed: int, speculative: bool) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        if speculative:
            out = speculative_generate(target, draft, PROMPTS[0], FixedK(3), NEW, 1.0, top_k=20, generator=generator)
        else:
            out = autoregressive_generate(target, PROMPTS[0], NEW, 1.0, top_k=20, generator=generator)
        tokens = out.sequences[0].tolist()
        assert len(tokens) == len(PROMPTS[0]) + out.stats.generated and out.stats.generated >= 1
        assert all(0 <= t < target.config.vocab_size for t in tokens)
        return tokens

    for speculative in (False, True):
        assert run(7, speculative) == run(7, speculative)
    assert len({tuple(run(seed, True)) for seed in range(4)}) > 1  # the seed matters: it is sampling


@pytest.mark.parametrize("device", DEVICES)
def test_learning_free_decoders_greedy_equal_autoregressive_on_device(device: str) -> None:
    target = on(device, near_bigram(make_llama(seed=0)))
    draft = on(device, perturbed_copy(target, relative_noise=0.3, seed=1))
    bigram = ModelBigram.build(target, top=10, batch_size=32)
    for prompt in PROMPTS:
        expected = reference(target, prompt)
        runs = {
            "ngrammys": ngrammys_generate(target, prompt, NEW, 0, k=4, w=3, q=2, bigram=bigram),
            "lookahead": lookahead_generate(target, prompt, NEW, 0, window=3, ngram=3, guess_set=3),
            "ouroboros": ouroboros_generate(target, draft, prompt, NEW, 0, gamma=3, phrase_length=3, candidates=2),
        }
        for name, result in runs.items():
            assert result.sequences[0].tolist() == expected, (name, prompt)


@pytest.mark.parametrize("device", DEVICES)
def test_rollout_labels_on_device(device: str, cpu_pair) -> None:
    target, draft = pair_on(device, cpu_pair)
    prompt = PROMPTS[1]
    labels = rollout_labels(target, draft, prompt, NEW, 4, SamplingConfig(0.0), generator=torch.Generator())
    assert labels.response_ids.tolist() == reference(target, prompt)[len(prompt) :]
    candidates = len(labels.draft_ids)
    assert candidates > 0 and labels.hidden.shape == (candidates, draft.config.hidden_size)
    for name in ("accept_prob", "target_logp", "draft_logp", "hidden", "accepted"):
        assert getattr(labels, name).device.type == "cpu", name
    # Greedy labels are 1[y_k = argmax p_k]: exactly the decode's accepted candidates, up to each round's first miss.
    assert set(labels.accept_prob.tolist()) <= {0.0, 1.0}
    assert bool((labels.accepted <= labels.accept_prob.bool()).all())


@pytest.mark.parametrize("device", DEVICES)
def test_a_head_training_step_on_device_lowers_the_loss(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 16, generator=generator)
    labels = (hidden[:, 0] > 0).float() * 0.9  # soft labels a linear probe can learn
    hidden, labels = hidden.to(device), labels.to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(16, depth=2).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = weighted_bce(head(hidden), labels, w_acc=1.0, w_rej=6.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(p.grad is not None and p.grad.device.type == device for p in head.parameters())
    assert losses[-1] < 0.8 * losses[0]
    head.eval()
    with torch.no_grad():  # the decoder's one-vector fast path agrees with the batched forward
        assert head.accept_prob_one(hidden[3]) == pytest.approx(float(head.accept_prob(hidden[3:4])[0]), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bundle_round_trip_onto_device(device: str, tmp_path: Path) -> None:
    target_dir, draft_dir = make_pair(tmp_path / "models")
    target, draft = (load_model(ModelSpec(str(path), dtype="float32")) for path in (target_dir, draft_dir))
    bundle = save_bundle(tmp_path / "bundle", target, draft, make_tokenizer(), target_dir, draft_dir)
    loaded = SpecDecPP.from_pretrained(tmp_path / "bundle", device=device)
    for module in (loaded.target, loaded.draft, loaded.head):
        assert {p.device.type for p in module.parameters()} == {device}
    for module in (bundle.target, bundle.draft, bundle.head):
        module.to(device)
    for prompt in ("the code", [5, 9, 10, 11]):
        ids = loaded.encode(prompt)
        expected = autoregressive_generate(loaded.target, ids, 16, 0, eos_token_id=loaded.eos_token_ids)
        a = bundle.generate(prompt, max_new_tokens=16, temperature=0)
        b = loaded.generate(prompt, max_new_tokens=16, temperature=0)
        assert a.new_token_ids == b.new_token_ids == expected.sequences[0, len(ids) :].tolist()
        assert a.text == b.text
        a, b = (x.generate(prompt, max_new_tokens=16, seed=3) for x in (bundle, loaded))
        assert a.new_token_ids == b.new_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_custom_generate_on_device_equals_the_targets_greedy_generate(device: str, cpu_pair) -> None:
    target, draft = pair_on(device, cpu_pair)
    fn = make_custom_generate(draft, FixedK(3))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=device)
        ours = target.generate(ids, custom_generate=fn, do_sample=False, max_new_tokens=NEW)
        plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)
        assert ours.device == plain.device and torch.equal(ours, plain), prompt
        assert fn.last_stats.generated == ours.shape[1] - len(prompt)
