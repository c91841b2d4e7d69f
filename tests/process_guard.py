"""No process left behind: a test that starts processes and returns (or fails) without stopping them would leave them
running for the rest of the suite, holding cores, ports and files (seen once with test_throughput). These hooks,
imported by tests/conftest.py, note the processes a test's body started that are still running when it returns; if
any of them outlives the test's teardown (where a fixture may stop it), the guard ends it and its children and fails
that test by name. Processes a fixture starts in its setup (a module's daemons, a server shared by its tests) are not
the test's and are left alone."""

import psutil
import pytest

GRACE_SECONDS = 5.0
"""How long a leaked process is given to end after SIGTERM before SIGKILL."""
STARTED = pytest.StashKey[list]()
"""The processes a test's body started that were running when it returned."""
SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")
"""Helpers a library starts once for the whole pytest process and keeps by design (multiprocessing's resource tracker
and fork server, Inductor's compile workers): not a test's to stop."""


def descendants() -> dict[int, psutil.Process]:
    """This process's children and their children, by pid."""
    try:
        return {process.pid: process for process in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_tree(processes: list[psutil.Process]) -> None:
    """SIGTERM to each process and its children, then SIGKILL to what is left after GRACE_SECONDS."""
    tree = []
    for process in processes:
        try:
            tree += [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
    for process in tree:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(tree, timeout=GRACE_SECONDS)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=GRACE_SECONDS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = descendants()
    try:
        return (yield)
    finally:
        item.stash[STARTED] = [process for pid, process in descendants().items()
                               if pid not in before and not any(parent.pid in before for parent in parents(process))]  # fmt: skip


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    leaked = [process for process in item.stash.get(STARTED, []) if running(process)
              and not any(helper in " ".join(cmdline(process)) for helper in SHARED_HELPERS)]  # fmt: skip
    if leaked:
        names = ", ".join(f"{process.pid} ({' '.join(cmdline(process))[:80]})" for process in leaked)
        end_tree(leaked)
        pytest.fail(f"{item.nodeid} left {len(leaked)} process(es) running, now ended: {names}", pytrace=False)
    return result


def parents(process: psutil.Process) -> list[psutil.Process]:
    """Its parent, theirs... (a process started by one that a fixture owns is the fixture's too)."""
    try:
        return process.parents()
    except psutil.Error:
        return []


def cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline() or [process.name()]
    except psutil.Error:
        return ["?"]
