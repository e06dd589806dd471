"""Benchmark: labelled tokens per second of the ``python -m data_gen`` pipeline against a naive loop, side by side.

    python -m data_gen.bench --config configs/data_gen/instructions.yaml --n_prompts 64 --naive_prompts 8

Takes the same config as ``python -m data_gen`` (pair, prompts, sampling, batch size) and writes no dataset; what
each side does is in :mod:`accept_head.labelgen.bench`.
"""

from __future__ import annotations

from collections.abc import Sequence

from accept_head.labelgen.bench import bench
from accept_head.labelgen.run import build_parser, parse_arguments


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse the data_gen flags plus the benchmark's own, run :func:`~accept_head.labelgen.bench.bench`, return it."""
    parser = build_parser(prog="python -m data_gen.bench")
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--n_prompts", type=int, default=64, help="Prompts labelled by the batched pipeline.")
    parser.add_argument("--naive_prompts", type=int, default=8, help="Prompts labelled by the naive loop.")
    parser.add_argument("--output_json", type=str, default=None, help="Also write the figures to this JSON file.")
    parser.set_defaults(output_dir="(unused by the benchmark)")
    init, cfg = parse_arguments(parser, argv)
    return bench(cfg, init.n_prompts, init.naive_prompts, init.output_json)


if __name__ == "__main__":
    main()
