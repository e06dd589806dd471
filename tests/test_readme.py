"""The README's Python snippets run as documented, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"(?P<marker><!-- test(?P<slow> slow)? -->\n)?```python\n(?P<code>.*?)```", re.S)


def readme_snippets() -> list[re.Match]:
    return list(FENCE.finditer(README.read_text()))


def run_snippets(snippets: list[re.Match], namespace: dict) -> None:
    text = README.read_text()
    for snippet in snippets:
        line = text[: snippet.start("code")].count("\n") + 1
        # Pad with newlines so tracebacks point at README.md's own line numbers.
        exec(compile("\n" * (line - 1) + snippet["code"], str(README), "exec"), namespace)


def test_every_python_snippet_in_the_readme_is_tested() -> None:
    snippets = readme_snippets()
    assert snippets, "README.md has no Python snippets"
    untested = [s["code"].splitlines()[0] for s in snippets if not s["marker"]]
    assert not untested, f"mark these README snippets with <!-- test --> or <!-- test slow -->: {untested}"


def test_readme_api_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # snippets may write files (a saved bundle)
    fast = [s for s in readme_snippets() if s["marker"] and not s["slow"]]
    assert len(fast) >= 2
    run_snippets(fast, {"__name__": "readme"})
    assert (tmp_path / "my-bundle" / "config.json").is_file()


@pytest.mark.slow
def test_readme_real_model_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    slow = [s for s in readme_snippets() if s["slow"]]
    assert slow
    run_snippets(slow, {"__name__": "readme"})


def test_ci_runs_the_readme_test_command() -> None:
    assert "```bash\nmake test\n```" in README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] in ("make test", "exec make test")
