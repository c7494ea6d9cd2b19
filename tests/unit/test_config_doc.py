"""docs/configuration.md is generated from ServerConfig and lists exactly the flags of `kvtier server --help`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.server import config_doc

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def help_flags() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.server.cli", "server", "--help"],
        capture_output=True, text=True, check=True, cwd=REPO, env={**os.environ, "COLUMNS": "200"},
    ).stdout
    # An option line of argparse's "options:" section starts with two spaces and its flags, then two spaces
    # and the help: "  --port PORT  ...", "  --l2-odirect, --no-l2-odirect  ...".
    flags = set()
    for m in re.finditer(r"^  (-\S.*?)(?:\s{2,}|$)", out, re.M):
        flags.update(FLAG.findall(m.group(1)))
    return flags - {"--help"}


def doc_flags(text: str) -> set[str]:
    flags = set()
    for line in text.splitlines():
        if line.startswith("| `--"):
            flags.update(FLAG.findall(line.split("|")[1]))
    return flags


def test_committed_page_equals_generator_output():
    expected = config_doc.render()
    assert DOC.read_text() == expected, (
        "docs/configuration.md is stale: run `python -m kvtier.server.config_doc > docs/configuration.md`"
    )


def test_doc_flags_match_help():
    documented, helped = doc_flags(DOC.read_text()), help_flags()
    assert "--l1-size-gb" in helped and "--config" in helped
    assert documented - helped == set(), "documented but not in --help"
    assert helped - documented == set(), "in --help but not documented"


def test_every_field_has_env_and_toml_key():
    text = DOC.read_text()
    for f in config_doc.fields():
        assert f"`KVTIER_{f.name.upper()}`" in text, f.name
        assert f"`{f.name}`" in text
        assert f.metadata["help"] in text


def test_module_entry_point_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "kvtier.server.config_doc"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out == DOC.read_text()
