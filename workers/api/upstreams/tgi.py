"""Hugging Face text-generation-inference: readiness from `/health`, load from `/metrics`
(`tgi_queue_size`, `tgi_batch_current_size`), model and context from `/info`, prompt counts
from `POST /chat_tokenize` (messages) or `POST /tokenize` (a prompt).

TGI reports no KV-cache usage: `kv_usage` stays None. The router only listens once the
model's shards are up, so loading reads as "unreachable".
"""

from typing import Any

from workers.api.upstreams.answers import (
    BUSY_STATUSES,
    count_or_none,
    first_sse_event,
    get_all,
    json_or_none,
    not_ready,
    plausible_count,
    post_json,
    prompt_of,
    sources,
    tokens_or_none,
)
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad
from workers.api.upstreams.prometheus import metric_sum, parse_exposition

_PATHS = ("/health", "/info", "/metrics")


class TgiAdapter:
    kind: UpstreamKind = "tgi"
    # Its chat endpoint takes `logprobs`/`top_logprobs` (router/src/lib.rs ChatRequest); its
    # /v1/completions request has no logprobs field.
    gives_logprobs = True

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        answers = await get_all(get, base_url, _PATHS, timeout_s)
        status, body = answers["/health"]
        if status != 200:
            # 503 {"error":"unhealthy","error_type":"healthcheck"}: up but not serving.
            return not_ready("/health", status, body)
        info = json_or_none(answers["/info"][1]) if answers["/info"][0] == 200 else None
        info = info if isinstance(info, dict) else {}
        samples = (
            parse_exposition(answers["/metrics"][1]) if answers["/metrics"][0] == 200 else None
        )
        samples = samples or {}
        model = info.get("model_id")
        return UpstreamLoad(
            state="ready",
            num_running=count_or_none(metric_sum(samples, "tgi_batch_current_size")),
            num_waiting=count_or_none(metric_sum(samples, "tgi_queue_size")),
            # The prompt bound, not max_total_tokens: TGI refuses a longer prompt even when
            # prompt plus output would fit.
            max_model_len=tokens_or_none(info.get("max_input_tokens")),
            model=model if isinstance(model, str) and model else None,
            source=sources(answers, _PATHS),
        )

    def overloaded(self, status: int, body: bytes) -> bool:
        # 429 {"error":"Model is overloaded","error_type":"overloaded"}; the same error as an
        # SSE event when it comes after the stream started.
        if status in BUSY_STATUSES:
            return True
        if status != 200:
            return False
        event = first_sse_event(body)
        return (
            isinstance(event, dict) and "error" in event and event.get("error_type") == "overloaded"
        )

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        messages, text, token_ids = prompt_of(body)
        if token_ids is not None:
            return len(token_ids)
        if messages is not None:
            payload: dict[str, Any] = {"messages": messages}
            if isinstance(body.get("model"), str):
                payload["model"] = body["model"]
            if isinstance(body.get("tools"), list):
                payload["tools"] = body["tools"]
            answer = await post_json(post, base_url + "/chat_tokenize", payload, timeout_s)
            # ChatTokenizeResponse: {"tokenize_response": [token, ...], "templated_text": ...}
            tokens = answer.get("tokenize_response") if isinstance(answer, dict) else answer
        elif text is not None:
            tokens = await post_json(post, base_url + "/tokenize", {"inputs": text}, timeout_s)
        else:
            return None
        return plausible_count(len(tokens), body) if isinstance(tokens, list) else None


ADAPTER = TgiAdapter()
