"""The local fleet supervisor: worker processes per pool, as a `workers.fleet.Actuator`.

`switchyard serve` runs one `LocalSupervisor` in the gateway's process. It launches
`switchyard worker` processes on free loopback ports, watches them (`/load` once a tick),
tells the gateway's pools when a member appears or goes (the `Membership` callbacks),
restarts a worker that crashed or stalled (with backoff; it stays `starting` meanwhile, so
the autoscaler counts it as capacity already ordered), and retires replicas by draining
them (`POST /drain` with `exit_when_empty`, the control key when one is set).

A pool's replicas may be another server (llama.cpp's llama-server): its `PoolLaunch` then
carries the command line and a `ReplicaProbe` of that kind, which says how it is watched
and whether it can drain itself; one that cannot is taken out of the gateway's rotation,
watched until its probe shows nothing running, and sent SIGTERM.

Process code lives here, not in `workers.fleet` (the pure policy; an import contract
keeps subprocess out of it).
"""

import asyncio
import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from workers.api.client import WorkerClient
from workers.api.types import LoadReport
from workers.fleet.devices import DeviceInventory, DeviceKind, Placement
from workers.fleet.signals import ReplicaSignals, ReplicaState

log = logging.getLogger(__name__)


class Membership(Protocol):
    """Where the supervisor reports pool membership (the gateway's pools)."""

    def add(self, pool: str, url: str) -> None: ...

    def remove(self, pool: str, url: str, lost: bool) -> None:
        """`lost`: the process died with work possibly in flight (waiters stop waiting)."""
        ...


@dataclass(frozen=True)
class ReplicaLoad:
    """What one poll of a replica told the supervisor. None: that kind does not report it."""

    state: str  # loading | ready | draining | stalled (a worker's /load state)
    num_running: int | None = None  # requests being decoded now
    num_waiting: int | None = None  # requests queued inside the replica
    kv_free_tokens: int | None = None
    kv_total_tokens: int | None = None
    tokens_per_s: float | None = None  # output tokens per second, recently

    @classmethod
    def from_report(cls, report: LoadReport) -> "ReplicaLoad":
        return cls(
            report.state,
            report.num_running,
            report.num_waiting,
            report.kv_free_tokens,
            report.kv_total_tokens,
            report.output_tokens_per_s,
        )


class ReplicaProbe(Protocol):
    """How the supervisor watches one kind of replica process and retires it."""

    # True: `drain` asks the replica to stop admitting and exit once empty, by itself.
    # False: it cannot; the supervisor takes it out of the rotation, waits until `load`
    # shows nothing running, then sends SIGTERM (`drain` is never called).
    drains_itself: bool

    async def load(self, url: str) -> ReplicaLoad | None:
        """The replica now; None when it does not answer (not up yet, hung, or gone)."""
        ...

    async def drain(self, url: str, control_key: str | None) -> int:
        """Ask it to drain; the HTTP status (200: it will exit when empty). May raise."""
        ...


class WorkerProbe:
    """A Switchyard worker: `/load`, and `POST /drain` with `exit_when_empty`."""

    drains_itself = True

    def __init__(self, client: WorkerClient) -> None:
        self.client = client

    async def load(self, url: str) -> ReplicaLoad | None:
        report = await self.client.load(url)
        return None if report is None else ReplicaLoad.from_report(report)

    async def drain(self, url: str, control_key: str | None) -> int:
        return await self.client.drain(url, exit_when_empty=True, control_key=control_key)


