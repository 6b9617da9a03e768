"""Redis key names. Everything lives under `sy:`; every key of one tenant carries the hash tag
`{<tenant_id>}` so a tenant's quota check touches one cluster slot.

Layout:
    sy:tenants                        set of tenant ids
    sy:{t}:tenant                     JSON tenant record
    sy:{t}:keys                       set of the tenant's key ids
    sy:apikey:{key_id}                JSON key record (salted hash, never the plaintext)
    sy:{t}:tpm:<minute>  sy:{t}:tpd:<day>  sy:{t}:rpm:<minute>   counters, with TTLs
    sy:{t}:conc                       sorted set: request id -> lease expiry (server ms)
    sy:{t}:pending:<request_id>       exists from reserve until its first reconcile
"""

TENANTS = "sy:tenants"


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
