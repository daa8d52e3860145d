"""`make test` starts the longest modules first (tests/support/module_seconds.py): the times are read from pytest's
durations report, and the order puts new integration modules first and other unknown ones last."""

from tests.support import module_seconds
from tests.support.module_seconds import longest_first, read_log

REPORT = """
============================= slowest durations ==============================
120.50s call     tests/integration/test_soak.py::test_a_short_soak[kill]
3.25s setup    tests/integration/test_grpo_app.py::test_run
2.00s call     tests/integration/test_grpo_app.py::test_run
0.40s teardown tests/integration/test_grpo_app.py::test_resume[a::b]
0.01s call     tests/unit/test_config.py::test_keys
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
1141 passed, 6 skipped in 2841.00s (0:47:21)
"""


def test_seconds_per_module_sum_its_tests_setups_calls_and_teardowns():
    assert read_log(REPORT) == {
        "tests/integration/test_soak.py": 120.5,
        "tests/integration/test_grpo_app.py": 5.65,
        "tests/unit/test_config.py": 0.01,
    }


def test_new_integration_modules_start_first_and_unknown_others_last(monkeypatch):
    monkeypatch.setattr(module_seconds, "known_seconds", lambda: read_log(REPORT))
    given = [
        "tests/unit/test_new.py",
        "tests/integration/test_grpo_app.py",
        "tests/unit/test_config.py",
        "tests/integration/test_new.py",
        "tests/integration/test_soak.py",
    ]
    assert longest_first(given) == [
        "tests/integration/test_new.py",
        "tests/integration/test_soak.py",
        "tests/integration/test_grpo_app.py",
        "tests/unit/test_config.py",
        "tests/unit/test_new.py",
    ]
