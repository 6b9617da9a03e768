"""Tenants, API keys and token quotas over Redis (`redis.asyncio`). Knows nothing of HTTP.

- `models`: Tenant, TenantLimits, ApiKeyRecord, IssuedKey and their validation.
- `store.TenantStore`: tenant CRUD, key issue/revoke/authenticate.
- `limiter.QuotaLimiter`: reserve before dispatch, reconcile after; `scripts` runs the `lua/`
  scripts (registered once); `connection.make_redis`: the client, whose pool retries and heals.
- `journal.ReconcileJournal`: settlements Redis could not take yet, durable on local disk.
- `sweeper.QuotaMaintenance`: heartbeat, journal replay, and settling dead gateways' reservations.
- `policy`: the quota arithmetic as pure functions; `errors`: what can go wrong, as data.
"""
