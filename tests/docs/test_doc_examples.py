"""The ```python examples in README.md and docs/*.md run as written, in a fresh directory (their temporary
directories too).

The blocks of one file run in order in one namespace (later examples use earlier variables). A block preceded by
an ``<!-- skip-test ... -->`` comment (multi-process or S3 examples) is not run.
"""

from __future__ import annotations

import re
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_BLOCK = re.compile(r"(?P<skip><!--\s*skip-test[^>]*-->\s*)?(?P<indent>[ \t]*)```python\n(?P<code>.*?)```", re.DOTALL)


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) for each ```python block of a markdown file."""
    text = path.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, textwrap.dedent(m.group("code")), m.group("skip") is not None)
        for m in _BLOCK.finditer(text)
    ]


def test_docs_exist_and_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in ("guide.md", "format.md", "api.md"):
        assert (ROOT / "docs" / name).exists()
        assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"


def test_block_extraction_honours_skip_markers(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "a\n```python\nx = 1\n```\n<!-- skip-test: S3 -->\n```python\nraise SystemExit\n```\n"
        "- item:\n\n  <!-- skip-test -->\n  ```python\n  raise SystemExit\n  ```\n"
        "  ```python\n  y = 2\n  ```\n"
    )
    assert python_blocks(md) == [
        (3, "x = 1\n", False),
        (7, "raise SystemExit\n", True),
        (13, "raise SystemExit\n", True),
        (16, "y = 2\n", False),
    ]


@pytest.mark.parametrize(
    "doc", [p for p in DOCS if any(not skipped for _, _, skipped in python_blocks(p))], ids=lambda p: p.name
)
def test_examples_run(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # an example's tempfile.mkdtemp() is cleaned up too
    namespace: dict = {"__name__": f"doc_{doc.stem}"}
    ran = 0
    for line, code, skipped in python_blocks(doc):
        if skipped:
            continue
        try:
            exec(compile(code, f"{doc.name}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the example at {doc.relative_to(ROOT)} line {line} failed: {e!r}") from e
        ran += 1
    assert ran > 0


def _rendered_parameters(fn) -> str:
    """``fn``'s parameters as docs/api.md writes them: ``name=default`` (strings in double quotes), ``*`` before
    the keyword-only ones, no annotations."""
    import inspect

    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in out:
            out.append("*")
        default = f'"{p.default}"' if isinstance(p.default, str) else repr(p.default)
        out.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={default}")
    return ", ".join(out)


@pytest.mark.parametrize("name", ["save_checkpoint", "load_checkpoint"])
def test_api_md_shows_every_parameter(name):
    """The signature headings of docs/api.md are the functions' own (a parameter added to one shows in the other)."""
    import nxd_ckpt

    headings = re.findall(rf"^### `{name}\((.*?)\)", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE)
    assert headings == [_rendered_parameters(getattr(nxd_ckpt, name))]
