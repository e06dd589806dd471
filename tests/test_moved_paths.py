"""The module paths from before the sub-packages keep working for one release: each old path warns once and gives the
module at its new place, and a bundle's hub ``custom_generate/generate.py`` written before the move still decodes."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from accept_head.core.moved import MOVED

REPO = Path(__file__).resolve().parents[1]
# The hub file the committed bundle shipped before the move (git show a01cc40:checkpoints/smollm2-135m-specdecpp/
# custom_generate/generate.py): bundles exported then and downloaded since still carry it.
PRE_MOVE_HUB_FILE = Path(__file__).parent / "fixtures" / "hub_generate_before_move.py.txt"


def forget(name: str) -> None:
    """Drop ``name`` from ``sys.modules`` and its package, so the next import resolves it afresh."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_module_at_its_new_place(old: str) -> None:
    forget(old)
    with pytest.warns(FutureWarning, match=rf"{old} moved to {MOVED[old][0]}"):
        module = importlib.import_module(old)
    new = [importlib.import_module(name) for name in MOVED[old]]
    if len(new) == 1:
        assert module is new[0] and module.__spec__.name == MOVED[old][0] == module.__name__
    else:  # a module split in two: its old path holds the public names of both
        for part in new:
            public = {k for k in vars(part) if not k.startswith("_")}
            assert all(getattr(module, k) is getattr(part, k) for k in public)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is module  # once imported, no second warning


def test_every_old_path_names_a_module_that_exists_and_no_folder_shadows_one() -> None:
    for old, news in MOVED.items():
        assert not (REPO / (old.replace(".", "/") + ".py")).exists(), f"{old} exists both at its old place and moved"
        assert all(importlib.util.find_spec(new) is not None for new in news), old


def test_the_old_engine_module_is_the_engine_package_and_exports_the_runner() -> None:
    """``accept_head.engine`` was one module; it is now the package, whose ``__init__`` exports the runner's API."""
    from accept_head.engine import MethodSpec, run_interleaved, runner

    assert MethodSpec is runner.MethodSpec and run_interleaved is runner.run_interleaved


def test_a_bundle_whose_hub_file_predates_the_move_still_decodes(tmp_path: Path) -> None:
    """A bundle's ``generate.py`` written before the move (``from accept_head.bundle import bundle_generate``) run
    over a tiny bundle saved by today's code gives the target's greedy output."""
    from tiny_models import make_pair, save_bundle

    from accept_head import load_model, load_tokenizer

    old_text = PRE_MOVE_HUB_FILE.read_text()
    assert "from accept_head.bundle import bundle_generate" in old_text
    target_dir, draft_dir = make_pair(tmp_path)
    target = load_model({"path": str(target_dir), "dtype": "float32"})
    draft = load_model({"path": str(draft_dir), "dtype": "float32"})
    save_bundle(tmp_path / "bundle", target, draft, load_tokenizer(str(target_dir)), target_dir, draft_dir)
    hub_file = tmp_path / "bundle" / "custom_generate" / "generate.py"
    hub_file.write_text(old_text)
    spec = importlib.util.spec_from_file_location("old_hub_generate", hub_file)
    module = importlib.util.module_from_spec(spec)
    forget("accept_head.bundle")
    with pytest.warns(FutureWarning, match="accept_head.specdecpp.bundle"):
        spec.loader.exec_module(module)
    x = torch.tensor([[5, 9, 10, 11]])
    ours = module.generate(model=target, input_ids=x, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, target.generate(x, max_new_tokens=12, do_sample=False))
