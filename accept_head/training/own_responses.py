"""The target's own responses as a draft's training data, on any device (the feature-draft recipe's ``responses``
stage).

For every prompt the target writes ``samples`` responses at its own temperature and, optionally, one greedy response
(the contexts a greedy decode drafts in). Rows of many prompts decode together in large left-padded batches; rows of
similar prompt length share a batch (sorted inside windows of the mixed prompt order, so a run stopped early still
holds every source). One batch is one shard (``{eval,train}-NNNNN.pt``, written atomically): a killed or
time-limited run resumes at the first missing shard. Sampling draws from one ``torch.Generator`` per shard on the
model's device, seeded from the recipe seed, the split and the shard index, so the same seed and split give the same
shards.

On a CPU, ``slots`` decodes each shard by continuous batching (:func:`~accept_head.models.slot_generate.slot_generate`:
finished rows' cache slots refilled with the next prompts, exact inverse-CDF sampling): the fast path there. It can
also keep the target's final hidden states and log-normalisers it computes while writing and save each shard's
``features`` file beside it (:func:`features_shard`), which spares the recipe's teacher-forced ``features`` pass.
On CUDA, ``static_cache`` decodes with a fixed-shape :class:`~transformers.StaticCache` (no batch compaction) so that
``compile`` can capture the single-token step with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import monotonic

import torch
from safetensors.torch import save_file
from transformers import DynamicCache

from ..core.hf_compat import cache_kwargs
from ..core.prompts import EncodedPrompt
from ..core.seeds import derive_seed
from ..models.batch_generate import left_pad
from ..models.features import decoder_matches_lm_head_input, teacher_force
from ..models.slot_generate import slot_generate
from .draft_recipe import save_atomic

GREEDY = -1
"""The ``sample`` index of a greedy response in a shard."""


@dataclass(frozen=True)
class ResponseRow:
    """One response to write: a prompt and which of its responses (sample index, or :data:`GREEDY`)."""

    prompt: EncodedPrompt
    sample: int


def response_rows(
    prompts: Sequence[EncodedPrompt], samples: int, greedy: bool, batch_size: int, sort_window: int
) -> list[list[ResponseRow]]:
    """The batches (= shards) of responses for ``prompts`` (already in their mixed order): each prompt's ``samples``
    sampled rows and its greedy row, cut into windows of ``sort_window`` batches, each window sorted by prompt
    length (then id and sample, so the order is fully determined) and cut into batches of ``batch_size`` rows."""
    if samples < 0 or (samples == 0 and not greedy):
        raise ValueError(f"samples_per_prompt={samples} with greedy_responses={greedy} writes no response.")
    if batch_size < 1 or sort_window < 1:
        raise ValueError(f"generate_batch_size={batch_size} and sort_window={sort_window} must be >= 1.")
    kinds = list(range(samples)) + ([GREEDY] if greedy else [])
    rows = [ResponseRow(prompt, sample) for prompt in prompts for sample in kinds]
    window = batch_size * sort_window
    batches = []
    for start in range(0, len(rows), window):
        chunk = sorted(rows[start : start + window], key=lambda r: (len(r.prompt.ids), r.prompt.id, r.sample))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


def _first_eos_lengths(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Response lengths of ``tokens`` (B, N): through the first EOS when there is one, else N."""
    is_eos = torch.isin(tokens, eos)
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, torch.full_like(tokens[:, 0], tokens.shape[1]))
    return first


