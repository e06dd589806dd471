"""How fast this CPU runs a decode pass's linears three ways (issue 37): the GEMM ``linear`` calls, the one-row
multiply-and-sum of :mod:`accept_head.models.row_linear` compiled by inductor, and oneDNN's GEMM on a packed weight.

    python docs/experiments/decode_linears.py --output docs/experiments/decode_linears-epyc.json

bf16, 2 threads, the embedded target's linear shapes (576 → 1536, 1536 → 576, the 49,152-row LM head), each fed
1, 2, 4 and 8 rows; more weights than the caches hold are cycled through, so each product reads its weight from
memory as a decode pass does. Medians of ``--repeats`` (µs per product and the weight bytes read per second), beside
the memory's own read rate (a sum over 212 MB, the target's decoder weights). Random weights and inputs: they choose
nothing.
"""

from __future__ import annotations

import argparse

import torch
from cpu_decode_profile import median_ms

from accept_head.core.records import machine_info, write_json
from accept_head.models.row_linear import packed_linear, rowwise_linear

SHAPES = ((1536, 576), (576, 1536), (49152, 576))
ROWS = (1, 2, 4, 8)


def median_s(fn, repeats: int) -> float:
    return median_ms(fn, repeats, warmup=3) / 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output", default="eval_out/decode_linears.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch._dynamo.config.cache_size_limit = 64
    memory = 0.212 / median_s(torch.randn(106_000_000, dtype=torch.bfloat16).sum, args.repeats)
    print(f"memory read: {memory:.1f} GB/s (a sum over 212 MB)")
    compiled = torch.compile(rowwise_linear, dynamic=False)
    results = []
    for n, k in SHAPES:
        weights = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(max(2, 80_000_000 // (n * k * 2)))]
        gigabytes = n * k * 2 / 1e9
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
            ways = {
                "linear": lambda: [torch.nn.functional.linear(x, w) for w in weights],
                "packed": lambda: [packed_linear(x, p) for p in packed],
            }
            if rows == 1:
                ways["rowwise"] = lambda: [compiled(x, w) for w in weights]
            row = {"out": n, "in": k, "rows": rows}
            for name, fn in ways.items():
                seconds = median_s(fn, args.repeats) / len(weights)
                row[f"{name}_us"], row[f"{name}_gb_s"] = 1e6 * seconds, gigabytes / seconds
            row["packed_equals_linear"] = bool(
                torch.equal(packed_linear(x, packed[0]), torch.nn.functional.linear(x, weights[0]))
            )
            results.append(row)
            print(
                f"{n:6d} x {k:4d}, {rows} row(s): "
                + "  ".join(f"{name} {row[f'{name}_us']:.0f} us ({row[f'{name}_gb_s']:.0f} GB/s)" for name in ways)
                + f"  packed == linear: {row['packed_equals_linear']}",
                flush=True,
            )
    write_json(args.output, {"machine": machine_info(), "memory_read_gb_s": memory, "linears": results})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
