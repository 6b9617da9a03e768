"""A fast fake OpenAI-compatible backend (raw ASGI), for gateway tests and benchmarks.

It stands in for a worker where the worker is not what is measured: it answers
`/v1/completions` and `/v1/chat/completions` (streaming or not) with `max_tokens`
one-character tokens, reports `/load` and `/health`, and can be told to misbehave through
`POST /_control` with `{"mode": ..., "token_delay_s": ...}`; modes are "ok", "refuse"
(503 with Retry-After), "bad_request" (400: the request's own fault), "hang" (accepts the
connection and never answers), "die_mid_stream", "slow_first" and "busy_first_event" (a
stream accepted with 200 whose first event is a 503 error, as vLLM may send). Its load
reports, usage and errors are the wire contract's types (`workers.api.types`), as a
worker's are. `GET /_stats` tells how many requests are active and what bodies it received.

`flavour="vllm"` makes it stand in for a vLLM server instead of a worker: no `/load`, its
load on `/metrics` under vLLM's names and its context length on `/v1/models`;
`flavour="ollama"` for an Ollama server (`/api/version`, `/api/ps` with nothing loaded). `api_key`
makes every request without `Authorization: Bearer <api_key>` a 401, as a hosted API.

Run alone: `python -m benchmarks.fake_backend --port 8101`; with `--join REDIS_URL --pool NAME`
it also announces itself as a pool member in the fleet's Redis, as `switchyard worker --join`
does (heartbeats with a TTL, withdrawn on exit), for gateways that take members from there.
"""

import argparse
import asyncio
import json
import signal
import time
from collections import deque
from typing import Any

import msgspec

from workers.api.types import ErrorBody, ErrorInfo, LoadReport, Usage

VOCAB_SIZE = 32000  # what its /load reports; token ids in prompts are checked against it


