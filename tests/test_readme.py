"""The Python snippets of the README and of the docs pages run as documented, and CI runs the README's test command.

A ```python block marked ``<!-- test -->`` runs in the default suite, one marked ``<!-- test slow -->`` (real models)
in the slow one. A page's blocks of one kind run in order in one namespace, in a scratch folder whose ``checkpoints/``
is the repository's, as a reader at the repository root would run them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?P<marker><!-- test(?P<slow> slow)? -->\n)?```python\n(?P<code>.*?)```", re.S)


def snippets(page: Path) -> list[re.Match]:
    return list(FENCE.finditer(page.read_text()))


def marked(page: Path, slow: bool) -> list[re.Match]:
    return [s for s in snippets(page) if s["marker"] and bool(s["slow"]) == slow]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def run_snippets(page: Path, chosen: list[re.Match], scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (scratch / "checkpoints").symlink_to(ROOT / "checkpoints", target_is_directory=True)
    monkeypatch.chdir(scratch)  # snippets may write files (a saved bundle) and read checkpoints/
    text = page.read_text()
    namespace = {"__name__": "snippet"}
    for snippet in chosen:
        line = text[: snippet.start("code")].count("\n") + 1
        # Pad with newlines so tracebacks point at the page's own line numbers.
        exec(compile("\n" * (line - 1) + snippet["code"], str(page), "exec"), namespace)


FAST_PAGES = [page for page in PAGES if marked(page, slow=False)]
SLOW_PAGES = [page for page in PAGES if marked(page, slow=True)]


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_python_snippet_is_tested(page: Path) -> None:
    untested = [s["code"].splitlines()[0] for s in snippets(page) if not s["marker"]]
    assert not untested, f"mark these {name(page)} snippets with <!-- test --> or <!-- test slow -->: {untested}"


def test_the_readme_quickstart_and_the_guide_are_tested() -> None:
    quickstart = [s["code"] for s in snippets(README) if s["marker"]]
    assert any("SpecDecPP.from_pretrained" in code and "custom_generate=" in code for code in quickstart)
    assert GUIDE in FAST_PAGES and GUIDE in SLOW_PAGES


@pytest.mark.parametrize("page", FAST_PAGES, ids=name)
def test_page_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_snippets(page, marked(page, slow=False), tmp_path, monkeypatch)
    if page == GUIDE:
        assert (tmp_path / "my-bundle" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES, ids=name)
def test_page_real_model_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_snippets(page, marked(page, slow=True), tmp_path, monkeypatch)


def test_ci_runs_the_readme_test_command() -> None:
    assert "```bash\nmake test\n```" in README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] in ("make test", "exec make test")
