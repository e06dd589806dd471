"""Would a 4-bit LM head make the drafting step cheap enough? Its cost, and the acceptance it gives up.

    python docs/experiments/draft_head_int4.py --output docs/experiments/draft_head_int4-epyc.json

The drafting step of the committed bundle streams 13.6 MB of int8 weights after every target pass, 9.4 MB of them
the 16,384-row LM head (docs/measurements.md). Groupwise 4-bit weights (``torch._weight_int4pack_mm_for_cpu``,
asymmetric, one scale and offset per group of 32 or 64 inputs) halve the head's bytes. Two measurements, 2 threads:

1. **Cost**: the head's product for one row — the bundle's int8 head, 4-bit heads, the bf16 rows — warm and right
   after 400 MB were written (what a target pass does to the caches), interleaved, medians of ``--repeats``.
2. **Acceptance**: step-1 Σ_x min(p, q) over the response positions of the target's greedy continuations of the
   chat's built-in prompts (they choose nothing), the bundle's draft reading the target's true features, with each
   head; and each head's total variation from the bf16 head's q.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accept_head import SpecDecPP
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info, write_json
from accept_head.specdecpp.chat import DEFAULT_PROMPTS


def int4_head(weight: torch.Tensor, group: int):
    """x (n, d) ↦ x Wᵀ with W (V, d) stored in 4 bits per weight: per group of ``group`` inputs, levels 0..15 over
    the group's [min, max] (the kernel's convention: w = (level − 8)·scale + zero)."""
    rows, width = weight.shape
    groups = weight.float().reshape(rows, width // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low).clamp_min(1e-8) / 15
    levels = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.reshape(rows, width), 1)
    scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group, scales_zeros)


def head_costs(heads: dict, width: int, repeats: int) -> dict:
    """µs of one row through each head, warm and after 400 MB were written, interleaved; medians."""
    x = torch.randn(1, width).to(torch.bfloat16)
    sweep = torch.empty(400_000_000, dtype=torch.uint8)
    out: dict = {}
    for mode in ("warm", "evicted"):
        times: dict = {name: [] for name in heads}
        for _ in range(repeats):
            for name, head in heads.items():
                sweep.add_(1) if mode == "evicted" else head(x)
                began = time.perf_counter()
                head(x)
                times[name].append(time.perf_counter() - began)
        out[mode] = {name: 1e6 * statistics.median(values) for name, values in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--new_tokens", type=int, default=96)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    target, draft = bundle.target, bundle.draft.bind(bundle.target)
    support, int8_rows = draft.support_rows()
    order = draft.kept_ids.argsort()
    weight = draft.lm_head.weight.detach()[order].to(torch.bfloat16)  # the head as trained, rows in support order
    heads = {
        "bf16": lambda x: torch.nn.functional.linear(x, weight),
        "int8": int8_rows,
        "int4, groups of 32": int4_head(weight, 32),
        "int4, groups of 64": int4_head(weight, 64),
    }
    result: dict = {"machine": machine_info(), "bundle": args.bundle}
    result["head_us"] = head_costs(heads, weight.shape[1], args.repeats)
    accept: dict = {name: [] for name in heads}
    tv: dict = {name: [] for name in heads}
    with torch.inference_mode():
        for text in DEFAULT_PROMPTS:
            prompt = chat_prompt_ids(bundle.tokenizer, text)
            ids = target.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False)[0]
            out = target(input_ids=ids[None], output_hidden_states=True)
            p = out.logits[0].float().softmax(-1)[len(prompt) - 1 : -1][:, support]  # the target at response tokens
            predicted = draft(out.hidden_states[-1][:, :-1], ids[None, 1:])[0][len(prompt) - 2 : -1]
            qs = {name: head(predicted).float().softmax(-1) for name, head in heads.items()}
            for name, q in qs.items():
                accept[name].append(torch.minimum(p, q).sum(-1))
                tv[name].append(0.5 * (q - qs["bf16"]).abs().sum(-1))
    result["positions"] = sum(len(a) for a in accept["bf16"])
    result["step1_acceptance"] = {name: torch.cat(values).mean().item() for name, values in accept.items()}
    result["tv_vs_bf16"] = {name: torch.cat(values).mean().item() for name, values in tv.items()}
    for name in heads:
        print(
            f"{name}: {result['head_us']['warm'][name]:.0f} µs warm, {result['head_us']['evicted'][name]:.0f} µs "
            f"evicted; step-1 acceptance {result['step1_acceptance'][name]:.4f}, TV from bf16 "
            f"{result['tv_vs_bf16'][name]:.4f}"
        )
    print(f"over {result['positions']} response positions")
    if args.output:
        write_json(args.output, result)


if __name__ == "__main__":
    main()
