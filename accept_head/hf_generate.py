"""SpecDec++ inside ``model.generate``: a ``custom_generate`` callable for any stop policy and any drafter.

::

    fn = make_custom_generate(draft, FixedK(4))            # or SpecDecPP(...).custom_generate, the trained head
    out = target.generate(**inputs, custom_generate=fn, max_new_tokens=64, do_sample=True, temperature=0.7,
                          top_p=0.9, repetition_penalty=1.1, streamer=TextStreamer(tokenizer))

transformers (>= 4.56) prepares the inputs, the generation config, its logits processors and its stopping criteria,
then hands the decoding loop to the callable. This module runs speculative rounds (the drafting of
:func:`~accept_head.decoding.draft_round`, the accept/reject step of :func:`~accept_head.decoding.verify`) with those
processors applied at every position, and honours stopping criteria, streamers and ``return_dict_in_generate``.

Why the output is exactly the target's processed distribution. Write Φ_c for the processor list at context c (a
deterministic map from raw logits to processed scores); HF's ``_sample`` draws x_t ~ softmax(Φ_{x<t}(logits_t)), or
takes its argmax when greedy. In a round with committed prefix x and candidates y_1..y_K the target's distribution
at candidate i is p_i = softmax(Φ_{x·y<i}(target logits_i)): exactly what HF would sample from had y_<i been
generated. :func:`verify` is exact for *any* proposal q_i that y_i was drawn from (Leviathan et al. 2023, Thm 1), so
losslessness needs p_i at the right context only. The draft side is processed the same way,
q_i = softmax(Φ_{x·y<i}(draft logits_i)), so that q_i is close to p_i: without it the draft would keep proposing
tokens that a penalty, a ban or top-p rules out, and acceptance would collapse. Greedy decoding is the limit case:
p_i and q_i are one-hot on their processed argmax, and the output is the target's own greedy output.

Processors must be functions of (input_ids, scores): they are called at hypothetical contexts (candidates that may be
rejected) and out of order. Those that keep state or run a model themselves are refused by name
(:data:`UNSUPPORTED_PROCESSORS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ._hf_compat import (
    CACHE_KWARGS,
    OUTPUT_CACHE_FIELD,
    cache_length,
    crop_cache,
    enclosing_generate_arguments,
    passed_cache,
)
from .decoding import (
    DecodeStats,
    _check_lengths,
    _check_pair,
    _target_pass,
    _timed,
    draft_room,
    draft_round,
    prefill,
    verify,
)
from .drafters import Drafter, DraftStep, as_drafter
from .policies import StopPolicy
from .sampling import SamplingConfig, probabilities

UNSUPPORTED_PROCESSORS: dict[str, str] = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs the model itself on a cache of its own, one committed "
    "token per call (guidance_scale)",
    "ClassifierFreeGuidanceLogitsProcessor": "it needs a doubled batch of conditional and unconditional rows",
    "SynthIDTextWatermarkLogitsProcessor": "it keeps state across calls (the context it has seen so far)",
    "WhisperTimeStampLogitsProcessor": "it is specific to Whisper's encoder-decoder timestamps",
    "WhisperNoSpeechDetection": "it runs the model itself and keeps state across calls",
    "AlternatingCodebooksLogitsProcessor": "it is specific to Bark's codebooks",
    "BarkEosPrioritizerLogitsProcessor": "it is specific to Bark",
    "DiaClassifierFreeGuidanceLogitsProcessor": "it needs a doubled batch (Dia)",
    "DiaEOSChannelFilterLogitsProcessor": "it is specific to Dia's audio channels",
    "DiaEOSDelayPatternLogitsProcessor": "it keeps state across calls (Dia)",
}
"""Logits processors (by class name) that cannot be evaluated at speculative positions, with the reason."""

_HANDLED_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", *CACHE_KWARGS}
"""What ``generate`` prepares for a plain decoder-only prompt; anything else (images, embeddings) is refused."""


@dataclass
class SpecDecGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` (sequences (1, L + N); scores/logits: N tensors (1, V) when asked for;
    ``cache`` (``past_key_values`` before transformers 5.24): the target's cache of all but the last token) plus the
    decoder's counters."""

    stats: DecodeStats | None = None


@dataclass
class DecodeOutput:
    """What :func:`speculative_decode` returns."""

    sequences: torch.Tensor
    """(1, L + N) LongTensor on the target's device."""
    stats: DecodeStats
    scores: list[torch.Tensor] = field(default_factory=list)
    """Processed target scores (1, V) of each generated token, if asked for."""
    logits: list[torch.Tensor] = field(default_factory=list)
    """Raw target logits (1, V) of each generated token, if asked for."""
    cache: DynamicCache | None = None


