"""Routing labels in Redis: a bounded stream per tenant, prompts kept apart with a TTL,
and the short-lived record of each `auto` request that a feedback can label later.

Keys (all of one tenant share the hash tag `sy:{tenant}`):
- `sy:{t}:labels`: stream, one entry per label (`label` = the msgspec JSON of
  `cascade.labels.Label`), trimmed to about the tenant's `max_labels`;
- `sy:{t}:lprompt:<request id>`: what was kept of the request's text (`{"prompt"}` or
  `{"messages"}`), only for tenants with `keep_prompts`, expiring after
  `prompt_retention_s`: the label outlives its text;
- `sy:{t}:req:<request id>`: a `RequestRecord`, expiring after `feedback_ttl_s`. Its key
  is in the tenant's namespace, so only that tenant's feedback can find it;
- `sy:{t}:once:<source>:<request id>`: the verdict of the request's label from that source
  (a `Verdict`), expiring after `feedback_ttl_s` (as long as a feedback can come): while
  it is there no other label of that request and source is added, so a request has one
  label per source however often, and from however many gateways, its feedback is posted.
"""

import logging
from typing import Any

import msgspec

from cascade.labels import Label
from cascade.policy import LearningSettings

log = logging.getLogger(__name__)

STREAM_READ_BATCH = 1000

# KEYS[1] the tenant's label stream, KEYS[2] the request's verdict from the label's source,
# KEYS[3] the request's kept text. ARGV[1] the label (JSON), ARGV[2] max_labels (the
# stream's approximate bound), ARGV[3] the label's verdict, ARGV[4] seconds KEYS[2] is
# kept, ARGV[5] the text (JSON) or "" to keep none, ARGV[6] seconds it is kept.
# Returns nil when the label was added, else the verdict already recorded (nothing written).
ADD_ONCE_LUA = """
local recorded = redis.call('GET', KEYS[2])
if recorded then return recorded end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'label', ARGV[1])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5], 'EX', ARGV[6]) end
return false
"""


class Verdict(msgspec.Struct, array_like=True, frozen=True):
    """What a label said, kept beside it while another of its request and source may come."""

    weak_ok: bool | None
    strong_ok: bool | None
    feedback_score: float | None = None

    @classmethod
    def of(cls, label: Label) -> "Verdict":
        return cls(label.weak_ok, label.strong_ok, label.feedback_score)


class RequestRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a later feedback needs of an `auto` request."""

    request_id: str
    served_pool: str
    small_pool: str
    features: list[float]
    score: float | None = None
    prompt: dict[str, Any] | None = None  # kept only with keep_prompts


def _labels_key(tenant: str) -> str:
    return f"sy:{{{tenant}}}:labels"


def _prompt_key(tenant: str, request_id: str) -> str:
    return f"sy:{{{tenant}}}:lprompt:{request_id}"


def _request_key(tenant: str, request_id: str) -> str:
    return f"sy:{{{tenant}}}:req:{request_id}"


def _once_key(tenant: str, source: str, request_id: str) -> str:
    return f"sy:{{{tenant}}}:once:{source}:{request_id}"


class LabelStore:
    """Reads and writes labels; every call is one round trip (a pipeline at most)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._add_once = redis.register_script(ADD_ONCE_LUA)

    async def add(
        self, label: Label, settings: LearningSettings, prompt: dict[str, Any] | None = None
    ) -> Verdict | None:
        """Append `label` to its tenant's stream unless its request already has a label from
        its source; keep `prompt` only if the tenant opted in. None: added; else the verdict
        of the label already there (nothing written: the first label stands)."""
        tenant, rid = label.tenant, label.request_id
        keep = prompt is not None and settings.keep_prompts
        recorded = await self._add_once(
            keys=[
                _labels_key(tenant),
                _once_key(tenant, label.source, rid),
                _prompt_key(tenant, rid),
            ],
            args=[
                msgspec.json.encode(label),
                settings.max_labels,
                msgspec.json.encode(Verdict.of(label)),
                max(int(settings.feedback_ttl_s), 1),
                msgspec.json.encode(prompt) if keep else b"",
                max(int(settings.prompt_retention_s), 1),
            ],
        )
        return None if recorded is None else msgspec.json.decode(recorded, type=Verdict)

    async def labels(self, tenant: str, limit: int | None = None) -> list[Label]:
        """The tenant's labels, oldest first (at most the newest `limit`)."""
        key = _labels_key(tenant)
        out: list[Label] = []
        if limit is not None:
            entries = await self.redis.xrevrange(key, count=limit)
            decoded = [_decode(fields) for _, fields in reversed(entries)]
            return [label for label in decoded if label is not None]
        start = "-"
        while True:
            entries = await self.redis.xrange(key, min=start, count=STREAM_READ_BATCH)
            for _, fields in entries:
                label = _decode(fields)
                if label is not None:
                    out.append(label)
            if len(entries) < STREAM_READ_BATCH:
                return out
            last = entries[-1][0]
            last = last.decode() if isinstance(last, bytes) else last
            start = "(" + last

    async def prompts(self, tenant: str, request_ids: list[str]) -> dict[str, dict]:
        """What is still kept of these requests' text, by request id."""
        out: dict[str, dict] = {}
        for i in range(0, len(request_ids), STREAM_READ_BATCH):
            ids = request_ids[i : i + STREAM_READ_BATCH]
            values = await self.redis.mget([_prompt_key(tenant, r) for r in ids])
            for rid, raw in zip(ids, values, strict=True):
                if raw is not None:
                    out[rid] = msgspec.json.decode(raw)
        return out

    async def count(self, tenant: str) -> int:
        return int(await self.redis.xlen(_labels_key(tenant)))

    async def remember(self, tenant: str, record: RequestRecord, ttl_s: float) -> None:
        await self.redis.set(
            _request_key(tenant, record.request_id),
            msgspec.json.encode(record),
            ex=max(int(ttl_s), 1),
        )

    async def served_pool(self, tenant: str, request_id: str, pool: str) -> None:
        """The request was answered by `pool` after all (escalated)."""
        key = _request_key(tenant, request_id)
        raw = await self.redis.get(key)
        if raw is not None:
            record = msgspec.json.decode(raw, type=RequestRecord)
            record.served_pool = pool
            await self.redis.set(key, msgspec.json.encode(record), keepttl=True)

    async def recall(self, tenant: str, request_id: str) -> RequestRecord | None:
        """The tenant's own request, None when unknown, expired or another tenant's."""
        raw = await self.redis.get(_request_key(tenant, request_id))
        return None if raw is None else msgspec.json.decode(raw, type=RequestRecord)


def _decode(fields: dict) -> Label | None:
    raw = fields.get(b"label") or fields.get("label")
    try:
        return msgspec.json.decode(raw, type=Label)
    except (msgspec.DecodeError, TypeError):
        log.warning("skipping an unreadable label entry")
        return None
