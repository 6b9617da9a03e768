"""A foreign pool's upstream settings as the gateway uses them: its kind checked, its API
key read from the environment or a file (never from the config itself, never logged)."""

import os
import re
from pathlib import Path

from gateway.config import UPSTREAM_KINDS, GatewayConfig, UpstreamConfig

_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what a header value may carry as is


def check_upstreams(config: GatewayConfig) -> None:
    """ValueError for an upstream entry that cannot work: an unknown kind, a pool that
    does not exist, a bound that is not positive."""
    for pool, up in config.upstreams.items():
        where = f"upstreams.{pool}"
        if pool not in config.pools:
            raise ValueError(f"{where}: no pool {pool!r} (pools: {sorted(config.pools)})")
        if up.kind not in UPSTREAM_KINDS:
            raise ValueError(f"{where}.kind: {up.kind!r} is not one of {list(UPSTREAM_KINDS)}")
        for name in ("max_concurrency", "tokens_per_minute", "context_length"):
            value = getattr(up, name)
            if value is not None and value < 1:
                raise ValueError(f"{where}.{name} must be >= 1, got {value}")
        if up.api_key_env and up.api_key_file:
            raise ValueError(f"{where}: set api_key_env or api_key_file, not both")


def upstream_headers(pool: str, up: UpstreamConfig) -> dict[str, str]:
    """The headers every request to the pool's members carries: its API key, when it has
    one. ValueError names the variable or file at fault, never the key."""
    where = f"upstreams.{pool}"
    key: str | None = None
    if up.api_key_env:
        key = os.environ.get(up.api_key_env)
        if not key:
            raise ValueError(
                f"{where}.api_key_env: the environment variable {up.api_key_env} is not set"
            )
    elif up.api_key_file:
        try:
            key = Path(up.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"{where}.api_key_file: cannot read {up.api_key_file}: {exc.strerror}"
            ) from None
        if not key:
            raise ValueError(f"{where}.api_key_file: {up.api_key_file} is empty")
    if key is None:
        return {}
    key = key.strip()
    if not _TOKEN.fullmatch(key):
        source = up.api_key_env or up.api_key_file
        raise ValueError(f"{where}: the API key from {source} has spaces or control characters")
    return {"authorization": f"Bearer {key}"}
