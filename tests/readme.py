"""The README's and the docs' code, read back for the tests that run it (`test_readme.py`,
`test_job_submit.py`, `test_docs.py`)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    """Line of the opening fence in its file."""
    heading: str
    """The nearest heading above the block."""

    @property
    def name(self) -> str:
        return f"L{self.line}:{self.heading}"


def blocks(lang: str | None = None, path: Path = README) -> list[Block]:
    """The fenced blocks of `path` (the README unless told), in `lang` or all."""
    found, heading, fence, body = [], "", None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif fence is None and line.startswith("```"):
            fence, body = (line[3:].strip(), number), []
        elif fence is not None and line.startswith("```"):
            found.append(Block(fence[0], "\n".join(body) + "\n", fence[1], heading))
            fence = None
        elif fence is not None:
            body.append(line)
    return [b for b in found if lang is None or b.lang == lang]


def block(heading: str, lang: str, path: Path = README) -> Block:
    """The one `lang` block under `heading` in `path` (the README unless told)."""
    (only,) = [b for b in blocks(lang, path) if b.heading == heading]
    return only


def commands(block: Block) -> list[str]:
    """Each shell command of a bash block: continuation lines joined, comments dropped, `&&` split."""
    joined = re.sub(r"\\\n\s*", " ", block.code)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split("&&"))
    return out


def argv(command: str) -> list[str]:
    return shlex.split(command)
