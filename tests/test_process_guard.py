"""tests/process_guard.py: a test that leaves a process running fails by name, and the process (with its children)
is ended; processes a fixture owns, or that a test stops itself, are left alone."""

import subprocess
import sys
import time

import psutil

from tests.conftest import REPO

GUARDED_TESTS = """
import subprocess, sys, time
from pathlib import Path

import pytest

LEAK = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(300.25)']); time.sleep(300.25)"]  # a process and its child
SLEEP = [sys.executable, "-c", "import time; time.sleep(300.25)"]


@pytest.fixture(scope="module")
def daemon():
    process = subprocess.Popen(SLEEP)
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def stopped_in_teardown():
    processes = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def test_leaves_one():
    process = subprocess.Popen(LEAK)
    time.sleep(1)  # its child started too
    (Path(__file__).parent / "leaked.pid").write_text(str(process.pid))
    assert False, "fails before it stops its process"


def test_uses_the_daemon(daemon):
    assert daemon.poll() is None


def test_starts_a_shared_helper():
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()  # its resource tracker stays, by design


def test_stops_its_own(stopped_in_teardown):
    stopped_in_teardown.append(subprocess.Popen(SLEEP))
    done = subprocess.Popen(SLEEP)
    done.kill()
    done.wait()
"""


def test_a_test_that_leaves_a_process_running_fails_and_the_process_ends(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.process_guard import pytest_runtest_call, pytest_runtest_teardown\n"
    )
    (tmp_path / "test_guarded.py").write_text(GUARDED_TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_guarded.py")], cwd=tmp_path,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    output = result.stdout + result.stderr
    pid = int((tmp_path / "leaked.pid").read_text())
    assert result.returncode == 1, output
    assert "test_guarded.py::test_leaves_one left 2 process(es) running, now ended" in output, output
    assert "1 failed, 3 passed, 1 error" in output, output  # the leak: an error at that test's teardown, nowhere else
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the leaked process {pid} still runs"
        time.sleep(0.1)
    sleepers = [
        p for p in psutil.process_iter(["cmdline"]) if "time.sleep(300.25)" in " ".join(p.info["cmdline"] or [])
    ]
    assert not sleepers, [p.pid for p in sleepers]  # its child ended too, and the fixtures' ones were stopped
