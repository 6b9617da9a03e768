"""The shapes every upstream adapter shares: the kinds, the HTTP callables an adapter is
given, what a probe learns (`UpstreamLoad`), and the adapter protocol."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

UpstreamKind = Literal["switchyard", "vllm", "sglang", "llamacpp", "tgi", "ollama", "openai"]
KINDS: tuple[UpstreamKind, ...] = (
    "switchyard",
    "vllm",
    "sglang",
    "llamacpp",
    "tgi",
    "ollama",
    "openai",
)
UpstreamState = Literal["ready", "loading", "unreachable"]

# GET `url` within `timeout_s`: (HTTP status, body); (None, b"") when it could not be had
# (connection refused, timeout). The caller binds the upstream's credentials.
Getter = Callable[[str, float], Awaitable[tuple[int | None, bytes]]]
# POST a JSON body to `url` within `timeout_s`: (HTTP status, decoded JSON or None); raises
# `workers.api.client.UpstreamError` when it cannot be had.
Poster = Callable[[str, Any, float], Awaitable[tuple[int, Any]]]


@dataclass(frozen=True)
class UpstreamLoad:
    """What one probe of a foreign server learnt. None: the kind does not report it (or
    this server did not), which admission treats as unknown, never as idle."""

    state: UpstreamState
    num_running: int | None = None  # requests being decoded now
    num_waiting: int | None = None  # requests queued inside the server
    kv_usage: float | None = None  # fraction of its KV cache in use, 0..1
    slots: int | None = None  # sequences it runs at once, where it says (llama-server)
    max_model_len: int | None = None  # context length, tokens
    model: str | None = None  # the served model's name, as the server calls it
    source: str = ""  # which endpoints the figures came from, e.g. "GET /metrics"
    reason: str = ""  # why not ready, when not (e.g. "GET /health: 503 loading model")


class Adapter(Protocol):
    """One kind of server. Stateless: per-replica state (caches) lives with the caller."""

    kind: UpstreamKind
    # Whether its completions can carry token logprobs (confidence escalation needs them).
    gives_logprobs: bool

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        """Readiness and load from the server's own endpoints."""
        ...

    def overloaded(self, status: int, body: bytes) -> bool:
        """True when an answer (before any token: the status and the body, or the first SSE
        event of a 200 stream) means the server is busy or still loading, so the request
        should go to another replica rather than reach the client as an error."""
        ...

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        """Prompt tokens of an OpenAI request body (`messages` or `prompt`) by the server's
        own tokenizer and chat template; None when this kind (or server) cannot say."""
        ...
