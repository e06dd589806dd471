r"""What one head call costs inside the bundle's decoder, and whether it shows in a decode: each head swapped into the
committed bundle (its calibration and h* kept: a timing, not a tuned decode), the chain decoder's ``score`` timed on
every call, the same T = 1 prompts decoded with each head in turn, ``--passes`` times alternating.

    R=eval_out/ablate-inputs-more/runs
    python docs/experiments/head_call_cost.py --heads \
        $R/scalars/version_0/checkpoints/last.ckpt $R/plus-hidden-64/version_0/checkpoints/last.ckpt
"""

import argparse
import statistics
import time

import torch

from accept_head import SpecDecPP
from accept_head.chain import policies
from accept_head.evaluation.predictors import load_head

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "A farmer has 12 cows and buys 7 more. Each cow gives 5 litres of milk a day. How much milk per week?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", required=True, help="head checkpoints or bundle folders")
    parser.add_argument("--bundle", default="checkpoints/smollm2-135m-specdecpp")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(2)
    bundle = SpecDecPP.from_pretrained(args.bundle)
    heads = {path: load_head(path).head.eval() for path in args.heads}
    calls: list[float] = []
    score = policies.HeadThreshold.score

    def timed(self, hidden, state=None):
        start = time.perf_counter()
        prob = score(self, hidden, state)
        calls.append(time.perf_counter() - start)
        return prob

    policies.HeadThreshold.score = timed
    for _ in range(args.passes):
        for path, head in heads.items():
            bundle.head, calls[:] = head, []
            start = time.perf_counter()
            for prompt in PROMPTS:
                bundle.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
            wall = time.perf_counter() - start
            print(
                f"{path}: {len(calls)} head calls, median {statistics.median(calls) * 1e3:.3f} ms, "
                f"{sum(calls):.3f} s of {wall:.2f} s decoding",
                flush=True,
            )


if __name__ == "__main__":
    main()
