"""The client for workers: the gateway's upstream, the supervisor's probe, the tests' reader.

`post`, the call every public request makes, goes over `workers.api.http1` (our own HTTP/1.1
client on httptools) to `http://` workers; the rest (load polls, health, drain) and any
`https://` worker over aiohttp. Per request to a worker, httpx's pool as the gateway used
it cost ~10x aiohttp's CPU, and aiohttp 2-4x http1's (`switchyard bench upstream`). Callers
see `UpstreamResponse` and two exceptions, `WorkerUnavailable` (before an answer started)
and `UpstreamError` (while one was read).

The aiohttp session is made on first use inside the running event loop (aiohttp binds a
session to its loop), and again if a later call runs on another loop (tests that call
`asyncio.run` more than once).

A worker's answer is untrusted input: its head is bounded (`max_head_bytes`), a body read
whole is bounded (`aread(max_bytes)`), and `heard_at` says when anything last came from a
worker, so a caller can tell a slow worker (still sending, or answering polls) from a
silent one.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from workers.api.http1 import BodyTooLarge, ConnectFailed, Http1Error, Http1Pool, Http1Response
from workers.api.types import LoadReport

_TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
_JSON = {"content-type": "application/json"}
_JSON_LINES = b"Content-Type: application/json\r\n"
_DEFAULT_MAX_BODY_BYTES = 64 << 20  # `aread` without a bound of the caller's


async def _head(url: str, sending: Awaitable[Any], stream: bool, timeout_s: float) -> Any:
    """The response of `sending` once its head is in; a stream's within `timeout_s`.
    Raises WorkerUnavailable when it fails or is late."""
    try:
        return await (asyncio.wait_for(sending, timeout_s) if stream else sending)
    except TimeoutError:
        raise WorkerUnavailable(url, f"no response within {timeout_s:g} s", "late") from None
    except ConnectFailed as exc:
        raise WorkerUnavailable(url, str(exc) or repr(exc), "connect") from exc
    except (Http1Error, *_TRANSPORT_ERRORS) as exc:
        raise WorkerUnavailable(url, str(exc) or repr(exc)) from exc


def _http_origin(url: str) -> tuple[str, int] | None:
    """(host, port) of an `http://` URL without a path; None for any other (aiohttp serves
    https, and a base URL with a path prefix such as `http://host/openai`)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path.strip("/"):
        return None
    return parts.hostname, parts.port or 80


class WorkerUnavailable(Exception):
    """The worker could not be reached, or did not start its answer in time. Nothing of
    the request was delivered to the client, so another replica may take it.

    `kind`: "connect" (no connection could be made), "late" (no head within the first-byte
    timeout: the worker may be alive and slow), "failed" (the connection broke, or the
    worker broke the protocol, before a head)."""

    def __init__(self, url: str, reason: str, kind: str = "failed") -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.kind = kind


class UpstreamError(Exception):
    """The connection to a worker failed while its answer was being read."""


class UpstreamResponse:
    """A worker's answer with its status and headers read and its body unread: read it
    (`aread`) or iterate it (`aiter_raw`), then `aclose` it. Closing a body not read to the
    end closes the connection, which is how the worker learns the request was abandoned;
    one read to the end goes back to the pool."""

    __slots__ = ("_r",)

    def __init__(self, response: Http1Response) -> None:
        self._r = response

    @property
    def status_code(self) -> int:
        return self._r.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive."""
        return self._r.headers

    async def aread(self, max_bytes: int = _DEFAULT_MAX_BODY_BYTES) -> bytes:
        """The whole body; UpstreamError when the connection breaks first or when more
        than `max_bytes` arrive (the connection is then dropped)."""
        try:
            return await self._r.aread(max_bytes)
        except Http1Error as exc:
            raise UpstreamError(repr(exc)) from exc

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (the transfer encoding removed); what arrived
        before a broken connection comes before its UpstreamError."""
        try:
            async for piece in self._r.aiter_raw():
                yield piece
        except Http1Error as exc:
            raise UpstreamError(repr(exc)) from exc

    @property
    def is_closed(self) -> bool:
        return self._r.closed

    def close(self) -> None:
        """Back to the pool if the body was read to its end, else the connection closed."""
        self._r.close()

    async def aclose(self) -> None:
        self.close()