class ProcessedLogits:
    """Applies a ``LogitsProcessorList`` at a position whose context is the first ``length`` tokens of ``buffer``.

    ``buffer`` (1, max_length) LongTensor holds the committed tokens followed by this round's candidates, so the
    context of candidate i (prefix + y_<i) is always a prefix view of it — no copy per call.
    """

    def __init__(self, processors: LogitsProcessorList, buffer: torch.Tensor) -> None:
        self.processors = processors
        self.buffer = buffer

    def __call__(self, logits: torch.Tensor, length: int) -> torch.Tensor:
        """logits (V,) raw → (V,) float32 processed scores (a fresh tensor when processors run: they may work in
        place; without processors, the logits themselves when already float32)."""
        if not self.processors:
            return logits.to(device=self.buffer.device, dtype=torch.float32)
        scores = logits.to(device=self.buffer.device, dtype=torch.float32, copy=True)[None, :]
        return self.processors(self.buffer[:, :length], scores)[0]

    def rows(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        """logits (R, V) of the positions whose contexts are buffer[:start], buffer[:start + 1], … → (R, V) float32
        processed scores; one conversion for all rows when there are no processors."""
        if not self.processors:
            return logits.to(device=self.buffer.device, dtype=torch.float32)
        return torch.stack([self(logits[i], start + i) for i in range(logits.shape[0])])


class ProcessedDrafter(Drafter):
    """Wraps a drafter so that every :class:`DraftStep` carries Φ_{x·y<i}(draft logits) — the same processors, at
    the same context, as the target's candidate i — instead of the raw logits; sampling then uses temperature 1.

    The context is the shared ``buffer`` of :class:`ProcessedLogits`: candidates fed to the drafter are written
    into it. A step whose processed scores are all −inf (the processors ban every token the draft can propose)
    ends the round: the drafter has nothing to propose.
    """

    def __init__(self, inner: Drafter, process: ProcessedLogits) -> None:
        self.inner, self.process = inner, process
        self.vocab_size = inner.vocab_size
        self.hidden_size = inner.hidden_size
        self.needs_target_features = inner.needs_target_features
        self.context_limit = inner.context_limit
        self.length = 0  # committed tokens
        self.fed = 0  # candidates fed this round

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.start(prompt, features)
        self.length, self.fed = len(prompt), 0

    def propose(self, token: int | None) -> DraftStep | None:
        if token is not None:
            self.process.buffer[0, self.length + self.fed] = token
            self.fed += 1
        step = self.inner.propose(token)
        if step is None:
            return None
        scores = self.process(step.logits, self.length + self.fed)
        if self.process.processors and not bool(torch.isfinite(scores).any()):
            return None
        return DraftStep(scores, step.hidden)

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.commit(tokens, features)
        self.length, self.fed = self.length + len(tokens), 0


def check_processors(processors: LogitsProcessorList) -> None:
    """Raise ValueError for processors that cannot be applied at speculative positions (to the draft and to
    candidates that may be rejected)."""
    for processor in processors:
        reason = UNSUPPORTED_PROCESSORS.get(type(processor).__name__)
        if reason is not None:
            raise ValueError(
                f"{type(processor).__name__} cannot be applied to the draft's candidates: {reason}. Speculative "
                "decoding evaluates processors at hypothetical contexts; drop the option that adds it or decode "
                "without custom_generate."
            )


def check_request(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    assistant_model: torch.nn.Module | None = None,
) -> None:
    """Clear errors for what this decoder does not do (beams, several sequences, batches, padding, a second
    speculative method, outputs it cannot produce). ``input_ids``: (B, L) as prepared by ``generate``."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("SpecDec++ custom_generate supports decoder-only models; this one is an encoder-decoder.")
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams}: SpecDec++ samples one sequence (greedy or sampling); "
            "beam search is not supported. Pass num_beams=1."
        )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences}: SpecDec++ returns one sequence per "
            "call. Call generate once per sample."
        )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"SpecDec++ decodes batch size 1 only; got input_ids of shape {tuple(input_ids.shape)}. "
            "Loop over the prompts."
        )
    if input_ids.shape[1] == 0 or model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("SpecDec++ needs the prompt as input_ids (inputs_embeds and empty prompts are not supported).")
    if assistant_model is not None or generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            "An assistant_model (or prompt_lookup_num_tokens) was passed as well as the SpecDec++ custom_generate: "
            "both are speculative decoders. Drop the assistant; SpecDec++ drafts with its own draft."
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("The attention_mask masks some prompt tokens (padding); pass the unpadded prompt.")
    cache = passed_cache(model_kwargs)
    if cache is not None and cache_length(cache) > 0:
        raise ValueError(
            "The KV cache passed to generate (cache= / past_key_values=) holds a prefix already; SpecDec++ starts "
            "from the prompt, pass none."
        )
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_MODEL_KWARGS)
    if unknown:
        raise ValueError(f"SpecDec++ custom_generate does not forward model inputs {unknown} (text-only prompts).")
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        raise ValueError(
            "output_attentions / output_hidden_states are not supported by SpecDec++ custom_generate "
            "(output_scores and output_logits are)."
        )


def _stop_index(
    criteria: StoppingCriteriaList, buffer: torch.Tensor, start: int, scores: torch.Tensor, count: int
) -> int | None:
    """Index j of the first of ``count`` tokens buffer[0, start + j] after which a criterion fires, else None.

    Criteria see exactly what HF's loop shows them after each token: input_ids (1, start + j + 1) and the processed
    scores (1, V) that token was drawn from (``scores`` is (≥count, V)).
    """
    for j in range(count):
        if bool(criteria(buffer[:, : start + j + 1], scores[j : j + 1]).any()):
            return j
    return None


def _ordinary_outputs(decode: Callable[..., DecodeOutput]) -> Callable[..., DecodeOutput]:
    """Run ``decode`` under ``torch.inference_mode`` (which skips autograd's version counting on every small op: ~5%
    of wall time on the embedded pair against ``no_grad``, measured by ``python -m accept_head overhead``) and clone
    the sequences, scores and logits outside it, so that callers get ordinary tensors. The returned cache holds
    inference tensors: fine for further no-grad decoding (a DynamicCache only concatenates), not for in-place
    updates."""

    @functools.wraps(decode)
    def run(*args: Any, **kwargs: Any) -> DecodeOutput:
        with torch.inference_mode():
            out = decode(*args, **kwargs)
        out.sequences = out.sequences.clone()
        out.scores = [score.clone() for score in out.scores]
        out.logits = [logit.clone() for logit in out.logits]
        return out

    return run


@_ordinary_outputs
def speculative_decode(
    target: torch.nn.Module,
    drafter: Drafter,
    policy: StopPolicy,
    input_ids: torch.Tensor,
    processors: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    greedy: bool,
    max_length: int,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    keep_scores: bool = False,
    keep_logits: bool = False,
) -> DecodeOutput:
    """Speculative rounds with HF logits processors and stopping criteria (batch size 1).

    input_ids: (1, L). ``max_length``: L plus the new-token budget. Streams each round's committed tokens to
    ``streamer.put`` (a (n,) CPU LongTensor) as soon as they are verified; ``streamer.end()`` is the caller's.
    """
    sampling = SamplingConfig(0.0 if greedy else 1.0)  # the processors already hold temperature / top-k / top-p
    device = next(target.parameters()).device
    prompt_len = input_ids.shape[1]
    budget = _check_lengths(prompt_len, max(max_length - prompt_len, 0), target)
    buffer = torch.zeros((1, prompt_len + budget + 1), dtype=torch.long, device=device)
    buffer[0, :prompt_len] = input_ids[0].to(device)
    process = ProcessedLogits(processors, buffer)
    drafter = ProcessedDrafter(drafter, process)
    _check_pair(drafter, policy, sampling)
    stats, kept_scores, kept_logits = DecodeStats(), [], []
    policy.reset()
    cache = DynamicCache()  # the target's: it always lacks the last committed token, which the next pass feeds
    with _timed(stats, "total_time"):
        with _timed(stats, "target_time"):
            prefill(target, drafter, buffer[:, :prompt_len], cache)
        n = prompt_len  # committed length
        while n - prompt_len < budget:
            # 1. Draft y_1..y_K from q_i = softmax(Φ_{x·y<i}(draft logits)); the target adds one token, hence the -1.
            limit = min(policy.max_candidates, budget - (n - prompt_len) - 1, draft_room(drafter, n))
            with _timed(stats, "draft_time"):
                state, q_rows = draft_round(drafter, policy, sampling, limit, n, generator, stats)
            k = state.n
            # 2. Verify: one target pass over [x_{n-1}, y_1..y_K] gives raw logits at positions n..n+K; row i is
            #    processed at context buffer[:n+i] = x·y<i, so p_i is HF's processed distribution there (module doc).
            with _timed(stats, "target_time"):
                buffer[0, n : n + k] = torch.tensor(state.candidates, dtype=torch.long)
                logits, hidden = _target_pass(target, buffer[:, n - 1 : n + k], cache, drafter.needs_target_features)
                scores = process.rows(logits[: k + 1], n)  # (K+1, V)
                p = probabilities(scores, sampling)
                q = torch.stack(q_rows) if q_rows else p[:0]
                m, next_token = verify(p, q, buffer[0, n : n + k], generator)
            policy.update(state, m)
            # 3. Commit y_1..y_m and the target's token, up to the first token after which a stopping criterion fires.
            buffer[0, n + m] = next_token
            stop = _stop_index(stopping_criteria, buffer, n, scores, m + 1)
            count = m + 1 if stop is None else stop + 1
            new = buffer[0, n : n + count].tolist()
            stats.record_round(k, m, count)
            crop_cache(cache, n + count - 1)  # all committed tokens but the last, as in HF's own loop
            if keep_scores:
                kept_scores.extend(scores[j : j + 1].clone() for j in range(count))
            if keep_logits:
                kept_logits.extend(logits[j : j + 1].float() for j in range(count))
            if streamer is not None:
                streamer.put(torch.tensor(new, dtype=torch.long))
            n += count
            if stop is not None:
                break
            with _timed(stats, "draft_time"):
                drafter.commit(new, None if hidden is None else hidden[:count])
    return DecodeOutput(buffer[:, :n], stats, kept_scores, kept_logits, cache)


def run_custom_generate(
    model: torch.nn.Module,
    draft: torch.nn.Module | Drafter,
    policy: StopPolicy,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor | SpecDecGenerateOutput, DecodeStats]:
    """The body of every SpecDec++ ``custom_generate`` callable: validate, decode, shape the output like HF.

    ``streamer`` and ``assistant_model`` that transformers does not forward to the callable are read back from the
    enclosing ``generate`` call (see :func:`~accept_head._hf_compat.enclosing_generate_arguments`). Returns
    (sequences (1, L + N) or a :class:`SpecDecGenerateOutput` when ``return_dict_in_generate``, stats).
    """
    found = enclosing_generate_arguments()
    streamer = streamer if streamer is not None else found.get("streamer")
    try:
        check_request(model, input_ids, generation_config, model_kwargs, found.get("assistant_model"))
        check_processors(logits_processor)
        drafter = as_drafter(draft, model, with_hidden=policy.uses_hidden)
        want = generation_config.return_dict_in_generate
        result = speculative_decode(
            model,
            drafter,
            policy,
            input_ids,
            logits_processor,
            stopping_criteria,
            greedy=not generation_config.do_sample,
            max_length=generation_config.max_length,
            streamer=streamer,
            generator=generator,
            keep_scores=bool(want and generation_config.output_scores),
            keep_logits=bool(want and generation_config.output_logits),
        )
    finally:
        if streamer is not None:
            streamer.end()
    sequences = result.sequences.to(input_ids.device)
    if not want:
        return sequences, result.stats
    output = SpecDecGenerateOutput(
        sequences=sequences,
        scores=tuple(result.scores) if generation_config.output_scores else None,
        logits=tuple(result.logits) if generation_config.output_logits else None,
        **{OUTPUT_CACHE_FIELD: result.cache if generation_config.use_cache else None},
        stats=result.stats,
    )
    return output, result.stats


class SpecDecGenerate:
    """A ``custom_generate`` callable running speculative decoding with ``draft`` and ``policy``.

    ``target.generate(**inputs, custom_generate=SpecDecGenerate(draft, policy), ...)``; per call, ``policy=`` and
    ``generator=`` may be passed to ``generate`` as extra keyword arguments. The counters of the latest call are
    kept in :attr:`last_stats`.
    """

    def __init__(self, draft: torch.nn.Module | Drafter, policy: StopPolicy) -> None:
        self.draft, self.policy = draft, policy
        self.last_stats: DecodeStats | None = None

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        streamer: Any = None,
        policy: StopPolicy | None = None,
        generator: torch.Generator | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor | SpecDecGenerateOutput:
        output, self.last_stats = run_custom_generate(
            model,
            self.draft,
            policy if policy is not None else self.policy,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer=streamer,
            generator=generator,
            **model_kwargs,
        )
        return output

    def __repr__(self) -> str:
        return f"SpecDecGenerate(draft={type(self.draft).__name__}, policy={self.policy.describe()})"


def make_custom_generate(draft: torch.nn.Module | Drafter, policy: StopPolicy) -> SpecDecGenerate:
    """A ``custom_generate`` callable for ``target.generate`` with any drafter the toolkit supports (an HF causal
    LM, a :class:`~accept_head.feature_draft.FeatureDraft`, a :class:`~accept_head.drafters.Drafter` such as a
    pruned ``ModelDrafter``) and any stop policy (``FixedK``, ``Heuristic``, ``HeadThreshold``, ...)."""
    return SpecDecGenerate(draft, policy)
