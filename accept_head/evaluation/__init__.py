"""The evidence behind ``python -m eval``: one module per command (``bench``, ``report``, ``calibration``, ``costs``,
``sweep``, ``ablate``, ``free_stop``, ``label_modes``), each a documented function that runs decoding methods through
:mod:`accept_head.engine.runner` and writes JSON, PNG and Markdown. ``eval/__main__.py`` only parses flags into these
calls.
"""
