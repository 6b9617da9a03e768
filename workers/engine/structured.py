"""Structured outputs: JSON-schema constrained decoding with llguidance.

Why llguidance (measured on SmolLM2's 49k-token vocabulary, 2 CPU cores, a schema with
nested objects, enums, ranges, anyOf): schema compile 13 ms vs xgrammar's 20 ms, mask
fill 0.09 ms vs 0.04 ms at batch 1 but 3.7 ms vs 4.9 ms at batch 64 (its executor fills
rows in parallel), and the wheel has no dependencies (xgrammar pulls triton and a TVM
FFI runtime). Unsupported schema keywords are reported by name, which becomes the 400.

- `GrammarCompiler` (one per engine) turns a `GrammarSpec` into a matcher. Each distinct
  schema of a tenant is compiled once and kept in a cache bounded in bytes per tenant and
  in total (`grammar_cache.py`); a request gets a deep copy of the cached pristine matcher
  (microseconds). The copies share the pristine's lexer, whose states llguidance builds
  lazily as requests use it, so a cached grammar grows after its build: an entry is
  charged its build's measured bytes plus `max_lexer_states` states. Measured (the same
  on SmolLM2's 49k and the demo's 4k vocabulary): a build leaves 0.13 MB (a few
  properties) to 7.4 MB (500 bounded numbers, a 30 KB schema); a string of 2,500 to
  3,000 characters grew its grammar by 8 MB in 450 tokens; a request's copy is under
  0.05 MB; the token table, once per engine, 34 MB on SmolLM2.
- `Guide` is a request's matcher. It is advanced only by tokens the engine appended, so a
  step re-run by failure isolation or a preemption by recompute (which keeps the output
  tokens and recomputes only KV) leaves it where it was. `replay` rebuilds it from the
  output tokens should it ever need to.
- `fill_bitmask` computes one packed bitmask row per guided request of a step, batched
  (parallel over rows), and `apply_bitmask` sends disallowed tokens' logits to -inf.
"""

import json
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from workers.engine.config import GrammarCacheConfig
from workers.engine.grammar_cache import (
    BuildLane,
    CacheKey,
    GrammarBusyError,
    GrammarCache,
    GrammarCacheStats,
)
from workers.engine.heap import heap_bytes
from workers.errors import InvalidRequestError

# Compact, readable JSON: no free whitespace, so a model cannot wander in blank space.
_JSON_OPTIONS: "JsonCompileOptions" = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_MAX_SCHEMA_CHARS = 64 * 1024
# Heap bytes one lexer state may take: llguidance says 1-2 kB; grown to a cap on SmolLM2's
# and the demo vocabularies, states took 680-880 bytes.
LEXER_STATE_BYTES = 1024


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must be: a JSON document matching `schema`
    (`{"type": "object"}` for `json_object`). `param` names the request field for errors."""

    schema_json: str  # canonical JSON of the schema: the cache key
    param: str = "response_format"

    @classmethod
    def from_schema(cls, schema: dict[str, Any], param: str = "response_format") -> "GrammarSpec":
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be an object", param)
        # Key order is kept: properties are generated in the order the schema lists them.
        text = json.dumps(schema, separators=(",", ":"))
        if len(text) > _MAX_SCHEMA_CHARS:
            raise InvalidRequestError(
                f"the JSON schema is longer than {_MAX_SCHEMA_CHARS} characters", param
            )
        return cls(text, param)


class Guide:
    """One request's grammar state; advanced with each token the engine appends."""

    __slots__ = ("matcher", "pristine", "num_tokens", "compiler")

    def __init__(self, pristine: Any, compiler: "GrammarCompiler") -> None:
        self.pristine = pristine
        self.compiler = compiler  # its vocabulary size and mask filler
        self.matcher = pristine.deep_copy()
        self.num_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False when the grammar does not allow it."""
        ok = self.matcher.consume_token(token_id)
        self.num_tokens += ok
        return bool(ok) and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the grammar stopped (its first line; a lexer past `max_lexer_states`, say);
        None while it has not."""
        if not self.matcher.is_error():
            return None
        return str(self.matcher.get_error()).split("\n", 1)[0]

    @property
    def is_done(self) -> bool:
        """The document is complete and nothing but EOS may follow."""
        return self.matcher.is_stopped()

    def replay(self, token_ids: list[int]) -> None:
        """Rebuild the state from a request's output tokens."""
        self.matcher = self.pristine.deep_copy()
        self.num_tokens = 0
        for t in token_ids:
            self.accept(t)


