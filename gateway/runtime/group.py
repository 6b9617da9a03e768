"""Several gateway processes on one port: the capacity split and the supervisor.

`switchyard gateway --workers N` (or `processes: N`): the parent serves nothing. It starts
the embedded Redis if there is one (once, for all), holds the port with a bound,
non-listening SO_REUSEPORT socket, and starts N member processes that each listen on the
same host:port with SO_REUSEPORT, so the kernel spreads connections over them. Each member
is a whole gateway (`build_gateway`: its own quota owner id, journal, fair queue and
dispatcher) over the shared Redis (quotas, keys, routing).

A pool worker accepts `max_inflight_per_worker` requests from "the gateway"; N processes
that each believed that would send it N times as many. Each member therefore gets 1/N of
it (and of the queue bounds), the remainder on the first members: a split costs nothing
per request, where a shared count in Redis would cost a round trip per request.

The parent forwards SIGINT/SIGTERM to the members (each shuts down gracefully within
`shutdown_grace_s`), restarts a member that exits unexpectedly (backoff 1, 2, 4 ... s,
reset after 30 s up), and returns once every member has exited.
"""

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.runtime.embedded_redis import EmbeddedRedis
from gateway.runtime.http_server import reuse_port_socket

log = logging.getLogger(__name__)


def split_evenly(total: int, num_parts: int) -> list[int]:
    """`total` over `num_parts`: equal shares, the remainder one each on the first parts,
    and never below 1 (so with `total < num_parts` the parts sum to more than `total`)."""
    base, extra = divmod(total, num_parts)
    return [max(1, base + (1 if i < extra else 0)) for i in range(num_parts)]


