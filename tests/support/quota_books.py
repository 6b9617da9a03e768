"""What Redis holds against a tenant, read straight from the counters.

The usage API's `tokens_this_minute` is the *current* minute's window: a test whose requests
straddle a minute boundary (or whose check runs just after one) reads a fresh, smaller window
and fails by the clock, not by the code. `tokens_charged` sums every minute window Redis still
holds for the tenant, so it is the same whenever the test happens to run.
"""

import redis

from quota import keyspace


def tokens_charged(redis_url: str, tenant_id: str) -> int:
    """Tokens charged to `tenant_id` across all its live minute windows (reserved, then
    reconciled to what was used)."""
    client = redis.Redis.from_url(redis_url)
    try:
        pattern = _glob_escape(keyspace.tenant_prefix(tenant_id)) + "tpm:*"
        keys = list(client.scan_iter(match=pattern, count=1000))
        return sum(int(v or 0) for v in client.mget(keys)) if keys else 0
    finally:
        client.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
