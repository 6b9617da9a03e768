"""Prometheus metrics of a worker, on a registry the caller passes in.

Names follow vLLM's where the meaning is the same, prefixed `switchyard_worker_`.
Engine state (queue lengths, KV usage, cumulative engine counters) is the snapshot the
engine thread last published, read at scrape time by a collector, and so is the grammar
cache's (`GrammarCacheStats`, published by its compiler at each change); per-request
latencies are observed by the server as they happen.

The same endpoint also answers the Gateway API Inference Extension's model-server protocol
(docs/proposals/003-model-server-protocol in kubernetes-sigs/gateway-api-inference-extension)
under the vLLM names its endpoint picker, and llm-d's, scrape by default, so that one can
route to these workers: `ModelServerProtocolCollector`, a rendering of `/load`.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from workers.api.types import LoadReport
from workers.engine.grammar_cache import GrammarCacheStats
from workers.engine.stats import EngineStats

P = "switchyard_worker_"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip


class EngineCollector(Collector):
    """Reports the engine's last published stats when Prometheus scrapes (never its live
    state: the scrape runs on the HTTP thread while the engine thread steps)."""

    def __init__(self, stats: Callable[[], EngineStats | None], model: str) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator:
        stats = self._stats()
        if stats is None:
            return
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self._model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self._model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.kv_usage)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_query_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hit_tokens,
        )
        yield counter(
            "request_errors",
            "Requests the engine failed alone (finish reason error); the others went on.",
            stats.num_failed_requests,
        )
        yield counter(
            "num_preemptions",
            "Requests preempted (recomputed) for lack of KV blocks.",
            stats.num_preemptions,
        )
        yield counter(
            "spec_proposed_tokens",
            "Speculative decoding: draft tokens verified (n-gram proposals).",
            stats.num_spec_proposed_tokens,
        )
        yield counter(
            "spec_accepted_tokens",
            "Speculative decoding: of the draft tokens verified, those the model agreed with.",
            stats.num_spec_accepted_tokens,
        )


class GrammarCacheCollector(Collector):
    """Reports the grammar cache's last published stats: its bytes in total and per tenant
    (the gateway's salt; `anonymous` without one) against their bounds, its entries, and
    what compiles did. An entry's bytes are its build's measured bytes plus the room its
    lexer has to grow."""

    GAUGES = (
        ("grammar_cache_bytes", "Bytes charged to cached grammars.", "num_bytes"),
        ("grammar_cache_limit_bytes", "Bound on cached grammar bytes.", "max_bytes"),
        ("grammar_cache_tenant_limit_bytes", "Bound on a tenant's.", "max_tenant_bytes"),
        ("grammar_cache_entries", "Cached grammars.", "num_entries"),
    )
    COUNTERS = (
        ("grammar_compiles", "JSON schemas compiled.", "num_compiles"),
        ("grammar_cache_hits", "Requests served a cached grammar.", "num_hits"),
        ("grammar_cache_evictions", "Grammars evicted to stay in bounds.", "num_evictions"),
        ("grammar_uncached", "Grammars over a tenant's bound, not kept.", "num_uncached"),
        ("grammar_compiles_refused", "Compiles refused (429): too many in flight.", "num_refused"),
        ("grammar_compile_seconds", "Time spent compiling.", "compile_s"),
    )

    def __init__(self, stats: Callable[[], GrammarCacheStats | None], model: str) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator:
        stats = self._stats()
        if stats is None:
            return
        for kind, table in ((GaugeMetricFamily, self.GAUGES), (CounterMetricFamily, self.COUNTERS)):
            for name, doc, attr in table:
                family = kind(P + name, doc, labels=["model_name"])
                family.add_metric([self._model], getattr(stats, attr))
                yield family
        per_tenant = GaugeMetricFamily(
            P + "grammar_cache_tenant_bytes",
            "Bytes charged to one tenant's cached grammars.",
            labels=["model_name", "tenant"],
        )
        for tenant, num_bytes in sorted(stats.tenant_bytes.items()):
            per_tenant.add_metric([self._model, tenant or "anonymous"], num_bytes)
        yield per_tenant


class ModelServerProtocolCollector(Collector):
    """The model-server protocol's metrics, under vLLM's names and `model_name` label, read
    from the report `/load` returns at scrape time (None: no engine yet, nothing reported):
    `vllm:num_requests_waiting` (its TotalQueuedRequests: requests handed in and not yet
    running), `vllm:num_requests_running`, the KV fraction in use (0-1) as both
    `vllm:kv_cache_usage_perc` and the older `vllm:gpu_cache_usage_perc`, and
    `vllm:cache_config_info` (value 1) whose `block_size` and `num_gpu_blocks` labels the
    pickers' prefix scorers read.

    No `vllm:lora_requests_info`: the protocol asks it of servers that serve LoRA adapters
    named in `model`, which these workers do not (vLLM too emits it only with LoRA on); the
    pickers score such a server as one with no adapters, and `--lora-info-metric ""` on
    the picker stops it looking for the series."""

    def __init__(self, load: Callable[[], LoadReport | None], model: str) -> None:
        self._load = load
        self._model = model

    def collect(self) -> Iterator:
        report = self._load()
        if report is None:
            return
        total = report.kv_blocks_total
        kv_usage = report.kv_blocks_used / total if total else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            return g

        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", report.num_waiting)
        yield gauge(
            "vllm:num_requests_running", "Requests in the running batch.", report.num_running
        )
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv_usage)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache layout: tokens per block, blocks in all.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        block_size = report.kv_total_tokens // total if total else 0
        info.add_metric([self._model, str(block_size), str(total)], 1)
        yield info


class WorkerMetrics:
    """Request-level metrics, observed by the HTTP server."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.registry = registry
        self.model = model
        lab = ["model_name"]
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of finished requests.", lab, registry=registry
        )
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated.", lab, registry=registry
        )
        self.request_success = Counter(
            P + "request_success",
            "Finished requests by finish reason.",
            lab + ["finished_reason"],
            registry=registry,
        )
        self.rejected = Counter(
            P + "requests_rejected",
            "Requests refused by admission control.",
            lab + ["reason"],
            registry=registry,
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(P + name, doc, lab, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to finish.")

    def watch_grammars(self, stats: Callable[[], GrammarCacheStats | None]) -> None:
        """Report the grammar cache whose stats `stats` returns (None: no engine yet)."""
        self.registry.register(GrammarCacheCollector(stats, self.model))

    def watch_load(self, load: Callable[[], LoadReport | None]) -> None:
        """Answer the model-server protocol from the report `load` returns (None: none yet)."""
        self.registry.register(ModelServerProtocolCollector(load, self.model))

    def observe_finished(
        self,
        reason: str,
        num_prompt: int,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
    ) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.request_success.labels(m, reason).inc()
        self.e2e.labels(m).observe(finished - arrival)
        if first_scheduled is not None:
            self.queue.labels(m).observe(first_scheduled - arrival)
            if first_token is not None:
                self.prefill.labels(m).observe(first_token - first_scheduled)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            self.decode.labels(m).observe(finished - first_token)