@dataclass
class PoolLaunch:
    """How to start one replica of a pool: `argv(port)` is its command line."""

    argv: Callable[[int], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    control_key: str | None = None  # sent with /drain
    # The devices each replica needs from the supervisor's inventory; None: not placed
    # (the replica runs wherever the OS puts it).
    placement: Placement | None = None
    # How its replicas are watched and drained; None: Switchyard workers (`WorkerProbe`
    # over the supervisor's client).
    probe: ReplicaProbe | None = None
    # The address `argv` makes a replica listen on, and where it is reached: loopback for
    # this host's gateway alone; a fleet host's own address for other hosts' gateways too.
    host: str = "127.0.0.1"


@dataclass
class SupervisorConfig:
    log_dir: Path
    restart_base_s: float = 1.0  # first restart delay after a crash; doubles per crash
    restart_max_s: float = 30.0
    stable_after_s: float = 30.0  # ready this long: the crash count starts again
    stall_restart_s: float = 30.0  # stalled this long: killed and restarted
    # Back from a stall: still `stalled` (to the autoscaler, and for stall_restart_s) until
    # it reports ready this long in a row, so a replica that flaps accumulates its stall
    # and is restarted rather than counted ready and stalled by turns.
    stall_recover_s: float = 5.0
    start_timeout_s: float = 300.0  # starting this long without /ready: killed, restarted
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this


def restart_delay_s(num_crashes: int, base_s: float, max_s: float) -> float:
    """Backoff before restarting a replica that crashed `num_crashes` times in a row."""
    return min(base_s * 2 ** max(num_crashes - 1, 0), max_s)


def detect_devices(kinds: set[DeviceKind]) -> dict[DeviceKind, list[int]]:
    """This host's devices of each kind asked for: the CPU cores this process may run on
    (its affinity), and the GPUs CUDA_VISIBLE_DEVICES lists, else those torch sees."""
    found: dict[DeviceKind, list[int]] = {}
    if "cpu" in kinds:
        try:
            found["cpu"] = sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            found["cpu"] = list(range(os.cpu_count() or 1))
    if "cuda" in kinds:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            found["cuda"] = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        else:
            import torch

            found["cuda"] = list(range(torch.cuda.device_count()))
    return found


def placed_env(kind: DeviceKind, devices: tuple[int, ...]) -> dict[str, str]:
    """The environment that keeps a replica on its GPUs (CPU cores are its affinity)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if kind == "cuda" else {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a worker and every process it started (the ranks of a shard group): each
    worker leads its own process group (`_die_with_parent` calls setsid)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.send_signal(sig)


def _die_with_parent(cpus: tuple[int, ...] | None = None) -> None:  # pragma: no cover
    """Runs in the child before exec. Linux: the worker gets SIGTERM if the supervisor dies
    without stopping it; `cpus`: it runs on those cores only (and sizes its threads so)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.setsid()  # a terminal's Ctrl-C reaches the supervisor, which drains first
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Replica:
    replica_id: str
    pool: str
    ordered_at_s: float
    state: ReplicaState = "starting"
    port: int = 0
    proc: subprocess.Popen | None = None
    launched_at_s: float = 0.0
    ready_since_s: float | None = None
    stalled_since_s: float | None = None
    recovering_since_s: float | None = None  # back from a stall: reporting ready since
    restart_at_s: float | None = None  # waiting out a backoff until then
    num_crashes: int = 0
    num_restarts: int = 0
    load: ReplicaLoad | None = None
    log_path: Path | None = None
    devices: tuple[int, ...] | None = None  # held from the inventory until it is gone
    # Draining a replica that cannot drain itself: out of the gateway's rotation, and how
    # many polls in a row have found it idle; SIGTERM sent.
    left_rotation: bool = False
    num_idle_polls: int = 0
    terminated: bool = False
    host: str = "127.0.0.1"  # the address it listens on (its pool's `PoolLaunch.host`)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def to_signals(self) -> ReplicaSignals:
        load = self.load if self.state != "starting" else None
        kv_used = None
        if load and load.kv_total_tokens is not None and load.kv_free_tokens is not None:
            kv_used = load.kv_total_tokens - load.kv_free_tokens
        return ReplicaSignals(
            replica_id=self.replica_id,
            state=self.state,
            ordered_at_s=self.ordered_at_s,
            num_running=load.num_running if load else None,
            num_waiting=load.num_waiting if load else None,
            kv_used_tokens=kv_used,
            kv_total_tokens=load.kv_total_tokens if load else None,
        )

    def to_dict(self) -> dict:
        return {
            "id": self.replica_id,
            "state": self.state,
            "url": self.url if self.proc is not None else None,
            "pid": self.proc.pid if self.proc is not None else None,
            "restarts": self.num_restarts,
            "running": self.load.num_running if self.load else None,
            "waiting": self.load.num_waiting if self.load else None,
            "kv_free_tokens": self.load.kv_free_tokens if self.load else None,
            "kv_total_tokens": self.load.kv_total_tokens if self.load else None,
            "tokens_per_s": self.load.tokens_per_s if self.load else None,
            "devices": list(self.devices) if self.devices is not None else None,
            "log": str(self.log_path) if self.log_path else None,
        }


class LocalSupervisor:
    """Worker processes on this machine. `start_replica` and `drain_replica` return at
    once (the `Actuator` contract); `tick` (about once a second, on the event loop) does
    the watching. Call everything from the event loop's thread (the main thread): a
    child's parent-death signal follows the thread that started it."""

    def __init__(
        self,
        pools: dict[str, PoolLaunch],
        client: WorkerClient,
        membership: Membership,
        config: SupervisorConfig,
        clock: Callable[[], float] = time.monotonic,
        inventory: DeviceInventory | None = None,
    ) -> None:
        self.pools = pools
        # Where placed pools' replicas get their devices; None: a placement is refused.
        self.inventory = inventory
        self.client = client
        self.worker_probe = WorkerProbe(client)
        self.membership = membership
        self.config = config
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self.stopping = False
        config.log_dir.mkdir(parents=True, exist_ok=True)

    # -- the Actuator ---------------------------------------------------------------------

    def start_replica(self, pool: str) -> str:
        """Raises NoDevices (nothing started) when the pool's placement does not fit the
        free devices."""
        replica = Replica(
            f"{pool}-{next(self._ids)}", pool, self.clock(), host=self.pools[pool].host
        )
        need = self.pools[pool].placement
        if need is not None:
            if self.inventory is None:
                raise ValueError(f"pool {pool} needs devices and the supervisor has none")
            replica.devices = self.inventory.take(replica.replica_id, pool, need)
        self.replicas[replica.replica_id] = replica
        self._launch(replica)
        return replica.replica_id

    def startable(self, pool: str) -> int | None:
        """More replicas of `pool` the free devices can place (None: it is not placed)."""
        need = self.pools[pool].placement
        if need is None or self.inventory is None:
            return None
        return self.inventory.startable(need)

    def drain_replica(self, pool: str, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.pool != pool or replica.state == "draining":
            return
        if replica.state == "starting":
            log.info("cancelling %s (still starting)", replica_id)
            self._forget(replica, kill=True)
            return
        replica.state = "draining"
        if self.probe(pool).drains_itself:
            log.info("draining %s (%s)", replica_id, replica.url)
            self._spawn(self._send_drain(replica))
            return
        # It cannot stop admitting by itself: the gateway stops sending it requests, and
        # the ticks stop it once it is idle (`_observe_draining`).
        log.info(
            "draining %s (%s): out of the rotation, stopped once idle", replica_id, replica.url
        )
        self._leave_rotation(replica, lost=False)

    def probe(self, pool: str) -> ReplicaProbe:
        return self.pools[pool].probe or self.worker_probe

    # -- watching -------------------------------------------------------------------------

    def pool_replicas(self, pool: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.pool == pool]

    def signals(self, pool: str) -> tuple[ReplicaSignals, ...]:
        return tuple(r.to_signals() for r in self.pool_replicas(pool))

    async def tick(self) -> None:
        """Reap exits, restart what is due, poll every live replica's /load."""
        now = self.clock()
        for replica in list(self.replicas.values()):
            self._check_process(replica, now)
        live = [r for r in self.replicas.values() if r.proc is not None]
        reports = await asyncio.gather(*(self.probe(r.pool).load(r.url) for r in live))
        now = self.clock()
        for replica, report in zip(live, reports, strict=True):
            if replica.replica_id in self.replicas and replica.proc is not None:
                self._observe(replica, report, now)

    def _check_process(self, replica: Replica, now: float) -> None:
        if replica.proc is None:
            if replica.restart_at_s is not None and now >= replica.restart_at_s:
                replica.num_restarts += 1
                self._launch(replica)
            return
        code = replica.proc.poll()
        if code is None:
            return
        if replica.state == "draining":
            log.info("%s drained and exited (%s)", replica.replica_id, code)
            self._forget(replica, kill=False)
            return
        self._crashed(replica, f"exited with status {code}", now)

    def _observe(self, replica: Replica, report: ReplicaLoad | None, now: float) -> None:
        replica.load = report
        state = report.state if report is not None else None
        if replica.state == "draining":
            if not self.probe(replica.pool).drains_itself:
                self._observe_draining(replica, report)
            return
        if replica.state == "starting":
            if state == "ready":
                replica.state = "ready"
                replica.ready_since_s = now
                log.info(
                    "%s ready on %s (%.1f s)",
                    replica.replica_id,
                    replica.url,
                    now - replica.launched_at_s,
                )
            elif now - replica.launched_at_s > self.config.start_timeout_s:
                self._crashed(replica, "not ready in time", now)
            return
        if replica.state in ("ready", "stalled"):
            if state == "stalled" or (state is None and replica.state == "stalled"):
                replica.recovering_since_s = None
                if replica.state != "stalled":
                    log.warning("%s is stalled", replica.replica_id)
                    replica.state = "stalled"
                    replica.stalled_since_s = now
                elif now - (replica.stalled_since_s or now) > self.config.stall_restart_s:
                    self._crashed(replica, "stalled too long", now)
            elif state == "ready" and replica.state == "stalled":
                since = replica.recovering_since_s
                if since is None:
                    replica.recovering_since_s = now
                elif now - since >= self.config.stall_recover_s:
                    log.info(
                        "%s is ready again (stalled %.1f s)",
                        replica.replica_id,
                        since - (replica.stalled_since_s or since),
                    )
                    replica.state = "ready"
                    replica.stalled_since_s = replica.recovering_since_s = None
            elif state == "ready":
                replica.state = "ready"
                replica.stalled_since_s = None
                if (
                    replica.ready_since_s
                    and now - replica.ready_since_s > self.config.stable_after_s
                ):
                    replica.num_crashes = 0

    def _observe_draining(self, replica: Replica, report: ReplicaLoad | None) -> None:
        """A replica that cannot drain itself gets SIGTERM once two polls in a row find
        nothing running in it (the second: after any request the gateway had sent it just
        before it left the rotation has arrived), or at once when it does not say."""
        if replica.terminated or replica.proc is None:
            return
        if report is not None and report.num_running:
            replica.num_idle_polls = 0
            return
        replica.num_idle_polls += 1
        if report is not None and report.num_running is None:
            log.warning("%s does not report what it runs; stopping it now", replica.replica_id)
        elif replica.num_idle_polls < 2:
            return
        log.info("%s is idle; stopping it (SIGTERM)", replica.replica_id)
        replica.terminated = True
        replica.proc.terminate()

    def _leave_rotation(self, replica: Replica, lost: bool) -> None:
        if not replica.left_rotation:
            replica.left_rotation = True
            self.membership.remove(replica.pool, replica.url, lost=lost)

    def _crashed(self, replica: Replica, why: str, now: float) -> None:
        """Kill what is left, leave the rotation, restart after a backoff."""
        url, proc = replica.url, replica.proc
        if proc is not None:  # the whole shard group, even when rank 0 is gone already
            kill_group(proc)
        if proc is not None:
            self.membership.remove(replica.pool, url, lost=True)
        replica.proc = None
        replica.left_rotation = replica.terminated = False
        replica.num_idle_polls = 0
        replica.load = None
        replica.state = "starting"
        replica.ready_since_s = None
        replica.stalled_since_s = replica.recovering_since_s = None
        replica.num_crashes += 1
        delay = restart_delay_s(
            replica.num_crashes, self.config.restart_base_s, self.config.restart_max_s
        )
        replica.restart_at_s = now + delay
        log.warning(
            "%s %s; restarting in %.0f s (log: %s%s)",
            replica.replica_id,
            why,
            delay,
            replica.log_path,
            _last_line(replica.log_path),
        )

    # -- processes ------------------------------------------------------------------------

    def _launch(self, replica: Replica) -> None:
        launch = self.pools[replica.pool]
        replica.port = free_port(replica.host)
        replica.restart_at_s = None
        replica.launched_at_s = self.clock()
        replica.log_path = self.config.log_dir / f"{replica.replica_id}.log"
        env = {**os.environ, **launch.env}
        cpus = None
        if launch.placement is not None and replica.devices is not None:
            env.update(placed_env(launch.placement.kind, replica.devices))
            if launch.placement.kind == "cpu":
                cpus = replica.devices
        with open(replica.log_path, "ab") as out:
            replica.proc = subprocess.Popen(
                launch.argv(replica.port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: _die_with_parent(cpus),
            )
        placed = ""
        if launch.placement is not None and replica.devices is not None:
            placed = f", on {launch.placement.kind} {','.join(map(str, replica.devices))}"
        log.info(
            "%s starting: pid %d, %s%s (log: %s)",
            replica.replica_id,
            replica.proc.pid,
            replica.url,
            placed,
            replica.log_path,
        )
        self.membership.add(replica.pool, replica.url)

    def _forget(self, replica: Replica, kill: bool) -> None:
        self.replicas.pop(replica.replica_id, None)
        proc = replica.proc
        if proc is None:
            self._give_back(replica.replica_id)
            return
        if kill and proc.poll() is None:
            proc.terminate()
            # Its devices are free once it is gone, not while it may still run.
            self._spawn(self._reap(proc, replica.replica_id))
        else:
            self._give_back(replica.replica_id)
        self._leave_rotation(replica, lost=False)

    def _give_back(self, replica_id: str) -> None:
        if self.inventory is not None:
            self.inventory.give_back(replica_id)

    async def _reap(self, proc: subprocess.Popen, replica_id: str | None = None) -> None:
        try:
            deadline = self.clock() + self.config.stop_grace_s
            while proc.poll() is None and self.clock() < deadline:
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                kill_group(proc)
                proc.wait()
        finally:
            if replica_id is not None:
                self._give_back(replica_id)

    async def _send_drain(self, replica: Replica) -> None:
        key = self.pools[replica.pool].control_key
        try:
            status = await self.probe(replica.pool).drain(replica.url, key)
        except Exception as exc:  # unreachable: it is gone or going; stop it outright
            status = repr(exc)
        if status != 200:
            log.warning("%s refused /drain (%s); terminating it", replica.replica_id, status)
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.terminate()

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after `stop_grace_s`. Idempotent."""
        self.stopping = True
        procs = [r.proc for r in self.replicas.values() if r.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = self.clock() + self.config.stop_grace_s
        while any(p.poll() is None for p in procs) and self.clock() < deadline:
            await asyncio.sleep(0.05)
        for proc in procs:
            if proc.poll() is None:
                log.warning("worker pid %d did not stop in time; killing it", proc.pid)
                kill_group(proc)
                proc.wait()
        for task in list(self._tasks):
            task.cancel()
        self.replicas.clear()

    def kill_all_now(self) -> None:
        """Last resort on the way out (an exception, a second Ctrl-C)."""
        for r in self.replicas.values():
            if r.proc is not None:
                kill_group(r.proc)


def _last_line(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 2048, 0))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f"; last line: {lines[-1][:200]}" if lines else ""
