"""The reference docs are checked against the code where they list names, so they cannot drift."""

import dataclasses
import re
from pathlib import Path

import pytest

from steptrace import _config, _schema

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _text(*names):
    return "".join((DOCS / n).read_text() for n in names)


def test_every_setting_and_variable_is_documented():
    text = _text("configuration.md", "prometheus.md", "otlp.md")
    missing = [f.name for f in dataclasses.fields(_config.Config) if f"`{f.name}`" not in text]
    assert not missing, f"docs/configuration.md lacks settings {missing}"
    variables = [v for k, v in vars(_config).items() if k.startswith("ENV_") and isinstance(v, str)]
    assert variables
    missing = [v for v in variables if v not in text]
    assert not missing, f"docs lack variables {missing}"


def _record_tables():
    """docs/records.md's field tables: heading (``every`` or a record type) -> field names, in order.

    A table belongs to the ``## `type` `` heading above it; a field is the first cell of a row."""
    tables: dict[str, list[str]] = {}
    heading = None
    for line in _text("records.md").split("# Errors and misuse")[0].splitlines():
        if line.startswith("## "):
            found = re.fullmatch(r"## `(\w+)`", line)
            heading = found.group(1) if found else ("every" if line == "## Every record" else None)
            continue
        row = re.match(r"\| `(\w+)` \|", line)
        if heading and row:
            tables.setdefault(heading, []).append(row.group(1))
    return tables


def test_the_common_fields_are_documented_once():
    assert _record_tables()["every"] == ["type", "run_id", "rank", "attempt"]


@pytest.mark.parametrize("record_type", _schema.RECORD_TYPES)
def test_every_record_field_is_documented_once(record_type):
    tables = _record_tables()
    assert record_type in tables, f"docs/records.md has no field table for {record_type} records"
    documented = tables[record_type]
    common = {"type", "run_id", "rank", "attempt"}  # the "Every record" table
    expected = [f for f in _schema.fields_of(record_type) if f not in common]
    twice = sorted({f for f in documented if documented.count(f) > 1})
    assert not twice, f"docs/records.md's {record_type} table lists {twice} more than once"
    missing = [f for f in expected if f not in documented]
    assert not missing, f"docs/records.md's {record_type} table lacks {missing}"
    unknown = [f for f in documented if f not in expected]
    assert not unknown, f"docs/records.md's {record_type} table lists {unknown}, not in steptrace/_schema.py"


def test_the_record_tables_have_four_columns():
    # One row per field (name, type, unit, meaning): a row with a stray "|" in its meaning would
    # shift the columns, and a cell that grows into a page is what this layout replaced.
    for line in _text("records.md").split("# Errors and misuse")[0].splitlines():
        if re.match(r"\| `\w+` \|", line):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            assert len(cells) == 4, f"docs/records.md row has {len(cells)} columns: {line[:80]}"
            assert len(line) < 400, f"docs/records.md row is {len(line)} characters: {line[:80]}"


def test_links_between_readme_and_docs_resolve():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_readme_stays_short():
    # A newcomer reads it in five minutes; the reference lives in docs/.
    assert len((ROOT / "README.md").read_text().split()) < 2000


@pytest.mark.parametrize("command, page", [("report", "report.md"), ("compare", "compare.md"),
                                           ("timeline", "timeline.md")])
def test_every_command_option_is_documented(command, page):
    import argparse

    from steptrace.analysis import compare, report
    from steptrace import timeline

    parser = argparse.ArgumentParser()
    {"report": report.add_report_arguments, "compare": compare.add_compare_arguments,
     "timeline": timeline.add_timeline_arguments}[command](parser)
    text = _text(page)
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    missing = [o for o in options if o != "--help" and not re.search(re.escape(o) + r"(?![\w-])", text)]
    assert not missing, f"docs/{page} lacks {command} options {missing}"
