"""llama.cpp's llama-server: readiness from `/health` (503 "Loading model" while it loads),
slots and context from `/props`, running requests from `/slots` (on by default, 501 with
`--no-slots`), queue figures from `/metrics` (501 unless started with `--metrics`).
Prompt counts by `POST /apply-template` then `POST /tokenize`.
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
    sources,
    tokens_or_none,
)
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad
from workers.api.upstreams.prometheus import metric_sum, parse_exposition

_PATHS = ("/health", "/props", "/slots", "/metrics")


def _busy_slots(slots: Any) -> tuple[int | None, int | None]:
    """(slots processing, slots in all) of `/slots`' list."""
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None, None
    flags = [s.get("is_processing") for s in slots]
    if not all(isinstance(flag, bool) for flag in flags):
        return None, len(slots)
    return sum(flags), len(slots)


class LlamaCppAdapter:
    kind: UpstreamKind = "llamacpp"
    gives_logprobs = True  # its OpenAI endpoints take logprobs/top_logprobs

    async def probe(self, get: Getter, base_url: str, timeout_s: float) -> UpstreamLoad:
        answers = await get_all(get, base_url, _PATHS, timeout_s)
        status, body = answers["/health"]
        if status != 200:
            return not_ready("/health", status, body)
        props = json_or_none(answers["/props"][1]) if answers["/props"][0] == 200 else None
        props = props if isinstance(props, dict) else {}
        settings = props.get("default_generation_settings")
        n_ctx = tokens_or_none(settings.get("n_ctx")) if isinstance(settings, dict) else None
        model = props.get("model_path")
        slots_answer = json_or_none(answers["/slots"][1]) if answers["/slots"][0] == 200 else None
        processing, num_slots = _busy_slots(slots_answer)
        samples = (
            parse_exposition(answers["/metrics"][1]) if answers["/metrics"][0] == 200 else None
        )
        samples = samples or {}
        running = count_or_none(metric_sum(samples, "llamacpp:requests_processing"))
        return UpstreamLoad(
            state="ready",
            num_running=processing if processing is not None else running,
            # Only /metrics says how many wait for a slot; without --metrics, unknown.
            num_waiting=count_or_none(metric_sum(samples, "llamacpp:requests_deferred")),
            kv_usage=fraction_or_none(metric_sum(samples, "llamacpp:kv_cache_usage_ratio")),
            slots=count_or_none(props.get("total_slots")) or num_slots,
            max_model_len=n_ctx,  # per slot: each sequence gets n_ctx / slots of --ctx-size
            model=model if isinstance(model, str) and model else None,
            source=sources(answers, _PATHS),
        )

    def overloaded(self, status: int, body: bytes) -> bool:
        # 503 is "Loading model" or, with ?fail_on_no_slot, no free slot (unavailable_error).
        return busy_answer(status, body)

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        messages, text, token_ids = prompt_of(body)
        if token_ids is not None:
            return len(token_ids)
        if messages is not None:
            templated = await post_json(
                post, base_url + "/apply-template", {"messages": messages}, timeout_s
            )
            text = templated.get("prompt") if isinstance(templated, dict) else None
        if not isinstance(text, str):
            return None
        answer = await post_json(post, base_url + "/tokenize", {"content": text}, timeout_s)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return plausible_count(len(tokens), body) if isinstance(tokens, list) else None


ADAPTER = LlamaCppAdapter()
