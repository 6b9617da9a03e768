"""A pool's members of other kinds (vLLM, llama-server, a hosted API, ...): probed through
their adapters (`workers.api.upstreams`), the kind detected first for `kind: auto`, and
their capacity measured by the gateway from the answers it relays (`measured.py`), since
such a server reports no step model of its own."""

import logging
import math
from typing import TYPE_CHECKING

from gateway.capacity.balancer import WorkerView, seats_share
from gateway.capacity.measured import MeasuredService
from workers.api.upstreams.base import UpstreamLoad
from workers.api.upstreams.registry import adapter_for, detect

if TYPE_CHECKING:  # the pool holds its foreign members
    from gateway.capacity.pool import Pool

log = logging.getLogger("gateway.capacity.pool")

# A hosted API (kind openai) tells nothing of its load: its readiness is asked this often.
HOSTED_PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 1.0


class ForeignMembers:
    """What one pool knows of its members that are not Switchyard workers."""

    def __init__(self, pool: "Pool", probe_interval_s: float = 1.0) -> None:
        self.pool = pool
        self.probe_interval_s = probe_interval_s  # a ready member's; one not ready: every poll
        self.measured: dict[str, MeasuredService] = {}
        self._probed_at: dict[str, float] = {}  # when a member was last probed

    def forget(self, url: str) -> None:
        """A member left: its measurements go with it."""
        self.measured.pop(url, None)
        self._probed_at.pop(url, None)

    async def probe(self, view: WorkerView) -> None:
        """Poll a member of another kind through its adapter (detecting the kind first
        when the pool's is `auto`)."""
        pool = self.pool

        async def get(url: str, timeout_s: float) -> tuple[int | None, bytes]:
            return await pool.client.get(url, timeout_s, heard=view.url)

        if view.kind == "auto":
            try:
                kind, why = await detect(get, view.url, PROBE_TIMEOUT_S)
            except ValueError as exc:
                pool.note_reported(view, "unreachable")
                log.debug("pool %s: kind of %s not known yet: %s", pool.name, view.url, exc)
                return
            if pool.kind == "auto":
                pool.kind = kind
            if kind != pool.kind:
                log.error(
                    "pool %s: %s is a %s server, the pool's others are %s: kept out of it",
                    pool.name,
                    view.url,
                    kind,
                    pool.kind,
                )
                pool.note_reported(view, "unreachable")
                return
            view.kind = kind
            log.info("pool %s: %s is a %s server (%s)", pool.name, view.url, kind, why)
            if kind == "switchyard":
                await pool.refresh_one(view)
                return
        # A ready member is probed every `probe_interval_s` (a hosted API every
        # HOSTED_PROBE_INTERVAL_S), not every poll: each probe is several requests and a
        # parse on the event loop, and this gateway counts its own requests there fresh.
        # One not ready yet is probed every poll, so it joins the rotation at once.
        now = pool.clock()
        every = HOSTED_PROBE_INTERVAL_S if view.kind == "openai" else self.probe_interval_s
        if view.state == "ready" and now - self._probed_at.get(view.url, -math.inf) < every:
            return
        self._probed_at[view.url] = now
        load = await adapter_for(view.kind).probe(get, view.url, PROBE_TIMEOUT_S)
        self._apply(view, load)

    def _apply(self, view: WorkerView, load: UpstreamLoad) -> None:
        """What a probe told (the step time and prefill rate are the gateway's own,
        `record_service`, and stay as measured)."""
        pool = self.pool
        if load.state != "unreachable":
            view.answered = True
        # Unknown figures stay out of the balance: our own in-flight count ranks it.
        view.num_running = load.num_running or 0
        view.num_waiting = load.num_waiting or 0
        view.kv_free_tokens = view.kv_total_tokens = 0
        view.kv_usage = load.kv_usage
        view.max_model_len = pool.context_length or load.max_model_len
        # Seats: what it runs at once (configured, else its slots, else our cap): beyond
        # them a request would wait in its queue, where no latency target holds.
        concurrency = pool.max_concurrency or load.slots or pool.max_inflight_per_worker
        view.seats = seats_share(concurrency, pool.seat_share)
        if load.state == "loading" and load.reason:
            log.debug("pool %s: %s is loading: %s", pool.name, view.url, load.reason)
        pool.note_reported(view, load.state)

    def record_service(
        self,
        url: str,
        prompt_tokens: int,
        output_tokens: int,
        *,
        first_token_s: float | None = None,
        decode_s: float = 0.0,
        total_s: float | None = None,
    ) -> None:
        """An answer a foreign member gave, for its measured capacity (`measured.py`): a
        stream's seconds from sending to its first token and from its first to its last,
        or a whole answer's `total_s`. Switchyard members report their own: ignored."""
        view = self.pool.views.get(url)
        if view is None or view.kind in ("switchyard", "auto"):
            return
        measured = self.measured.setdefault(url, MeasuredService())
        if first_token_s is not None:
            measured.stream(prompt_tokens, first_token_s, output_tokens, decode_s)
        elif total_s is not None:
            measured.whole(prompt_tokens, total_s, output_tokens)
        view.decode_step_s = measured.decode_step_s
        view.prefill_tokens_per_s = measured.prefill_tokens_per_s
