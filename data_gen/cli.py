"""Command line of ``python -m data_gen`` (the parser is :func:`accept_head.labelgen.run.build_parser`).

Examples::

    python -m data_gen --config configs/data_gen/humaneval.yaml
    python -m data_gen --config configs/data_gen/humaneval.yaml --max_new_tokens 128 --target.device cuda:0
    python -m data_gen --target.path T --draft.path D --prompts '[{"path": "p.jsonl", "field": "instruction"}]' \\
        --output_dir out --max_new_tokens 32
    python -m data_gen --config big.yaml --shard 0/4      # ... up to --shard 3/4, one per process / GPU
    python -m data_gen --config big.yaml --merge          # join the four shard outputs
    torchrun --nproc_per_node 4 -m data_gen --config big.yaml --target.device cuda --draft.device cuda
                                                         # the same: one shard per GPU, merged by rank 0
    python -m data_gen --config configs/data_gen/humaneval.yaml --print_config
    python -m data_gen join --datasets '[data/labels/a, data/labels/b]' --output_dir data/labels/ab
                                                         # one dataset from two runs on disjoint prompts
    python -m data_gen responses --config configs/distill/smollm2-135m-feature-draft-cpu.yaml --output_dir out
                                                         # the target's own responses (fast CPU generator,
                                                         # resumable shards) as a Hugging Face dataset
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from accept_head.core.cli import user_errors
from accept_head.labelgen.run import build_parser, parse_arguments, run


def join_parser(prog: str):
    """The parser of ``join``: the arguments of :func:`accept_head.labelgen.join.join`."""
    from jsonargparse import ArgumentParser

    from accept_head.labelgen.join import join

    parser = ArgumentParser(prog=prog, description=join.__doc__.splitlines()[0])
    parser.add_function_arguments(join, as_group=False)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m data_gen") -> dict:
    """Parse, run (generate, merge, join or responses) and return the dataset's meta dict; user errors exit with a
    one-line message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with user_errors(prog):
        if argv[:1] == ["join"]:
            from accept_head.labelgen.join import join

            parser = join_parser(f"{prog} join")
            args = parser.parse_args(argv[1:])
            return join(args.datasets, args.output_dir, args.overwrite)
        if argv[:1] == ["responses"]:
            from jsonargparse import CLI

            from accept_head.training.feature_draft_recipe import responses_to_dataset

            return CLI(responses_to_dataset, args=argv[1:], as_positional=False, prog=f"{prog} responses")
        return run(parse_arguments(build_parser(prog), argv)[1])


def script() -> None:
    """The ``accept-head-data-gen`` console script: :func:`main` under that name."""
    main(prog="accept-head-data-gen")
