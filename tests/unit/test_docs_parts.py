"""docs/architecture.md's parts table names every module: a module under ``clawray/``,
``bench/`` or ``scripts/`` that the table does not mention fails this test (the page opens
with "This page matches the code")."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parts_section() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("## Parts")
    return text[start:text.index("\n## ", start + 1)]


def mentioned(path: Path, parts: str) -> bool:
    """The full path is in the table; or, for ``clawray/<part>/<file>``, the file's name is in
    the row of ``clawray/<part>/`` (for ``clawray/<part>/<sub>/<file>``, with ``<sub>/``); or a ``bench/…*…`` / ``scripts/…*…`` pattern covers it."""
    rel = path.relative_to(REPO).as_posix()
    if rel in parts:
        return True
    bits = rel.split("/")
    if bits[0] == "clawray" and len(bits) in (3, 4):  # a part's file, or its sub-package's
        rows = [r for r in parts.splitlines() if r.startswith("| ")
                and f"`clawray/{bits[1]}/`" in r.split("|")[2]]
        return any(re.search(rf"\b{re.escape(path.name)}\b", r)
                   and (len(bits) == 3 or f"`{bits[2]}/`" in r) for r in rows)
    patterns = re.findall(r"`((?:bench|scripts)/[^`]*\*[^`]*)`", parts)
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def modules() -> list[Path]:
    out = []
    for top in ("clawray", "bench", "scripts"):
        for p in sorted((REPO / top).rglob("*")):
            if p.suffix in (".py", ".sh") and p.name != "__init__.py" \
                    and "__pycache__" not in p.parts:
                out.append(p)
    return out


def test_every_module_is_in_the_parts_table():
    parts = parts_section()
    missing = [p.relative_to(REPO).as_posix() for p in modules() if not mentioned(p, parts)]
    assert not missing, f"docs/architecture.md's parts table does not mention {missing}"


def test_the_check_finds_a_module_the_table_does_not_name():
    parts = parts_section()
    assert modules() and all(mentioned(p, parts) for p in modules()[:3])
    assert not mentioned(REPO / "clawray" / "serve" / "no_such_module.py", parts)
    assert not mentioned(REPO / "bench" / "no_such_bench.py", parts)
