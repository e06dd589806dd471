"""The target over a preallocated KV cache, eager or compiled (:mod:`accept_head.models.static_target`), on tiny
random models.

* ``target_runtime="static"``: autoregressive and chain speculative decoding (a Hugging Face draft and a feature
  draft, which reads the target's hidden states from the same pass) return exactly the eager greedy text (float32).
* After rounds that rejected candidates, the kept keys and values equal a fresh prefill of the text, and a pass after
  a crop gives the logits a fresh model gives (padding and roll-back leave nothing behind).
* At T = 1 chain decoding over the static cache follows the target's exact distribution (χ²); accepting every
  candidate fails the same check.
* ``target_runtime="compiled"`` (``torch.compile``, inductor) decodes the eager greedy tokens (float32).
* A token tree over the static cache (chains with copied rows) gives the ``DynamicCache`` logits, keeping one branch
  leaves a fresh prefill's keys and values, and chains with copies decode the eager greedy text, static and compiled.
* ``SpecDecPP.generate(target_runtime="static")`` writes the eager tokens; trees refuse a non-eager runtime.
* Bad settings raise errors naming the value and the fix.
"""

from __future__ import annotations

import pytest
import torch
from stats_helpers import ALPHA, SMALL_PROMPT, accept_every_candidate, pair_p_values, sampled_tokens, small_vocab_pair
from tiny_models import distilled_feature_draft, draft_vocabulary, make_llama, perturbed_copy

import accept_head.chain.decoding as decoding
from accept_head import AcceptanceHead, FixedK, SpecDecPP, autoregressive_generate, speculative_generate
from accept_head.core.hf_compat import cache_kwargs
from accept_head.models.static_target import StaticTarget, target_cache

PROMPTS = [[2, 10, 11, 12, 13, 14], [5]]
NEW = 24


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0, num_layers=2)
    return target, perturbed_copy(target, relative_noise=0.15, seed=3)


def test_static_runtime_decodes_the_eager_greedy_text(pair) -> None:
    target, draft = pair
    references = [autoregressive_generate(target, p, NEW, temperature=0).sequences for p in PROMPTS]
    kept = draft_vocabulary(target.config.vocab_size, [t for r in references for t in r[0].tolist()], leave_out=4)
    feature_draft = distilled_feature_draft(target, kept, [r[0].tolist() for r in references], steps=60)
    accepted = 0
    for prompt, reference in zip(PROMPTS, references):
        out = autoregressive_generate(target, prompt, NEW, temperature=0, target_runtime="static")
        assert torch.equal(out.sequences, reference)
        for chain_draft in (draft, feature_draft):
            out = speculative_generate(
                target, chain_draft, prompt, FixedK(4), NEW, temperature=0, target_runtime="static"
            )
            assert torch.equal(out.sequences, reference), prompt
            accepted += sum(out.stats.accepted)
    assert accepted > 0  # candidates were accepted and rejected: crops of several lengths ran


def test_kept_positions_equal_a_fresh_prefill_after_rejections(pair) -> None:
    target, draft = pair
    seen = []
    crop = decoding._crop

    def record(cache, length):
        crop(cache, length)
        seen.append((length, [t.clone() for layer in cache.cache.layers for t in (layer.keys, layer.values)]))

    decoding._crop = record
    try:
        out = speculative_generate(target, draft, PROMPTS[0], FixedK(4), NEW, temperature=0, target_runtime="static")
    finally:
        decoding._crop = crop
    text = out.sequences[0].tolist()
    fresh = StaticTarget(target, 64)
    for length, tensors in seen:
        fresh.reset()
        fresh.forward(torch.tensor([text[:length]]))
        want = [t for layer in fresh.cache.layers for t in (layer.keys, layer.values)]
        for got, expected in zip(tensors, want, strict=True):
            torch.testing.assert_close(got[:, :, :length], expected[:, :, :length], atol=1e-5, rtol=1e-4)
    # A pass after a crop sees only the kept positions: its logits are a fresh model's.
    static = StaticTarget(target, 64)
    static.forward(torch.tensor([text[:10]]))
    static.forward(torch.tensor([text[10:13]]))  # padded to 4, then rolled back
    static.crop(11)
    logits, _ = static.forward(torch.tensor([text[11:14]]))
    want = target(input_ids=torch.tensor([text[:14]])).logits[0, 11:14]
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)


