"""Ollama: ready as soon as `/api/version` answers (it loads models lazily, on the first
request that names one), the loaded models and their context from `/api/ps`.

Ollama reports no queue, batch or KV figures: `num_running`, `num_waiting` and `kv_usage`
stay None. It counts no prompts over HTTP.
"""

from typing import Any

from workers.api.upstreams.answers import (
    busy_answer,
    get_all,
    json_or_none,
    not_ready,
    sources,
    tokens_or_none,
)
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad

_PATHS = ("/api/version", "/api/ps")


def _loaded(ps: Any) -> tuple[str | None, int | None]:
    """(model, context length) from `/api/ps`: the one loaded model's; with several, no
    model and the smallest context (any of them may serve the next request); none loaded
    (or an Ollama before `context_length` was added to /api/ps), None."""
    models = ps.get("models") if isinstance(ps, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        return None, None
    contexts = [tokens_or_none(m.get("context_length")) for m in models]
    known = [c for c in contexts if c is not None]
    context = min(known) if known and len(known) == len(contexts) else None
    if len(models) != 1:
        return None, context
    name = models[0].get("model") or models[0].get("name")
    return (name if isinstance(name, str) and name else None), context


class OllamaAdapter:
    kind: UpstreamKind = "ollama"
    # docs/api/openai-compatibility.mdx (ollama at fb307609) lists Logprobs as unsupported
    # for both /v1/chat/completions and /v1/completions.
    gives_logprobs = False

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        answers = await get_all(get, base_url, _PATHS, timeout_s)
        status, body = answers["/api/version"]
        if status != 200:
            return not_ready("/api/version", status, body)
        ps = json_or_none(answers["/api/ps"][1]) if answers["/api/ps"][0] == 200 else None
        model, context = _loaded(ps)
        return UpstreamLoad(
            state="ready", max_model_len=context, model=model, source=sources(answers, _PATHS)
        )

    def overloaded(self, status: int, body: bytes) -> bool:
        # 503 "server busy, please try again.  maximum pending requests exceeded" once
        # OLLAMA_MAX_QUEUE requests wait; 429 from a rate-limited cloud model.
        return busy_answer(status, body)

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        return None


ADAPTER = OllamaAdapter()
