"""The README's invariant table is made from AREAS, not kept by hand:
EXPECTTEST_ACCEPT=1 rewrites it."""

import os
import re
from pathlib import Path

import pytest

from conformance.areas import CATALOG, invariant_table

pytestmark = pytest.mark.selfcheck

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"(<!-- invariants:begin -->\n)(.*?)(<!-- invariants:end -->)", re.S)


def test_the_readme_table_is_the_catalog():
    text = README.read_text()
    m = BLOCK.search(text)
    assert m, "README.md has no <!-- invariants:begin --> / <!-- invariants:end --> block"
    want = invariant_table()
    if m.group(2) != want and os.environ.get("EXPECTTEST_ACCEPT") == "1":
        README.write_text(text[: m.start(2)] + want + text[m.end(2):])
        return
    assert m.group(2) == want, "README.md's invariant table is stale: rerun with EXPECTTEST_ACCEPT=1"


def test_the_table_names_every_invariant_once():
    ids = [i for i in re.findall(r"^\| ([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*) \|", invariant_table(), re.M) if i != "ID"]
    assert sorted(ids) == sorted(CATALOG) and len(ids) == len(set(ids))


FINDINGS = re.compile(r"(<!-- findings:begin -->\n)(.*?)(<!-- findings:end -->)", re.S)


def test_the_readme_findings_block_is_known_failures_toml():
    from conformance.run.known import findings_summary

    text = README.read_text()
    m = FINDINGS.search(text)
    assert m, "README.md has no <!-- findings:begin --> / <!-- findings:end --> block"
    want = findings_summary()
    if m.group(2) != want and os.environ.get("EXPECTTEST_ACCEPT") == "1":
        README.write_text(text[: m.start(2)] + want + text[m.end(2):])
        return
    assert m.group(2) == want, "README.md's findings block is stale: rerun with EXPECTTEST_ACCEPT=1"
