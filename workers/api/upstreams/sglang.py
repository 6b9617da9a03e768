"""SGLang's server (`sglang.launch_server`): readiness from `/health` (503 while it warms
up), load from `/metrics` (`--enable-metrics`) or else `/get_load`, context length from
`/v1/models`. SGLang's metric names are `sglang:` and, in some builds, `sglang_`.

No prompt counting: no tokenize endpoint whose request and answer could be sourced.
"""

from typing import Any

from workers.api.upstreams.answers import (
    busy_answer,
    count_or_none,
    fraction_or_none,
    get_all,
    json_or_none,
    not_ready,
    served_model,
    sources,
)
from workers.api.upstreams.base import Getter, Poster, UpstreamKind, UpstreamLoad
from workers.api.upstreams.prometheus import metric_mean, metric_sum, parse_exposition

_PATHS = ("/health", "/metrics", "/v1/models")


def _names(metric: str) -> tuple[str, str]:
    return f"sglang:{metric}", f"sglang_{metric}"


def _from_get_load(load: Any) -> tuple[int | None, int | None]:
    """(running, waiting) summed over the data-parallel ranks of `/get_load`'s list, where
    `num_reqs` counts running and waiting together."""
    ranks = load if isinstance(load, list) else [load]
    running = waiting = 0
    for rank in ranks:
        total = count_or_none(rank.get("num_reqs")) if isinstance(rank, dict) else None
        queued = count_or_none(rank.get("num_waiting_reqs")) if isinstance(rank, dict) else None
        if total is None or queued is None:
            return None, None
        running += max(total - queued, 0)
        waiting += queued
    return (running, waiting) if ranks else (None, None)


class SglangAdapter:
    kind: UpstreamKind = "sglang"
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
        running = count_or_none(metric_sum(samples, *_names("num_running_reqs")))
        waiting = count_or_none(metric_sum(samples, *_names("num_queue_reqs")))
        used: tuple[str, ...] = _PATHS
        if running is None or waiting is None:
            # /get_load is deprecated in newer builds (it logs a warning per call): only
            # read it when /metrics is off.
            load_status, load_body = await get(base_url + "/get_load", timeout_s)
            answers["/get_load"] = (load_status, load_body)
            used = (*_PATHS, "/get_load")
            if load_status == 200:
                running, waiting = _from_get_load(json_or_none(load_body))
        model, max_model_len = served_model(
            json_or_none(answers["/v1/models"][1]) if answers["/v1/models"][0] == 200 else None
        )
        return UpstreamLoad(
            state="ready",
            num_running=running,
            num_waiting=waiting,
            kv_usage=fraction_or_none(metric_mean(samples, *_names("token_usage"))),
            max_model_len=max_model_len,
            model=model,
            source=sources(answers, used),
        )

    def overloaded(self, status: int, body: bytes) -> bool:
        return busy_answer(status, body)

    async def count_prompt(
        self, post: Poster, base_url: str, body: dict[str, Any], timeout_s: float
    ) -> int | None:
        return None


ADAPTER = SglangAdapter()
