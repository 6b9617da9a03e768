"""A gateway's durable record of quota settlements Redis has not confirmed yet.

While Redis is unreachable a reconcile cannot be applied and a fail-open request cannot be
charged; both are written here (JSON lines, one file per owner in the gateway's data dir) and
applied by `quota.sweeper` once Redis is back. Applying is idempotent in Redis (pending, swept
and done markers), and an applied settlement is marked done here, so each is applied once.

File format, one JSON object a line:
    {"op": "put", ...Settlement fields}   a settlement to apply; a later put of the same
                                          request id replaces it (reserve-time -> final usage)
    {"op": "done", "request_id": ...}     applied (or nothing left to apply): forget it
A torn last line (a crash mid-write) is skipped and cut off when the file is opened.
"""

import fcntl
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["ReconcileJournal", "Settlement", "journal_path", "orphaned_journals"]

SUFFIX = ".journal"


@dataclass(frozen=True)
class Settlement:
    """One request's correction of its tenant's counters, as reconcile.lua applies it.

    checked: True for a reservation made by reserve.lua (settled through its pending marker,
      `delta_tokens` = actual - reserved); False for a request admitted unchecked while Redis
      was down (charged once through a done marker, `delta_tokens` = tokens to charge).
    minute, day: the windows to correct: floor(unix_s / 60), floor(unix_s / 86400).
    owner_id: whose pending index holds the reservation; None when not indexed.
    final: False for an unchecked request journaled at admission with its reserved tokens,
      what is charged if the gateway dies before the request ends; True once usage is known.
    usage: the request's usage record (`quota.usage.usage_record`), written with the
      settlement in the same script call; None: nothing to record.
    delta_cost_nanos: money, as `delta_tokens` is for tokens (`quota.budget`): actual -
      reserved (checked) or the actual cost (unchecked), corrected on the spend counters of
      `day` and its month.
    """

    tenant_id: str
    request_id: str
    checked: bool
    minute: int
    day: int
    delta_tokens: int
    owner_id: str | None = None
    final: bool = True
    usage: str | None = None
    delta_cost_nanos: int = 0


def journal_path(directory: str | Path, owner_id: str) -> Path:
    return Path(directory) / f"quota-{owner_id}{SUFFIX}"


def orphaned_journals(directory: str | Path, own: Path) -> list[Path]:
    """Journal files in `directory` other than `own`: candidates for `ReconcileJournal.adopt`."""
    return sorted(p for p in Path(directory).glob(f"quota-*{SUFFIX}") if p != own)


class ReconcileJournal:
    """Append-only journal of outstanding settlements, exclusively locked by its owner.

    `fsync_every`: appends between fsyncs (also `sync()`, which the sweeper calls each tick);
    a process crash loses nothing (each line is one write to the OS), a machine crash at most
    that many lines. `compact_lines`: once the file holds this many lines and four times more
    than are outstanding, it is rewritten with only the outstanding ones.
    Raises BlockingIOError if another process holds the journal (see `adopt`).
    """

    def __init__(
        self, path: str | Path, *, fsync_every: int = 64, compact_lines: int = 4096
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync_every = max(1, fsync_every)
        self._compact_lines = max(1, compact_lines)
        self._lock = threading.Lock()  # sync() may run in a worker thread
        self._lock_fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise
        self._outstanding: dict[str, Settlement] = {}
        num_lines, torn = self._load()
        self._num_lines = num_lines
        self._unsynced = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if torn:
            self._compact()

    @classmethod
    def adopt(cls, path: str | Path) -> "ReconcileJournal | None":
        """Open a journal whose owner may be dead. None: its process still holds it."""
        try:
            return cls(path)
        except BlockingIOError:
            return None

    def put(self, settlement: Settlement) -> None:
        """Record a settlement to apply (replacing one of the same request id)."""
        self._append({"op": "put", **asdict(settlement)})
        self._outstanding[settlement.request_id] = settlement

    def done(self, request_id: str) -> None:
        """The settlement of `request_id` is applied (or void): forget it. Unknown ids: no-op."""
        if self._outstanding.pop(request_id, None) is None:
            return
        self._append({"op": "done", "request_id": request_id})
        if self._num_lines >= self._compact_lines and self._num_lines > 4 * len(self._outstanding):
            self._compact()

    def outstanding(self) -> list[Settlement]:
        """Settlements not yet done, oldest first."""
        return list(self._outstanding.values())

    def __len__(self) -> int:
        return len(self._outstanding)

    def sync(self) -> None:
        """fsync what was appended. Safe to call from another thread."""
        with self._lock:
            if self._unsynced and self._fd >= 0:
                os.fsync(self._fd)
                self._unsynced = 0

    def close(self, *, remove_if_empty: bool = False) -> None:
        """Sync and release the file. `remove_if_empty`: delete it if nothing is outstanding."""
        self.sync()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if remove_if_empty and not self._outstanding:
                self.path.unlink(missing_ok=True)
                self.path.with_suffix(".lock").unlink(missing_ok=True)
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = -1

    def _append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd < 0:
                raise ValueError("the journal is closed")
            os.write(self._fd, line)
            self._num_lines += 1
            self._unsynced += 1
        if self._unsynced >= self._fsync_every:
            self.sync()

    def _load(self) -> tuple[int, bool]:
        """Read the file into `_outstanding`: (lines read, whether any line was unreadable)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0, False
        lines = data.split(b"\n")
        torn = lines[-1] != b""  # no final newline: the last write did not finish
        num_read = 0
        for raw in lines[:-1] if not torn else lines:
            if not raw:
                continue
            try:
                record = json.loads(raw)
                op = record.pop("op")
                if op == "put":
                    s = Settlement(**record)
                    self._outstanding[s.request_id] = s
                elif op == "done":
                    self._outstanding.pop(record["request_id"], None)
                num_read += 1
            except (ValueError, KeyError, TypeError):
                torn = True
                log.warning("quota journal %s: skipped an unreadable line", self.path)
        return num_read, torn

    def _compact(self) -> None:
        """Rewrite the file with only the outstanding settlements (atomic rename)."""
        tmp = self.path.with_suffix(".tmp")
        body = b"".join(
            (json.dumps({"op": "put", **asdict(s)}, separators=(",", ":")) + "\n").encode()
            for s in self._outstanding.values()
        )
        with self._lock:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self._num_lines = len(self._outstanding)
            self._unsynced = 0
