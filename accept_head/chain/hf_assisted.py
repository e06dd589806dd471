"""HF transformers' own assisted generation on a target/draft pair, measured in the same :class:`DecodeStats` shape.

``target.generate(..., assistant_model=draft)`` with the assistant's generation config setting the candidate length
(``num_assistant_tokens``), its schedule (``"constant"``, ``"heuristic"``, ``"heuristic_transient"``) and the
confidence stop (``assistant_confidence_threshold``, auto-tuned by HF from the ROC of the draft's probabilities).
Only public APIs are used: ``generate`` and torch forward hooks, which count and time the models' passes — HF does
not report target calls, so the rounds are reconstructed from the target passes (their input length and the length
of the KV cache they extend).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import timing
from ..core.hf_compat import cache_length, passed_cache
from ..core.timing import device_timer, module_device, synchronize
from ..models.pairs import check_same_vocab
from .decoding import DecodeStats, GenerationResult, _as_input_ids, _eos_set

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@dataclass
class AssistedSettings:
    """How HF's assisted generation chooses the candidate length (fields of the assistant's generation config)."""

    num_assistant_tokens: int = 20
    """Candidates per round (the start value for the heuristic schedules; HF's default is 20)."""
    schedule: str = "constant"
    """``constant``, ``heuristic`` (K += 2 after a fully accepted round, else K −= 1; K persists across calls) or
    ``heuristic_transient`` (the same, restarted every call)."""
    confidence_threshold: float = 0.0
    """Stop drafting when the draft's probability of its token is below this (0 disables it; HF's default is 0.4,
    which HF then re-tunes during each call from the ROC of (probability, accepted) with cost fpr + 3·fnr)."""

    def __post_init__(self) -> None:
        if self.num_assistant_tokens < 1:
            raise ValueError(f"num_assistant_tokens={self.num_assistant_tokens} must be >= 1.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold} must be in [0, 1) (0 disables it).")

    def describe(self) -> str:
        text = f"HF({self.schedule}, K={self.num_assistant_tokens}"
        if self.confidence_threshold > 0:
            text += f", conf={self.confidence_threshold:g}"
        return text + ")"


class _PassRecorder:
    """Forward hooks that count and time a model's passes; for the target also (cache length, input length)."""

    def __init__(self, model: torch.nn.Module, record_shapes: bool) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.shapes: list[tuple[int, int]] = []
        self._record_shapes = record_shapes
        self._start = 0.0
        self._device = module_device(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, module, args, kwargs) -> None:
        synchronize(self._device)  # earlier work is not this pass's
        self._start = timing.clock()
        if self._record_shapes:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            self.shapes.append((int(cache_length(passed_cache(kwargs))), int(input_ids.shape[1])))

    def _post(self, module, args, output) -> None:
        synchronize(self._device)  # the pass's kernels may still be running
        self.seconds += timing.clock() - self._start
        self.calls += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def rounds_from_target_passes(
    passes: Sequence[tuple[int, int]], prompt_length: int, final_length: int
) -> tuple[list[int], list[int]]:
    """Per-round (proposed, accepted) from the target passes of one assisted generation.

    ``passes`` holds (tokens already in the target's cache, tokens fed) per pass. Round r starts from a sequence of
    n_r tokens (n_1 = the prompt; later n_r = cache + 1, since HF crops the cache to the accepted prefix and feeds the
    last token again); it proposes K_r = cache_r + fed_r − n_r candidates and accepts m_r = n_{r+1} − n_r − 1 of them
    (the round's own target token excluded), clipped to [0, K_r] where EOS or the length limit cut the last round.
    """
    starts = [prompt_length] + [cached + 1 for cached, _ in passes[1:]]
    ends = starts[1:] + [final_length]
    proposed, accepted = [], []
    for (cached, fed), start, end in zip(passes, starts, ends):
        k = cached + fed - start
        if k < 0:
            raise AssertionError(f"inconsistent assisted-generation pass: cache {cached}, fed {fed}, start {start}")
        proposed.append(k)
        accepted.append(min(max(end - start - 1, 0), k))
    return proposed, accepted


class HFAssisted:
    """Runs ``target.generate(assistant_model=draft)`` with fixed :class:`AssistedSettings`, one prompt at a time.

    The settings live in this object, not in ``draft.generation_config``: they are swapped in for each call and the
    draft's own config is restored afterwards, while what HF writes back (the ``heuristic`` schedule's K) is kept here
    so it persists across calls as it would in HF. Sampling uses HF's global RNG, so each call runs under
    ``torch.random.fork_rng`` seeded from the ``generator`` passed in: results are reproducible and the caller's
    global RNG state is untouched.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, settings: AssistedSettings) -> None:
        check_same_vocab(target, draft)
        self.target, self.draft, self.settings = target, draft, settings
        self.reset()

    def reset(self) -> None:
        """Forget what earlier calls taught the schedule (the persisted heuristic K)."""
        config = copy.deepcopy(self.draft.generation_config)
        config.num_assistant_tokens = self.settings.num_assistant_tokens
        config.num_assistant_tokens_schedule = self.settings.schedule
        config.assistant_confidence_threshold = self.settings.confidence_threshold
        self._assistant_config = config

    def describe(self) -> str:
        return self.settings.describe()

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        """Generate like :func:`~accept_head.chain.decoding.speculative_generate` (same arguments and result shape)."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy).")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1 for HF's generate.")
        ids = _as_input_ids(input_ids)
        device = next(self.target.parameters()).device
        eos = sorted(_eos_set(eos_token_id))
        kwargs = dict(max_new_tokens=max_new_tokens, num_beams=1, use_cache=True, repetition_penalty=1.0)
        if temperature == 0:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0)
        if eos:
            kwargs.update(eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=eos[0])
        seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator is not None else 0
        devices = [device] if device.type == "cuda" else []
        target_passes = _PassRecorder(self.target, record_shapes=True)
        draft_passes = _PassRecorder(self.draft, record_shapes=False)
        own_config, target_config = self.draft.generation_config, self.target.generation_config
        self.draft.generation_config = self._assistant_config
        if not eos:  # as in the other decoders, no EOS ids means none: not the model's own generation-config EOS
            self.target.generation_config = copy.deepcopy(target_config)
            self.target.generation_config.eos_token_id = None
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                with device_timer({device, module_device(self.draft)}) as watch:
                    sequences = self.target.generate(
                        ids.to(device),
                        attention_mask=torch.ones_like(ids).to(device),
                        assistant_model=self.draft,
                        **kwargs,
                    )
                total = watch.seconds
        finally:
            self._assistant_config = self.draft.generation_config  # keeps HF's write-back of the heuristic K
            self.draft.generation_config = own_config
            self.target.generation_config = target_config
            target_passes.close()
            draft_passes.close()
        sequences = sequences.cpu()
        proposed, accepted = rounds_from_target_passes(target_passes.shapes, ids.shape[1], sequences.shape[1])
        generated = sequences.shape[1] - ids.shape[1]
        stats = DecodeStats(
            generated=generated,
            target_calls=target_passes.calls,
            draft_calls=draft_passes.calls,
            discarded=sum(k - a for k, a in zip(proposed, accepted)),
            proposed=proposed,
            accepted=accepted,
            draft_time=draft_passes.seconds,
            target_time=target_passes.seconds,
            total_time=total,
        )
        return GenerationResult(sequences, stats)