@torch.inference_mode()
def generate_responses(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    greedy: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    static_cache: bool = False,
    cache_length: int | None = None,
    step_fn=None,
    check_every: int = 8,
) -> list[list[int]]:
    """Responses of ``model`` to ``prompts`` (each a list of token ids), one left-padded batch on the model's device.

    Rows where ``greedy`` (B,) bool is set take the argmax, the others sample at ``temperature`` with ``generator``
    (on the model's device). A response ends with its first EOS (kept) or after ``max_new_tokens``. Finished rows
    are checked every ``check_every`` steps (each check waits for the device) and, with the dynamic cache, dropped
    from the batch. ``static_cache`` keeps every row to the end in a fixed-shape cache of ``cache_length`` positions
    (default: this batch's longest prompt + ``max_new_tokens``; a fixed value keeps the shapes of a compiled step
    the same across batches); ``step_fn`` replaces the model's forward for the single-token steps there (e.g. a
    compiled one) and must take the same keyword arguments.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rows are chosen by `greedy`).")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    batch, prompt_length = ids.shape
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.as_tensor(list(eos_token_ids), device=device)
    greedy = greedy.to(device)
    out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # original row of each batch position
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    forward = step_fn or model
    if static_cache:
        cache, mask = _static_cache(model, mask, cache_length or prompt_length + max_new_tokens, max_new_tokens)
    else:
        cache = DynamicCache()
    step_ids, step_pos = ids, positions
    for step in range(max_new_tokens):
        call, extra = _step_call(model, forward, static_cache, step, prompt_length)
        inputs = dict(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, logits_to_keep=1, **extra)
        logits = call(**inputs, **cache_kwargs(model, cache)).logits[:, -1].float()
        sampled = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(-1)
        next_ids = torch.where(greedy, logits.argmax(-1), sampled)
        next_ids = torch.where(done, torch.full_like(next_ids, pad_token_id), next_ids)
        out[rows, step] = next_ids
        done |= torch.isin(next_ids, eos)
        step_ids, step_pos = next_ids[:, None], step_pos[:, -1:] + 1
        if static_cache:
            mask[:, prompt_length + step] = 1
        else:
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        if (step + 1) % check_every == 0 or step + 1 == max_new_tokens:
            if bool(done.all()):
                break
            if not static_cache and bool(done.any()):  # drop the finished rows from the batch and the cache
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, step_ids, step_pos, mask, done, greedy = (
                    x[keep] for x in (rows, step_ids, step_pos, mask, done, greedy)
                )
    lengths = _first_eos_lengths(out, eos).tolist()
    return [row[:length] for row, length in zip(out.cpu().tolist(), lengths)]


def _step_call(model: torch.nn.Module, forward, static_cache: bool, step: int, prompt_length: int):
    """The callable of generation step ``step`` and its extra keyword arguments: with a static cache, the prompt fills
    positions 0..P-1 and step s >= 1 feeds the token written at step s - 1 (position P + s - 1), through ``forward``
    (a compiled step) from step 1 on — the prefill has another shape, never the captured graph."""
    if not static_cache:
        return model, {}
    device = next(model.parameters()).device
    first = 0 if step == 0 else prompt_length + step - 1
    return (forward if step > 0 else model), {
        "cache_position": torch.arange(first, prompt_length + step, device=device)
    }


def _static_cache(model: torch.nn.Module, mask: torch.Tensor, length: int, max_new_tokens: int):
    """A :class:`~transformers.StaticCache` of ``length`` positions and ``mask`` (B, P) widened to it with zeros."""
    from transformers import StaticCache

    prompt_length = mask.shape[1]
    if length < prompt_length + max_new_tokens:
        raise ValueError(
            f"cache_length={length} is shorter than the prompt ({prompt_length}) + max_new_tokens "
            f"({max_new_tokens}); raise it."
        )
    cache = StaticCache(config=model.config, max_cache_len=length)
    return cache, torch.cat([mask, mask.new_zeros(mask.shape[0], length - prompt_length)], dim=1)


def _generate_in_halves(model: torch.nn.Module, prompts: list, greedy: torch.Tensor, settings: dict) -> list:
    """:func:`generate_responses` of ``prompts``; a batch the device has no memory for is generated as two halves,
    one after the other with the same generator (so such a shard's draws differ from one generated whole)."""
    try:
        return generate_responses(model, prompts, greedy, **settings)
    except torch.OutOfMemoryError:
        if len(prompts) < 2:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(prompts) // 2
    print(f"[responses] out of device memory at {len(prompts)} rows: generating two batches of ~{half}", flush=True)
    first = _generate_in_halves(model, prompts[:half], greedy[:half], settings)
    return first + _generate_in_halves(model, prompts[half:], greedy[half:], settings)


def write_response_shards(
    model: torch.nn.Module,
    batches: list[list[ResponseRow]],
    folder: Path,
    kind: str,
    *,
    seed: int,
    split_seed: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    first: int = 0,
    deadline: float | None = None,
    static_cache: bool = False,
    cache_length: int | None = None,
    step_fn=None,
    slots: int | None = None,
    compile_slots: bool = False,
    features_folder: Path | None = None,
) -> dict:
    """Write the shards ``<folder>/<kind>-NNNNN.pt`` of ``batches`` that are missing, in order, from index ``first``
    on (the same rows and draws as a run that wrote the earlier shards too), until ``deadline`` (a
    ``time.monotonic()`` value; None: no limit). Each holds ``prompt_id``, ``prompt_ids``, ``response_ids`` and
    ``sample`` (the sample index, :data:`GREEDY` for greedy rows). Returns the shard counts, the tokens written
    and the seconds spent in this call; prints the tokens/s meter after every shard. ``slots``: decode each shard by
    continuous batching over that many cache slots (:func:`~accept_head.models.slot_generate.slot_generate`) instead
    of as one left-padded batch; ``compile_slots``: its full-width decode steps compiled; ``features_folder`` (with
    ``slots``): also write ``<features_folder>/<kind>-NNNNN.safetensors``, the target's final hidden states and
    log-normalisers computed while writing (:func:`features_shard`), before the response shard."""
    folder.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    tokens, seconds, written, stopped = 0, 0.0, 0, False
    for index, batch in enumerate(batches):
        path = folder / f"{kind}-{index:05d}.pt"
        if index < first or path.exists():
            continue
        if deadline is not None and monotonic() > deadline:
            stopped = True
            break
        generator = torch.Generator(device).manual_seed(derive_seed(seed, "responses", split_seed, kind, index))
        greedy = torch.tensor([row.sample == GREEDY for row in batch])
        start = time.perf_counter()
        settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids)
        settings |= dict(pad_token_id=pad_token_id, generator=generator)
        prompts = [row.prompt.ids for row in batch]
        if slots:
            dest = features_folder / f"{kind}-{index:05d}.safetensors" if features_folder is not None else None
            responses = _slot_responses(model, prompts, greedy, slots, compile_slots, dest, settings)
        else:
            batch_settings = dict(static_cache=static_cache, cache_length=cache_length, step_fn=step_fn, **settings)
            responses = _generate_in_halves(model, prompts, greedy, batch_settings)
        elapsed = time.perf_counter() - start
        shard = {
            "prompt_id": [row.prompt.id for row in batch],
            "prompt_ids": [torch.tensor(row.prompt.ids, dtype=torch.int32) for row in batch],
            "response_ids": [torch.tensor(r, dtype=torch.int32) for r in responses],
            "sample": torch.tensor([row.sample for row in batch]),
        }
        save_atomic(shard, path)
        n = sum(len(r) for r in responses)
        tokens, seconds, written = tokens + n, seconds + elapsed, written + 1
        print(
            f"[responses] {path.name}: {len(batch)} rows, {n} tokens in {elapsed:.1f}s ({n / elapsed:.0f} tok/s); "
            f"this run {tokens / max(seconds, 1e-9):.0f} tok/s",
            flush=True,
        )
    present = sum((folder / f"{kind}-{i:05d}.pt").exists() for i in range(len(batches)))
    return {
        "shards": len(batches),
        "present": present,
        "written": written,
        "tokens": tokens,
        "seconds": seconds,
        "stopped_by_budget": stopped,
    }


