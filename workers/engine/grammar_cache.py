"""The bookkeeping of compiled grammars: which are kept, who pays for them, who builds next.

Pure Python (no llguidance, no torch): `GrammarCompiler` (`structured.py`) builds and
measures the grammars; this module decides.

- `GrammarCache` keeps compiled grammars by (tenant, schema) under three bounds: bytes per
  tenant, bytes in total, entries in total. A tenant over its own budget gives up its own
  least recently used entries; past the total, the tenant holding the most gives up one
  first, so a tenant sending distinct schemas displaces only itself. Tenants never share an
  entry, as they never share prefix-cache blocks: a hit would tell one tenant that another
  sent that schema.
- `BuildLane` runs one build at a time, and tenants waiting for it take turns, so one
  tenant's flood of new schemas delays another's first compile by at most one build per
  tenant waiting, and never a cached schema (a hit does not enter the lane).
"""

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from workers.engine.config import GrammarCacheConfig
from workers.errors import EngineError

CacheKey = tuple[str, str]  # (tenant, canonical schema JSON); "" is the anonymous tenant


class GrammarBusyError(EngineError):
    """`tenant` already has `num_compiles` schema compiles in flight, its bound: the same
    request may be sent again later (its schemas already compiled are served meanwhile)."""

    def __init__(self, tenant: str, num_compiles: int) -> None:
        super().__init__(
            f"{num_compiles} new JSON schemas of this tenant are already compiling here; "
            "retry later, or reuse a schema already sent"
        )
        self.tenant = tenant
        self.num_compiles = num_compiles


@dataclass(frozen=True, slots=True)
class GrammarCacheStats:
    """One immutable view of a compiler's cache, published at each change. Bytes are what
    entries are charged (their builds' measured bytes plus their lexers' room to grow);
    counters are cumulative."""

    num_entries: int = 0
    num_bytes: int = 0
    # Per tenant holding entries ("": anonymous), its bytes.
    tenant_bytes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    max_bytes: int = 0
    max_tenant_bytes: int = 0
    num_compiles: int = 0  # grammars built (kept or not)
    num_hits: int = 0  # requests served a cached grammar
    num_evictions: int = 0  # entries given up to stay within the bounds
    num_uncached: int = 0  # grammars built but larger than a tenant's budget: not kept
    num_refused: int = 0  # compiles refused: the tenant had its bound in flight
    compile_s: float = 0.0  # total time spent building grammars

    @property
    def hit_rate(self) -> float:
        total = self.num_compiles + self.num_hits
        return self.num_hits / total if total else 0.0


@dataclass(slots=True)
class _Entry:
    value: Any
    num_bytes: int


class GrammarCache:
    """Compiled grammars within `config`'s byte and entry bounds. Not thread-safe: the
    compiler's lock guards it."""

    def __init__(self, config: GrammarCacheConfig) -> None:
        self.config = config
        self.num_bytes = 0
        self.num_entries = 0
        self.num_evictions = 0
        # Per tenant, its entries from least to most recently used, and their bytes.
        self._tenants: dict[str, OrderedDict[str, _Entry]] = {}
        self._tenant_bytes: dict[str, int] = {}

    def get(self, key: CacheKey) -> Any | None:
        """The cached value (now its tenant's most recently used); None when absent."""
        tenant, schema = key
        entries = self._tenants.get(tenant)
        if entries is None or schema not in entries:
            return None
        entries.move_to_end(schema)
        return entries[schema].value

    def put(self, key: CacheKey, value: Any, num_bytes: int) -> bool:
        """Keep `value`, charged `num_bytes`, evicting to stay within the bounds. False when
        it is not kept: alone it is over the tenant's budget or the total."""
        cfg = self.config
        if num_bytes > min(cfg.max_tenant_bytes, cfg.max_bytes) or cfg.max_entries < 1:
            return False
        tenant, schema = key
        entries = self._tenants.setdefault(tenant, OrderedDict())
        old = entries.pop(schema, None)
        entries[schema] = _Entry(value, num_bytes)
        self._account(tenant, num_bytes - (old.num_bytes if old else 0), 0 if old else 1)
        while self._tenant_bytes.get(tenant, 0) > cfg.max_tenant_bytes:
            self._evict_oldest(tenant)
        while self.num_bytes > cfg.max_bytes:
            self._evict_oldest(max(self._tenant_bytes, key=self._tenant_bytes.__getitem__))
        while self.num_entries > cfg.max_entries:
            self._evict_oldest(max(self._tenants, key=lambda t: len(self._tenants[t])))
        return schema in self._tenants.get(tenant, ())

    def tenant_bytes(self) -> Mapping[str, int]:
        """Bytes per tenant holding entries (a read-only copy)."""
        return MappingProxyType(dict(self._tenant_bytes))

    def _evict_oldest(self, tenant: str) -> None:
        _, entry = self._tenants[tenant].popitem(last=False)
        self._account(tenant, -entry.num_bytes, -1)
        self.num_evictions += 1

    def _account(self, tenant: str, num_bytes: int, num_entries: int) -> None:
        self.num_bytes += num_bytes
        self.num_entries += num_entries
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + num_bytes
        if not self._tenants[tenant]:
            del self._tenants[tenant], self._tenant_bytes[tenant]


class BuildLane:
    """One build at a time. Tenants waiting take turns (round robin), each tenant's builds
    in the order they came."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._granted: object | None = None  # the waiting ticket whose turn it is
        self._lines: OrderedDict[Hashable, deque[object]] = OrderedDict()  # in turn order

    @contextmanager
    def turn(self, tenant: Hashable) -> Iterator[None]:
        """Wait for `tenant`'s turn, and hold the lane for the block."""
        with self._cond:
            if self._busy:
                ticket = object()
                self._lines.setdefault(tenant, deque()).append(ticket)
                self._cond.notify_all()  # for whoever watches `num_waiting`
                self._cond.wait_for(lambda: self._granted is ticket)
                self._granted = None
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._pass_on()

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return sum(len(line) for line in self._lines.values())

    def _pass_on(self) -> None:
        """Hand the lane to the next tenant's oldest ticket, or free it."""
        if not self._lines:
            self._busy = False
            return
        tenant, line = next(iter(self._lines.items()))
        self._granted = line.popleft()
        if line:
            self._lines.move_to_end(tenant)  # its next build after the others' turns
        else:
            del self._lines[tenant]
        self._cond.notify_all()
