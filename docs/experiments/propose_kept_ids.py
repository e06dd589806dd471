"""What proposing a tree's children costs over the whole vocabulary against the feature draft's kept ids alone
(:func:`accept_head.trees.decoding.propose_children` with ``TreeStep.support``): the draft distributions of ``n``
parents (bf16 logits of 16,384 kept ids among 49,152, −inf elsewhere when whole), their entropies, top-k and — at
T = 1 — siblings drawn without replacement, as one tree forward's children are proposed; a 160 MB sweep before each
call evicts the caches as a target pass does. Medians of 60 calls, 2 threads.

    python docs/experiments/propose_kept_ids.py
"""

import statistics
import time

import torch

from accept_head.core.costs import CostModel
from accept_head.core.records import machine_info
from accept_head.core.sampling import SamplingConfig
from accept_head.trees.decoding import draft_probs, propose_children
from accept_head.trees.growth import CostTree, DraftTree

VOCAB, KEPT = 49152, 16384
COST = CostModel(t_draft=0.0016, t_target_a=0.023, t_target_b=0.0005)


def median_ms(n: int, greedy: bool, whole: bool, evict: torch.Tensor, repeats: int = 60) -> float:
    support = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:KEPT].sort().values
    kept = (3 * torch.randn(n, KEPT, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    logits = kept.new_full((n, VOCAB), float("-inf")).index_copy_(1, support, kept) if whole else kept
    sampling = SamplingConfig(0.0 if greedy else 1.0)
    rule = CostTree(COST, width=4, top_k=4, max_depth=6, max_nodes=24, siblings="top" if greedy else "sampled")
    times = []
    for r in range(repeats):
        evict.add_(1.0)
        tree = DraftTree(sampled=not greedy)
        parents = [-1] if n == 1 else [tree.add(i + 1, -1, 0.1, 0.1) for i in range(n)]
        generator = torch.Generator().manual_seed(r)
        began = time.perf_counter()
        q = draft_probs(logits, sampling)
        if whole:
            propose_children(tree, rule, parents, q, generator)
        else:
            propose_children(tree, rule, parents, q, generator, support, VOCAB)
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    machine = machine_info()
    print(f"{machine['cpu']} ({machine['cpu_capability']}), torch {machine['torch']}")
    evict = torch.empty(40_000_000)
    for greedy in (True, False):
        for n in (1, 3, 6):
            whole, kept = median_ms(n, greedy, True, evict), median_ms(n, greedy, False, evict)
            mode = "greedy" if greedy else "T = 1"
            print(f"{mode:>6}, {n} parents: whole vocabulary {whole:.3f} ms, kept ids {kept:.3f} ms")


if __name__ == "__main__":
    main()
