"""pytest hooks for the oracle suites. With MEMRA_REQUIRE_ORACLES=1 in the environment (CTest sets it on every
oracle.* test when CMake's MEMRA_REQUIRE_ORACLES option is on, as scripts/test.sh does for CI), a skip is a
failure: a suite whose oracle is missing would otherwise skip and CTest would report it as passed. This covers a
module-level pytest.importorskip (a skipped collection report) as well as a skip inside a test or a skipif mark
(a skipped test report); the failure keeps the skip's reason, which names the missing oracle."""
import os

import pytest

REQUIRE_ORACLES = os.environ.get("MEMRA_REQUIRE_ORACLES") == "1"


def _skip_reason(report):
    """The reason of a skipped report: pytest stores (path, line, "Skipped: <reason>")."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_instead_of_skip(report, where):
    # An expected failure (xfail) is reported as skipped too, but it ran; only real skips are refused.
    if not REQUIRE_ORACLES or not report.skipped or hasattr(report, "wasxfail"):
        return
    report.outcome = "failed"
    report.longrepr = (f"oracle missing: {where} skipped: {_skip_reason(report)}\n"
                       "MEMRA_REQUIRE_ORACLES=1 forbids skipping: install the oracle (scripts/setup.sh installs "
                       "requirements-oracle.txt) or configure without -DMEMRA_REQUIRE_ORACLES=ON")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_instead_of_skip(report, collector.nodeid or "collection")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_instead_of_skip(report, item.nodeid)
    return report