def member_configs(config: GatewayConfig, redis_url: str) -> list[GatewayConfig]:
    """Each member's config: its share of the worker slots and the queue, the group's Redis."""
    n = config.processes
    inflight = split_evenly(config.max_inflight_per_worker, n)
    requests = split_evenly(config.queue_max_requests, n)
    tokens = split_evenly(config.queue_max_tokens, n)
    return [
        replace(
            config,
            redis_url=redis_url,
            max_inflight_per_worker=inflight[i],
            queue_max_requests=requests[i],
            queue_max_tokens=tokens[i],
            seat_share=1.0 / n,
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class MemberSpec:
    """What one member process is told (pickled to its stdin by the parent)."""

    config: GatewayConfig  # its share of the capacity; redis_url set
    host: str
    port: int
    index: int  # 0..num_processes-1, kept across restarts (the metrics' `process` label)
    num_processes: int
    procs_dir: str  # where members record their private metrics port


@dataclass(frozen=True)
class RestartPolicy:
    base_s: float = 1.0  # first restart after this, doubling per crash in a row
    max_s: float = 30.0
    reset_after_s: float = 30.0  # a member up this long starts its count afresh


def restart_delay_s(num_crashes: int, policy: RestartPolicy) -> float:
    """Backoff before restarting a member that crashed `num_crashes` (>= 1) times in a row."""
    return min(policy.base_s * 2 ** max(num_crashes - 1, 0), policy.max_s)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Own session (a terminal's Ctrl-C reaches only the parent, which forwards it once),
    and on Linux SIGTERM when the parent dies without stopping it."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Member:
    __slots__ = ("spec", "proc", "started_at", "up", "num_crashes", "restart_at")

    def __init__(self, spec: MemberSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.up = False  # its record appeared: it serves
        self.num_crashes = 0
        self.restart_at: float | None = None


class ProcessGroup:
    """Starts the members (`command`, spec on stdin) and supervises them until they exit."""

    def __init__(
        self,
        specs: list[MemberSpec],
        command: list[str],
        policy: RestartPolicy | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.members = [_Member(s) for s in specs]
        self.command = command
        self.policy = policy or RestartPolicy()
        self.poll_s = poll_s
        self.stopping = False
        self.failed = False  # a member exited before any member ever served
        self.ever_up = False
        self._signals: list[int] = []

    def run(self) -> int:
        """Until every member has exited after a signal (0), or the first start failed (1)."""
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for m in self.members:
                self._start(m)
            while any(m.proc is not None or m.restart_at is not None for m in self.members):
                self._tick(time.monotonic())
                time.sleep(self.poll_s)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return 1 if self.failed else 0

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members if m.proc is not None]

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)  # acted on by the loop, never midway through a tick

    def _stop(self, signum: int) -> None:
        """Stop restarting; pass `signum` on to every live member (a second SIGINT reaches
        uvicorn as one too: it stops at once)."""
        if not self.stopping:
            log.info("%s: stopping the gateway processes", signal.Signals(signum).name)
        self.stopping = True
        for m in self.members:
            m.restart_at = None
            if m.proc is not None and m.proc.poll() is None:
                try:
                    os.kill(m.proc.pid, signum)
                except ProcessLookupError:
                    pass

    def _start(self, m: _Member) -> None:
        m.restart_at = None
        m.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, preexec_fn=_die_with_parent)
        m.started_at, m.up = time.monotonic(), False
        assert m.proc.stdin is not None
        try:
            m.proc.stdin.write(pickle.dumps(m.spec))
            m.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: reaped by the next tick
        log.info("gateway process %d started (pid %d)", m.spec.index, m.proc.pid)

    def _record(self, m: _Member) -> Path:
        assert m.proc is not None
        return Path(m.spec.procs_dir) / f"{m.proc.pid}.json"

    def _tick(self, now: float) -> None:
        while self._signals:
            self._stop(self._signals.pop(0))
        for m in self.members:
            if m.proc is None:
                if m.restart_at is not None and now >= m.restart_at and not self.stopping:
                    self._start(m)
                continue
            code = m.proc.poll()
            if code is None:
                if not m.up and self._record(m).exists():
                    m.up = self.ever_up = True
                continue
            self._record(m).unlink(missing_ok=True)  # a killed member could not remove it
            pid, was_up, m.proc = m.proc.pid, m.up, None
            if self.stopping:
                log.info("gateway process %d (pid %d) exited (%s)", m.spec.index, pid, _how(code))
                continue
            if not was_up and not self.ever_up:
                log.error(
                    "gateway process %d (pid %d) exited (%s) before it served; stopping",
                    m.spec.index,
                    pid,
                    _how(code),
                )
                self.failed = self.stopping = True
                self._stop(signal.SIGTERM)
                continue
            m.num_crashes = (
                1 if now - m.started_at >= self.policy.reset_after_s else m.num_crashes + 1
            )
            delay = restart_delay_s(m.num_crashes, self.policy)
            m.restart_at = now + delay
            log.warning(
                "gateway process %d (pid %d) exited unexpectedly (%s); restarting in %.1f s",
                m.spec.index,
                pid,
                _how(code),
                delay,
            )


def _how(returncode: int) -> str:
    if returncode < 0:
        return signal.Signals(-returncode).name
    return f"status {returncode}"


def serve_processes(config: GatewayConfig, host: str, port: int, command: list[str]) -> int:
    """The parent of a group: Redis once, the port held, `config.processes` members
    supervised until they have exited. The exit status."""
    n = config.processes
    holder = reuse_port_socket(host, port, listen=False)  # resolves port 0 for all members
    embedded = None
    try:
        port = holder.getsockname()[1]
        url = config.redis_url
        if url is None:
            embedded = EmbeddedRedis(Path(config.data_dir) / "redis")
            url = embedded.url
        procs_dir = Path(config.data_dir) / "gateway-procs" / str(port)
        procs_dir.mkdir(parents=True, exist_ok=True)
        for stale in procs_dir.glob("*.json"):  # of a group that was killed
            stale.unlink(missing_ok=True)
        configs = member_configs(config, url)
        specs = [MemberSpec(c, host, port, i, n, str(procs_dir)) for i, c in enumerate(configs)]
        log.info(
            "gateway on http://%s:%d: %d processes; per process: in flight per worker %s, "
            "queue requests %s, queue tokens %s",
            host,
            port,
            n,
            [c.max_inflight_per_worker for c in configs],
            [c.queue_max_requests for c in configs],
            [c.queue_max_tokens for c in configs],
        )
        if config.max_inflight_per_worker < n:
            log.warning(
                "max_inflight_per_worker %d < %d processes: each process still sends a worker "
                "1 request at a time, so a worker may get %d",
                config.max_inflight_per_worker,
                n,
                n,
            )
        return ProcessGroup(specs, command).run()
    finally:
        holder.close()
        if embedded is not None:
            embedded.close()
