"""Every decoder that verifies under a custom mask, on targets whose attention is not Llama's full causal attention.

* Sliding windows (tiny float32 Mistral, Qwen2 with ``use_sliding_window``, Gemma-2, Gemma-3, Phi-3; window 4, texts
  of 20+ tokens): a tree pass and a tree drafter's batched pass give every node the logits of a chain holding only
  its own path, also after a later branch won and the cache was trimmed; the mask per layer type equals
  transformers' own on a chain; greedy output of every mask-based decoder — draft trees under every rule with a HF
  draft and an untrained feature draft, ``SpecDecPP.generate(tree=True)``, ``generate(custom_generate=...)`` with a
  tree rule, Lookahead, N-Grammys, Ouroboros — equals autoregressive greedy decoding. A window longer than the text
  is the control that passes with or without the window.
* At temperature 1 the first four tokens follow the exact distribution of a small-vocabulary Gemma-3 with a window
  of 2 (χ²); the tree pass without the window (the old mask) fails the same check.
* ALiBi targets (MPT, Bloom, Falcon with ``alibi``) are refused by every mask-based decoder with one message that
  names the model type and the decoders that still work — and those do.
* A request past the target's context warns at the start and says how many tokens it returns.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from generate_helpers import greedy
from stats_helpers import ALPHA, exact_joint, pair_p_values, sampled_tokens
from tiny_models import make_llama, perturbed_copy
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    DynamicCache,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MptConfig,
    MptForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import accept_head.trees.verify as tree_verify
from accept_head import (
    AcceptanceHead,
    FeatureDraft,
    FixedK,
    SpecDecPP,
    autoregressive_generate,
    lookahead_generate,
    make_custom_generate,
    ngrammys_generate,
    ouroboros_generate,
    speculative_generate,
)
from accept_head.chain.decoding import ContextLimitWarning
from accept_head.core.costs import CostModel
from accept_head.core.hf_compat import cache_kwargs
from accept_head.models.feature_draft import FeatureDraftConfig
from accept_head.trees.decoding import tree_generate
from accept_head.trees.drafters import ModelTreeDrafter
from accept_head.trees.growth import ConfidenceTree, HeadTree, StaticTree

FAMILIES = {
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, max_window_layers=1)),  # full, sliding
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(head_dim=8)),  # sliding, full
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(head_dim=8, sliding_window_pattern=2)),  # sliding, full
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
}
VOCAB, WINDOW, LONG_WINDOW = 48, 4, 64
PROMPTS = [[1, 5, 7, 9, 3, 2, 8, 11, 5, 7, 9, 3], [4, 20, 21, 22, 20, 21, 22, 20, 21]]
NEW = 14
COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.00032)


def sliding_model(family: str, window: int, vocab: int = VOCAB, seed: int = 0, attn: str | None = None, **overrides):
    """A random float32 ``family`` causal LM (2 layers) whose sliding layers have a window of ``window`` tokens;
    SDPA attention, but eager for Gemma-2 (which has no SDPA path)."""
    config_class, model_class, extra = FAMILIES[family]
    values = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        sliding_window=window,
    )
    config = config_class(**{**values, **extra, **overrides})
    config._attn_implementation = attn or ("eager" if family == "gemma2" else "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


def chain_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) logits of one plain forward over ``ids``: the model's own masks."""
    return model(input_ids=torch.tensor([ids])).logits[0]


# --- the masks ------------------------------------------------------------------------------------------------------


def test_a_chain_gets_transformers_own_mask_per_layer_type(family) -> None:
    """On a chain (no branching) the mask of every layer type equals the one transformers builds itself, so the
    window convention (a query at position i sees keys at positions > i − w) is transformers' own."""
    from transformers.masking_utils import create_masks_for_generate

    from accept_head.trees.attention import attention_layout, layer_masks, tree_mask

    model = sliding_model(family, WINDOW, attn="eager")
    prefix, new = 9, 5
    cache = DynamicCache()
    model(input_ids=torch.arange(1, prefix + 1)[None], **cache_kwargs(model, cache))
    allowed, depths = tree_mask([-1, 0, 1, 2, 3])
    ours = layer_masks(attention_layout(model), allowed, prefix + depths, prefix, torch.float32, "cpu")
    theirs = create_masks_for_generate(
        model.config, torch.zeros(1, new, 32), None, cache, position_ids=(prefix + depths)[None]
    )
    if not isinstance(theirs, dict):
        theirs = {"sliding_attention": theirs}
    ours = ours if isinstance(ours, dict) else dict.fromkeys(theirs, ours)
    assert set(ours) == set(theirs)
    for layer_type, mask in theirs.items():
        assert torch.equal(ours[layer_type] == 0, mask == 0), layer_type


