"""vLLM's OpenAI server (`vllm serve`): readiness from `/health`, load from `/metrics`,
context length from `/v1/models`, prompt counts from `POST /tokenize`.

While the engine loads, the API server is not listening yet: the probe sees no answer
("unreachable") and the caller tells starting from lost.
"""

from typing import Any

from workers.api.upstreams.answers import (
    busy_answer,
    count_or_none,
    fraction_or_none,
    get_all,
    json_or_none,
    not_ready,
    plausible_count,
    post_json,
    prompt_of,
    served_model,
    sources,
)
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad
from workers.api.upstreams.prometheus import metric_mean, metric_sum, parse_exposition

_PATHS = ("/health", "/metrics", "/v1/models")
# vllm/v1/metrics/loggers.py; `gpu_cache_usage_perc` is the name before 0.9 (and v0's).
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class VllmAdapter:
    kind: UpstreamKind = "vllm"
    gives_logprobs = True

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        answers = await get_all(get, base_url, _PATHS, timeout_s)
        status, body = answers["/health"]
        if status != 200:
            return not_ready("/health", status, body)
        samples = (
            parse_exposition(answers["/metrics"][1]) if answers["/metrics"][0] == 200 else None
        )
        samples = samples or {}
        model, max_model_len = served_model(
            json_or_none(answers["/v1/models"][1]) if answers["/v1/models"][0] == 200 else None
        )
        return UpstreamLoad(
            state="ready",
            num_running=count_or_none(metric_sum(samples, "vllm:num_requests_running")),
            num_waiting=count_or_none(metric_sum(samples, "vllm:num_requests_waiting")),
            kv_usage=fraction_or_none(metric_mean(samples, *_KV_USAGE)),
            max_model_len=max_model_len,
            model=model,
            source=sources(answers, _PATHS),
        )

    def overloaded(self, status: int, body: bytes) -> bool:
        return busy_answer(status, body)

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        messages, text, token_ids = prompt_of(body)
        if token_ids is not None:
            return len(token_ids)
        payload: dict[str, Any] = {}
        if isinstance(body.get("model"), str):
            payload["model"] = body["model"]
        if messages is not None:
            payload["messages"] = messages
            if isinstance(body.get("tools"), list):  # a tool list is part of the prompt
                payload["tools"] = body["tools"]
        elif text is not None:
            payload["prompt"] = text
        else:
            return None
        answer = await post_json(post, base_url + "/tokenize", payload, timeout_s)
        return plausible_count(answer.get("count"), body) if isinstance(answer, dict) else None


ADAPTER = VllmAdapter()
