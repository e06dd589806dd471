"""Methods run side by side over prompts: the pair, the interleaved runner that decodes and prices them, the cost
model's measurement, the threshold sweep and the adaptive row stop of the learning-free decoders."""

import warnings

_MODULES = frozenset(("free_stop", "measure", "pair_loading", "runner", "sweep"))


def __getattr__(name: str):
    """``accept_head.engine`` was one module before this package; its names now live in :mod:`.runner` (kept for one
    release, with a ``FutureWarning``)."""
    if name.startswith("_") or name in _MODULES:  # a sub-module not imported yet: the import system goes on to it
        raise AttributeError(f"module 'accept_head.engine' has no attribute {name!r}")
    from . import runner

    if not hasattr(runner, name):
        raise AttributeError(f"module 'accept_head.engine' has no attribute {name!r}")
    warnings.warn(
        f"accept_head.engine.{name} moved to accept_head.engine.runner.{name}; import it from there — "
        "the old path is kept for one release.",
        FutureWarning,
        stacklevel=2,
    )
    value = globals()[name] = getattr(runner, name)  # warned once: later lookups find it here
    return value
