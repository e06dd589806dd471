"""Tables of results for a terminal (fixed width) and for Markdown (model cards, reports)."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> str:
    """A fixed-width terminal table: first column left-aligned, the others right-aligned."""
    body = [list(header)] + [list(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in body
    ]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join(([title] if title else []) + [rule, lines[0], rule, *lines[1:], rule])


RULES = {"l": ":---", "r": "---:", "-": "---"}
"""The rule under a Markdown table's header per column alignment: left, right, or none (``-``, shown left)."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], aligns: str | None = None) -> str:
    """The same table in Markdown; ``aligns`` has one ``l``/``r``/``-`` per column (:data:`RULES`; default: first
    left, others right)."""
    aligns = aligns or "l" + "r" * (len(header) - 1)
    if len(aligns) != len(header):
        raise ValueError(f"aligns={aligns!r} must have one letter per column ({len(header)}).")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(RULES.get(a, RULES["r"]) for a in aligns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
