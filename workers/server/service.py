"""One worker's behaviour, independent of the HTTP framework: state, admission, load."""

import asyncio
import hmac
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from workers.api.types import ApiError, LoadReport, WorkerState
from workers.engine.async_engine import AsyncEngine
from workers.engine.grammar_cache import GrammarCacheStats
from workers.server.admission import backlog
from workers.server.config import WorkerConfig
from workers.server.logprobs import TokenTexts
from workers.server.metrics import WorkerMetrics
from workers.server.stall import StallWatch

log = logging.getLogger(__name__)

# What a stream's queue gets when its worker's drain hands it over (`hand_over`).
HANDOVER = object()


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer <key>` (constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def retry_after_headers(seconds: float) -> dict[str, str]:
    """`Retry-After` in whole seconds (rounded up), and `retry-after-ms` exactly."""
    return {"Retry-After": str(math.ceil(seconds)), "retry-after-ms": str(int(seconds * 1000))}


def jittered_retry_after(base_s: float, jitter_s: float, rng: random.Random) -> float:
    """Seconds to wait before retrying, spread so refused clients do not return together."""
    return base_s + rng.uniform(0.0, jitter_s)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


class WorkerService:
    """Holds the engine (None while loading) and decides state and admission."""

    def __init__(
        self,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        engine: AsyncEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.engine = engine
        self.clock = clock
        self.rng = rng or random.Random()
        self.draining = False
        # Streams a resuming gateway can continue elsewhere: each one's queue, to which
        # `hand_over` puts HANDOVER once a drain's grace is over.
        self._handover_queues: set[asyncio.Queue] = set()
        self.handed_over = False
        self.load_error: str | None = None
        self._rate: deque[tuple[float, int]] = deque(maxlen=256)
        self._lock = threading.Lock()
        self.on_drained: Callable[[], None] | None = None  # set by the process to exit
        # Called once a drain starts (the fleet membership announces it at once).
        self.drain_listeners: list[Callable[[], None]] = []
        # Set by the process: exit non-zero (called from the engine thread).
        self.on_engine_failure: Callable[[], None] | None = None
        self._max_chars_per_token: int | None = None
        self._token_texts: TokenTexts | None = None
        self._stall_watch = StallWatch(config.stall_timeout_s, config.stall_hard_timeout_s)
        self._progress = "ok"  # the watch's last verdict, for logging its changes
        if engine is not None:
            engine.add_death_callback(self._engine_died)
        metrics.watch_grammars(self._grammar_stats)
        metrics.watch_load(self._published_load)

    def watch_handover(self, queue: asyncio.Queue) -> None:
        """Hand this stream's queue HANDOVER when the drain's grace is over (at once when
        it is over already)."""
        self._handover_queues.add(queue)
        if self.handed_over:
            queue.put_nowait(HANDOVER)

    def unwatch_handover(self, queue: asyncio.Queue) -> None:
        self._handover_queues.discard(queue)

    def hand_over(self) -> None:
        """The drain's grace is over: every resumable stream still running ends with a
        `handed_over` event (a resuming gateway continues it on another replica)."""
        self.handed_over = True
        if self._handover_queues:
            log.info("drain grace over: handing %d streams over", len(self._handover_queues))
        for queue in list(self._handover_queues):
            queue.put_nowait(HANDOVER)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0] if self.config.served_model_names else "model"

    def set_engine(self, engine: AsyncEngine) -> None:
        self.engine = engine
        engine.add_death_callback(self._engine_died)

    def _grammar_stats(self) -> GrammarCacheStats | None:
        """What the engine's grammar compiler last published (None: no engine or tokenizer)."""
        grammars = getattr(self.engine.engine, "grammars", None) if self.engine else None
        return grammars.stats if grammars is not None else None

    def _engine_died(self, error: BaseException) -> None:
        """The engine thread is gone: /ready is 503 (stalled) until the process exits."""
        log.critical("the engine failed; in-flight requests got an error: %r", error)
        if self.config.exit_on_engine_failure and self.on_engine_failure is not None:
            self.on_engine_failure()

    @property
    def vocab_size(self) -> int | None:
        """Token ids must be below it; None while loading."""
        return self.engine.engine.runner.model_config.vocab_size if self.engine else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.engine.max_model_len if self.engine else None

    @property
    def state(self) -> WorkerState:
        engine = self.engine
        if engine is None:
            return "loading"
        if self.draining:
            return "draining"
        if engine.error is not None:
            return "stalled"
        if engine.is_idle():  # as of the snapshot the engine thread published
            return "ready"
        progress = self._stall_watch.observe(self.clock(), engine.heartbeat, engine.thread_cpu_s())
        if progress != self._progress:
            self._progress_changed(progress, engine)
        return "stalled" if progress == "stalled" else "ready"

    def _progress_changed(self, progress: str, engine: AsyncEngine) -> None:
        silent_s = self.clock() - engine.heartbeat[0]
        if progress == "slow":
            log.warning(
                "engine step running %.1f s, its thread using CPU: slow (cores shared?), "
                "not stalled",
                silent_s,
            )
        elif progress == "stalled":
            log.error("engine made no progress for %.1f s: stalled", silent_s)
        elif self._progress != "ok":
            log.info("engine stepping again (%s before)", self._progress)
        self._progress = progress

    def refuse(self, message: str, reason: str, code: str = "server_overloaded") -> ApiError:
        self.metrics.rejected.labels(self.metrics.model, reason).inc()
        retry = jittered_retry_after(
            self.config.retry_after_s, self.config.retry_after_jitter_s, self.rng
        )
        return ApiError(503, message, type="server_error", code=code, retry_after_s=retry)

    def admit(self, num_prompt_tokens: int) -> AsyncEngine:
        """The engine to submit to, or ApiError(503) when this worker must refuse."""
        engine = self.engine
        if engine is None:
            raise self.refuse("the model is still loading", "loading", "model_loading")
        if self.draining:
            raise self.refuse("this worker is draining", "draining", "worker_draining")
        if engine.error is not None:
            raise self.refuse("the engine has failed", "engine_dead", "engine_failed")
        # Only what cannot be admitted soon counts against the short line: a burst that
        # fits the running batch and the KV cache is never refused.
        line = backlog(engine.admission_snapshot(), num_prompt_tokens)
        if line.fits:
            return engine
        cfg = self.config
        waiting, queued = line.num_requests, line.num_tokens
        if waiting >= cfg.max_waiting_requests:
            raise self.refuse(f"{waiting} requests are already waiting", "queue_full")
        if queued + num_prompt_tokens > cfg.max_waiting_prompt_tokens and waiting:
            raise self.refuse(f"{queued} prompt tokens are already queued", "queue_tokens")
        return engine

    def record_tokens(self, n: int) -> None:
        with self._lock:
            self._rate.append((self.clock(), n))

    def tokens_per_s(self, window_s: float = 5.0) -> float:
        now = self.clock()
        with self._lock:
            recent = [(t, n) for t, n in self._rate if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / max(span, min(window_s, 1.0))

    def load(self) -> LoadReport:
        engine = self.engine
        if engine is None:
            return LoadReport("loading", 0, 0, 0, 0, 0, 0, 0, 0.0, self.model_name, 0)
        stats, arrivals = engine.published()  # the engine thread's snapshot, not its lists
        return LoadReport(
            state=self.state,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + len(arrivals),
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            kv_free_tokens=stats.free_kv_tokens,
            kv_total_tokens=stats.kv_blocks_total * stats.block_size,
            queued_prompt_tokens=sum(stats.waiting_tokens) + sum(arrivals),
            output_tokens_per_s=round(self.tokens_per_s(), 2),
            model=self.model_name,
            max_model_len=engine.engine.max_model_len,
            vocab_size=self.vocab_size,
            seats=stats.seats or None,
            itl_target_s=stats.itl_target_s,
            decode_step_s=_rounded(stats.decode_step_s),
            prefill_tokens_per_s=_rounded(stats.prefill_tokens_per_s),
            step_s=_rounded(stats.recent_step_s),
            running_remaining=list(stats.running_remaining),
            running_prefill_tokens=stats.running_prefill_tokens,
            waiting_max_tokens=list(stats.waiting_max_tokens),
        )

    def _published_load(self) -> LoadReport | None:
        """`/load`'s report for /metrics (None while loading: nothing to report yet)."""
        report = self.load()
        return None if report.state == "loading" else report

    def token_texts(self) -> TokenTexts:
        """The engine's token texts as responses show them (built once, filled as used)."""
        if self._token_texts is None:
            tok = self.engine.engine.tokenizer if self.engine else None
            self._token_texts = TokenTexts(tok)
        return self._token_texts

    def max_chars_per_token(self) -> int:
        """Longest token in characters: len(text) / this bounds the token count from below."""
        if self._max_chars_per_token is None:
            tok = self.engine.engine.tokenizer if self.engine else None
            vocab = tok.backend.get_vocab() if tok else {}
            self._max_chars_per_token = max((len(t) for t in vocab), default=16)
        return self._max_chars_per_token
