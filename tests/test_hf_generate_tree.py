"""Draft trees through ``model.generate(custom_generate=..., tree=True)`` (a bundle) or a ``TreeRule`` (any draft).

* Greedy output is the target's own ``generate(do_sample=False)``, with and without processors that read the
  sequence; processing each node at the flattened tree instead of its own branch breaks it (negative control).
* At temperature > 0 with a repetition penalty, temperature and top-k, the first tokens follow HF's own processed
  sampling distribution (χ²); the flattened-tree context fails the same check.
* Scores, logits, cache and stats of ``return_dict_in_generate``; streamers; stopping criteria and EOS lists.
* The bundle's ``tree=True`` and the hub file; clear errors for what the tree path refuses.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from generate_helpers import AtLength, Recorder, greedy
from stats_helpers import ALPHA, exact_joint, pair_p_values, sampled_tokens
from tiny_models import (
    distilled_feature_draft,
    make_llama,
    make_pair,
    make_tokenizer,
    perturbed_copy,
    small_vocab_llama,
)
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopKLogitsWarper,
)
from transformers.generation import GenerateDecoderOnlyOutput

import accept_head.specdecpp.hf_generate as hf_generate
from accept_head import (
    AcceptanceHead,
    FixedK,
    ModelSpec,
    SpecDecPP,
    load_model,
    load_tokenizer,
    make_custom_generate,
)
from accept_head.core.costs import CostModel
from accept_head.core.hf_compat import OUTPUT_CACHE_FIELD
from accept_head.models.features import lm_head_input
from accept_head.specdecpp.bundle import CUSTOM_GENERATE
from accept_head.trees.drafters import FeatureTreeDrafter, ModelTreeDrafter
from accept_head.trees.growth import ConfidenceTree, HeadTree, StaticTree
from accept_head.trees.verify import TreeDecodeStats

COST = CostModel(t_draft=0.004, t_target_a=0.039, t_target_b=0.00032)
PROMPTS = ([2, 10, 11], [5, 9, 10, 11, 40, 41], [7])
PROCESSED = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, min_new_tokens=6)
"""Greedy options whose processors read the sequence, so a node processed at the wrong context changes the output."""


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama target (no default EOS: generations run to ``max_new_tokens``) and a noisy copy as the draft."""
    target = make_llama(seed=0, num_layers=3)
    target.generation_config.eos_token_id = None
    return target, perturbed_copy(target, relative_noise=0.05, seed=1)


def tree_rules(hidden_size: int) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(hidden_size, depth=1).eval()
    with torch.no_grad():
        head.out.bias.fill_(2.0)  # optimistic: the tree grows several depths
    return {
        "head": HeadTree(head, COST, width=3, top_k=3, max_depth=4, max_nodes=16),
        "confidence": ConfidenceTree(width=3, top_k=3, max_depth=4, max_nodes=16),
        "static": StaticTree((3, 2, 1)),
    }


def flattened_paths(self: hf_generate.ProcessedLogits, logits: torch.Tensor, start: int, paths) -> torch.Tensor:
    """A broken ``ProcessedLogits.paths``: each node's row processed at the tree laid out flat after the prefix (its
    earlier siblings and cousins in the context), as chain-minded code that wrote the tree into the buffer would."""
    flat = torch.tensor([[path[-1] for path in paths if path]], dtype=torch.long)
    context = torch.cat([self.buffer[:, :start], flat], dim=1)
    rows, seen = [], 0
    for row, path in zip(logits, paths):
        seen += bool(path)
        rows.append(self.processors(context[:, : start + seen], row.float().clone()[None])[0])
    return torch.stack(rows)


# ---- greedy output is the target's own ----------------------------------------------------------------------------


@pytest.mark.parametrize("rule_name", ["head", "confidence", "static"])
@pytest.mark.parametrize("options", [{}, PROCESSED], ids=["plain", "processed"])
def test_greedy_tree_generate_equals_the_targets_own_greedy_generate(pair, rule_name: str, options: dict) -> None:
    target, draft = pair
    fn = make_custom_generate(draft, tree_rules(draft.config.hidden_size)[rule_name])
    accepted, branched = 0, 0
    for prompt in PROMPTS:
        ours = greedy(target, prompt, custom_generate=fn, max_new_tokens=20, **options)
        assert torch.equal(ours, greedy(target, prompt, max_new_tokens=20, **options)), prompt
        assert isinstance(fn.last_stats, TreeDecodeStats) and fn.last_stats.generated == 20
        accepted += sum(fn.last_stats.accepted)
        branched += sum(rows > 1 for rows in fn.last_stats.rows)
    assert accepted > 0 and branched > 0  # drafted nodes were accepted, from trees with several leaves