def _slot_responses(
    model, prompts: list, greedy: torch.Tensor, slots: int, compile_slots: bool, features_dest, settings
):
    """:func:`slot_generate`'s responses to ``prompts``; with ``features_dest``, their features shard written there."""
    run = dict(slots=slots, compile=compile_slots, features=features_dest is not None)
    responses = slot_generate(model, prompts, greedy.tolist(), **run, **settings)
    if features_dest is None:
        return responses
    responses, kept = responses
    # A row's states cover its prompt and response but the last token, which no computed state has read: the pair
    # whose target is the state after the response's end is left out.
    rows = [(torch.tensor(list(p) + r[:-1]), h, lse, len(p)) for p, r, (h, lse) in zip(prompts, responses, kept)]
    features_dest.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(features_shard(rows), features_dest, save_file)
    return responses


def features_shard(rows: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> dict:
    """A ``features`` shard of ``rows``, each (tokens (n,), final hidden states (n, d), log-normalisers (n,), prompt
    length): ``tokens`` (int32), ``features`` (bf16), ``lse`` (float32), ``offsets`` and ``prompt_lengths``, on the
    CPU — what the ``features`` stage writes and ``fit`` reads."""
    return {
        "tokens": torch.cat([r[0] for r in rows]).to(torch.int32),
        "features": torch.cat([r[1] for r in rows]).to("cpu", torch.bfloat16).contiguous(),
        "lse": torch.cat([r[2] for r in rows]).to("cpu", torch.float32),
        "offsets": torch.tensor([0] + [len(r[0]) for r in rows]).cumsum(0),
        "prompt_lengths": torch.tensor([r[3] for r in rows]),
    }


GENERATORS = ("generate", "batch", "slots")
"""What :func:`bench_generators` times: Hugging Face's ``model.generate``, :func:`generate_responses` (one
left-padded batch at a time, finished rows dropped) and :func:`~accept_head.models.slot_generate.slot_generate`."""


@torch.inference_mode()
def bench_generators(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    repeats: int = 1,
    seed: int = 0,
    compile: bool = False,
    features: bool = False,
    forced_batch_tokens: int = 8192,
    only: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Response tokens/s of each of :data:`GENERATORS` writing T=``temperature`` samples for every prompt, the same
    rows through batches of ``batch_size`` (``model.generate`` and ``batch``: one batch after another; ``slots``:
    ``batch_size`` slots refilled from all of them), interleaved ``repeats`` times. A response counts through its
    first EOS. ``compile``: also ``slots_compiled`` (:func:`~accept_head.models.slot_generate.slot_generate` with
    ``compile=True``), after one untimed pass that compiles its graph (its seconds under ``compile_seconds``).
    ``features``: also the two ways to a draft's training data — ``slots_then_forced`` (``slots``, then the
    ``features`` stage's teacher-forced pass over the rows written, :func:`~accept_head.models.features.teacher_force`)
    and ``slots_features`` (the states kept while writing: ``slot_generate(features=True)``; with ``compile`` too,
    ``slots_features_compiled``). ``only``: time just these. Returns, per generator, its tokens and seconds a pass."""
    device = next(model.parameters()).device
    chunks = [list(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
    eos = torch.as_tensor(list(eos_token_ids))
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids)
    settings |= dict(pad_token_id=pad_token_id)

    def hf_generate(generator: torch.Generator) -> int:
        tokens = 0
        for chunk in chunks:
            ids, mask = left_pad(chunk, pad_token_id)
            out = model.generate(
                ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature, top_k=0,
                top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                pad_token_id=pad_token_id,
            )[:, ids.shape[1] :].cpu()  # fmt: skip
            tokens += int(_first_eos_lengths(out, eos).sum())
        return tokens

    def batch(generator: torch.Generator) -> int:
        greedy = [torch.zeros(len(chunk), dtype=torch.bool) for chunk in chunks]
        return sum(
            len(r)
            for c, g in zip(chunks, greedy)
            for r in generate_responses(model, c, g, generator=generator, **settings)
        )

    def slots(generator: torch.Generator, compiled: bool = False, kept: bool = False, forced: bool = False) -> int:
        responses = slot_generate(
            model, list(prompts), [False] * len(prompts), slots=batch_size, generator=generator, compile=compiled,
            features=kept, **settings,
        )  # fmt: skip
        responses = responses[0] if kept else responses
        if forced:  # the features stage's pass over the same rows (sorted by length, forced_batch_tokens a pass)
            rows = sorted((torch.tensor(list(p) + r) for p, r in zip(prompts, responses)), key=len)
            teacher_force(model, rows, forced_batch_tokens, decoder_matches_lm_head_input(model))
        return sum(len(r) for r in responses)

    runs = dict(zip(GENERATORS, (hf_generate, batch, slots)))
    if compile:
        runs["slots_compiled"] = lambda generator: slots(generator, compiled=True)
    if features:
        runs["slots_then_forced"] = lambda generator: slots(generator, forced=True)
        runs["slots_features"] = lambda generator: slots(generator, kept=True)
    if features and compile:
        runs["slots_features_compiled"] = lambda generator: slots(generator, compiled=True, kept=True)
    if only is not None:
        if unknown := set(only) - set(runs):
            raise ValueError(f"generators {sorted(unknown)} are not among {list(runs)} (with these settings).")
        runs = {name: run for name, run in runs.items() if name in only}
    passes: dict[str, dict] = {name: {"tokens": [], "seconds": []} for name in runs}
    for name in [name for name in passes if name.endswith("_compiled")]:  # compiled before timing
        start = time.perf_counter()
        slots(torch.Generator(device).manual_seed(seed), compiled=True, kept=name == "slots_features_compiled")
        passes[name]["compile_seconds"] = time.perf_counter() - start
    return _timed_passes(runs, passes, repeats, seed, device)


def _timed_passes(runs: dict, passes: dict, repeats: int, seed: int, device: torch.device) -> dict:
    """Time every generator of ``runs`` (name → function of a generator, returning tokens) ``repeats`` times,
    interleaved, each pass with its own seeded generator; its tokens and seconds appended to ``passes[name]``."""
    for repeat in range(repeats):
        for name in runs:
            generator = torch.Generator(device).manual_seed(derive_seed(seed, "bench", name, repeat))
            torch.manual_seed(derive_seed(seed, "bench-global", name, repeat))  # model.generate's own draws
            start = time.perf_counter()
            tokens = runs[name](generator)
            passes[name]["seconds"].append(time.perf_counter() - start)
            passes[name]["tokens"].append(tokens)
            print(f"[bench] {name}: {tokens} tokens in {passes[name]['seconds'][-1]:.1f}s", flush=True)
    return passes


def responses_dataset(folder: Path):
    """The response shards under ``folder`` (``<kind>-NNNNN.pt``) as a Hugging Face ``DatasetDict``, one split per
    kind (``train``, ``eval``), a row per response: ``prompt_id``, ``source`` (the prompt id's prefix),
    ``prompt_ids``, ``response_ids`` (through its EOS), ``sample`` (:data:`GREEDY` for greedy rows) and ``shard``."""
    from datasets import Dataset, DatasetDict, Features, Value
    from datasets import Sequence as ListOf

    columns = ("prompt_id", "source", "prompt_ids", "response_ids", "sample", "shard")
    splits: dict[str, dict[str, list]] = {}
    for path in sorted(folder.glob("*-*.pt")):
        kind, index = path.stem.split("-")
        shard = torch.load(path, weights_only=True)
        rows = splits.setdefault(kind, {name: [] for name in columns})
        rows["prompt_id"] += shard["prompt_id"]
        rows["source"] += [prompt_id.rsplit(":", 1)[0] for prompt_id in shard["prompt_id"]]
        rows["prompt_ids"] += [ids.tolist() for ids in shard["prompt_ids"]]
        rows["response_ids"] += [ids.tolist() for ids in shard["response_ids"]]
        rows["sample"] += shard["sample"].tolist()
        rows["shard"] += [int(index)] * len(shard["prompt_id"])
    features = Features(
        {"prompt_id": Value("string"), "source": Value("string"), "prompt_ids": ListOf(Value("int32")),
         "response_ids": ListOf(Value("int32")), "sample": Value("int64"), "shard": Value("int64")}
    )  # fmt: skip
    return DatasetDict({kind: Dataset.from_dict(rows, features=features) for kind, rows in splits.items()})


def shard_positions(folder: Path) -> dict[str, dict]:
    """What the response shards under ``folder`` (``<kind>-NNNNN.pt``) hold, per kind: shards, rows, prompt and
    response tokens, and positions (prompt + response: what a draft trains on)."""
    out: dict[str, dict] = {}
    for path in sorted(folder.glob("*-*.pt")):
        shard = torch.load(path, weights_only=True)
        kind = out.setdefault(path.name.split("-")[0], dict.fromkeys(("shards", "rows", "prompt", "response"), 0))
        kind["shards"] += 1
        kind["rows"] += len(shard["response_ids"])
        kind["prompt"] += sum(len(p) for p in shard["prompt_ids"])
        kind["response"] += sum(len(r) for r in shard["response_ids"])
    for kind in out.values():
        kind["positions"] = kind["prompt"] + kind["response"]
    return out
