"""Sending a request to a pool member: retries before the first token, streaming relay.

A worker that refuses (429/503) or fails before answering is retried on another replica,
honouring its Retry-After (capped) with jitter, a bounded number of times. Once a
response has started, nothing is retried: a worker dying mid-stream becomes an in-band
error event and `[DONE]`.
"""

import json
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

from gateway.balancer import WorkerView
from gateway.pool import Pool

log = logging.getLogger(__name__)

_RELAYED_STATUS = {200, 400, 404, 413, 422}


class WorkerRefused(Exception):
    """No replica took the request this attempt; `retry_after_s` says when to try again."""

    def __init__(self, message: str, retry_after_s: float = 0.05) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _WaitRetryAfter(wait_base):
    """Wait what the refusing worker asked (capped), plus jitter."""

    def __init__(self, cap_s: float, rng: random.Random) -> None:
        self.cap_s = cap_s
        self.rng = rng

    def __call__(self, retry_state) -> float:  # noqa: ANN001 (tenacity's RetryCallState)
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        base = exc.retry_after_s if isinstance(exc, WorkerRefused) else 0.05
        return min(base, self.cap_s) * (1.0 + 0.5 * self.rng.random())


@dataclass
class Attempt:
    """What the dispatch learned: who served and what it used."""

    worker: WorkerView | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0  # from usage, or chunks counted when the stream was cut
    usage_seen: bool = False
    tried: set[str] = field(default_factory=set)
    claimed: WorkerView | None = None  # chosen and counted in flight at admission


def _retry_after(r: httpx.Response) -> float:
    try:
        return float(r.headers.get("retry-after", "0.2"))
    except ValueError:
        return 0.2


class Dispatcher:
    """Retrying sender for one request against one pool."""

    def __init__(self, pool: Pool, attempts: int, retry_cap_s: float, rng: random.Random) -> None:
        self.pool = pool
        self.attempts = attempts
        self.retry_cap_s = retry_cap_s
        self.rng = rng

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=_WaitRetryAfter(self.retry_cap_s, self.rng),
            retry=retry_if_exception_type(WorkerRefused),
            reraise=True,
        )

    def _pick(self, affinity: bytes | None, attempt: Attempt) -> WorkerView:
        """The claimed worker on the first try; then another replica, counted in flight."""
        view, attempt.claimed = attempt.claimed, None
        if view is None:
            view = self.pool.choose(affinity, attempt.tried) or self.pool.choose(affinity, set())
            if view is None:
                raise WorkerRefused(f"no replica of {self.pool.name} has room")
            self.pool.begin(view)
        attempt.tried.add(view.url)
        return view

    async def post_json(
        self, path: str, body: bytes, affinity: bytes | None, attempt: Attempt
    ) -> httpx.Response:
        """Non-streaming: the worker's response (status relayed); refusals retried."""
        async for trying in self._retrying():
            with trying:
                view = self._pick(affinity, attempt)
                try:
                    r = await self.pool.client.post(
                        f"{view.url}{path}",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                except httpx.TransportError as exc:
                    self.pool.end(view)
                    self.pool.mark_unreachable(view.url)
                    raise WorkerRefused(f"{view.url}: {exc!r}") from exc
                if r.status_code in (429, 503) or r.status_code >= 500:
                    self.pool.end(view)
                    raise WorkerRefused(f"{view.url} answered {r.status_code}", _retry_after(r))
                attempt.worker = view
                if r.status_code == 200:
                    usage = r.json().get("usage") or {}
                    attempt.prompt_tokens = usage.get("prompt_tokens")
                    attempt.completion_tokens = usage.get("completion_tokens", 0)
                    attempt.usage_seen = bool(usage)
                return r
        raise AssertionError("unreachable")

    async def open_stream(
        self, path: str, body: bytes, affinity: bytes | None, attempt: Attempt
    ) -> httpx.Response:
        """Streaming: an open 200 (or relayed 4xx) response; refusals retried before any byte."""
        async for trying in self._retrying():
            with trying:
                view = self._pick(affinity, attempt)
                req = self.pool.client.build_request(
                    "POST",
                    f"{view.url}{path}",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                try:
                    r = await self.pool.client.send(req, stream=True)
                except httpx.TransportError as exc:
                    self.pool.end(view)
                    self.pool.mark_unreachable(view.url)
                    raise WorkerRefused(f"{view.url}: {exc!r}") from exc
                if r.status_code not in _RELAYED_STATUS:
                    await r.aclose()
                    self.pool.end(view)
                    raise WorkerRefused(f"{view.url} answered {r.status_code}", _retry_after(r))
                attempt.worker = view
                return r
        raise AssertionError("unreachable")


async def relay_events(
    upstream: httpx.Response, attempt: Attempt, client_wants_usage: bool
) -> AsyncIterator[bytes]:
    """Forward SSE events as they arrive; note usage; drop the usage chunk unless asked.

    Raises httpx errors when the worker dies mid-stream (the caller reports in-band).
    """
    async for line in upstream.aiter_lines():
        if not line:
            continue
        if line.startswith(":"):
            yield line.encode() + b"\n\n"  # the worker's heartbeat
            continue
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield b"data: [DONE]\n\n"
            return
        if '"usage"' in line:
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                attempt.prompt_tokens = usage.get("prompt_tokens")
                attempt.completion_tokens = usage.get("completion_tokens", 0)
                attempt.usage_seen = True
                if not chunk.get("choices") and not client_wants_usage:
                    continue
        elif not attempt.usage_seen:
            attempt.completion_tokens += 1  # one chunk per token, for a stream cut short
        yield line.encode() + b"\n\n"
