"""``python -m data_gen``: run a target/draft pair on prompt sets and write token-level acceptance labels.

The command is thin: :mod:`data_gen.cli` parses the config, :mod:`data_gen.run` drives the library
(:mod:`accept_head.prompts`, :mod:`accept_head.batch_generate`, :mod:`accept_head.labels`) and writes the dataset.
"""
