"""Loopback only: no test reaches any address but this machine's own 127.0.0.1 (or ::1, "localhost"; and the
machine's own host name, which torchrun looks up to name its workers, and the addresses it resolves to). A test that
builds its own network namespaces (tests/test_slurm_two_nodes.py) names their hosts file in $LOOPBACK_GUARD_HOSTS: its
names, which that file answers without a DNS query, and its private addresses, which exist only inside those
namespaces, count as local too.

tests/conftest.py installs this guard in the pytest process for the whole session, and puts this directory first on
the PYTHONPATH of every script the tests run, where Python loads it as `sitecustomize` before the script's first line.
A DNS lookup of another name, or a connect to another address, then raises OSError (as an offline machine's would)
and is written to the file named by $LOOPBACK_GUARD_LOG, which conftest reads after each test and fails the test on,
even when the code that tried swallowed the error.

It also turns off the two requests `datasets` makes beside the Hub, to hosts the tests cannot serve: its parquet
export probe (datasets-server.<HF_ENDPOINT's host>, `datasets.config.USE_PARQUET_EXPORT`) and its download counter
(an S3 host, `HF_UPDATE_DOWNLOAD_COUNTS`), set as soon as `datasets.config` is imported.

pip too: what the tests install or bundle with pip, and the wheels quickstart_assets.py reads, were downloaded before
the tests ran (tests/fetch.py, which `.ci/run` runs), and tests/conftest.py points pip at them with no index.

Beside the guard, two settings for speed: the tests' processes run Python's cyclic garbage collector less often, and
not at exit (fewer_collections); DeepSpeed does not build its CPU-only shared-memory op in them (no_shared_memory_op).
"""

import atexit
import gc
import ipaddress
import os
import socket
import sys

LOG_VARIABLE = "LOOPBACK_GUARD_LOG"
HOSTS_VARIABLE = "LOOPBACK_GUARD_HOSTS"
LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", socket.gethostname().lower()}
own_addresses: set[str] = set()  # what this machine's own name resolved to
blocked: list[str] = []  # what this process tried, in order


class LeftLoopback(socket.gaierror):
    """A lookup or connection that would leave this machine (an OSError, as the network being down raises)."""


def namespace_hosts() -> set[str]:
    """The names and addresses of $LOOPBACK_GUARD_HOSTS's lines whose address is private (the test's namespaces)."""
    path = os.environ.get(HOSTS_VARIABLE)
    if not path or not os.path.isfile(path):
        return set()
    local = set()
    with open(path) as file:
        for line in file:
            fields = line.split("#")[0].split()
            try:
                private = len(fields) > 1 and ipaddress.ip_address(fields[0]).is_private
            except ValueError:
                private = False
            if private:
                local.update(field.lower() for field in fields)
    return local


def is_loopback(host) -> bool:
    if host is None:
        return True  # getaddrinfo(None, port): the local host
    if isinstance(host, bytes):
        host = host.decode()
    host = host.strip("[]").lower()
    if host in LOCAL_NAMES or host in own_addresses or host in namespace_hosts():
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name other than localhost: a DNS lookup


def is_address(host) -> bool:
    try:
        ipaddress.ip_address((host.decode() if isinstance(host, bytes) else str(host)).strip("[]").split("%")[0])
        return True
    except ValueError:
        return False


def refuse(what: str, host) -> None:
    message = f"{what} {host!r} from {' '.join(sys.argv)[:200]} (pid {os.getpid()})"
    blocked.append(message)
    log = os.environ.get(LOG_VARIABLE)
    if log:
        with open(log, "a") as file:
            file.write(message + "\n")
    print(f"loopback guard: blocked {message}", file=sys.stderr)
    raise LeftLoopback(socket.EAI_NONAME, f"loopback guard: the tests may not reach {host!r}")


def install() -> None:
    if getattr(socket, "_loopback_guard", False):
        return
    socket._loopback_guard = True
    getaddrinfo, gethostbyname, gethostbyname_ex = socket.getaddrinfo, socket.gethostbyname, socket.gethostbyname_ex
    gethostbyaddr, connect, connect_ex = socket.gethostbyaddr, socket.socket.connect, socket.socket.connect_ex

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not is_loopback(host):
            refuse("a connection to" if is_address(host) else "a DNS lookup of", host)
        answers = getaddrinfo(host, *args, **kwargs)
        if host == socket.gethostname():
            own_addresses.update(str(answer[4][0]).lower() for answer in answers)
        return answers

    def guarded_lookup(lookup):
        def guarded(host, *args):
            if not is_loopback(host):
                refuse("a DNS lookup of", host)
            answer = lookup(host, *args)
            if host == socket.gethostname():
                own_addresses.update(a.lower() for a in ([answer] if isinstance(answer, str) else answer[2]))
            return answer

        return guarded

    def guarded_connect(connect_function):
        def guarded(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address[0]):
                refuse("a connection to", address[0])
            return connect_function(self, address)

        return guarded

    socket.getaddrinfo = guarded_getaddrinfo
    socket.gethostbyname, socket.gethostbyname_ex = guarded_lookup(gethostbyname), guarded_lookup(gethostbyname_ex)
    socket.gethostbyaddr = guarded_lookup(gethostbyaddr)
    socket.socket.connect, socket.socket.connect_ex = guarded_connect(connect), guarded_connect(connect_ex)
    os.environ["HF_UPDATE_DOWNLOAD_COUNTS"] = "0"
    after_import("datasets.config", no_side_requests)


def no_side_requests(config) -> None:
    config.USE_PARQUET_EXPORT = False
    config.HF_UPDATE_DOWNLOAD_COUNTS = False


def after_import(name: str, patch) -> None:
    """`patch(module)` as soon as the module `name` is imported (or now, if it is already): importing it here would
    add its import time to every script that never uses it."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, AfterImport(name, patch))


class AfterImport:
    """The import hook of after_import: finds `name`'s spec as Python would, then patches the module once loaded."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def no_shared_memory_op(comm_torch) -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory collective (deepspeed_shm_comm, ~60 CPU-s) when its
    engine starts, and again whenever another Python environment built it last; only its inference all-reduce uses
    it (training's reductions are torch.distributed's: gloo here, NCCL on GPUs, where it is never built). Not built
    in the tests' processes: their runs reduce exactly as without it, and no test waits on that build or its lock."""
    comm_torch.build_shm_op = lambda: None


def fewer_collections() -> None:
    """Python's cyclic garbage collector every 10,000 new container objects instead of every 700, and no collection
    at exit (gc.freeze as the last exit handler: what is alive then is left to the operating system, as a killed
    process's is; whatever reference counting frees is freed as before). Each collection walks the ~340,000 objects
    that importing torch, torch._dynamo and transformers leaves, and Python's exit walks them several times (1.0
    CPU-s of a 4-update tiny policy run's 10.3). Measured on that run (2-vCPU AMD EPYC): 10.3 CPU-s (median of 6)
    -> 9.3 with no collection at exit -> 8.3 with both, its peak memory ~90 MiB higher. The tests' processes only:
    when a reference cycle is freed is nothing the tests check, and the scripts close what they write."""
    gc.set_threshold(10_000, 10, 10)
    atexit.register(gc.freeze)  # registered first, so run last: after every other exit handler (weakref.finalize's)


if __name__ == "sitecustomize":  # loaded by a script the tests start; conftest imports it under its own name
    install()
    fewer_collections()
    after_import("deepspeed.comm.torch", no_shared_memory_op)