def test_tree_pass_logits_equal_the_chain_of_each_node_also_after_a_later_branch_won(family) -> None:
    """Every node of a tree fed on a prefix longer than the window gets the logits of its own chain; after a later
    branch is kept (the cache trimmed past a rejected one) the next tree pass does too."""
    model = sliding_model(family, WINDOW)
    prefix = [1, 5, 7, 9, 3, 2, 8, 11, 6]
    cache = tree_verify.prefill_root(model, torch.tensor([prefix]))
    # root, two branches of depth 3 and 2 off it, a third off the first branch's first node
    tokens, parents = [prefix[-1], 10, 12, 14, 20, 22, 30], [-1, 0, 1, 2, 0, 4, 1]
    paths = [[], [10], [10, 12], [10, 12, 14], [20], [20, 22], [10, 30]]
    logits = tree_verify.tree_forward(model, cache, tokens, parents)
    for node, path in enumerate(paths):
        want = chain_logits(model, prefix + path)[-1]
        torch.testing.assert_close(logits[node], want, atol=2e-5, rtol=1e-4, msg=f"{family} node {node}")
    tree_verify.commit_nodes(cache, len(prefix) - 1, [4])  # the second branch's 20 won, the target added 22
    committed = prefix + [20, 22]  # the cache holds all but 22, the next root
    tokens, parents = [committed[-1], 3, 4, 5, 6], [-1, 0, 1, 0, 3]
    logits = tree_verify.tree_forward(model, cache, tokens, parents)
    for node, path in enumerate([[], [3], [3, 4], [5], [5, 6]]):
        want = chain_logits(model, committed + path)[-1]
        torch.testing.assert_close(logits[node], want, atol=2e-5, rtol=1e-4, msg=f"{family} round 2 node {node}")


def test_tree_drafter_logits_equal_the_chain_of_each_node(family) -> None:
    """The draft side: a HF draft with sliding layers scores each batch of tree nodes as its own chain would, before
    and after a later branch was committed."""
    model = sliding_model(family, WINDOW, seed=2)
    prompt = [1, 5, 7, 9, 3, 2, 8, 11, 6]
    drafter = ModelTreeDrafter(model)
    drafter.start(prompt, None)
    torch.testing.assert_close(drafter.root().logits[0], chain_logits(model, prompt)[-1], atol=2e-5, rtol=1e-4)
    first = drafter.expand([10, 20], [-1, -1])
    second = drafter.expand([12, 14, 22], [0, 0, 1])
    for got, path in zip([*first.logits, *second.logits], [[10], [20], [10, 12], [10, 14], [20, 22]]):
        torch.testing.assert_close(got, chain_logits(model, prompt + path)[-1], atol=2e-5, rtol=1e-4)
    drafter.commit([20, 22, 7], None, [1, 4])  # the second branch won; the target added 7
    committed = prompt + [20, 22, 7]
    torch.testing.assert_close(drafter.root().logits[0], chain_logits(model, committed)[-1], atol=2e-5, rtol=1e-4)
    third = drafter.expand([3, 4], [-1, 0])
    for got, path in zip(third.logits, [[3], [3, 4]]):
        torch.testing.assert_close(got, chain_logits(model, committed + path)[-1], atol=2e-5, rtol=1e-4)


# --- greedy: every mask-based decoder writes the target's own text ----------------------------------------------------


def untrained_feature_draft(target) -> FeatureDraft:
    """``FeatureDraft.from_target`` (untrained: exactness needs no training), or for targets whose config it does not
    read (no ``intermediate_size``: MPT, Bloom, Falcon) a random one of the target's width."""
    if hasattr(target.config, "intermediate_size"):
        return FeatureDraft.from_target(target, torch.arange(VOCAB))
    shape = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    config = FeatureDraftConfig(hidden_size=32, vocab_size=VOCAB, kept_vocab_size=VOCAB, **shape)
    return FeatureDraft(config).bind(target)


