"""The adapter for each kind, and detecting the kind of an unknown server.

`detect` asks every telling endpoint at once and decides only where an answer can come
from one kind alone; two kinds' signs, or none, raise ValueError: a wrong guess would route
a pool's requests by another server's rules. The `openai` kind has no telling endpoint
(every server answers /v1/models) and is never detected.
"""

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from workers.api.upstreams import llamacpp, ollama, openai, sglang, tgi, vllm
from workers.api.upstreams.answers import get_all, json_or_none
from workers.api.upstreams.base import Adapter, Getter, UpstreamKind
from workers.api.upstreams.prometheus import has_prefix, parse_exposition

ADAPTERS: MappingProxyType[str, Adapter] = MappingProxyType(
    {
        "vllm": vllm.ADAPTER,
        "sglang": sglang.ADAPTER,
        "llamacpp": llamacpp.ADAPTER,
        "tgi": tgi.ADAPTER,
        "ollama": ollama.ADAPTER,
        "openai": openai.ADAPTER,
    }
)


def adapter_for(kind: str) -> Adapter:
    """The adapter of `kind`. `switchyard` has none (its workers are read by
    `WorkerClient.load`, `GET /load`); it and unknown kinds raise ValueError."""
    if kind == "switchyard":
        raise ValueError("switchyard workers are polled on /load by WorkerClient, not an adapter")
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"unknown upstream kind {kind!r}; known: {', '.join(ADAPTERS)}") from None


def _keys(*names: str) -> Callable[[Any], bool]:
    return lambda doc: isinstance(doc, dict) and all(name in doc for name in names)


# (path, kind, test of the decoded JSON, what the sentence says was seen), in the order
# they are named when several of one kind answer.
_JSON_SIGNS: tuple[tuple[str, UpstreamKind, Callable[[Any], bool], str], ...] = (
    (
        "/load",
        "switchyard",
        _keys("state", "kv_blocks_total", "queued_prompt_tokens"),
        "a Switchyard load report",
    ),
    (
        "/props",
        "llamacpp",
        _keys("total_slots", "default_generation_settings"),
        "total_slots and default_generation_settings (llama-server)",
    ),
    (
        "/info",
        "tgi",
        _keys("model_id", "max_input_tokens", "max_total_tokens"),
        "model_id and max_input_tokens (text-generation-inference)",
    ),
    (
        "/get_model_info",
        "sglang",
        _keys("model_path", "is_generation"),
        "model_path and is_generation (SGLang)",
    ),
    (
        "/get_server_info",
        "sglang",
        _keys("model_path", "tp_size", "version"),
        "SGLang's server arguments",
    ),
    (
        "/api/version",
        "ollama",
        lambda doc: (
            isinstance(doc, dict) and set(doc) == {"version"} and isinstance(doc["version"], str)
        ),
        "a version alone (Ollama)",
    ),
    (
        "/api/ps",
        "ollama",
        lambda doc: (
            isinstance(doc, dict) and set(doc) == {"models"} and isinstance(doc["models"], list)
        ),
        "its loaded models (Ollama)",
    ),
)
_METRIC_SIGNS: tuple[tuple[tuple[str, ...], UpstreamKind], ...] = (
    (("vllm:",), "vllm"),
    (("sglang:", "sglang_"), "sglang"),
    (("llamacpp:",), "llamacpp"),
    (("tgi_",), "tgi"),
)
_PATHS = (*(path for path, *_ in _JSON_SIGNS), "/metrics")


async def detect(get: Getter, base_url: str, timeout_s: float) -> tuple[UpstreamKind, str]:
    """(kind, a sentence naming the endpoint that decided) of the server at `base_url`.
    Raises ValueError, saying what was tried, unless exactly one kind's signs are seen."""
    answers = await get_all(get, base_url, _PATHS, timeout_s)
    seen: dict[UpstreamKind, str] = {}
    for path, kind, test, what in _JSON_SIGNS:
        status, body = answers[path]
        if status == 200 and kind not in seen and test(json_or_none(body)):
            seen[kind] = f"GET {path} answered with {what}"
    status, body = answers["/metrics"]
    samples = parse_exposition(body) if status == 200 else None
    for prefixes, kind in _METRIC_SIGNS:
        if samples and kind not in seen and has_prefix(samples, *prefixes):
            seen[kind] = f"GET /metrics has {' or '.join(prefixes)} metrics"
    tried = ", ".join(f"{path} ({answers[path][0] or 'no answer'})" for path in _PATHS)
    if len(seen) == 1:
        ((kind, sentence),) = seen.items()
        return kind, sentence
    if not seen:
        raise ValueError(
            f"{base_url}: no endpoint tells its kind (tried {tried}); set the pool's kind"
            " (an OpenAI-compatible server with none of these is kind openai)"
        )
    signs = "; ".join(f"{kind}: {sentence}" for kind, sentence in seen.items())
    raise ValueError(f"{base_url}: signs of more than one kind ({signs}); set the pool's kind")
