# The gate of tests/oracle/conftest.py, shown able to fail: pytest runs in a subprocess on a temporary suite
# whose oracle is missing (a module-level importorskip of a module that does not exist, or a skip inside a
# test), once with MEMRA_REQUIRE_ORACLES=1, which must fail and name the missing oracle, and once without,
# which must pass with the skip. Each temporary suite also holds a test that passes: pytest alone exits 5
# ("no tests collected") when its only module is skipped whole, which is not the pass being shown here. The
# conftest is copied beside the suite because pytest finds conftest.py files by the directory of the tests.
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
MISSING = "memra_no_such_oracle_module"

SUITES = {
    "module_importorskip": f"""
import pytest

pytest.importorskip("{MISSING}")


def test_never_collected():
    pass
""",
    "test_skip": f"""
import pytest


def test_needs_an_oracle():
    pytest.skip("{MISSING} not installed")
""",
}


PRESENT = """
def test_present_oracle():
    pass
"""


def run_pytest(tmp_path, suite, require):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITES[suite])
    (tmp_path / "test_present.py").write_text(PRESENT)
    env = {k: v for k, v in os.environ.items() if k != "MEMRA_REQUIRE_ORACLES"}  # CTest may have set it
    if require:
        env["MEMRA_REQUIRE_ORACLES"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "test_present.py", "test_suite.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_required_oracle_that_skips_fails_and_names_it(tmp_path, suite):
    r = run_pytest(tmp_path, suite, require=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert MISSING in out, out
    assert "oracle missing" in out, out
    assert "MEMRA_REQUIRE_ORACLES=1 forbids skipping" in out, out
    summary = out.splitlines()[-1]  # "1 error" (collection stops there) or "1 failed, 1 passed"; no skip
    assert ("1 error" in summary or "1 failed" in summary) and "skipped" not in summary, out


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_oracle_that_skips_without_the_requirement_passes(tmp_path, suite):
    r = run_pytest(tmp_path, suite, require=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    summary = out.splitlines()[-1]
    assert "1 passed" in summary and "1 skipped" in summary, out
    assert "forbids skipping" not in out, out
