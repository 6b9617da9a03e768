"""Whether a busy engine is stalled or only slow: a stall is a thread that makes no progress.

The engine thread publishes a heartbeat at every step. A step can take seconds when the
machine's cores are shared (several engine processes on two cores, a long prefill): its
heartbeat is then old, but the thread is computing. What a stalled thread does not do is
use CPU: blocked on a lock, a queue, a device or I/O, its CPU clock stands still. So the
worker reads the engine thread's CPU clock (`AsyncEngine.thread_cpu_s`) whenever its
state is asked for, and calls the engine

- `ok` while its last step is at most `timeout_s` old;
- `slow` while the step is older but the thread used at least `min_cpu_s` of CPU over
  the last `timeout_s`: reported, never restarted;
- `stalled` when it used less (blocked), when its step is older than `hard_timeout_s`
  whatever the CPU (a step that never ends: a loop, a spinning wait), or when there is no
  CPU clock to read (no thread, or a platform without one: the old rule).

Pure: the clock readings come in as arguments.
"""

from collections import deque
from typing import Literal

Progress = Literal["ok", "slow", "stalled"]


class StallWatch:
    """Reads of the engine thread's CPU clock, kept over the last `timeout_s`."""

    def __init__(self, timeout_s: float, hard_timeout_s: float, min_cpu_s: float = 0.01) -> None:
        if not 0 < timeout_s <= hard_timeout_s:
            raise ValueError(
                f"need 0 < timeout_s <= hard_timeout_s, got {timeout_s}, {hard_timeout_s}"
            )
        self.timeout_s = timeout_s
        self.hard_timeout_s = hard_timeout_s
        self.min_cpu_s = min_cpu_s
        self._reads: deque[tuple[float, float]] = deque()  # (wall, thread CPU), oldest first

    def observe(self, now: float, heartbeat: tuple[float, float], cpu_s: float | None) -> Progress:
        """`heartbeat`: (wall, thread CPU) when the engine last published; `cpu_s`: the
        thread's CPU clock now (None: unreadable)."""
        step_at, step_cpu = heartbeat
        silent_s = now - step_at
        if silent_s <= self.timeout_s:
            self._remember(now, cpu_s)
            return "ok"
        if cpu_s is None or silent_s > self.hard_timeout_s:
            return "stalled"
        # The CPU used since the latest read at least timeout_s old; the heartbeat stands in
        # for a read when there is none (it is older than timeout_s here).
        start = self.timeout_s
        base = step_cpu
        for at, cpu in self._reads:
            if now - at < start:
                break
            base = max(base, cpu)
        self._remember(now, cpu_s)
        return "slow" if cpu_s - base >= self.min_cpu_s else "stalled"

    def _remember(self, now: float, cpu_s: float | None) -> None:
        if cpu_s is None:
            return
        reads = self._reads
        reads.append((now, cpu_s))
        # Keep one read at least timeout_s old (the window's start), drop older ones.
        while len(reads) > 1 and now - reads[1][0] >= self.timeout_s:
            reads.popleft()