def test_a_tree_pass_over_the_static_cache_gives_the_dynamic_caches_logits_and_keeps_a_fresh_prefill(pair) -> None:
    """A token tree through :meth:`StaticTarget.tree_forward` (padded, two branches) gives the logits of the same tree
    over a ``DynamicCache`` (:func:`~accept_head.trees.verify.tree_forward`); after :meth:`StaticTarget.keep` of
    one branch the kept keys and values are a fresh prefill's, and the next pass's logits a fresh model's."""
    from transformers import DynamicCache

    from accept_head.trees.attention import tree_mask
    from accept_head.trees.verify import commit_nodes, tree_forward

    target, _ = pair
    text = [2, 10, 11, 12, 13, 14, 15, 16, 17]
    tokens, parents = [14, 30, 31, 15, 16], [-1, 0, 1, 0, 3]  # root 14; branches 30 31 and 15 16 (the text's)
    static = StaticTarget(target, 64)
    static.forward(torch.tensor([text[:5]]))
    allowed, depths = tree_mask(parents)
    logits, hidden = static.tree_forward(torch.tensor([tokens]), allowed, depths)
    dynamic = DynamicCache()
    target(input_ids=torch.tensor([text[:5]]), **cache_kwargs(target, dynamic))
    torch.testing.assert_close(logits, tree_forward(target, dynamic, tokens, parents), atol=1e-5, rtol=1e-4)
    assert hidden.shape == (5, target.config.hidden_size)
    commit_nodes(static, 5, [3, 4])  # keep the root and the second branch: text[:8]
    assert static.length == 8
    fresh = StaticTarget(target, 64)
    fresh.forward(torch.tensor([text[:8]]))
    for got, want in zip(static.cache.layers, fresh.cache.layers, strict=True):
        torch.testing.assert_close(got.keys[:, :, :8], want.keys[:, :, :8], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values[:, :, :8], want.values[:, :, :8], atol=1e-5, rtol=1e-4)
    after, _ = static.forward(torch.tensor([text[8:9]]))
    torch.testing.assert_close(after, target(input_ids=torch.tensor([text])).logits[0, 8:9], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"extra=\[9, 9\] must be strictly increasing"):
        static.keep(9, [9, 9])


@pytest.mark.parametrize("runtime", ["static", "compiled"])
def test_chains_with_copies_decode_the_eager_greedy_text_over_the_static_cache(
    pair, runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:func:`~accept_head.trees.chain_copies.chain_copy_generate` over a static (and a compiled) target: the eager
    greedy text. The copies are the target's own continuation and the draft an unrelated model, so the accepted row
    is the copy branched off the chain: its keys and values are moved next to the prefix every round."""
    from test_context_row import FutureRow

    import accept_head.trees.chain_copies as chain_copies
    from accept_head import chain_copy_generate

    target, _ = pair
    draft = make_llama(seed=11, num_layers=1)
    prompt = PROMPTS[0]
    reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
    row = FutureRow(reference[0].tolist(), 0, target.config.vocab_size)
    monkeypatch.setattr(chain_copies, "ContextRow", lambda length: row)
    out = chain_copy_generate(
        target, draft, prompt, FixedK(3), NEW, context_row=4, temperature=0, target_runtime=runtime
    )
    assert torch.equal(out.sequences, reference)
    assert out.stats.accepted[:-1] == [4] * (len(out.stats.accepted) - 1) and max(out.stats.rows) == 2


SAMPLES = 1200


@pytest.fixture(scope="module")
def small():
    return small_vocab_pair()


def sample_chain(target, draft):
    def decode(generator):
        return speculative_generate(
            target, draft, SMALL_PROMPT, FixedK(2), 4, temperature=1.0, generator=generator, target_runtime="static"
        )

    return decode


def test_static_runtime_keeps_the_target_distribution(small) -> None:
    target, draft, joint = small
    tokens, hit_rate = sampled_tokens(sample_chain(target, draft), SAMPLES, len(SMALL_PROMPT))
    assert hit_rate > 0.3, hit_rate
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


def test_a_broken_verifier_over_the_static_cache_is_detected(small, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft, joint = small
    monkeypatch.setattr(decoding, "verify", accept_every_candidate)
    tokens, _ = sampled_tokens(sample_chain(target, draft), SAMPLES // 4, len(SMALL_PROMPT))
    assert min(pair_p_values(tokens, joint)) < ALPHA


def test_compiled_runtime_decodes_the_eager_greedy_text(pair) -> None:
    target, _ = pair
    reference = autoregressive_generate(target, PROMPTS[0], 12, temperature=0).sequences
    out = autoregressive_generate(target, PROMPTS[0], 12, temperature=0, target_runtime="compiled")
    assert torch.equal(out.sequences, reference)
    with torch.inference_mode():  # as decoding: the kept cache was made there
        assert target_cache(target, "compiled", 20).compiled  # the compiled StaticTarget is kept for the next call


def test_a_bundle_decodes_over_the_static_cache(pair) -> None:
    target, draft = pair
    head = AcceptanceHead(draft.config.hidden_size, depth=1)
    bundle = SpecDecPP(target=target, draft=draft, head=head, threshold=0.7)
    eager = bundle.generate(PROMPTS[0], max_new_tokens=16, temperature=0)
    static = bundle.generate(PROMPTS[0], max_new_tokens=16, temperature=0, target_runtime="static")
    assert static.new_token_ids == eager.new_token_ids
    with pytest.raises(ValueError, match="target_runtime='static' serves chain decoding; pass tree=False or 'eager'"):
        bundle.generate(PROMPTS[0], max_new_tokens=4, tree=True, target_runtime="static")


def test_bad_runtime_settings_raise_clear_errors(pair) -> None:
    target, _ = pair
    with pytest.raises(ValueError, match=r"target_runtime='jit' must be one of \['eager', 'static', 'compiled'\]"):
        autoregressive_generate(target, PROMPTS[0], 4, temperature=0, target_runtime="jit")
    static = StaticTarget(target, 8)
    with pytest.raises(ValueError, match=r"exceeds this StaticTarget's 256 positions: build it with a larger max_len"):
        static.forward(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="max_length=0 must be >= 1"):
        StaticTarget(target, 0)
