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


@pytest.mark.parametrize("record_type", _schema.RECORD_TYPES)
def test_every_record_field_is_documented(record_type):
    text = _text("records.md")
    row = [line for line in text.splitlines() if line.startswith(f"| `{record_type}` |")]
    assert row, f"docs/records.md has no row for {record_type} records"
    # A setting's own fields may sit in a row of their own: "| `step` (`pauses=True`) |".
    rows = " ".join(line for line in text.splitlines() if line.startswith(f"| `{record_type}` "))
    common = {"type", "run_id", "rank", "attempt"}  # said once, above the table
    missing = [f for f in _schema.fields_of(record_type) if f not in common and f not in rows]
    assert not missing, f"docs/records.md's {record_type} row lacks {missing}"


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
