"""The split scripts/test relies on: `--phase parallel` runs everything but the serial tests,
`--phase serial` runs those alone without importing the other modules, and a serial test the
serial part could not see is refused rather than skipped by both parts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    serial: runs alone\n")
    pytester.makepyfile(
        test_plain="""
            from pathlib import Path
            Path("plain-imported").touch()

            def test_plain():
                assert True
        """,
        test_timed="""
            import pytest
            pytestmark = pytest.mark.serial

            def test_timed():
                assert True
        """,
        test_mixed="""
            import pytest

            @pytest.mark.serial
            def test_alone():
                assert True

            def test_beside():
                assert True
        """)
    return pytester


def test_each_phase_runs_its_own_tests_and_serial_imports_no_other_module(suite: pytest.Pytester) -> None:
    parallel = suite.runpytest("--phase", "parallel", "-v", "-p", "no:cacheprovider")
    parallel.assert_outcomes(passed=2, deselected=2)
    ran = {line.split(" PASSED")[0] for line in parallel.outlines if " PASSED" in line}
    assert ran == {"test_plain.py::test_plain", "test_mixed.py::test_beside"}
    (suite.path / "plain-imported").unlink()

    serial = suite.runpytest("--phase", "serial", "-v", "-p", "no:cacheprovider")
    serial.assert_outcomes(passed=2, deselected=1)
    assert {line.split(" PASSED")[0] for line in serial.outlines if " PASSED" in line} == {
        "test_timed.py::test_timed", "test_mixed.py::test_alone"}
    assert not (suite.path / "plain-imported").exists()
    everything = suite.runpytest("-p", "no:cacheprovider")
    everything.assert_outcomes(passed=4)


def test_a_serial_mark_the_serial_phase_would_not_see_is_refused(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_hidden="""
        import pytest

        @getattr(pytest.mark, "ser" + "ial")
        def test_hidden():
            assert True
    """)
    result = suite.runpytest("--phase", "parallel", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_hidden.py::test_hidden is marked serial without the text*"])
