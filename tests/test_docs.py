"""The README and docs point at things that exist: its two commands are Makefile targets, every
relative link (image links included, and a `#heading` anchor where one is given) reaches a file and a
heading, and every `kvserve ...` line in their shell blocks parses with the real command line. Docs
rot silently when a file or a flag moves; this catches it in `make test`, without loading torch."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the hand-written docs and the benchmark reports beside them
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), the target up to a space (a title) or the closing parenthesis
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.M | re.S)
# a kvserve command, after any environment assignments (OMP_NUM_THREADS=1 kvserve bench ...)
COMMAND = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*kvserve\s")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text outside code blocks and code spans, where a `[x](y)` is an example, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_` removed,
    spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_reach_a_file_and_heading(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: `with code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) ![ok](there.md) [web](https://example.com)\n"
        "`[not a link](gone.md)`\n```\n[not a link](gone.md)\n```\n"
        "[gone](gone.md) ![gone](gone.png) [bad anchor](there.md#nowhere) [self](#nowhere)\n"
    )
    assert broken_links(page) == [
        "gone.md: no such file",
        "gone.png: no such file",
        "there.md#nowhere: no such heading",
        "#nowhere: no such heading",
    ]


def kvserve_commands(path: Path) -> list[str]:
    lines = []
    for block in SHELL_BLOCK.findall(path.read_text()):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if COMMAND.match(line)]
    return lines


def argv(line: str) -> list[str]:
    """The arguments after `kvserve`: the comment cut off, `[optional]` groups left out."""
    words = shlex.split(re.sub(r"\[[^\]]*\]", "", re.sub(r"\s#.*", "", line)))
    return words[[i for i, w in enumerate(words) if w == "kvserve"][0] + 1 :]


@pytest.mark.parametrize("path", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_kvserve_commands_parse(path: Path) -> None:
    from kvserve.entrypoints.cli import build_parser  # argparse and the flags' modules only: no torch

    parser, refused = build_parser(), []
    for line in kvserve_commands(path):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv(line))
        except SystemExit as e:
            if e.code:
                refused.append(f"{line}: {err.getvalue().strip().splitlines()[-1]}")
    assert refused == []


def test_readme_commands_are_makefile_targets() -> None:
    targets = set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))
    readme = README.read_text()
    for command in ("serve", "test"):
        assert command in targets, f"the Makefile has no `{command}` target"
        assert f"make {command}" in readme, f"the README does not name `make {command}`"


def test_readme_is_short() -> None:
    """A newcomer reads it in five minutes; the rest belongs in docs/."""
    assert len(README.read_text().splitlines()) <= 200