def mask_decoders(target, draft) -> dict:
    """Every decoder that verifies under a custom mask, as ``decode(prompt, new_tokens) -> (1, L + N) ids``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, depth=1).eval()
        feature_head = AcceptanceHead(target.config.hidden_size, depth=1).eval()
    bundle = SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree=dict(width=3, max_depth=4))
    confidence = ConfidenceTree(width=3, top_k=3, max_depth=4, max_nodes=16)

    def tree(rule, drafter=lambda: draft):
        return lambda p, n: tree_generate(target, drafter(), p, rule, n, temperature=0).sequences

    return {
        "confidence tree": tree(confidence),
        "static tree": tree(StaticTree((3, 2, 1))),
        "head tree, feature draft": tree(
            HeadTree(feature_head, COST, width=2, top_k=2, max_depth=3), lambda: untrained_feature_draft(target)
        ),
        "SpecDecPP tree=True": lambda p, n: bundle.generate(p, n, temperature=0, tree=True).sequences,
        "custom_generate tree": lambda p, n: greedy(
            target, p, custom_generate=make_custom_generate(draft, confidence), max_new_tokens=n
        ),
        "lookahead": lambda p, n: lookahead_generate(target, p, n, 0, window=3, ngram=3, guess_set=3).sequences,
        "ngrammys": lambda p, n: ngrammys_generate(target, p, n, 0, strategy="context", k=3, w=4, q=1).sequences,
        "ouroboros": lambda p, n: ouroboros_generate(target, draft, p, n, 0, gamma=4, prompt_phrases=True).sequences,
    }


@pytest.mark.parametrize("window", [WINDOW, LONG_WINDOW], ids=["window 4", "window 64 (control)"])
def test_every_mask_decoder_equals_autoregressive_greedy(family, window: int) -> None:
    target = sliding_model(family, window)
    draft = perturbed_copy(target, relative_noise=0.15, seed=3)
    accepted = 0
    for name, decode in mask_decoders(target, draft).items():
        for prompt in PROMPTS:
            reference = autoregressive_generate(target, prompt, NEW, temperature=0).sequences
            out = decode(prompt, NEW)
            assert torch.equal(out.cpu(), reference), (family, window, name, prompt)
    for prompt in PROMPTS:  # the drafts' candidates were accepted: verification, not only the root, is under test
        accepted += sum(tree_generate(target, draft, prompt, StaticTree((3, 2, 1)), NEW, 0).stats.accepted)
    assert accepted > 0


# --- sampling: the target's exact distribution ----------------------------------------------------------------------

SMALL_PROMPT, SAMPLES = [0, 3, 5, 1, 3, 5, 0, 2], 400


@pytest.fixture(scope="module")
def small():
    """A Gemma-3 over 8 tokens, one sliding layer with a window of 2 then one global layer, its noisy copy as draft,
    and the exact distribution of its first four tokens after a prompt four times the window."""
    target = sliding_model("gemma3", 2, vocab=8, seed=1, initializer_range=0.5)
    return target, perturbed_copy(target, relative_noise=0.3, seed=1), exact_joint(target, SMALL_PROMPT, 4)


def sample_tree(target, draft):
    rule = ConfidenceTree(width=2, top_k=2, max_depth=2, max_nodes=6)
    return lambda g: tree_generate(target, draft, SMALL_PROMPT, rule, 4, temperature=1.0, generator=g)


def test_sampled_tree_decoding_keeps_a_sliding_targets_distribution(small) -> None:
    target, draft, joint = small
    tokens, hit_rate = sampled_tokens(sample_tree(target, draft), SAMPLES, len(SMALL_PROMPT))
    assert hit_rate > 0.3, hit_rate  # draft nodes were accepted often: verification under the mask is under test
    p_first, p_second = pair_p_values(tokens, joint)
    assert p_first > ALPHA and p_second > ALPHA, (p_first, p_second)


def test_a_tree_pass_without_the_window_is_detected(small, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old mask (every node sees the whole prefix) must fail the same χ² check."""
    from accept_head.trees.attention import AttentionLayout

    target, draft, joint = small
    monkeypatch.setattr(AttentionLayout, "full", property(lambda self: True))  # layer_masks: the tree pattern only
    tokens, _ = sampled_tokens(sample_tree(target, draft), SAMPLES // 4, len(SMALL_PROMPT))
    assert min(pair_p_values(tokens, joint)) < ALPHA


# --- ALiBi: refused by every mask-based decoder, with one clear message -------------------------------------------

REFUSED = (
    "uses ALiBi attention biases, which transformers computes from each key's index in the input rather than from "
    "position_ids, so the nodes of a token tree would get the biases of their places in the flattened tree. Draft "
    "trees (tree_generate, SpecDecPP.generate(tree=True), generate(custom_generate=...) with a tree rule), "
    "Lookahead, N-Grammys and Ouroboros cannot take it as their {role}; decode with the chain instead: "
    "speculative_generate, or SpecDecPP.generate without tree=True."
)


def alibi_models() -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return {
            "mpt": MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2)).eval(),
            "bloom": BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_head=4, n_layer=2)).eval(),
            "falcon": FalconForCausalLM(
                FalconConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    num_attention_heads=4,
                    num_hidden_layers=2,
                    alibi=True,
                    new_decoder_architecture=False,
                )
            ).eval(),
        }