def test_a_feature_draft_gets_the_targets_features_of_the_committed_text(pair) -> None:
    """Greedy output stays the target's with a feature draft, which receives exactly the target's teacher-forced
    features of every committed position (read from the verification passes, the accepted path's rows)."""
    target, _ = pair
    received = []

    class Recording(FeatureTreeDrafter):
        def start(self, prompt, features):
            received.append(features.clone())
            super().start(prompt, features)

        def commit(self, tokens, features, slots):
            received.append(features.clone())
            super().commit(tokens, features, slots)

    reference = greedy(target, PROMPTS[1], max_new_tokens=16, **PROCESSED)
    everything = torch.arange(target.config.vocab_size)
    draft = Recording(distilled_feature_draft(target, everything, reference.tolist(), steps=100), target)
    fn = make_custom_generate(draft, tree_rules(target.config.hidden_size)["head"])
    ours = greedy(target, PROMPTS[1], custom_generate=fn, max_new_tokens=16, **PROCESSED)
    assert torch.equal(ours, reference)
    assert sum(fn.last_stats.accepted) > 0
    got, want = torch.cat(received), lm_head_input(target, ours[:, :-1])[0]
    assert len(PROMPTS[1]) - 1 < got.shape[0] < want.shape[0]  # the round that reached max_length commits nothing
    torch.testing.assert_close(got, want[: got.shape[0]], atol=1e-5, rtol=1e-4)


def test_processing_at_the_flattened_tree_breaks_greedy_equality(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: a node's context must be its own branch, not the tree laid out flat."""
    target, draft = pair
    fn = make_custom_generate(draft, tree_rules(draft.config.hidden_size)["confidence"])
    monkeypatch.setattr(hf_generate.ProcessedLogits, "paths", flattened_paths)
    options = dict(max_new_tokens=20, **PROCESSED)
    same = [
        torch.equal(greedy(target, x, custom_generate=fn, **options), greedy(target, x, **options)) for x in PROMPTS
    ]
    assert not all(same), same


def test_draft_nodes_are_processed_at_their_own_branch(pair) -> None:
    """Each node's draft scores equal the processors applied at prefix + its path to a fresh draft pass there."""
    target, draft = pair
    prompt = [5, 9, 10, 11, 9, 10]
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8), NoRepeatNGramLogitsProcessor(2)])
    buffer = torch.zeros((1, 20), dtype=torch.long)
    buffer[0, : len(prompt)] = torch.tensor(prompt)
    drafter = hf_generate.ProcessedTreeDrafter(ModelTreeDrafter(draft), hf_generate.ProcessedLogits(processors, buffer))
    drafter.start(prompt, None)
    steps = [(drafter.root(), [[]])]
    steps.append((drafter.expand([11, 40], [-1, -1]), [[11], [40]]))  # slots 0, 1: two children of the root
    steps.append((drafter.expand([12, 9], [1, 0]), [[40, 12], [11, 9]]))  # slot 2 under slot 1, slot 3 under 0
    for step, paths in steps:
        for scores, path in zip(step.logits, paths, strict=True):
            ids = torch.tensor([prompt + path])
            with torch.no_grad():
                want = processors(ids, draft(input_ids=ids).logits[:, -1].float())[0]
            assert torch.equal(torch.isinf(scores), torch.isinf(want)), path  # the same tokens banned
            finite = torch.isfinite(want)
            torch.testing.assert_close(scores[finite], want[finite], atol=1e-4, rtol=1e-4)
    # The prompt holds the bigrams (10, 11) and (11, 9): 11 is banned at the root, 9 after node 11 but not after 40.
    root, children = steps[0][0].logits, steps[1][0].logits
    assert bool(torch.isinf(root[0, 11])) and bool(torch.isinf(children[0, 9])) and bool(torch.isfinite(children[1, 9]))


# ---- sampling: HF's processed distribution (χ²) --------------------------------------------------------------------

SMALL_PROMPT, NEW, SAMPLES = [0, 3, 5, 0, 3, 5, 0], 4, 1500
SAMPLED = dict(do_sample=True, repetition_penalty=2.0, temperature=0.7, top_k=5)


def sampled_processors() -> LogitsProcessorList:
    """What generate builds for :data:`SAMPLED` (pinned by the spy below)."""
    return LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(2.0), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    )


@pytest.fixture(scope="module")
def small():
    target = small_vocab_llama(seed=0)
    target.generation_config.eos_token_id = None
    draft = perturbed_copy(target, relative_noise=0.3, seed=1)
    return target, draft, exact_joint(target, SMALL_PROMPT, NEW, sampled_processors())


