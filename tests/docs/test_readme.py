"""The Python snippets of the README and of the docs pages run as written (in a scratch
directory).

Every ```python block of README.md and docs/**/*.md runs, except one that an HTML comment
`<!-- not-run -->` announces on the line before it (for code that needs what a test machine
lacks; bash blocks are never run). A block that appears on several pages runs once; one that
trains a whole run (`.train()`) is marked `e2e`, outside the fast subset.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = "<!-- not-run -->"
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```", re.M | re.S)


def _snippets() -> tuple[dict[str, str], list[str]]:
    """{"page:n": code} of the blocks to run (first occurrence of each), and the skipped ones."""
    snippets: dict[str, str] = {}
    skipped: list[str] = []
    seen: set[str] = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for n, match in enumerate(FENCE.finditer(text), 1):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            key = f"{name}:{n}"
            if before.strip() == NOT_RUN:
                skipped.append(key)
            elif match["code"] not in seen:
                seen.add(match["code"])
                snippets[key] = match["code"]
    return snippets, skipped


SNIPPETS, SKIPPED = _snippets()


def test_the_readme_and_docs_have_python_snippets() -> None:
    readme = [key for key in SNIPPETS if key.startswith("README.md:")]
    assert len(readme) >= 2
    assert any(key.startswith("docs/") for key in SNIPPETS)


def test_few_snippets_are_skipped() -> None:
    # `<!-- not-run -->` is for the rare block a test machine cannot run, not a way out.
    assert len(SKIPPED) <= 2, SKIPPED


@pytest.mark.parametrize("key", [
    pytest.param(key, marks=pytest.mark.e2e) if ".train()" in code else key
    for key, code in SNIPPETS.items()])
def test_snippet_runs(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = compile(SNIPPETS[key], f"{key} (python snippet)", "exec")
    exec(code, {"__name__": "__snippet__"})
