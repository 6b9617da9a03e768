"""`switchyard serve` as a child process on a config of the bench's own, its tenants, and
a thread that polls `/admin/fleet` while the load runs."""

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.processes import free_port
from benchmarks.slo.levels import compact_fleet

REPO_ROOT = Path(__file__).resolve().parents[2]
BANNER = "Stop: Ctrl-C"  # serve prints this once the stack is ready and set up


class StackError(RuntimeError):
    """The stack did not come up; the message carries the tail of its log."""


class ServeStack:
    """`python -m cli serve --config <run_dir>/serve.yaml`, output in `run_dir/serve.log`.

    `make_doc(port)` gives the config for a free `port` (`plan.stack_doc`). The child gets
    its own admin key (in its environment) and its own `SWITCHYARD_CACHE`, so the
    local-stack pointer that `switchyard admin` follows is not overwritten. Start waits
    for the banner, `/ready` and every pool's `min_replicas` ready in `/admin/fleet`.
    Stop is SIGINT (serve drains), then SIGTERM (kills the workers), then SIGKILL.
    """

    def __init__(
        self,
        make_doc: Callable[[int], dict[str, Any]],
        run_dir: Path,
        ready_timeout_s: float = 600.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.say = say
        self.run_dir = Path(run_dir)
        self.port = free_port()
        self.doc = make_doc(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = "sy-admin-bench-" + secrets.token_urlsafe(18)
        self.log_path = self.run_dir / "serve.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "ServeStack":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def admin(self) -> httpx.Client:
        auth = {"authorization": f"Bearer {self.admin_key}"}
        return httpx.Client(base_url=self.url, headers=auth, timeout=10)

    def _tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "serve.yaml"
        config.write_text(yaml.safe_dump(self.doc, sort_keys=False))
        env = {
            **os.environ,
            "SWITCHYARD_ADMIN_KEY": self.admin_key,
            "SWITCHYARD_CACHE": str(self.run_dir / "cache"),
            "PYTHONUNBUFFERED": "1",
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "serve", "--config", str(config)],
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the terminal's Ctrl-C reaches the bench, not it
            )
        t0 = time.monotonic()
        try:
            self._wait_ready()
            self.say(f"  up at {self.url} in {time.monotonic() - t0:.0f} s")
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with self.admin() as admin:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise StackError(f"switchyard serve exited:\n{self._tail()}")
                if BANNER in self._tail(20_000) and self._fleet_ready(admin):
                    return
                time.sleep(0.5)
        raise StackError(f"not ready after {self.ready_timeout_s:.0f} s:\n{self._tail()}")

    def _fleet_ready(self, admin: httpx.Client) -> bool:
        try:
            if admin.get("/ready", timeout=2).status_code != 200:
                return False
            doc = admin.get("/admin/fleet", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        for name, pool in (self.doc.get("pools") or {}).items():
            want = (pool or {}).get("min_replicas", 1)
            reps = (doc.get(name) or {}).get("replicas") or []
            if sum(r.get("state") == "ready" for r in reps) < want:
                return False
        return True

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, 60.0), (signal.SIGTERM, 15.0)):
            proc.send_signal(sig)
            try:
                proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def tenant_keys(admin: httpx.Client, num_tenants: int, prefix: str = "slo") -> list[str]:
    """One fresh API key per tenant `<prefix>-1..N` (made when missing, no limits)."""
    keys = []
    for i in range(1, num_tenants + 1):
        tenant = f"{prefix}-{i}"
        r = admin.post("/admin/tenants", json={"tenant_id": tenant, "name": tenant})
        if r.status_code not in (201, 409):
            raise StackError(f"creating tenant {tenant}: {r.status_code} {r.text[:200]}")
        r = admin.post(f"/admin/tenants/{tenant}/keys", json={"name": "switchyard bench slo"})
        if r.status_code != 201:
            raise StackError(f"creating a key of {tenant}: {r.status_code} {r.text[:200]}")
        keys.append(r.json()["key"])
    return keys


class FleetWatch:
    """Polls `/admin/fleet` every `interval_s` on a thread of its own (a slow answer never
    holds up the load's event loop). Each sample is `{"t", "label", "pools":
    compact_fleet(doc)}`, `t` in seconds since start; `label` is what the bench set."""

    def __init__(self, stack: ServeStack, interval_s: float = 1.0) -> None:
        self.stack = stack
        self.interval_s = interval_s
        self.label = "idle"
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-watch", daemon=True)

    def __enter__(self) -> "FleetWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def labelled(self, label: str) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["label"] == label]

    def _run(self) -> None:
        t0 = time.monotonic()
        with self.stack.admin() as admin:
            while not self._stop.wait(self.interval_s):
                try:
                    doc = admin.get("/admin/fleet", timeout=2).json()
                except (httpx.HTTPError, ValueError):
                    continue
                sample = {"t": round(time.monotonic() - t0, 1), "label": self.label}
                self.samples.append(sample | {"pools": compact_fleet(doc)})