class FakeBackend:
    def __init__(
        self,
        token_delay_s: float = 0.0,
        mode: str = "ok",
        name: str = "fake",
        flavour: str = "switchyard",
        api_key: str | None = None,
    ) -> None:
        self.flavour = flavour
        self.api_key = api_key
        self.unauthorized = 0  # requests refused for a missing or wrong key
        self.answer_headers: dict[str, str] = {}  # sent with each completion (x-ratelimit-*)
        self.token_delay_s = token_delay_s
        self.mode = mode
        self.logprob = -0.05  # of every token, when logprobs are asked for
        self.state = "ready"  # what /load reports: "ready" | "draining" | "stalled" | ...
        self.name = name
        self.active = 0
        self.total = 0
        self.aborted = 0
        self.bodies: deque[dict[str, Any]] = deque(maxlen=256)
        # The capacity model its /load reports (None: none, as an external server): set
        # them to make the gateway's admission predict from them.
        self.seats: int | None = None
        self.decode_step_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self.itl_target_s: float | None = None
        self.step_s: float | None = None

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 (ASGI)
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if self.api_key is not None and not path.startswith("/_"):
            sent = dict(scope.get("headers") or []).get(b"authorization", b"")
            if sent != f"Bearer {self.api_key}".encode():
                self.unauthorized += 1
                bad = ErrorBody(
                    ErrorInfo("invalid api key", "invalid_request_error", None, "invalid_api_key")
                )
                return await _json(send, 401, msgspec.to_builtins(bad))
        if path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if path == "/load" and self.flavour == "switchyard":
            return await _json(send, 200, self._load())
        if path == "/api/version" and self.flavour == "ollama":
            return await _json(send, 200, {"version": "0.5.7"})
        if path == "/api/ps" and self.flavour == "ollama":
            return await _json(send, 200, {"models": []})
        if path == "/metrics" and self.flavour == "vllm":
            return await _text(send, self._vllm_metrics())
        if path == "/v1/models" and self.flavour == "vllm":
            model = {"id": self.name, "object": "model", "owned_by": "vllm", "max_model_len": 4096}
            return await _json(send, 200, {"object": "list", "data": [model]})
        if path == "/_stats":
            return await _json(
                send,
                200,
                {
                    "active": self.active,
                    "total": self.total,
                    "aborted": self.aborted,
                    "bodies": list(self.bodies),
                },
            )
        if path == "/_control" and method == "POST":
            ctl = json.loads(body or b"{}")
            self.mode = ctl.get("mode", self.mode)
            self.token_delay_s = ctl.get("token_delay_s", self.token_delay_s)
            self.state = ctl.get("state", self.state)
            self.logprob = ctl.get("logprob", self.logprob)
            return await _json(send, 200, {"mode": self.mode})
        if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            return await self._generate(
                json.loads(body), path.endswith("chat/completions"), send, receive
            )
        return await _json(
            send,
            404,
            {
                "error": {
                    "message": "not found",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
        )

    def _load(self) -> dict[str, Any]:
        report = LoadReport(
            state=self.state,
            num_running=self.active,
            num_waiting=0,
            kv_blocks_used=0,
            kv_blocks_total=1000,
            kv_free_tokens=16000,
            kv_total_tokens=16000,
            queued_prompt_tokens=0,
            output_tokens_per_s=0.0,
            model=self.name,
            max_model_len=4096,
            vocab_size=VOCAB_SIZE,
            seats=self.seats,
            decode_step_s=self.decode_step_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            itl_target_s=self.itl_target_s,
            step_s=self.step_s,
        )
        return msgspec.structs.asdict(report)

    def _vllm_metrics(self) -> bytes:
        """Its load as vLLM's /metrics exposition names it (vllm/v1/metrics/loggers.py)."""
        label = f'{{engine="0",model_name="{self.name}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(self.active)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, self.active / 64):.4f}",
        ]
        return ("\n".join(lines) + "\n").encode()

    def _logprobs(self, chat: bool, n: int) -> dict[str, Any]:
        """Every token at log-probability `self.logprob` (set it low for an unsure model)."""
        if chat:
            entry = {"token": "x", "logprob": self.logprob, "bytes": [120], "top_logprobs": []}
            return {"content": [entry] * n}
        return {
            "tokens": ["x"] * n,
            "token_logprobs": [self.logprob] * n,
            "top_logprobs": [{}] * n,
            "text_offset": list(range(n)),
        }

    async def _generate(self, req: dict[str, Any], chat: bool, send, receive) -> None:  # noqa: ANN001
        self.bodies.append(req)
        if self.mode == "refuse":
            busy = ErrorBody(ErrorInfo("busy", "server_error", None, "server_overloaded"))
            return await _json(send, 503, msgspec.to_builtins(busy), {"retry-after": "0.05"})
        if self.mode == "bad_request":
            bad = ErrorBody(ErrorInfo("bad top_k", "invalid_request_error", "top_k", None))
            return await _json(send, 400, msgspec.to_builtins(bad))
        if self.mode == "busy_first_event" and req.get("stream"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            busy = {"error": {"message": "overloaded", "type": "server_error", "code": 503}}
            event = b"data: " + json.dumps(busy).encode() + b"\n\ndata: [DONE]\n\n"
            return await send({"type": "http.response.body", "body": event, "more_body": False})
        if self.mode == "hang":
            self.active += 1
            try:
                await _wait_disconnect(receive)
            finally:
                self.active -= 1
            return
        n = int(req.get("max_tokens") or 16)
        prompt = req.get("prompt") or req.get("messages") or ""
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(len(str(prompt)) // 4, 1)
        usage = msgspec.to_builtins(Usage(prompt_tokens, n, prompt_tokens + n))
        rid = f"fake-{self.total}"
        self.total += 1
        self.active += 1
        try:
            if not req.get("stream"):
                if self.token_delay_s:
                    gone = asyncio.ensure_future(_wait_disconnect(receive))
                    try:
                        await asyncio.wait({gone}, timeout=self.token_delay_s * n)
                    finally:
                        gone.cancel()
                    if gone.done() and not gone.cancelled():
                        self.aborted += 1
                        return
                text = self.name[:1] * n  # replicas of different pools answer differently
                choice = (
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                    if chat
                    else {"index": 0, "text": text, "finish_reason": "length"}
                )
                if req.get("logprobs") is not None and req.get("logprobs") is not False:
                    choice["logprobs"] = self._logprobs(chat, n)
                return await _json(
                    send,
                    200,
                    {
                        "id": rid,
                        "object": "chat.completion" if chat else "text_completion",
                        "created": 0,
                        "model": self.name,
                        "choices": [choice],
                        "usage": usage,
                    },
                    self.answer_headers,
                )
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            disconnected = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                for i in range(n):
                    if self.token_delay_s or (self.mode == "slow_first" and i == 0):
                        await asyncio.sleep(self.token_delay_s or 0.5)
                    if disconnected.done():
                        self.aborted += 1
                        return
                    if self.mode == "die_mid_stream" and i == n // 2:
                        raise ConnectionAbortedError("fake backend died")
                    last = i == n - 1
                    delta = (
                        {
                            "index": 0,
                            "delta": {"content": "x"},
                            "finish_reason": "length" if last else None,
                        }
                        if chat
                        else {"index": 0, "text": "x", "finish_reason": "length" if last else None}
                    )
                    chunk = {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 0,
                        "model": self.name,
                        "choices": [delta],
                        "sent_at": time.time(),  # lets a benchmark measure relay delay
                    }
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                            "more_body": True,
                        }
                    )
                opts = req.get("stream_options") or {}
                if opts.get("include_usage"):
                    tail = {
                        "id": rid,
                        "object": "text_completion",
                        "created": 0,
                        "model": self.name,
                        "choices": [],
                        "usage": usage,
                    }
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + json.dumps(tail).encode() + b"\n\n",
                            "more_body": True,
                        }
                    )
                await send(
                    {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                )
            finally:
                disconnected.cancel()
        finally:
            self.active -= 1


async def _wait_disconnect(receive) -> None:  # noqa: ANN001
    while (await receive())["type"] != "http.disconnect":
        pass


async def _text(send, body: bytes) -> None:  # noqa: ANN001
    headers = [
        (b"content-type", b"text/plain; version=0.0.4"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(send, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:  # noqa: ANN001
    raw = json.dumps(obj).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


FAKE_FINGERPRINT = "fake-backend"  # the model identity a joined fake backend announces


async def _serve_joined(app: FakeBackend, args: argparse.Namespace) -> None:
    """Serve `app` and keep it a member of `args.pool` in the fleet's Redis (as `switchyard
    worker --join` does) until stopped; withdraw on the way out (SIGINT/SIGTERM)."""
    import uvicorn

    from workers.api.membership import MemberRecord, check_url, member_id_for
    from workers.api.membership_store import MembershipStore, membership_redis
    from workers.fleet.announcer import Announcer, default_host_id, started_at

    url = check_url(args.advertise_url or f"http://{args.host}:{args.port}")
    host_id = args.host_id or default_host_id()
    since = started_at()

    def describe() -> MemberRecord:
        return MemberRecord(
            pool=args.pool,
            member_id=member_id_for(url),
            url=url,
            model=app.name,
            fingerprint=FAKE_FINGERPRINT,
            host_id=host_id,
            state="ready" if app.state == "ready" else "draining",
            started_at=since,
        )

    client = membership_redis(args.join)
    announcer = Announcer(MembershipStore(client), args.join_ttl)
    announcer.add(describe)
    announcer.start()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop serving, then withdraw below
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    try:
        await server.serve()
    finally:
        await announcer.close()
        await client.aclose()


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8101)
    ap.add_argument("--token-delay-s", type=float, default=0.0)
    ap.add_argument("--join", metavar="REDIS_URL", help="announce it in the fleet's Redis")
    ap.add_argument("--pool", default="small", help="with --join: the pool it joins")
    ap.add_argument("--advertise-url", help="with --join: default http://HOST:PORT")
    ap.add_argument("--host-id", help="with --join: default the hostname")
    ap.add_argument("--join-ttl", type=float, default=6.0, help="with --join: heartbeat TTL")
    args = ap.parse_args()
    app = FakeBackend(args.token_delay_s)
    if args.join:
        asyncio.run(_serve_joined(app, args))
        return
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