def test_generate_builds_the_processors_the_tree_chi_square_test_uses(small) -> None:
    target, _, _ = small
    seen = {}

    def spy(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen["processors"] = logits_processor
        return input_ids

    target.generate(torch.tensor([SMALL_PROMPT]), custom_generate=spy, max_new_tokens=NEW, **SAMPLED)
    assert [type(p) for p in seen["processors"]] == [type(p) for p in sampled_processors()]
    scores = torch.randn(1, 8)
    ids = torch.tensor([SMALL_PROMPT])
    assert torch.equal(seen["processors"](ids, scores.clone()), sampled_processors()(ids, scores.clone()))


def sample_tree_generate(target, draft):
    fn = make_custom_generate(draft, ConfidenceTree(width=2, top_k=2, max_depth=2, max_nodes=6))
    x = torch.tensor([SMALL_PROMPT])
    return lambda g: target.generate(
        x, custom_generate=fn, generator=g, max_new_tokens=NEW, return_dict_in_generate=True, **SAMPLED
    )


def test_sampled_tree_generate_follows_hfs_processed_distribution(small) -> None:
    target, draft, joint = small
    tokens, hit_rate = sampled_tokens(sample_tree_generate(target, draft), SAMPLES, len(SMALL_PROMPT))
    assert hit_rate > 0.3, hit_rate  # drafted nodes were accepted often: verification itself is under test
    p_values = pair_p_values(tokens, joint)
    assert min(p_values) > ALPHA, p_values


def test_chi_square_rejects_the_flattened_tree_context(small, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: every node processed at the flattened tree (its siblings penalised as if generated). The
    draft side is broken too, but candidates only shape speed; the failure comes from the target's rows. Half the
    samples suffice (p ~ 1e-12 there; ~1e-5 with a quarter)."""
    target, draft, joint = small
    monkeypatch.setattr(hf_generate.ProcessedLogits, "paths", flattened_paths)
    tokens, _ = sampled_tokens(sample_tree_generate(target, draft), SAMPLES // 2, len(SMALL_PROMPT))
    p_values = pair_p_values(tokens, joint)
    assert min(p_values) < ALPHA, p_values


# ---- outputs, streaming, stopping ---------------------------------------------------------------------------------


def test_return_dict_scores_logits_and_cache_match_hf(pair) -> None:
    target, draft = pair
    options = dict(max_new_tokens=12, repetition_penalty=1.5, return_dict_in_generate=True)
    options.update(output_scores=True, output_logits=True)
    fn = make_custom_generate(draft, tree_rules(draft.config.hidden_size)["confidence"])
    ours = greedy(target, PROMPTS[1], custom_generate=fn, **options)
    ref = greedy(target, PROMPTS[1], **options)
    assert isinstance(ours, GenerateDecoderOnlyOutput) and torch.equal(ours.sequences, ref.sequences)
    vocab = target.config.vocab_size
    assert len(ours.scores) == len(ours.logits) == 12 and all(s.shape == (1, vocab) for s in ours.scores + ours.logits)
    for mine, theirs in zip(ours.scores + ours.logits, ref.scores + ref.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)  # processed at each token's own context
    assert getattr(ours, OUTPUT_CACHE_FIELD).get_seq_length() == ours.sequences.shape[1] - 1
    assert isinstance(ours.stats, TreeDecodeStats) and ours.stats.generated == 12 and sum(ours.stats.accepted) > 0
    assert not any(t.is_inference() for t in (ours.sequences, *ours.scores, *ours.logits))


def test_streamers_receive_exactly_the_output_tokens(pair) -> None:
    target, draft = pair
    fn = make_custom_generate(draft, tree_rules(draft.config.hidden_size)["confidence"])
    recorder = Recorder()
    out = greedy(target, PROMPTS[1], custom_generate=fn, max_new_tokens=16, streamer=recorder, **PROCESSED)
    assert recorder.puts[0] == PROMPTS[1] and recorder.ended == 1  # generate itself streams the prompt first
    assert sum(recorder.puts[1:], []) == out[0, len(PROMPTS[1]) :].tolist()
    assert len(recorder.puts) - 1 == fn.last_stats.target_calls  # one put per round, as tokens are verified
    tokenizer = make_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=5)
    out = greedy(target, PROMPTS[0], custom_generate=fn, max_new_tokens=12, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0, len(PROMPTS[0]) :])


def test_stopping_criteria_and_eos_lists_stop_at_the_first_firing_token(pair) -> None:
    target, _ = pair
    draft = perturbed_copy(target, relative_noise=0.0)  # its top child is always right: stops fall mid-path
    fn = make_custom_generate(draft, ConfidenceTree(width=2, top_k=2, max_depth=6, max_nodes=12))
    prompt = PROMPTS[1]
    stop = StoppingCriteriaList([AtLength(len(prompt) + 3)])
    out = greedy(
        target, prompt, custom_generate=fn, max_new_tokens=20, stopping_criteria=stop, return_dict_in_generate=True
    )
    ours = out.sequences
    assert ours.shape[1] == len(prompt) + 3 and fn.last_stats.accepted[0] >= 3  # trimmed inside the round
    assert torch.equal(ours, greedy(target, prompt, max_new_tokens=20, stopping_criteria=stop))
    assert getattr(out, OUTPUT_CACHE_FIELD).get_seq_length() == ours.shape[1] - 1  # the kept path, trimmed too
    free = greedy(target, prompt, max_new_tokens=20)[0, len(prompt) :].tolist()
    eos = [free[7], free[9]]
    first = min(i for i, token in enumerate(free) if token in eos)  # generation ends at the first of either
    ours = greedy(target, prompt, custom_generate=fn, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(ours, greedy(target, prompt, max_new_tokens=20, eos_token_id=eos))
    assert ours.shape[1] == len(prompt) + first + 1 and ours[0, -1].item() in eos


# ---- the bundle: tree=True through generate and the hub file; errors -----------------------------------------------


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """Two saved tiny bundles on one pair: ``tree`` (with a cost model and tree settings) and ``chain`` (without a
    cost model)."""
    root = tmp_path_factory.mktemp("cg-tree")
    target_dir, draft_dir = make_pair(root / "models")
    specs = ModelSpec(str(target_dir), dtype="float32"), ModelSpec(str(draft_dir), dtype="float32")
    target, draft = load_model(specs[0]), load_model(specs[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = AcceptanceHead(draft.config.hidden_size, depth=1)
    common = dict(tokenizer=load_tokenizer(specs[0]), target_spec=specs[0], draft_spec=specs[1])
    tree_settings = {"width": 2, "top_k": 3, "max_depth": 4, "max_nodes": 12}
    SpecDecPP(target, draft, head, 0.6, cost_model=COST.to_dict(), tree=tree_settings, **common).save_pretrained(
        root / "tree"
    )
    SpecDecPP(target, draft, head, 0.6, **common).save_pretrained(root / "chain")
    return {"tree": root / "tree", "chain": root / "chain"}


def test_bundle_tree_true_through_generate_and_the_hub_file(bundles: dict[str, Path]) -> None:
    specdec = SpecDecPP.from_pretrained(bundles["tree"])
    target, x = specdec.target, torch.tensor([[5, 9, 10, 11, 12, 13]])
    options = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3)
    reference = target.generate(x, **options)
    ours = target.generate(x, custom_generate=specdec.custom_generate, tree=True, **options)
    assert torch.equal(ours, reference) and isinstance(specdec.last_stats, TreeDecodeStats)
    assert specdec.last_stats.fed and specdec.last_stats.draft_calls > 0
    seeded = [
        target.generate(x, custom_generate=specdec.custom_generate, tree=True, do_sample=True, max_new_tokens=10,
                        generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]  # fmt: skip
    assert torch.equal(*seeded)
    # The hub convention: custom_generate/generate.py hands tree= and threshold= through to the bundle.
    spec = importlib.util.spec_from_file_location("tree_bundle_custom_generate", bundles["tree"] / CUSTOM_GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loaded = load_model(ModelSpec(str(specdec.target_spec.path), dtype="float32"))
    assert torch.equal(module.generate(loaded, x, tree=True, threshold=0.9, **options), reference)


@pytest.mark.parametrize(
    ("bundle", "options", "match"),
    [
        ("chain", {"tree": True}, "no cost model"),
        ("tree", {"tree": True, "guidance_scale": 1.5}, "UnbatchedClassifierFreeGuidanceLogitsProcessor cannot be"),
        ("tree", {"tree": True, "policy": FixedK(2)}, r"tree=True but policy=FixedK\(k=2\) is a chain stop policy"),
        ("tree", {"tree": "yes"}, "tree='yes' must be True"),
    ],
)
def test_tree_requests_the_decoder_cannot_serve_raise_clear_errors(
    bundles: dict[str, Path], bundle: str, options: dict, match: str
) -> None:
    specdec = SpecDecPP.from_pretrained(bundles[bundle])
    recorder = Recorder()
    with pytest.raises(ValueError, match=match):
        specdec.target.generate(
            torch.tensor([[5, 9, 10]]), custom_generate=specdec.custom_generate, max_new_tokens=4, streamer=recorder,
            **options,
        )  # fmt: skip
    assert recorder.ended == 1  # a streamer's consumer is never left waiting


def test_a_tree_rule_refuses_a_target_without_tree_masks(pair) -> None:
    target, draft = pair
    rule = ConfidenceTree(width=2, top_k=2, max_depth=2, max_nodes=4)
    original = target.config._attn_implementation
    try:
        target.config._attn_implementation = "flash_attention_2"
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
            greedy(target, PROMPTS[0], custom_generate=make_custom_generate(draft, rule), max_new_tokens=4)
    finally:
        target.config._attn_implementation = original
