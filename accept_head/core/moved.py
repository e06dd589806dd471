"""Module paths from before the sub-packages (``accept_head.decoding`` is now ``accept_head.chain.decoding``), kept
for one release: importing an old path warns once (``FutureWarning``) and gives the module at its new place."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, tuple[str, ...]] = {
    f"accept_head.{old}": tuple(f"accept_head.{new}" for new in news)
    for old, news in {
        "_hf_compat": ("core.hf_compat",),
        "sampling": ("core.sampling",),
        "seeds": ("core.seeds",),
        "timing": ("core.timing",),
        "tables": ("core.tables",),
        "prompts": ("core.prompts",),
        "cost_model": ("core.costs", "engine.measure"),
        "pairs": ("models.pairs",),
        "loading": ("models.loading",),
        "drafters": ("models.drafters",),
        "feature_draft": ("models.feature_draft",),
        "features": ("models.features",),
        "batch_generate": ("models.batch_generate",),
        "head": ("acceptance.head",),
        "loss": ("acceptance.loss",),
        "metrics": ("acceptance.metrics",),
        "mixing": ("acceptance.mixing",),
        "calibration": ("acceptance.calibration",),
        "labels": ("acceptance.labels",),
        "plots": ("acceptance.plots",),
        "decoding": ("chain.decoding",),
        "policies": ("chain.policies",),
        "baselines": ("chain.baselines",),
        "rollout": ("chain.rollout",),
        "hf_assisted": ("chain.hf_assisted",),
        "tree_verify": ("trees.verify",),
        "tree_drafters": ("trees.drafters",),
        "tree_growth": ("trees.growth",),
        "tree_decoding": ("trees.decoding",),
        "tree_labels": ("trees.labels",),
        "lookahead": ("learning_free.lookahead",),
        "ngrammys": ("learning_free.ngrammys",),
        "ouroboros": ("learning_free.ouroboros",),
        "bundle": ("specdecpp.bundle",),
        "hf_generate": ("specdecpp.hf_generate",),
        "chat": ("specdecpp.chat",),
        "pair_loading": ("engine.pair_loading",),
        "sweep": ("engine.sweep",),
        "free_stop": ("engine.free_stop",),
    }.items()
}
"""Old dotted module path → the module(s) now holding its names (``cost_model`` was split in two)."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path of :data:`MOVED` to the module at its new place (the same object, so a patch through either
    path is seen by both); a path split in two resolves to a module holding the public names of both."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        news = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(news)} (docs/architecture.md); import it from there — "
            "the old path is kept for one release.",
            FutureWarning,
            stacklevel=2,
        )
        modules = [importlib.import_module(new) for new in news]
        if len(modules) == 1:
            self._specs[spec.name] = modules[0].__spec__  # the import system overwrites it with the old path's spec
            return modules[0]
        joined = types.ModuleType(spec.name, modules[0].__doc__)
        for module in modules:
            joined.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        return joined

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__.name in self._specs:  # a moved module: give it back its own spec
            module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """Add the finder to ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