class _AiohttpResponse(UpstreamResponse):
    """UpstreamResponse over aiohttp (an `https://` worker)."""

    __slots__ = ()

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._r = response  # type: ignore[assignment]

    @property
    def status_code(self) -> int:
        return self._r.status  # type: ignore[attr-defined]

    @property
    def headers(self) -> Mapping[str, str]:
        return self._r.headers

    async def aread(self, max_bytes: int = _DEFAULT_MAX_BODY_BYTES) -> bytes:
        pieces = []
        received = 0
        async for piece in self.aiter_raw():
            received += len(piece)
            if received > max_bytes:
                self._r.close()  # type: ignore[attr-defined]
                raise UpstreamError(repr(BodyTooLarge(f"a body over {max_bytes} bytes")))
            pieces.append(piece)
        return b"".join(pieces)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        content = self._r.content  # type: ignore[attr-defined]
        try:
            while piece := await content.readany():
                yield piece
        except _TRANSPORT_ERRORS as exc:
            # aiohttp raises a broken connection's error before the data that arrived ahead
            # of it: hand that data on first (a worker's last tokens before it died).
            rest = _buffered(content)
            if rest:
                yield rest
            raise UpstreamError(repr(exc)) from exc

    @property
    def is_closed(self) -> bool:
        return self._r.closed

    def close(self) -> None:
        r: aiohttp.ClientResponse = self._r  # type: ignore[assignment]
        if r.content.at_eof():
            r.release()
        else:
            r.close()


def _buffered(content: aiohttp.StreamReader) -> bytes:
    """What `content` received but nobody read (aiohttp keeps it in a private deque)."""
    buffer = getattr(content, "_buffer", None)
    if not buffer:
        return b""
    rest = b"".join(buffer)[getattr(content, "_buffer_offset", 0) :]
    buffer.clear()
    return rest


