"""What a gateway tells the fleet's autoscaler about the pools it serves: pure wire types
and key names (`workers.api.demand_store` does the Redis part).

Every gateway process with membership on (`switchyard gateway`, each process of a group)
publishes, every `interval_s`, one hash under its own gateway id with a short TTL:
    sy:{fleet}:demand:<gateway id>   hash: pool -> `PoolDemand` (JSON); expires ttl_s after
                                     the last publish (Redis server clock)
    sy:{fleet}:demand_gateways       set of the gateway ids that published (a reader drops
                                     the ids whose hash has expired)
A gateway that stops publishing (SIGKILL, a lost pod) leaves the leader's sums within its
TTL. The leader (`workers.fleet.leader`) adds each gateway's queue and arrivals to its own
and takes the members' load it reports for members no supervisor of the fleet polls.
"""

import msgspec

DEMAND_GATEWAYS_KEY = "sy:{fleet}:demand_gateways"
DEFAULT_DEMAND_TTL_S = 5.0
MAX_DEMAND_BYTES = 65536  # a report is untrusted input to the leader: bigger is dropped


def demand_key(gateway_id: str) -> str:
    return f"sy:{{fleet}}:demand:{gateway_id}"


class MemberLoad(msgspec.Struct, frozen=True):
    """One pool member as a gateway last saw it on its /load (None: not reported)."""

    state: str  # the worker's own: ready, loading, draining, stalled, unreachable
    num_running: int | None = None
    num_waiting: int | None = None
    kv_used_tokens: int | None = None
    kv_total_tokens: int | None = None


class PoolDemand(msgspec.Struct, frozen=True):
    """One pool at one gateway: its queue and rates over the gateway's short window, and
    the load of the members it routes to (by URL)."""

    queue_depth: int | None = None  # requests in this gateway's queue for the pool
    estimated_wait_s: float | None = None
    arrivals_per_s: float | None = None  # requests offered to this gateway
    mean_service_s: float | None = None  # mean seconds a request held a worker slot
    ttft_p90_s: float | None = None
    members: dict[str, MemberLoad] = {}


class GatewayDemand(msgspec.Struct, frozen=True):
    """One gateway's report as read: every pool it serves."""

    gateway_id: str
    pools: dict[str, PoolDemand]


def encode_demand(demand: PoolDemand) -> bytes:
    return msgspec.json.encode(demand)


def decode_demand(raw: bytes | str) -> PoolDemand | None:
    """A stored report; None when it is too big or malformed."""
    if len(raw) > MAX_DEMAND_BYTES:
        return None
    try:
        return msgspec.json.decode(raw, type=PoolDemand)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
