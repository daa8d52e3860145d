"""`make gpu-check` names what failed (gpu_check/pytest_report.py): a real pytest run of a small test file whose
tests fail as the GPU tier's did (an assertion on a memory bound, an error in a fixture) becomes one row per
failure with the test's name, the line that failed and what it said, and pytest's whole output is kept (a pytest
of its own in a subprocess: an integration test)."""

from gpu_check.pytest_report import pytest_rows

TESTS = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("no CUDA memory reading")

def test_passes():
    assert 1 + 1 == 2

def test_cached_memory_given_back():
    after = {"reserved": 7_373_586_432, "allocated": 7_225_487_360}
    assert after["reserved"] - after["allocated"] <= 64 * 2**20

def test_needs_a_fixture(broken):
    pass
"""


def test_each_failed_test_is_a_row_with_its_failing_line_and_the_whole_output_is_kept(tmp_path):
    (tmp_path / "test_tier.py").write_text(TESTS)
    rows = pytest_rows("a tier", [str(tmp_path / "test_tier.py")], tmp_path, "tier")
    verdict, *failed = rows
    assert verdict[0] == "a tier"
    assert verdict[1].startswith("FAILED: 1 failed, 1 passed, 1 error in ")
    assert "pytest's output: tier.log" in verdict[1]
    assert failed[0][0] == "  failed: test_cached_memory_given_back"
    assert failed[0][1] == (
        f'{tmp_path}/test_tier.py:13: `assert after["reserved"] - after["allocated"] <= '
        "64 * 2**20`: assert (7373586432 - 7225487360) <= (64 * (2 ** 20))"
    )
    assert failed[1][0] == "  error: test_needs_a_fixture"
    assert failed[1][1].startswith(f'{tmp_path}/test_tier.py:6: `raise RuntimeError("no CUDA memory reading")`: ')
    assert "RuntimeError: no CUDA memory reading" in failed[1][1]
    assert len(failed) == 2
    log = (tmp_path / "tier.log").read_text()
    assert "def test_cached_memory_given_back" in log and "RuntimeError" in log  # the tracebacks, whole