@pytest.mark.parametrize("model_type", ["mpt", "bloom", "falcon"])
def test_alibi_targets_are_refused_by_every_mask_decoder_and_decode_with_the_chain(model_type: str) -> None:
    target = alibi_models()[model_type]
    expected = f"The target {type(target).__name__} (model_type '{model_type}') " + REFUSED.format(role="target")
    prompt = PROMPTS[0]
    for name, decode in mask_decoders(target, target).items():
        with pytest.raises(ValueError) as error:
            decode(prompt, 4)
        assert str(error.value) == expected, name
    reference = autoregressive_generate(target, prompt, 8, temperature=0).sequences
    assert torch.equal(speculative_generate(target, target, prompt, FixedK(3), 8, temperature=0).sequences, reference)


def test_an_alibi_draft_is_refused_for_a_tree() -> None:
    target, draft = make_llama(num_layers=1), alibi_models()["bloom"]
    draft.resize_token_embeddings(target.config.vocab_size)
    with pytest.raises(ValueError) as error:
        tree_generate(target, draft, PROMPTS[0], StaticTree((2, 1)), 4, temperature=0)
    assert str(error.value) == "The draft BloomForCausalLM (model_type 'bloom') " + REFUSED.format(role="draft")


def test_layer_types_a_tree_mask_cannot_express_are_refused() -> None:
    target = sliding_model("qwen2", WINDOW, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"\['chunked_attention'\] layers, and a tree mask expresses only"):
        ngrammys_generate(target, PROMPTS[0], 4, 0, strategy="context")


# --- the context limit ------------------------------------------------------------------------------------------------


def test_a_request_past_the_context_warns_and_returns_what_fits() -> None:
    target = make_llama(num_layers=1, max_position_embeddings=16)
    prompt = list(range(10, 20))
    message = (
        "The prompt has 10 tokens and max_new_tokens=10, but LlamaForCausalLM has a context of 16 positions "
        "(max_position_embeddings): decoding stops at its end, after at most 6 new tokens."
    )
    decoders = {
        "autoregressive": lambda n: autoregressive_generate(target, prompt, n, 0).sequences,
        "chain": lambda n: speculative_generate(target, target, prompt, FixedK(2), n, 0).sequences,
        "tree": lambda n: tree_generate(target, target, prompt, StaticTree((2, 1)), n, 0).sequences,
        "lookahead": lambda n: lookahead_generate(target, prompt, n, 0).sequences,
        "custom_generate": lambda n: greedy(
            target, prompt, custom_generate=make_custom_generate(target, FixedK(2)), max_new_tokens=n
        ),
    }
    for name, decode in decoders.items():
        with pytest.warns(ContextLimitWarning) as caught:
            out = decode(10)
        assert any(str(w.message).startswith(message) for w in caught), (name, [str(w.message) for w in caught])
        assert out.shape[1] == 16, name
        with warnings.catch_warnings():
            warnings.simplefilter("error", ContextLimitWarning)
            assert decode(6).shape[1] == 16, name  # exactly the context: no warning