class WorkerClient:
    """One shared aiohttp connection pool to the workers.

    `first_byte_timeout_s` bounds the wait for a response's status line. A worker sends
    its headers as soon as it accepts a streaming request (and SSE comments while the
    request waits for its first token), so a streaming request that gets no status within
    this time went to a hung worker. A non-streaming answer starts only when it is whole:
    the caller bounds those by the request's deadline and the worker's health instead.
    `max_head_bytes` bounds a response's status line and headers (http:// workers; aiohttp
    bounds its own at 8 KiB a line).
    """

    def __init__(
        self,
        first_byte_timeout_s: float = 10.0,
        *,
        max_connections: int = 1024,
        connect_timeout_s: float = 2.0,
        max_head_bytes: int = 65536,
    ) -> None:
        self.first_byte_timeout_s = first_byte_timeout_s
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http1 = Http1Pool(connect_timeout_s, max_head_bytes=max_head_bytes)
        self._origins: dict[str, tuple[str, int] | None] = {}  # worker URL -> (host, port)
        self._heard: dict[str, float] = {}  # worker URL -> when a poll or head last came back
        # Headers of a member's every request (a foreign server's API key): URL -> headers.
        self._headers: dict[str, dict[str, str]] = {}
        self._header_lines: dict[str, bytes] = {}

    def set_headers(self, url: str, headers: Mapping[str, str]) -> None:
        """Send `headers` (e.g. `authorization`) with every request to the member at `url`:
        its polls, probes and requests. An empty mapping removes them."""
        url = url.rstrip("/")
        if not headers:
            self._headers.pop(url, None)
            self._header_lines.pop(url, None)
            return
        self._headers[url] = dict(headers)
        self._header_lines[url] = b"".join(
            f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()
        )

    def headers_for(self, url: str) -> dict[str, str]:
        """The headers set for the member at `url` (a URL under it inherits them)."""
        for base, headers in self._headers.items():
            if url == base or url.startswith(base + "/"):
                return headers
        return {}

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=0, ttl_dns_cache=None
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # Whole-request bounds are the request's deadline (dispatch) and the
                # stream's idle bound (relay); only connecting is bounded here.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                auto_decompress=False,
                skip_auto_headers=("user-agent",),
            )
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        await self._http1.aclose()

    async def __aenter__(self) -> "WorkerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def heard_at(self, url: str) -> float:
        """time.monotonic() when anything last came from the worker at `url`: an answer to
        a poll, a response head, or any byte on one of its connections (0.0: never)."""
        origin = self._origins.get(url)
        on_wire = self._http1.heard.get(origin, 0.0) if origin is not None else 0.0
        return max(self._heard.get(url, 0.0), on_wire)

    def quiet_s(self, url: str) -> float:
        """Seconds since anything came from the worker at `url` (`heard_at`)."""
        return time.monotonic() - self.heard_at(url)

    async def load(self, url: str, timeout_s: float = 1.0) -> LoadReport | None:
        """The worker's `/load`; None when it cannot be had or is not a LoadReport."""
        status, body = await self.get(f"{url}/load", timeout_s, heard=url)
        if status != 200:
            return None
        try:
            return msgspec.json.decode(body, type=LoadReport)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def alive(self, url: str, timeout_s: float = 1.0) -> bool:
        """`/health` answers 200 (an OpenAI-compatible server without `/load`)."""
        return (await self.get(f"{url}/health", timeout_s, heard=url))[0] == 200

    async def get(
        self, url: str, timeout_s: float, heard: str | None = None
    ) -> tuple[int | None, bytes]:
        """GET `url` whole: (status, body); (None, b"") when it cannot be had in time.
        `heard`: the worker URL whose `heard_at` an answer (any status) renews."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            headers = self.headers_for(url)
            async with self._http().get(url, timeout=timeout, headers=headers) as r:
                if heard is not None:
                    self._heard[heard] = time.monotonic()
                return r.status, await r.read()
        except (*_TRANSPORT_ERRORS, TimeoutError):
            return None, b""

    async def post_json(
        self, url: str, body: Any, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """POST a JSON body and read a JSON answer: (status, decoded body or None).
        Raises UpstreamError when `url` cannot be had within `timeout_s`."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            data = msgspec.json.encode(body)
            sent = {**_JSON, **self.headers_for(url), **(headers or {})}
            async with self._http().post(url, data=data, headers=sent, timeout=timeout) as r:
                content = await r.read()
        except (*_TRANSPORT_ERRORS, TimeoutError) as exc:
            raise UpstreamError(f"{url}: {exc!r}") from exc
        try:
            return r.status, msgspec.json.decode(content) if content else None
        except msgspec.DecodeError:
            return r.status, None

    async def post(
        self, url: str, path: str, body: bytes, *, stream: bool, first_byte_timeout_s=None
    ) -> UpstreamResponse:
        """POST a request body; the response with its status and headers read and its body
        not yet read (close it). Raises WorkerUnavailable on a transport error, or when a
        streaming request's status does not come within the first-byte timeout."""
        timeout_s = first_byte_timeout_s or self.first_byte_timeout_s
        if url not in self._origins:
            self._origins[url] = _http_origin(url)
        origin = self._origins[url]
        if origin is None:  # https, or a path prefix: aiohttp
            headers = {**_JSON, **self._headers.get(url, {})}
            sending = self._http().post(f"{url}{path}", data=body, headers=headers)
            response: UpstreamResponse = _AiohttpResponse(
                await _head(url, sending, stream, timeout_s)
            )
            self._heard[url] = time.monotonic()
            return response
        sending = self._http1.post(
            origin, path, body, _JSON_LINES + self._header_lines.get(url, b"")
        )
        return UpstreamResponse(await _head(url, sending, stream, timeout_s))

    async def drain(
        self, url: str, *, exit_when_empty: bool = False, control_key: str | None = None
    ) -> int:
        """Ask a worker to stop admitting and finish what it holds; the HTTP status.
        Raises UpstreamError when the worker cannot be reached."""
        headers = {"authorization": f"Bearer {control_key}"} if control_key else {}
        status, _ = await self.post_json(
            f"{url}/drain", {"exit_when_empty": exit_when_empty}, 30.0, headers
        )
        return status
