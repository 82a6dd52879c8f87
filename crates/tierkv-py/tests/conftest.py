"""Shared fixtures. The tests import the *installed* `tierkv` wheel (scripts/test.sh builds it
with `maturin build --release` and installs it into a fresh virtual environment)."""

import pytest

import tierkv

# Figures measured by tests (not asserted), printed at the end of the run.
REPORT = []

# Small PM pools for the tests: a pool file is allocated whole (256 MiB by default), and
# stores are made by the hundred here. Each preset's PM structures scaled to fit.
_POOL = {"pm_pool_size": 1 << 23}
SMALL = {
    "native": dict(_POOL),
    "pmekv": dict(_POOL, pmekv={"kv_log_size": 1 << 18, "key_log_size": 1 << 18}),
    "slmdb": dict(_POOL, slmdb={"memtable_size": 1 << 20}),
    "hpdk": dict(_POOL, hpdk={"vlog_pool_size": 1 << 20}),
    "lightkv": dict(_POOL, lightkv={"segment_size": 1 << 20}),
    "hoakv": dict(_POOL, hoakv={"vtable_size": 1 << 20}),
}


def open_small(path, preset="native", **options):
    """`tierkv.open` with the preset's small-PM options (overridable)."""
    return tierkv.open(path, preset=preset, **dict(SMALL[preset], **options))


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def db(path):
    with open_small(path) as d:
        yield d


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("tierkv measurements (reported, not asserted)")
        for line in REPORT:
            terminalreporter.write_line(line)
