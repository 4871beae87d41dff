"""The split scripts/test relies on: `--phase parallel` runs everything but the serial and alone
tests, `--phase serial` the serial ones and `--phase alone` the alone ones, each without importing
the other modules, and a marked test its part could not see is refused rather than skipped by
every part."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    serial: beside one other\n    alone: by itself\n")
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
        """,
        test_busy="""
            import pytest
            pytestmark = pytest.mark.serial

            @pytest.mark.alone
            def test_by_itself():
                assert True

            def test_busy_serial():
                assert True
        """)
    return pytester


def test_each_phase_runs_its_own_tests_and_serial_imports_no_other_module(suite: pytest.Pytester) -> None:
    parallel = suite.runpytest("--phase", "parallel", "-v", "-p", "no:cacheprovider")
    parallel.assert_outcomes(passed=2, deselected=4)
    ran = {line.split(" PASSED")[0] for line in parallel.outlines if " PASSED" in line}
    assert ran == {"test_plain.py::test_plain", "test_mixed.py::test_beside"}
    (suite.path / "plain-imported").unlink()

    serial = suite.runpytest("--phase", "serial", "-v", "-p", "no:cacheprovider")
    serial.assert_outcomes(passed=3, deselected=2)
    assert {line.split(" PASSED")[0] for line in serial.outlines if " PASSED" in line} == {
        "test_timed.py::test_timed", "test_mixed.py::test_alone", "test_busy.py::test_busy_serial"}
    assert not (suite.path / "plain-imported").exists()
    alone = suite.runpytest("--phase", "alone", "-v", "-p", "no:cacheprovider")
    alone.assert_outcomes(passed=1)  # the other modules are not even collected
    assert [line.split(" PASSED")[0] for line in alone.outlines if " PASSED" in line] == [
        "test_busy.py::test_by_itself"]
    assert not (suite.path / "plain-imported").exists()
    everything = suite.runpytest("-p", "no:cacheprovider")
    everything.assert_outcomes(passed=6)


@pytest.mark.parametrize("mark", ["serial", "alone"])
def test_a_mark_its_phase_would_not_see_is_refused(suite: pytest.Pytester, mark: str) -> None:
    head, tail = mark[:3], mark[3:]
    suite.makepyfile(test_hidden=f"""
        import pytest

        @getattr(pytest.mark, "{head}" + "{tail}")
        def test_hidden():
            assert True
    """)
    result = suite.runpytest("--phase", "parallel", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_hidden.py::test_hidden is marked {mark} without the text*"])
