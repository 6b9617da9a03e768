"""Redis key names. Everything lives under `sy:`; every key of one tenant carries the hash tag
`{<tenant_id>}` so a tenant's quota check touches one cluster slot.

Layout:
    sy:tenants                        set of tenant ids
    sy:{t}:tenant                     JSON tenant record
    sy:{t}:keys                       set of the tenant's key ids
    sy:apikey:{key_id}                JSON key record (salted hash, never the plaintext)
    sy:{t}:tpm:<minute>  sy:{t}:tpd:<day>  sy:{t}:rpm:<minute>   counters, with TTLs
    sy:{t}:conc                       sorted set: request id -> lease expiry (server ms)
    sy:{t}:pending:<request_id>       hash {owner, tokens, minute, day}: from reserve until its
                                      first reconcile (or until a sweep of its dead owner)
    sy:{t}:swept:<request_id>         the pending hash, moved there by a sweep: a late reconcile
                                      still applies its delta, once
    sy:{t}:charged:<request_id>       done marker of an unchecked (fail-open) charge
    sy:{t}:spend:d:<day>  sy:{t}:spend:m:<month>   money charged (nanos; `quota.budget`)
    sy:{t}:soft:<period id>           a budget's soft threshold was crossed in that period
    sy:owners                         sorted set: owner id -> last heartbeat (server ms)
    sy:owner:{o}                      an owner's (gateway's) heartbeat, with a TTL of seconds
    sy:owner:{o}:pending              sorted set of "<tenant>|<request id>" the owner reserved
                                      and has not reconciled -> reserve time (server ms)

The two owner keys carry the owner's hash tag, not a tenant's: reserve.lua and reconcile.lua
touch the owner's index in the same call as the tenant's keys, so on Redis Cluster they would
be cross-slot. Switchyard runs against one Redis (embedded or a primary); a cluster deployment
would move the index writes out of the scripts (index before reserve, remove after reconcile).
"""

TENANTS = "sy:tenants"


KEY_QUOTA_PREFIX = "key."  # the quota holder of a key with limits of its own: "key.<key id>"
RESERVED_TENANT_PREFIXES = (KEY_QUOTA_PREFIX,)  # no tenant id starts with one of these


def key_quota_id(key_id: str) -> str:
    """The id a key's own limits are counted under, in a namespace no tenant id can take."""
    return KEY_QUOTA_PREFIX + key_id


def tenant_prefix(tenant_id: str) -> str:
    return f"sy:{{{tenant_id}}}:"


def tenant_record(tenant_id: str) -> str:
    return tenant_prefix(tenant_id) + "tenant"


def tenant_keys(tenant_id: str) -> str:
    return tenant_prefix(tenant_id) + "keys"


def api_key(key_id: str) -> str:
    return f"sy:apikey:{{{key_id}}}"


def tokens_minute(tenant_id: str, minute: int) -> str:
    return f"{tenant_prefix(tenant_id)}tpm:{minute}"


def tokens_day(tenant_id: str, day: int) -> str:
    return f"{tenant_prefix(tenant_id)}tpd:{day}"


def requests_minute(tenant_id: str, minute: int) -> str:
    return f"{tenant_prefix(tenant_id)}rpm:{minute}"


def concurrency(tenant_id: str) -> str:
    return tenant_prefix(tenant_id) + "conc"


def pending(tenant_id: str, request_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}pending:{request_id}"


def swept(tenant_id: str, request_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}swept:{request_id}"


def charged(tenant_id: str, request_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}charged:{request_id}"


def spend_day(tenant_id: str, day: int) -> str:
    return f"{tenant_prefix(tenant_id)}spend:d:{day}"


def spend_month(tenant_id: str, month: int) -> str:
    return f"{tenant_prefix(tenant_id)}spend:m:{month}"


def soft_crossed(tenant_id: str, period_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}soft:{period_id}"


OWNERS = "sy:owners"


def owner_heartbeat(owner_id: str) -> str:
    return f"sy:owner:{{{owner_id}}}"


def owner_pending(owner_id: str) -> str:
    return f"sy:owner:{{{owner_id}}}:pending"


def pending_member(tenant_id: str, request_id: str) -> str:
    """A member of an owner's pending index. Tenant ids never contain "|" (TENANT_ID_RE)."""
    return f"{tenant_id}|{request_id}"


def split_pending_member(member: str) -> tuple[str, str]:
    tenant_id, _, request_id = member.partition("|")
    return tenant_id, request_id
