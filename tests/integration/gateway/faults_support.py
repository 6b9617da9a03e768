"""What the fault tests (tests/integration/gateway/test_faults_*.py) share: sending
requests and reading answers, the tenant's books, gateways in-process or as subprocesses."""

import json
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.app import create_gateway_app
from gateway.capacity.balancer import prefix_key, rendezvous_weight
from gateway.config import GatewayConfig
from gateway.runtime.http_server import server_config
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import ADMIN, Stack
from tests.support.servers import serving, wait_ready
from tests.support.worker import free_port

PROMPT = [5, 6, 7, 8]  # 4 prompt tokens, for the gateway and the fake backend alike
BODY = {"model": "small", "prompt": PROMPT, "max_tokens": 6}
BIG = 10**9  # a limit that is never reached: set so the class is tracked


# -- helpers ------------------------------------------------------------------------------


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.02):
    """Poll `cond` until it returns something truthy (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(every_s)


@dataclass
class Result:
    """One request as its client saw it."""

    status: int
    headers: dict[str, str]
    elapsed_s: float
    body: Any = None  # the JSON of a non-streaming answer (or of a refused stream)
    events: list[Any] = field(default_factory=list)  # a stream's data payloads, "[DONE]" as is
    comments: int = 0  # SSE comment lines (": queued")
    error: str | None = None  # a transport error the client met
    t0: float = 0.0  # time.monotonic() when it was sent

    @property
    def usage(self) -> int:
        """The tokens the client was told it used (0 when not served)."""
        if self.status != 200:
            return 0
        if self.events:
            usage = [e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")]
            return usage[-1]["total_tokens"] if usage else 0
        return self.body["usage"]["total_tokens"] if self.body else 0

    @property
    def code(self) -> str | None:
        """The OpenAI error code: of the body, or of an in-band error event."""
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]["code"]
        for e in self.events:
            if isinstance(e, dict) and "error" in e:
                return e["error"]["code"]
        return None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def send(
    base: str,
    key: str,
    body: dict,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    on_status: Callable[[int], None] | None = None,
) -> Result:
    """POST /v1/completions (streaming when body says so) and read the whole answer."""
    hdrs = {"authorization": f"Bearer {key}", **(headers or {})}
    t0 = time.monotonic()
    result = Result(0, {}, 0.0, t0=t0)
    try:
        with (
            httpx.Client(timeout=timeout_s) as c,
            c.stream("POST", f"{base}/v1/completions", json=body, headers=hdrs) as r,
        ):
            result.status, result.headers = r.status_code, dict(r.headers)
            if on_status is not None:
                on_status(r.status_code)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                for line in r.iter_lines():
                    if line.startswith(":"):
                        result.comments += 1
                    elif line.startswith("data: "):
                        data = line[6:]
                        result.events.append(data if data == "[DONE]" else json.loads(data))
            else:
                raw = r.read()
                try:
                    result.body = json.loads(raw)
                except ValueError:
                    result.body = raw.decode(errors="replace")
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    result.elapsed_s = time.monotonic() - t0
    return result


def stream_body(**extra) -> dict:
    return {**BODY, "stream": True, "stream_options": {"include_usage": True}, **extra}


class Background:
    """Requests sent from threads; `results` in completion order."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: list[Result] = []
        self.statuses: list[int] = []  # response statuses as they arrive (before bodies)

    def send(self, *args, **kwargs) -> None:
        def run() -> None:
            self.results.append(send(*args, on_status=self.statuses.append, **kwargs))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout_s: float) -> list[Result]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in self.threads)
        assert alive == 0, f"{alive} requests still running after {timeout_s} s"
        return self.results


def usage(base: str, key: str) -> dict:
    r = httpx.get(f"{base}/v1/usage", headers={"authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def assert_books(base: str, key: str, told: int, minute0: int, timeout_s: float = 5.0) -> float:
    """Wait until the tenant's counters show exactly `told` tokens and no slot is held;
    returns how long that took. `minute0`: the minute the tenant's traffic began (the
    minute window is only compared when no minute boundary passed since)."""
    t0 = time.monotonic()
    last: dict = {}

    def settled() -> bool:
        nonlocal last
        last = usage(base, key)
        same_minute = int(time.time() // 60) == minute0
        return (
            last["tokens_today"] == told
            and last["concurrent_requests"] == 0
            and (last["tokens_this_minute"] == told or not same_minute)
        )

    try:
        wait_until(settled, timeout_s, "books settle", every_s=0.05)
    except AssertionError:
        raise AssertionError(f"counters {last} != told {told} tokens, 0 slots") from None
    return time.monotonic() - t0


def this_minute() -> int:
    return int(time.time() // 60)


def prompt_preferring(target: str, urls: list[str], skip: int = 0) -> list[int]:
    """A 4-token prompt whose rendezvous winner among `urls` is `target` (the gateway
    sends it there while that replica is not much busier than the others)."""
    found = 0
    for i in range(1, 10_000):
        prompt = [i, i + 1, i + 2, i + 3]
        aff = prefix_key(prompt)
        if max(urls, key=lambda u: rendezvous_weight(aff, u.rstrip("/"))) == target:
            if found == skip:
                return prompt
            found += 1
    raise AssertionError("no prompt found")


def metric(base: str, name: str, labels: str = "") -> float:
    """The value of one sample of the gateway's /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + (labels or " ")) or line.startswith(name + "{" + labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def stats(url: str) -> dict:
    return httpx.get(f"{url}/_stats", timeout=5).json()


@contextmanager
def gateway_over(redis_url: str, pools: dict[str, list[str]], *, server=None, **config):
    """An in-process gateway over these worker URLs (fresh Redis db); `server`: kwargs of
    `gateway.runtime.http_server.server_config` to serve it as the gateway process does."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    with ExitStack() as stack:
        cfg = GatewayConfig(
            pools=pools,
            data_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-gw-")),
            admin_key=ADMIN,
            load_poll_interval_s=0.05,
            **config,
        )
        gw = build_gateway(cfg, redis_url)
        app = create_gateway_app(gw)
        if server is not None:
            app = server_config(app, "127.0.0.1", free_port(), **server)
        url = stack.enter_context(serving(app))
        wait_ready(url, 10)
        yield Stack(url, {}, {}, redis_url, gw)


def subprocess_config(stack: Stack, data_dir, **extra) -> dict:
    """A `gateway:` config for a gateway process over `stack`'s Redis and backends."""
    pools: dict[str, list[str]] = {}
    for name, url in stack.backend_urls.items():
        pools.setdefault(name.rstrip("0123456789"), []).append(url)
    return {
        "pools": pools,
        "redis_url": stack.redis_url,
        "admin_key": ADMIN,
        "data_dir": str(data_dir),
        "load_poll_interval_s": 0.05,
        **extra,
    }
