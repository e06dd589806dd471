"""SpecDec++ inside ``model.generate``: a ``custom_generate`` callable for any stop policy and any drafter.

::

    fn = make_custom_generate(draft, FixedK(4))            # or SpecDecPP(...).custom_generate, the trained head
    out = target.generate(**inputs, custom_generate=fn, max_new_tokens=64, do_sample=True, temperature=0.7,
                          top_p=0.9, repetition_penalty=1.1, streamer=TextStreamer(tokenizer))

transformers (>= 4.56) prepares the inputs, the generation config, its logits processors and its stopping criteria,
then hands the decoding loop to the callable. This module runs speculative rounds (the drafting of
:func:`~accept_head.chain.decoding.draft_round`, the accept/reject step of :func:`~accept_head.chain.decoding.verify`)
with those
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

Draft trees. With a :class:`~accept_head.trees.growth.TreeRule` instead of a stop policy (for a bundle:
``generate(..., tree=True)``) each round drafts a token tree and verifies it in one target pass, as
:func:`~accept_head.trees.decoding.tree_generate` does (:func:`speculative_tree_decode`). A node's context is the
committed prefix x and its own path y_1..y_d from the root, not the flattened tree: the target's row after that node is
processed as Φ_{x·y≤d}(target logits), the draft's proposals from it as Φ_{x·y≤d}(draft logits)
(:class:`ProcessedTreeDrafter`). The candidates (the top-k of those processed draft distributions) are then
deterministic functions of x, so :func:`~accept_head.trees.verify.verify_sampled` emits each token from the target's
processed p whatever they are, and greedy verification follows the processed argmax.

Processors must be functions of (input_ids, scores): they are called at hypothetical contexts (candidates that may be
rejected) and out of order. Those that keep state or run a model themselves are refused by name
(:data:`UNSUPPORTED_PROCESSORS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..chain.decoding import (
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
from ..chain.policies import StopPolicy
from ..core.hf_compat import (
    CACHE_KWARGS,
    OUTPUT_CACHE_FIELD,
    cache_length,
    crop_cache,
    enclosing_generate_arguments,
    passed_cache,
)
from ..core.sampling import SamplingConfig, probabilities
from ..models.drafters import Drafter, DraftStep, as_drafter
from ..models.features import capture_lm_head_input
from ..trees.attention import attention_layout
from ..trees.chain_copies import ChainRounds, CopyingChain
from ..trees.decoding import TreeRounds, tree_drafter_for, tree_rows, verify_tree
from ..trees.drafters import TreeDrafter, TreeStep
from ..trees.growth import TreeRule
from ..trees.verify import TreeDecodeStats, commit_nodes, tree_forward

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

    def paths(self, logits: torch.Tensor, start: int, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """logits (R, V) of tree nodes whose contexts are buffer[:start] followed by ``paths[i]`` (the tokens from
        the root down to node i) → (R, V) float32 processed scores. Each path is written into buffer[start:] before
        its row is processed, so every row sees its own branch, never its siblings or cousins."""
        if not self.processors:
            return logits.to(device=self.buffer.device, dtype=torch.float32)
        rows = []
        for row, path in zip(logits, paths, strict=True):
            self.buffer[0, start : start + len(path)] = torch.tensor(path, dtype=torch.long)
            rows.append(self(row, start + len(path)))
        return torch.stack(rows)


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


class ProcessedTreeDrafter(TreeDrafter):
    """Wraps a tree drafter so that every :class:`~accept_head.trees.drafters.TreeStep` carries, for each node fed,
    Φ_{x·path}(draft logits): the processors at the committed text x followed by that node's own path from the root
    (the context of the target's row after it). The root step is processed at x; a root whose processed scores are
    all −inf ends the round with no tree (the draft has nothing to propose)."""

    def __init__(self, inner: TreeDrafter, process: ProcessedLogits) -> None:
        self.inner, self.process = inner, process
        self.vocab_size = inner.vocab_size
        self.hidden_size = inner.hidden_size
        self.needs_target_features = inner.needs_target_features
        self.context_limit = inner.context_limit
        self.length = 0  # committed tokens
        self.paths: list[list[int]] = []  # per slot fed this round: the tokens from depth 1 down to its node

    def start(self, prompt: Sequence[int], features: torch.Tensor | None) -> None:
        self.inner.start(prompt, features)
        self.length, self.paths = len(prompt), []

    def root(self) -> TreeStep | None:
        step = self.inner.root()
        if step is None:
            return None
        step = step.over_vocabulary(self.vocab_size)  # processors read whole-vocabulary scores
        scores = self.process.paths(step.logits, self.length, [[]])
        if self.process.processors and not bool(torch.isfinite(scores).any()):
            return None
        return TreeStep(scores, step.hidden)

    def expand(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeStep:
        step = self.inner.expand(tokens, parents).over_vocabulary(self.vocab_size)
        for token, parent in zip(tokens, parents):
            self.paths.append([*(self.paths[parent] if parent >= 0 else []), int(token)])
        return TreeStep(self.process.paths(step.logits, self.length, self.paths[-len(tokens) :]), step.hidden)

    def commit(self, tokens: Sequence[int], features: torch.Tensor | None, slots: Sequence[int]) -> None:
        self.inner.commit(tokens, features, slots)
        self.length, self.paths = self.length + len(tokens), []


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
    outputs = ("output_attentions", "output_hidden_states")  # generate hands them over in either place
    asked = [k for k in outputs if model_kwargs.get(k) or getattr(generation_config, k, False)]
    if asked and (generation_config.return_dict_in_generate or any(model_kwargs.get(k) for k in outputs)):
        raise ValueError(
            f"{' / '.join(asked)} not supported by SpecDec++ custom_generate (output_scores and output_logits are): "
            "leave it out."
        )
    handled = _HANDLED_MODEL_KWARGS | set(outputs)
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in handled)
    if unknown:
        raise ValueError(f"SpecDec++ custom_generate does not forward model inputs {unknown} (text-only prompts).")


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


@_ordinary_outputs
def speculative_tree_decode(
    target: torch.nn.Module,
    drafter: TreeDrafter | Drafter,
    rule: TreeRule | CopyingChain,
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
    """Tree rounds (:func:`~accept_head.trees.decoding.tree_generate`'s) with HF logits processors at every node, at
    its own branch context, and HF stopping criteria (batch size 1). Arguments and streaming as
    :func:`speculative_decode`; ``drafter`` is a tree drafter (:func:`~accept_head.trees.decoding.tree_drafter_for`)
    and the stats are :class:`~accept_head.trees.verify.TreeDecodeStats`. With a
    :class:`~accept_head.trees.chain_copies.CopyingChain` for ``rule`` (and its chain drafter) the rounds are a stop
    policy's chains with copied rows beside them (:func:`~accept_head.trees.chain_copies.chain_copy_generate`'s)."""
    sampling = SamplingConfig(0.0 if greedy else 1.0)  # the processors already hold temperature / top-k / top-p
    device = next(target.parameters()).device
    prompt_len = input_ids.shape[1]
    budget = _check_lengths(prompt_len, max(max_length - prompt_len, 0), target)
    buffer = torch.zeros((1, prompt_len + budget + 1), dtype=torch.long, device=device)
    buffer[0, :prompt_len] = input_ids[0].to(device)
    process = ProcessedLogits(processors, buffer)
    layout = attention_layout(target)  # checked by tree_drafter_for or CopyingChain.drafter
    stats, kept_scores, kept_logits = TreeDecodeStats(), [], []
    if isinstance(rule, CopyingChain):
        rounds = ChainRounds(ProcessedDrafter(drafter, process), rule, sampling, stats, generator)
    else:
        rounds = TreeRounds(ProcessedTreeDrafter(drafter, process), rule, sampling, stats, generator)
    drafter = rounds.drafter
    cache = DynamicCache()  # the target's: it lacks the last committed token, each round's root
    with _timed(stats, "total_time"):
        with _timed(stats, "target_time"):
            prefill(target, drafter, buffer[:, :prompt_len], cache)
        n = prompt_len  # committed length
        while n - prompt_len < budget:
            # 1. Draft a tree from Φ at each node's own path (ProcessedTreeDrafter); a path commits at most
            #    budget - generated - 1 candidates, never past the draft's context.
            depth = min(budget - (n - prompt_len) - 1, draft_room(drafter, n))
            with _timed(stats, "draft_time"):
                tree, nodes = rounds.draft(buffer[0, :n].tolist(), depth)
            # 2. Verify the root and the nodes in one pass; the row after node v is processed at x·path(v).
            with _timed(stats, "target_time"):
                tree_tokens, parents, paths, rows = tree_rows(tree, nodes)
                with capture_lm_head_input(target) as box:
                    root = int(buffer[0, n - 1])
                    logits = tree_forward(target, cache, [root, *tree_tokens], [-1, *parents], layout=layout)
                contexts = [[], *([tree.tokens[v] for v in tree.path(node)] for node in nodes)]
                scores = process.paths(logits, n, contexts)  # (1 + |nodes|, V)
                row, m, next_token = verify_tree(scores, tree, paths, rows, sampling, generator)
            accepted, drawn_from = (paths[row][:m], [0, *rows[row][:m]]) if m else ([], [0])  # target rows used
            # 3. Commit the accepted path and the target's token, up to the first one after which a criterion fires.
            new = [*(tree.tokens[v] for v in accepted), next_token]
            buffer[0, n : n + len(new)] = torch.tensor(new, dtype=torch.long)
            stop = _stop_index(stopping_criteria, buffer, n, scores[drawn_from], len(new))
            count = len(new) if stop is None else stop + 1
            stats.record_tree_round(1 + len(nodes), len(paths), len(paths[row]) if row >= 0 else 0, m, count)
            commit_nodes(cache, n - 1, drawn_from[1:count])  # all committed tokens but the last, as in HF's loop
            if keep_scores:
                kept_scores.extend(scores[i : i + 1].clone() for i in drawn_from[:count])
            if keep_logits:
                kept_logits.extend(logits[i : i + 1].float() for i in drawn_from[:count])
            if streamer is not None:
                streamer.put(torch.tensor(new[:count], dtype=torch.long))
            n += count
            if stop is not None:
                break
            with _timed(stats, "draft_time"):
                rounds.commit(tree, accepted, new, box[0][0, drawn_from] if drafter.needs_target_features else None)
    return DecodeOutput(buffer[:, :n], stats, kept_scores, kept_logits, cache)


@contextmanager
def streamer_ended_on_error(streamer: Any = None) -> Iterator[None]:
    """End ``streamer`` (else the one passed to the enclosing ``generate``) if the block raises, so that a consumer
    reading it (``TextIteratorStreamer``) is never left waiting for a generation that failed before it began."""
    try:
        yield
    except BaseException:
        streamer = streamer if streamer is not None else enclosing_generate_arguments().get("streamer")
        if streamer is not None:
            streamer.end()
        raise


def run_custom_generate(
    model: torch.nn.Module,
    draft: torch.nn.Module | Drafter,
    policy: StopPolicy | TreeRule,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor | SpecDecGenerateOutput, DecodeStats]:
    """The body of every SpecDec++ ``custom_generate`` callable: validate, decode, shape the output like HF.

    ``policy``: a stop policy decodes chains (:func:`speculative_decode`), a
    :class:`~accept_head.trees.growth.TreeRule` draft trees and a
    :class:`~accept_head.trees.chain_copies.CopyingChain` chains with copied rows (:func:`speculative_tree_decode`; the
    target must take a custom 4D attention mask, eager or SDPA attention).

    ``streamer`` and ``assistant_model`` that transformers does not forward to the callable are read back from the
    enclosing ``generate`` call (see :func:`~accept_head.core.hf_compat.enclosing_generate_arguments`). A
    ``max_length`` past the target's ``max_position_embeddings`` warns at the start
    (:class:`~accept_head.chain.decoding.ContextLimitWarning`) and decoding stops there, where HF's own loop would go
    on with a "friendly reminder". Returns
    (sequences (1, L + N) or a :class:`SpecDecGenerateOutput` when ``return_dict_in_generate``, stats).
    """
    found = enclosing_generate_arguments()
    streamer = streamer if streamer is not None else found.get("streamer")
    try:
        check_request(model, input_ids, generation_config, model_kwargs, found.get("assistant_model"))
        check_processors(logits_processor)
        if isinstance(policy, TreeRule):
            decode, drafter = speculative_tree_decode, tree_drafter_for(draft, model, policy)
        elif isinstance(policy, CopyingChain):
            sampling = SamplingConfig(1.0 if generation_config.do_sample else 0.0)
            decode, drafter = speculative_tree_decode, policy.drafter(draft, model, sampling)
        else:
            decode, drafter = speculative_decode, as_drafter(draft, model, with_hidden=policy.uses_hidden)
        want = generation_config.return_dict_in_generate
        result = decode(
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
    ``generator=`` may be passed to ``generate`` as extra keyword arguments. A stop policy drafts chains, a
    :class:`~accept_head.trees.growth.TreeRule` (``ConfidenceTree()``, ``HeadTree(head, cost)``, ...) draft trees.
    The counters of the latest call are kept in :attr:`last_stats`.
    """

    def __init__(self, draft: torch.nn.Module | Drafter, policy: StopPolicy | TreeRule | CopyingChain) -> None:
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
        policy: StopPolicy | TreeRule | CopyingChain | None = None,
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


def make_custom_generate(
    draft: torch.nn.Module | Drafter, policy: StopPolicy | TreeRule | CopyingChain
) -> SpecDecGenerate:
    """A ``custom_generate`` callable for ``target.generate`` with any drafter the toolkit supports (an HF causal
    LM, a :class:`~accept_head.models.feature_draft.FeatureDraft`, a :class:`~accept_head.models.drafters.Drafter` such
    as a
    pruned ``ModelDrafter``) and any stop policy (``FixedK``, ``Heuristic``, ``HeadThreshold``, ...) or tree rule
    (``HeadTree``, ``ConfidenceTree``, ``StaticTree``, ...: tree decoding), or a stop policy's chains with rows copied
    from the text beside them (``CopyingChain(policy, context_row=4)``)."""
    return SpecDecGenerate(draft, policy)
