"""Shared fixtures. The tests import the *installed* `tierkv` wheel (scripts/test.sh builds it
with `maturin build --release` and installs it into a fresh virtual environment)."""

import pytest

import tierkv

# Figures measured by tests (not asserted), printed at the end of the run.
REPORT = []


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def db(path):
    with tierkv.open(path) as d:
        yield d


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("tierkv measurements (reported, not asserted)")
        for line in REPORT:
            terminalreporter.write_line(line)
