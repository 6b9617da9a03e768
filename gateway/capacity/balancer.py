"""Pure worker choice within a pool: least loaded, with prefix affinity.

Requests sharing a prompt prefix (a system prompt) go to the same worker where that
worker is not much busier than the least loaded one, so its prefix cache hits. The
preferred worker comes from rendezvous (highest-random-weight) hashing: when a member
joins or leaves, only the keys that member wins or held move.
"""

from collections.abc import Collection
from dataclasses import dataclass, field
from hashlib import blake2b

# load_score weights, in units of "one request this gateway has in flight there".
RUNNING_WEIGHT = 0.5  # a running sequence shares the batch; it slows ours a little
WAITING_WEIGHT = 1.0  # a waiting one is ahead of ours in the worker's line
KV_PRESSURE_WEIGHT = 4.0  # a full KV cache (preemptions ahead) counts as 4 more requests


@dataclass
class WorkerView:
    """What the gateway knows of one pool member (from /load and its own accounting)."""

    url: str
    state: str  # "ready" | "loading" | "draining" | "stalled" | "unreachable"
    num_running: int
    num_waiting: int
    kv_free_tokens: int
    kv_total_tokens: int  # 0 when unknown (e.g. an external OpenAI-compatible server)
    inflight: int  # requests this gateway has sent there and not finished
    max_inflight: int  # this gateway's cap per worker
    max_model_len: int | None = None  # from /load; None: not reported
    vocab_size: int | None = None  # from /load; None: not reported
    joined_at: float = 0.0  # when it joined the pool (the pool's clock, seconds)
    answered: bool = False  # it answered a poll since joining: silent now means lost
    # Its capacity model, from /load (workers/api/types.py LoadReport); None/empty: not
    # reported (still learning, or an external server).
    seats: int | None = None  # the running batch its ITL target allows
    decode_step_s: float | None = None
    prefill_tokens_per_s: float | None = None
    queued_prompt_tokens: int = 0
    running_prefill_tokens: int = 0
    running_remaining: tuple[int, ...] = ()
    waiting_max_tokens: tuple[int, ...] = ()
    itl_target_s: float | None = None  # the inter-token latency its seats are sized for
    step_s: float | None = None  # its recent mean step time, measured
    ready_at: float | None = None  # when it was first seen ready (the pool's clock)
    seen_loading: bool = False  # it reported `loading` (it was seen starting)
    kind: str = "switchyard"  # the kind of server (workers.api.upstreams); auto: not yet known
    kv_usage: float | None = None  # a foreign server's KV fraction in use, where it says
    # This gateway's requests there, in the order sent: request id -> (prompt tokens,
    # max_tokens). Those its last report does not show yet are the most recent.
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def room(self) -> int:
        """Requests this gateway may have in flight there: its cap, and no more than the
        seats the replica's ITL target allows (a request past them would wait in the
        worker's line, where no latency target holds)."""
        return self.max_inflight if self.seats is None else min(self.max_inflight, self.seats)


def seats_share(seats: int, share: float) -> int:
    """This gateway process's part of a replica's `seats` (`share`: 1/N of a group of N)."""
    return max(1, int(seats * share))


# A replica in one of these states takes requests now or will soon (a busy one is ready).
LIVE_STATES = frozenset({"ready", "loading"})


def prefix_key(text_or_tokens_prefix: str | list[int], num_chars: int = 512) -> bytes:
    """A stable 16-byte hash of the first `num_chars` characters (or token ids) of a
    prompt, for affinity. Text and token ids hash into different domains."""
    head = text_or_tokens_prefix[:num_chars]
    if isinstance(head, str):
        return blake2b(head.encode(), digest_size=16, person=b"sy-prefix-text").digest()
    data = ",".join(map(str, head)).encode()
    return blake2b(data, digest_size=16, person=b"sy-prefix-tokens").digest()


def has_room(w: WorkerView) -> bool:
    """Ready, and under this gateway's in-flight cap and the replica's seats."""
    return w.state == "ready" and w.inflight < w.room


def is_live(w: WorkerView, now: float, start_grace_s: float) -> bool:
    """Whether the replica serves, or soon will: ready (busy or not), loading (a model
    warming up), or silent since it joined less than `start_grace_s` ago (its server is
    still starting; so is every member of a gateway that has not polled yet, as members
    join `loading`). Not live: unreachable after it had answered, or silent past the grace,
    stalled, or draining."""
    if w.state in LIVE_STATES:
        return True
    return w.state == "unreachable" and not w.answered and now - w.joined_at < start_grace_s


def load_score(w: WorkerView) -> float:
    """Lower is better, in units of in-flight requests. `inflight` is fresh (counted
    here); running/waiting/KV come from the last /load and include other gateways."""
    kv_used = 0.0
    if w.kv_total_tokens > 0:
        kv_used = 1.0 - max(0, min(w.kv_free_tokens, w.kv_total_tokens)) / w.kv_total_tokens
    elif w.kv_usage is not None:  # a foreign server reports a fraction, not tokens
        kv_used = w.kv_usage
    return (
        w.inflight
        + RUNNING_WEIGHT * w.num_running
        + WAITING_WEIGHT * w.num_waiting
        + KV_PRESSURE_WEIGHT * kv_used
    )


def rendezvous_weight(affinity: bytes, url: str) -> int:
    """The highest-random-weight hash of (key, worker); the highest weight wins."""
    digest = blake2b(affinity + b"\0" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose_worker(
    workers: list[WorkerView],
    affinity: bytes | None,
    exclude: Collection[str] = frozenset(),
    busy_slack: float = 2.0,
) -> WorkerView | None:
    """The worker for the next request; None when no worker has room.

    Eligible: ready, with room, url not in `exclude`. Without `affinity`, the least
    loaded (first in list order on ties). With it, the rendezvous winner among the
    eligible, unless its load_score exceeds the least loaded one's by more than
    `busy_slack`; then the least loaded.
    """
    eligible = [w for w in workers if w.url not in exclude and has_room(w)]
    if not eligible:
        return None
    scores = {w.url: load_score(w) for w in eligible}
    least = min(eligible, key=lambda w: scores[w.url])
    if affinity is None:
        return least
    preferred = max(eligible, key=lambda w: rendezvous_weight(affinity, w.url))
    if scores[preferred.url] - scores[least.url] > busy_slack:
        return least
    return preferred
