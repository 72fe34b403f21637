"""Headless Chromium for tests (Debian's `chromium` package, driven through its command line).

`dump_dom` runs a page's scripts (timers on virtual time, network for real) and returns the DOM
they left; `screenshot` writes a PNG. `page_fields` reads what the page shows in its
`data-field` elements. A machine without Chromium skips the test that asks for it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

MISSING = (
    "headless Chromium is not installed (Debian's `chromium` package; `make test` installs it where "
    "apt-get can): the dashboard's browser test cannot run here"
)
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def chromium_binary() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip(MISSING)
    return binary


def _run(url: str, *flags: str, budget_ms: int, timeout: float = 90.0) -> str:
    with tempfile.TemporaryDirectory(prefix="kvserve-chromium-") as profile:
        args = [
            chromium_binary(),
            "--headless",
            "--no-sandbox",  # tests run as root, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",  # page timers run ahead on virtual time: a few polls
            *flags,
            url,
        ]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dump_dom(url: str, budget_ms: int = 2500) -> str:
    return _run(url, "--dump-dom", budget_ms=budget_ms)


def screenshot(url: str, path: Path, size: tuple[int, int] = (1400, 1000), budget_ms: int = 2500) -> Path:
    _run(url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}", budget_ms=budget_ms)
    return path


class _Fields(HTMLParser):
    """Text of every element with a data-field attribute, by the data-replica section it is in
    ("" outside any) and field (nested text included)."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict[str, str]] = {}
        self.body: dict[str, str] = {}
        self._open: list[tuple[str, str | None, str]] = []  # (tag, field, section)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        if tag in _VOID:
            return
        section = a.get("data-replica") or (self._open[-1][2] if self._open else "")
        field = a.get("data-field")
        if field is not None:
            self.sections.setdefault(section, {}).setdefault(field, "")
        self._open.append((tag, field, section))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            opened, _, _ = self._open.pop()
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, field, section in self._open:
            if field is not None:
                self.sections[section][field] += data


def page_fields(dom: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """(section -> data-field -> its text, spaces collapsed; the body's attributes). A replica's
    panel is section "replica" on a replica's page, "replica-<index>" on the router's."""
    parser = _Fields()
    parser.feed(dom)
    sections = {s: {k: " ".join(v.split()) for k, v in f.items()} for s, f in parser.sections.items()}
    return sections, parser.body
