"""The README's configuration table lists every environment variable the project reads."""

import re
from pathlib import Path

from tests.test_compose import names_read_by_settings

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
LAUNCHER_NAMES = {"PORT", "WEB_CONCURRENCY", "AQ_VAR_DIR"}  # read by project/launch.py


def documented() -> set[str]:
    section = README[README.index("## Configuration"):]
    section = section[:section.index("\n## ", 1)]
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", section, re.M))


def test_every_variable_read_is_in_the_readme_table():
    missing = (names_read_by_settings() | LAUNCHER_NAMES) - documented()
    assert not missing, f"add to the README's configuration table: {sorted(missing)}"


def test_the_table_lists_nothing_that_is_not_read():
    stale = documented() - names_read_by_settings() - LAUNCHER_NAMES
    assert not stale, f"the README documents variables nothing reads: {sorted(stale)}"
