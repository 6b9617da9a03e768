"""The two-host harness itself: a real Redis on host A reached from host B over the veth,
nothing reachable across without it, and everything it made removed, also after a failure."""

import errno
import socket
import subprocess
from pathlib import Path

import pytest
import redis

from tests.support.netns import (
    HOST_A_ADDRESS,
    HOST_B_ADDRESS,
    PREFIX,
    REDIS_PORT,
    TwoHosts,
    ip,
    reclaim_stale,
    require_netns,
    start_redis,
    two_hosts,
)


def _netns_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def _connect_error(address: str, port: int) -> int | None:
    """errno of a TCP connect to address:port from the calling thread's namespace (None: it
    connected). A 2 s bound: a dropped SYN counts as unreachable (ETIMEDOUT)."""
    with socket.socket() as sock:
        sock.settimeout(2.0)
        try:
            sock.connect((address, port))
        except TimeoutError:
            return errno.ETIMEDOUT
        except OSError as exc:
            return exc.errno
    return None


def test_redis_on_host_a_serves_host_b_over_the_veth(hosts: TwoHosts, tmp_path: Path) -> None:
    url = start_redis(hosts.a, tmp_path / "redis")
    assert url == f"redis://{HOST_A_ADDRESS}:{REDIS_PORT}/0"

    def write_and_read_back() -> tuple[bytes | None, str]:
        with redis.Redis.from_url(url, socket_timeout=5) as client:
            client.set("written-by", "host-b")
            client.client_setname("host-b-client")
            peer = next(c for c in client.client_list() if c["name"] == "host-b-client")
            return client.get("written-by"), peer["addr"].rsplit(":", 1)[0]

    value, peer_address = hosts.b.call(write_and_read_back)
    assert value == b"host-b"
    # The server saw the connection come from host B's own address: it crossed the veth.
    assert peer_address == HOST_B_ADDRESS


def _redis_answers(address: str, port: int) -> bool:
    """Whether a Redis server answers PING at address:port from the calling thread's
    namespace (a connection something else accepts, a proxy on the machine's default
    route say, is not one)."""
    with socket.socket() as sock:
        sock.settimeout(2.0)
        try:
            sock.connect((address, port))
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def test_nothing_crosses_without_the_veth(hosts: TwoHosts, tmp_path: Path) -> None:
    start_redis(hosts.a, tmp_path / "redis")
    (redis_proc,) = hosts.a.procs
    assert hosts.b.call(lambda: _redis_answers(HOST_A_ADDRESS, REDIS_PORT))
    # The machine's own namespace does not reach into the hosts' subnet (whatever its
    # default route leads to, it is not host A's Redis)...
    assert not _redis_answers(HOST_A_ADDRESS, REDIS_PORT)
    # ... and a host's loopback is its own: a listener on the machine's 127.0.0.1 is not there.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert hosts.b.call(lambda: _connect_error("127.0.0.1", port)) == errno.ECONNREFUSED
    # A host has no route but its veth's subnet: cut the wire and host A is unreachable.
    hosts.cut()
    assert hosts.b.call(lambda: _connect_error(HOST_A_ADDRESS, REDIS_PORT)) == errno.ENETUNREACH
    assert redis_proc.poll() is None  # the wire went, not the server


def test_everything_made_is_removed_even_when_the_test_fails(tmp_path: Path) -> None:
    require_netns()
    seen: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="the test failed here"):
        with two_hosts() as made:
            start_redis(made.a, tmp_path / "redis")
            seen["names"] = {made.a.netns, made.b.netns}
            seen["pids"] = made.a.pids()
            seen["interfaces"] = (made.a.interface, made.b.interface)
            assert seen["pids"], "redis-server runs inside host A"
            raise RuntimeError("the test failed here")
    assert not (seen["names"] & _netns_names())  # type: ignore[operator]
    for pid in seen["pids"]:  # type: ignore[attr-defined]
        assert not Path(f"/proc/{pid}").exists(), f"pid {pid} outlived its namespace"
    links = ip("-o", "link", "show")
    for name in seen["interfaces"]:  # type: ignore[attr-defined]
        assert name not in links


def test_two_runs_at_once_get_their_own_hosts(tmp_path: Path) -> None:
    require_netns()
    with two_hosts() as first, two_hosts() as second:
        assert {first.a.netns, first.b.netns}.isdisjoint({second.a.netns, second.b.netns})
        start_redis(first.a, tmp_path / "first")
        start_redis(second.a, tmp_path / "second")  # the same address and port, apart

        def mark(url: str, value: str) -> None:
            with redis.Redis.from_url(url) as client:
                client.set("run", value)

        def read(url: str) -> bytes | None:
            with redis.Redis.from_url(url) as client:
                return client.get("run")

        url = f"redis://{HOST_A_ADDRESS}:{REDIS_PORT}/0"
        first.b.call(lambda: mark(url, "first"))
        second.b.call(lambda: mark(url, "second"))
        assert first.b.call(lambda: read(url)) == b"first"
        assert second.b.call(lambda: read(url)) == b"second"


def test_a_dead_runs_namespace_is_reclaimed() -> None:
    require_netns()
    dead_pid = _a_dead_pid()
    name = f"{PREFIX}{dead_pid}xdead00a"
    ip("netns", "add", name)
    try:
        assert name in reclaim_stale()
        assert name not in _netns_names()
    finally:
        if name in _netns_names():
            ip("netns", "del", name)


def _a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid
