"""Would a 4-bit LM head make the drafting step cheap enough? Its cost, the acceptance it gives up, decoding speed.

    python docs/experiments/draft_head_int4.py --output docs/experiments/draft_head_int4-epyc.json

The drafting step of the committed bundle streams 13.6 MB of int8 weights after every target pass, 9.4 MB of them
the 16,384-row LM head (docs/measurements.md). Groupwise 4-bit weights (``torch._weight_int4pack_mm_for_cpu``,
asymmetric, one scale and offset per group of 32 or 64 inputs) halve the head's bytes; ``quantize: int4`` decodes
with the head so (groups of 32), the rest of the draft in int8. Measurements, 2 threads:

1. **Cost**: the head's product for one row — the bundle's int8 head, 4-bit heads, the bf16 rows — warm and right
   after 400 MB were written (what a target pass does to the caches), interleaved, medians of ``--repeats``.
2. **Acceptance**: step-1 Σ_x min(p, q) over the response positions of the target's greedy continuations of the
   chat's built-in prompts (they choose nothing), the bundle's draft reading the target's true features, with each
   head; and each head's total variation from the bf16 head's q.
3. **The whole draft**: the bundle's int8 draft against the same draft loaded with ``quantize: int4`` —
   ``draft_int8.step_cost`` (a drafting step right after a one-token target pass, the forward alone and the whole step
   with the head at T = 1, medians of ``--repeats``, the two drafts interleaved ``--rounds`` times) and
   ``draft_int8.decode_speed`` (``bundle.generate`` at the bundle's h*, greedy and T = 1, the chat's built-in
   prompts, the two drafts and autoregressive decoding interleaved prompt by prompt, ``--decode_repeats`` times).
"""

from __future__ import annotations

import statistics
import time

import torch
from draft_int8 import comparison_arguments, decode_speed, finish, step_cost, step_cost_summary

from accept_head import SpecDecPP, load_model
from accept_head.core.prompts import chat_prompt_ids
from accept_head.core.records import machine_info
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


def int4_bundle(path: str, bundle: SpecDecPP) -> SpecDecPP:
    """The bundle at ``path`` with its draft loaded with ``quantize: int4`` (its target and tokenizer shared)."""
    spec = {**bundle.draft_spec.to_dict(), "quantize": "int4"}
    return SpecDecPP.from_pretrained(path, target=bundle.target, tokenizer=bundle.tokenizer, draft=load_model(spec))


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
    parser = comparison_arguments(__doc__.split("\n\n")[0], repeats=30)
    parser.add_argument("--new_tokens", type=int, default=96)
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
    prompts = [chat_prompt_ids(bundle.tokenizer, text) for text in DEFAULT_PROMPTS]
    with torch.inference_mode():
        for prompt in prompts:
            ids = target.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False)[0]
            out = target(input_ids=ids[None], output_hidden_states=True)
            features = out.hidden_states[-1][0]
            p = out.logits[0].float().softmax(-1)[len(prompt) - 1 : -1][:, support]  # the target at response tokens
            predicted = draft(out.hidden_states[-1][:, :-1], ids[None, 1:])[0][len(prompt) - 2 : -1]
            qs = {name: head(predicted).float().softmax(-1) for name, head in heads.items()}
            for name, q in qs.items():
                accept[name].append(torch.minimum(p, q).sum(-1))
                tv[name].append(0.5 * (q - qs["bf16"]).abs().sum(-1))
        drafts = {"int8": bundle, "int4": int4_bundle(args.bundle, bundle)}
        result["step_cost"] = {name: [] for name in drafts}
        for _ in range(args.rounds):
            for name, each in drafts.items():
                draft = each.draft.bind(target)
                result["step_cost"][name].append(
                    step_cost(target, draft, ids[None], features, args.repeats, each.policy())
                )
    if args.decode_repeats:
        result["decode_tok_s"] = decode_speed(drafts, prompts, args.decode_tokens, args.decode_repeats)
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
    for name, costs in result["step_cost"].items():
        print(f"{name} draft: {step_cost_summary(costs)}")
    finish(result, args.output)


if __name__ == "__main__":
    main()