class _Pending:
    """A compile in flight: requests of the same tenant for the same schema wait for it."""

    __slots__ = ("done", "matcher", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.matcher: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.matcher


class GrammarCompiler:
    """Compiles schemas against one tokenizer and vocabulary; thread-safe (HTTP threads
    compile, the engine thread fills masks).

    A cached grammar is served under a short lock that no build holds. A new one is built
    outside it, in the build lane (one build at a time, tenants taking turns). A tenant may
    have `config.max_compiles_per_tenant` requests waiting for compiles (its own or another
    of its requests' for the same schema); one more is refused with `GrammarBusyError`.
    The tokenizer's token table is built on the first compile (about a second and 34 MB
    for SmolLM2's 49k vocabulary), once for all schemas and tenants.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        config: GrammarCacheConfig | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.config = config or GrammarCacheConfig()
        # What a grammar's lexer may still grow to after its build, charged up front.
        self.growth_bytes = self.config.max_lexer_states * LEXER_STATE_BYTES
        self._limits = llguidance.LLParserLimits(max_lexer_states=self.config.max_lexer_states)
        self._tok: Any = None
        self._cache = GrammarCache(self.config)
        self._pending: dict[CacheKey, _Pending] = {}
        self._in_flight: dict[str, int] = {}  # per tenant: requests waiting for compiles
        self._lock = threading.Lock()  # the cache, the compiles in flight, the stats
        self._lane = BuildLane()
        self.stats = GrammarCacheStats(
            max_bytes=self.config.max_bytes, max_tenant_bytes=self.config.max_tenant_bytes
        )
        self.filler = MaskFiller()

    def cached(self, spec: GrammarSpec, tenant: str | None = None) -> Guide | None:
        """A fresh matcher for `spec` when `tenant` has it compiled; None when not
        (microseconds: an event loop may call it)."""
        with self._lock:
            pristine = self._hit((tenant or "", spec.schema_json))
        return Guide(pristine, self) if pristine is not None else None

    def guide(self, spec: GrammarSpec, tenant: str | None = None) -> Guide:
        """A fresh matcher for `spec`, compiled for `tenant` (None: anonymous) unless cached;
        blocks while it compiles. InvalidRequestError naming what is unsupported;
        GrammarBusyError when the tenant has its bound of compiles in flight."""
        key = (tenant or "", spec.schema_json)
        with self._lock:
            pristine = self._hit(key)
            if pristine is not None:
                return Guide(pristine, self)
            num = self._in_flight.get(key[0], 0)
            if num >= self.config.max_compiles_per_tenant:
                self._publish(num_refused=self.stats.num_refused + 1)
                raise GrammarBusyError(key[0], num)
            self._in_flight[key[0]] = num + 1
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                pending = self._pending[key] = _Pending()
        try:
            if owner:
                self._compile(key, spec, pending)
            return Guide(pending.result(), self)
        finally:
            with self._lock:
                self._in_flight[key[0]] -= 1
                if not self._in_flight[key[0]]:
                    del self._in_flight[key[0]]

    def _hit(self, key: CacheKey) -> Any | None:
        """Under the lock: the cached pristine matcher, counted as a hit; None when absent."""
        pristine = self._cache.get(key)
        if pristine is not None:
            self._publish(num_hits=self.stats.num_hits + 1)
        return pristine

    def _compile(self, key: CacheKey, spec: GrammarSpec, pending: _Pending) -> None:
        """Build in the lane, keep the result within the bounds, wake those waiting for it."""
        try:
            with self._lane.turn(key[0]):
                t0 = time.perf_counter()
                pending.matcher, num_bytes = self._build(spec)
                compile_s = time.perf_counter() - t0
        except BaseException as exc:
            pending.error = exc
        with self._lock:
            if pending.error is None:
                stats = self.stats
                kept = self._cache.put(key, pending.matcher, num_bytes + self.growth_bytes)
                self._publish(
                    num_compiles=stats.num_compiles + 1,
                    num_uncached=stats.num_uncached + (not kept),
                    compile_s=stats.compile_s + compile_s,
                    num_entries=self._cache.num_entries,
                    num_bytes=self._cache.num_bytes,
                    tenant_bytes=self._cache.tenant_bytes(),
                    num_evictions=self._cache.num_evictions,
                )
            del self._pending[key]
        pending.done.set()

    def _publish(self, **changes: Any) -> None:
        self.stats = replace(self.stats, **changes)

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = llguidance.hf.from_tokenizer(
                self.hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tok

    def _build(self, spec: GrammarSpec) -> tuple[Any, int]:
        """In the lane: the pristine matcher of `spec` and the heap bytes its build left.

        The bytes are the C heap in use after the build less before it (the token table
        is built first, so it is not charged to the first schema). Builds run one at a
        time, so no build is counted in another's bytes; the other threads' allocations
        during it are (the engine's step buffers: measured within 0.3 MB while decoding,
        1.5 MB during prefill on the demo model). The matcher reports every error of the
        grammar, so llguidance's validation, which built the whole grammar a second time,
        is not run."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.loads(spec.schema_json), defaults=_JSON_OPTIONS
            )
        except Exception as exc:
            raise InvalidRequestError(f"unsupported JSON schema: {exc}", spec.param) from None
        tok = self._tokenizer()
        before = heap_bytes()
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self._limits)
        num_bytes = max(0, heap_bytes() - before)
        if matcher.is_error():
            raise InvalidRequestError(f"unsupported JSON schema: {matcher.get_error()}", spec.param)
        return matcher, num_bytes


class MaskFiller:
    """Packed bitmasks for the guided rows of a step, filled in parallel."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, guides: list[Guide], vocab_size: int) -> torch.Tensor:
        """[len(guides), ceil(vocab / 32)] int32 on the CPU: bit t of row i set when token
        t is allowed next for guides[i]."""
        words = (vocab_size + 31) // 32
        bitmask = torch.full((len(guides), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(g.matcher, i) for i, g in enumerate(guides)],
            bitmask.data_ptr(),
            words * 4,
            len(guides),
        )
        return bitmask


def fill_bitmask(guides: list[Guide]) -> torch.Tensor:
    """The packed bitmask rows of `guides` (all of one engine), in order."""
    compiler = guides[0].compiler
    return compiler.filler.fill(guides, compiler.vocab_size)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the disallowed tokens of `rows` at -inf (a new tensor)."""
    vocab = logits.shape[-1]
    bm = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
