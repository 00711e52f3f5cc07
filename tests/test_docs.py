"""The docs stay true: every flag `--help` prints is on the CLI page and every flag there
exists; every environment variable the code reads is on the configuration page; the
site builds with `mkdocs build --strict` (no broken link)."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pantheon.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCES = ["common", "frontend", "worker", "pantheon", "bench", "deploy"]
# names the code reads from the environment: our own, and the spec's (QWEN35_*, BS_*, PN_*)
ENV_NAME = re.compile(r"\b((?:PANTHEON|QWEN35|BS|PN)_[A-Z0-9_]*[A-Z0-9])\b")


def parsers(parser: argparse.ArgumentParser, path: str = "pantheon"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def flags() -> dict[str, set[str]]:
    """--flag → the commands that take it."""
    out: dict[str, set[str]] = {}
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    out.setdefault(option, set()).add(path)
    return out


def test_every_flag_is_on_the_cli_page_and_every_flag_there_exists():
    page = (DOCS / "cli.md").read_text()
    known = flags()
    missing = sorted(f"{flag} ({', '.join(sorted(cmds))})" for flag, cmds in known.items()
                     if not re.search(re.escape(flag) + r"(?![\w-])", page))
    assert not missing, f"flags `--help` prints that docs/cli.md does not: {missing}"
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", page))
    unknown = sorted(named - set(known))
    assert not unknown, f"flags docs/cli.md names that no command takes: {unknown}"


def environment_names() -> dict[str, str]:
    """Every environment variable name in the sources → a file that names it."""
    found = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".conf", ".service") and path.is_file():
                for name in ENV_NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_environment_variable_is_on_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    names = environment_names()
    assert "PANTHEON_CACHE_DIR" in names and "QWEN35_BS_PREFILL_CHUNK" in names   # the scan works
    missing = sorted(f"{n} ({where})" for n, where in names.items()
                     if not re.search(r"\b" + n + r"\b", page))
    assert not missing, f"read by the code, not in docs/configuration.md: {missing}"


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs not installed (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "cli" / "index.html").exists()


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in re.findall(r"\]\(docs/([\w-]+\.md)", readme):
        assert (DOCS / page).exists(), page
