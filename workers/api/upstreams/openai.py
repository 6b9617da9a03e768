"""Any OpenAI-compatible server (a hosted API, another gateway): ready when `GET /v1/models`
answers 200. `base_url` is the server's root, as for every kind: the adapter appends
`/v1/models` (for a hosted API: `https://api.example.com`, not `.../v1`).

Such a server tells nothing of its load: every figure stays None, and the pool's
`UpstreamConfig` (max_concurrency, context_length) stands in for them.
"""

from typing import Any

from workers.api.upstreams.answers import busy_answer, json_or_none, not_ready_reason
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad


class OpenAIAdapter:
    kind: UpstreamKind = "openai"
    gives_logprobs = True  # the OpenAI API's `logprobs`; a server that lacks it ignores it

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        status, body = await get(base_url + "/v1/models", timeout_s)
        if status == 200:
            models = json_or_none(body)
            data = models.get("data") if isinstance(models, dict) else None
            # The served model's name only when there is one: a hosted API lists many.
            name = data[0].get("id") if isinstance(data, list) and len(data) == 1 else None
            return UpstreamLoad(
                state="ready",
                model=name if isinstance(name, str) and name else None,
                source="GET /v1/models",
            )
        # 503: up but not serving yet; anything else (401, 404, no answer) is not a server
        # this pool can use, which the caller tells from "starting" by how long it lasts.
        reason = not_ready_reason("/v1/models", status, body)
        if status == 503:
            return UpstreamLoad(state="loading", reason=reason)
        return UpstreamLoad(state="unreachable", reason=reason)

    def overloaded(self, status: int, body: bytes) -> bool:
        return busy_answer(status, body)

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        return None


ADAPTER = OpenAIAdapter()
