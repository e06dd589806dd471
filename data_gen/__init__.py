"""``python -m data_gen``: run a target/draft pair on prompt sets and write token-level acceptance labels.

The command is thin: :mod:`data_gen.cli` turns the command line into a call of :mod:`accept_head.labelgen.run`,
which parses the config and drives the library (prompts, batched generation, labels, the resumable output folder).
"""
