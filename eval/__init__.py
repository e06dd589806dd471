"""``python -m eval``: side-by-side evidence for a SpecDec++ bundle — every stop rule a user could pick instead, the
greedy oracle limit, the cost model, the head's calibration, and a regenerated results page.

Subcommands (each writes JSON + PNG into its output folder and prints a table): ``calibration``, ``costs``,
``sweep``, ``bench``, ``report``, ``ablate``, ``free_stop``, ``label_modes``; their code is
:mod:`accept_head.evaluation`. ``python -m eval <subcommand> --help`` documents every flag.
"""
