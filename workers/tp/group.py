"""The shard group: `torch.distributed` over a TCP store on 127.0.0.1, collectives that
time out, and the small protocol rank 0 uses to drive the other ranks.

Every collective waits at most `collective_timeout_s`; one that fails or times out
raises `ShardGroupError`. That error is a BaseException on purpose: the engine's failure
isolation retries a failed step in halves, which is right for one bad request but wrong
once the ranks' collectives are out of step (a half-done all-reduce cannot be re-run
alone). A shard group fails as one unit.

The protocol, on the control group (gloo, CPU tensors, also under NCCL): rank 0 sends a
header `[command, payload bytes]` as an all-reduce (the other ranks add zeros), so a
header completes only when every rank took part: a dead or hung rank is noticed there
even when the payload is small. STEP is followed by a broadcast of the payload (the
step's batch, msgpack) and then the forward pass; PING is a heartbeat; STOP ends the
other ranks' loops.
"""

import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from workers.tp.config import ShardConfig

log = logging.getLogger(__name__)

STEP, PING, STOP = 1, 2, 3


class ShardGroupError(BaseException):
    """A collective failed or timed out: a rank died or hung. The group cannot go on."""


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: `cuda` (or `cuda:k`) means the r-th GPU from k; CPU stays CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


class ShardGroup:
    """This process's membership of a shard group. Collectives are serialised by `lock`:
    the engine thread (steps) and the heartbeat thread (pings) share the group."""

    def __init__(
        self,
        rank: int,
        size: int,
        store_port: int,
        config: ShardConfig,
        device: torch.device,
        store: dist.TCPStore | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self.device = device
        self.backend = config.backend or default_backend(device)
        self.timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        start = datetime.timedelta(seconds=config.start_timeout_s)
        if store is None:
            store = dist.TCPStore("127.0.0.1", store_port, size, is_master=rank == 0, timeout=start)
        self.store = store
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            self.backend, store=store, rank=rank, world_size=size, timeout=start
        )
        # Control messages travel over gloo on the CPU whatever the device backend.
        self.control = dist.new_group(backend="gloo") if self.backend != "gloo" else None
        self.lock = threading.RLock()
        self.last_contact = time.monotonic()
        self.failed: BaseException | None = None
        self.closed = False

    def mark_failed(self, error: BaseException) -> None:
        """The ranks are out of step (a collective failed, or a rank failed mid-step)."""
        if self.failed is None:
            self.failed = error

    # -- collectives with a timeout ---------------------------------------------------

    def _wait(self, work, what: str, timeout: datetime.timedelta | None = None) -> None:
        if self.failed is not None:
            raise ShardGroupError(f"the shard group already failed: {self.failed}")
        try:
            ok = work.wait(timeout=timeout or self.timeout)
        except Exception as exc:  # a peer closed its connection, or the wait timed out
            self.mark_failed(exc)
            raise ShardGroupError(
                f"rank {self.rank}: {what} failed ({exc}); a rank died or hung"
            ) from exc
        if ok is False:
            self.mark_failed(TimeoutError(what))
            raise ShardGroupError(f"rank {self.rank}: {what} timed out")
        self.last_contact = time.monotonic()

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._wait(dist.all_reduce(t, op=op, async_op=True), "all-reduce")
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape) along the last dimension."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, t.contiguous(), async_op=True), "all-gather")
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int, timeout_s: float | None = None) -> int:
        """The smallest `value` over the ranks (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control, async_op=True)
        self._wait(work, "agreement", timeout)
        return int(t.item())

    # -- the step protocol (control group) --------------------------------------------

    def send(self, command: int, payload: bytes = b"") -> None:
        """Rank 0: a command to the other ranks (they are in `receive`)."""
        with self.lock:
            header = torch.tensor([command, len(payload)], dtype=torch.int64)
            work = dist.all_reduce(header, group=self.control, async_op=True)
            self._wait(work, f"command {command}")
            if payload:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                work = dist.broadcast(data, src=0, group=self.control, async_op=True)
                self._wait(work, "step broadcast")

    def receive(self, timeout_s: float) -> tuple[int, bytes]:
        """The other ranks: the next command of rank 0, waiting at most `timeout_s`."""
        header = torch.zeros(2, dtype=torch.int64)
        work = dist.all_reduce(header, group=self.control, async_op=True)
        self._wait(work, "waiting for rank 0", datetime.timedelta(seconds=timeout_s))
        command, size = (int(x) for x in header.tolist())
        if not size:
            return command, b""
        data = torch.empty(size, dtype=torch.uint8)
        self._wait(dist.broadcast(data, src=0, group=self.control, async_op=True), "step")
        return command, data.numpy().tobytes()

    def ping_if_quiet(self) -> None:
        """Rank 0, from the heartbeat thread: PING when nothing was sent for a while."""
        with self.lock:
            if time.monotonic() - self.last_contact >= self.config.heartbeat_s:
                self.send(PING)

    def close(self) -> None:
        """Leave the group. After a failure the process should exit instead (a timed-out
        collective may still hold the group's threads)."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (leaving is best effort)
                log.debug("destroy_process_group failed", exc_info=True)


class HeartbeatThread(threading.Thread):
    """Rank 0: pings the group while it is quiet and watches the other ranks' processes.

    `on_failure(error)` is called once, from this thread, when a rank dies (its process
    exits) or a ping fails; then the thread ends.
    """

    def __init__(
        self,
        group: ShardGroup,
        on_failure: Callable[[BaseException], None],
        rank_exited: Callable[[], str | None] = lambda: None,
        poll_s: float = 0.1,
    ) -> None:
        super().__init__(name="shard-heartbeat", daemon=True)
        self.group = group
        self.on_failure = on_failure
        self.rank_exited = rank_exited
        self.poll_s = poll_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            try:
                why = self.rank_exited()
                if why is not None:
                    self.group.mark_failed(RuntimeError(why))
                    raise ShardGroupError(why)
                self.group.ping_if_quiet()
            except ShardGroupError as exc:
                if not self.stopped.is_set():
                    log.critical("shard group failed: %s", exc)
                    self.on_failure(exc)
                return

    def stop(self) -> None:
        self.stopped.set()
