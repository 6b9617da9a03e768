"""Tenants, API keys and token quotas over Redis (`redis.asyncio`). Knows nothing of HTTP.

- `models`: Tenant, TenantLimits, ApiKeyRecord, IssuedKey and their validation.
- `store.TenantStore`: tenant CRUD, key issue/revoke/authenticate.
- `limiter.QuotaLimiter`: reserve before dispatch, reconcile after (`lua/` scripts).
- `policy`: the quota arithmetic as pure functions; `errors`: what can go wrong, as data.
"""
