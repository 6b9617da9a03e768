"""Closed-loop HTTP load from `wrk` (a C load generator, Debian package `wrk`), and the CPU
time a set of processes spent meanwhile, read from /proc.

The Python client saturates near 250-500 requests/s on this machine, below what one gateway
process serves, so throughput and CPU per request are measured with wrk where installed.
"""

import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import psutil

# wrk runs this per connection: POST a JSON body with headers, and at the end print one JSON
# line of the summary and latency percentiles (microseconds).
_SCRIPT = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nWRK_JSON {{"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, '
    .. '"read": %d, "write": %d, "status": %d, "timeout": %d, "p50_us": %d, "p90_us": %d, '
    .. '"p99_us": %d, "max_us": %d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""


def wrk_path() -> str | None:
    return shutil.which("wrk")


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    errors: int  # connect/read/write/timeout errors and non-2xx/3xx answers
    p50_ms: float
    p90_ms: float
    p99_ms: float
    cpu_s: float = 0.0  # user + system CPU wrk itself spent (is the load generator the limit?)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def _lua_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def run_wrk(
    url: str,
    body: dict,
    headers: dict[str, str],
    *,
    connections: int,
    duration_s: float,
    threads: int = 1,
) -> WrkResult:
    """POST `body` to `url` over `connections` keep-alive connections for `duration_s`."""
    exe = wrk_path()
    if exe is None:
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    hdrs = "\n".join(
        f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items()
    )
    script = _SCRIPT.format(body=_lua_string(json.dumps(body)), headers=hdrs)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
        path = f.name
    cmd = [
        exe,
        f"-t{max(1, min(threads, connections))}",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "30s",
        "-s",
        path,
        url,
    ]
    try:
        rc, out, cpu_s = _run_measured(cmd, timeout_s=duration_s + 60)
    finally:
        os.unlink(path)
    if rc != 0:
        raise RuntimeError(f"wrk exited {rc}: {out[-500:]}")
    line = next((x for x in out.splitlines() if x.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary: {out[-500:]}")
    d = json.loads(line[len("WRK_JSON ") :])
    errors = sum(d[k] for k in ("connect", "read", "write", "status", "timeout"))
    return WrkResult(
        requests=d["requests"],
        duration_s=d["duration_us"] / 1e6,
        errors=errors,
        p50_ms=d["p50_us"] / 1e3,
        p90_ms=d["p90_us"] / 1e3,
        p99_ms=d["p99_us"] / 1e3,
        cpu_s=cpu_s,
    )


def _run_measured(cmd: list[str], timeout_s: float) -> tuple[int, str, float]:
    """Run `cmd` to the end: (exit code, output, its user + system CPU seconds), the CPU
    read from the kernel's accounting when it is reaped (wait4), so nothing is missed."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait
        finally:
            timer.cancel()
        out.seek(0)
        return proc.returncode, out.read(), usage.ru_utime + usage.ru_stime


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and its descendants (a gateway started with --workers N forks N children)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds spent so far by `pids` and their descendants (/proc)."""
    total = 0.0
    for pid in pids:
        try:
            procs = process_tree(pid)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total
