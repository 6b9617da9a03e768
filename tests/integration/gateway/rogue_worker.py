"""A worker that misbehaves on the wire, for the tests of the gateway's upstream client.

`RogueWorker` speaks raw HTTP/1.1 on a loopback port (an asyncio server on a thread of its
own), so it can send what no well-behaved server would: an endless body, a head of any
size, a second answer after the one asked for, an interim 100, a Retry-After of `nan`,
usage no request could have produced. It answers `/load` and `/health` as a ready worker
(or holds them, `hold_polls`), and `POST /v1/completions` as `mode` says. The fake is not
what is tested: the gateway in front of it is.
"""

import asyncio
import json
import threading
from typing import Any

import msgspec

from workers.api.types import LoadReport

LEAK = "LEAKED-TO-SOMEONE-ELSE"  # the text of an answer nobody asked for


def _load_report() -> bytes:
    report = LoadReport(
        state="ready",
        num_running=0,
        num_waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=1000,
        kv_free_tokens=16000,
        kv_total_tokens=16000,
        queued_prompt_tokens=0,
        output_tokens_per_s=0.0,
        model="rogue",
        max_model_len=4096,
        vocab_size=32000,
    )
    return msgspec.json.encode(report)


def response(status: int, body: bytes, headers: str = "", reason: str = "X") -> bytes:
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    return head.encode() + body


def completion(text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    """A non-streaming completion body (one choice)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    body = {"id": "rogue", "object": "text_completion", "created": 0, "model": "rogue"}
    return json.dumps({**body, "choices": [choice], "usage": usage}).encode()


def sse_answer(num_tokens: int, prompt_tokens: int, usage_tokens: int) -> bytes:
    """A whole SSE body: `num_tokens` one-token chunks, then usage claiming
    `usage_tokens` completion tokens, then [DONE]."""
    events = []
    for _ in range(num_tokens):
        choice = {"index": 0, "text": "r", "logprobs": None, "finish_reason": None}
        events.append({"id": "rogue", "object": "text_completion", "choices": [choice]})
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": usage_tokens,
        "total_tokens": prompt_tokens + usage_tokens,
    }
    events.append({"id": "rogue", "object": "text_completion", "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


def chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class RogueWorker:
    """Modes (`mode`) of `POST /v1/completions`, streaming or not as the request says:
    "ok" (one token of text "r" per max_tokens, honest usage), "endless" (a 200, then
    junk without end, never an SSE event boundary), "big_head" (a head of `head_bytes`),
    "two_answers" (the answer, and a second one right behind it in the same write),
    "usage_lie" (honest tokens, usage claiming 10**15), "retry_nan" (503 with
    `Retry-After: nan`), "continue" (an interim 100, then the answer), "status" (an answer
    with status `status`), "stall_body" (a head and 10 bytes of the body, the rest never),
    "hold" (the answer only once `release` is set; a stream's head at once, and an SSE
    comment every 50 ms until then).

    `hold_polls` set: `/load` and `/health` are answered only once it is cleared again
    (a worker whose event loop is busy). Counters: `posts` (request bodies), `dropped`
    (connections the gateway closed while this worker was still writing to them)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.head_bytes = 200 << 20
        self.status = 302
        self.posts: list[dict[str, Any]] = []
        self.dropped = 0
        self.sent_bytes = 0
        self.release = threading.Event()
        self.hold_polls = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "RogueWorker":
        self._thread.start()
        assert self._started.wait(10), "the rogue worker did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.hold_polls.clear()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        async with server:
            await self._stop.wait()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if path in ("/load", "/health"):
                    while self.hold_polls.is_set():
                        await asyncio.sleep(0.01)
                    out = _load_report() if path == "/load" else b'{"status":"ok"}'
                    writer.write(response(200, out, "Content-Type: application/json\r\n"))
                    await writer.drain()
                    continue
                if method != "POST":
                    writer.write(response(404, b"{}"))
                    await writer.drain()
                    continue
                req = json.loads(body)
                self.posts.append(req)
                try:
                    if not await self._answer(req, writer):
                        return
                except ConnectionError:
                    self.dropped += 1
                    return
        except ConnectionError:
            return
        finally:
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        self.sent_bytes += len(data)
        await writer.drain()

    async def _answer(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False: the connection is to be closed."""
        stream = bool(req.get("stream"))
        n = int(req.get("max_tokens") or 16)
        prompt = len(req.get("prompt") or [])
        mode = self.mode
        honest = sse_answer(n, prompt, n) if stream else completion("r" * n, prompt, n)
        if mode == "endless":
            await self._write(writer, SSE_HEAD if stream else CHUNKED_HEAD)
            junk = f"{64 << 10:x}\r\n".encode() + b"x" * (64 << 10) + b"\r\n"
            while True:
                await self._write(writer, junk)
        if mode == "big_head":
            status_line, rest = _framed(honest, stream).split(b"\r\n", 1)
            await self._write(writer, status_line + b"\r\nX-Junk: ")
            piece = b"a" * (1 << 20)
            for _ in range(self.head_bytes // len(piece)):
                await self._write(writer, piece)
            await self._write(writer, b"\r\n" + rest)
            return True
        if mode == "two_answers":
            second = completion(LEAK, prompt, n)
            await self._write(writer, _framed(honest, stream) + response(200, second))
            return True
        if mode == "usage_lie":
            lie = 10**15
            body = sse_answer(n, lie, lie) if stream else completion("r" * n, lie, lie)
            await self._write(writer, _framed(body, stream))
            return True
        if mode == "retry_nan":
            error = b'{"error":{"message":"busy","type":"server_error","param":null,"code":null}}'
            await self._write(writer, response(503, error, "Retry-After: nan\r\n"))
            return True
        if mode == "continue":
            await self._write(writer, b"HTTP/1.1 100 Continue\r\n\r\n" + _framed(honest, stream))
            return True
        if mode == "status":
            await self._write(writer, response(self.status, honest, "Location: /x\r\n"))
            return True
        if mode == "stall_body":
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(honest)}\r\n\r\n".encode()
            await self._write(writer, head + honest[:10])
            await self._held()
            return False
        if mode == "hold" and stream:
            await self._write(writer, SSE_HEAD)
            while not self.release.is_set():  # alive: a heartbeat every 50 ms
                await self._write(writer, chunked(b": held\n\n")[:-5])
                await asyncio.sleep(0.05)
            await self._write(writer, chunked(honest))
            return True
        if mode == "hold":
            await self._held()
        await self._write(writer, _framed(honest, stream))
        return True

    async def _held(self) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.01)


def _framed(body: bytes, stream: bool) -> bytes:
    """A whole 200 response around `body`: an SSE stream (chunked) or JSON."""
    if stream:
        return SSE_HEAD + chunked(body)
    return response(200, body, "Content-Type: application/json\r\n", "OK")
