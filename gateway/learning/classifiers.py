"""Per-tenant classifiers: versioned artifacts in Redis, promotion checked on the tenant's
held-out labels, every replica switching within a second, rollback, an audit log.

Keys:
- `sy:clf:files:{tenant}:<version>`: hash, artifact file name -> bytes (the
  pickle-free artifact of `cascade.artifact`, as `switchyard cascade train` wrote it);
- `sy:clf:tenants`: hash, tenant -> JSON `{"current": version | null, "previous": [...],
  "versions": {version: {name, sha256 of the manifest, created, who}}}`;
- `sy:clf:epoch`: incremented by every change; replicas poll it every `routing_poll_s`
  and load the artifacts whose pointer moved (cached on disk by tenant and version);
- `sy:clf:audit`: list of `{who, when, tenant, action, old, new, figures}`, newest first.
"""

import asyncio
import hashlib
import json
import logging
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cascade.artifact import (
    ARRAYS,
    MANIFEST,
    MODEL,
    REFERENCE_SCORES,
    ArtifactError,
    load_artifact,
    read_manifest,
)
from cascade.classifier import DifficultyScorer, load_reference_scores
from cascade.features import request_view
from cascade.labels import is_holdout, merge_labels
from cascade.metrics import routing_curve

log = logging.getLogger(__name__)

INDEX_KEY = "sy:clf:tenants"
EPOCH_KEY = "sy:clf:epoch"
AUDIT_KEY = "sy:clf:audit"
AUDIT_LEN = 1000
ARTIFACT_FILES = (MANIFEST, MODEL, *(f"{n}.npy" for n in ARRAYS), REFERENCE_SCORES)
MIN_HOLDOUT_LABELS = 30  # fewer held-out labels cannot tell two classifiers apart
# An artifact's files together; what a 64 MiB upload of them in base64 can carry.
MAX_ARTIFACT_BYTES = 48 * 1024 * 1024


class PromotionRefused(Exception):
    """The candidate does not beat the current classifier on the tenant's held-out labels
    (or there are too few to tell); `figures` says by how much."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def _files_key(tenant: str, version: int) -> str:
    return f"sy:clf:files:{tenant}:{version}"


def artifact_store(data_dir: str | Path) -> Path:
    """Where `PUT /admin/routing/classifiers/{tenant}` with a `path` may read artifacts from."""
    return Path(data_dir) / "classifiers" / "artifacts"


def in_store(store: Path, name: str) -> Path | None:
    """The artifact directory `name` names inside `store` (relative to it, or absolute),
    links resolved; None when it lies outside (whether or not it exists)."""
    root = store.resolve()
    try:
        path = (root / name).resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
        return None
    return path if path != root and path.is_relative_to(root) else None


def check_artifact(path: Path, max_bytes: int = MAX_ARTIFACT_BYTES) -> DifficultyScorer:
    """The scorer of the artifact at `path` (blocking). Raises ArtifactError unless its
    files are regular files (not links) of at most `max_bytes` together, checked before
    any is read, its manifest names only artifact files (no other path is ever opened or
    hashed), and it loads."""
    total = 0
    for name in ARTIFACT_FILES:
        try:
            info = (path / name).lstat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ArtifactError(f"cannot read {name}: {exc.strerror}", path) from None
        if not stat.S_ISREG(info.st_mode):
            raise ArtifactError(f"{name} is not a regular file", path)
        total += info.st_size
    if total > max_bytes:
        raise ArtifactError(f"its files hold {total} bytes, over the {max_bytes} allowed", path)
    named = read_manifest(path).get("files") or {}
    if not isinstance(named, dict) or not set(named) <= set(ARTIFACT_FILES):
        raise ArtifactError(f"the manifest may name only {', '.join(ARTIFACT_FILES)}", path)
    return load_artifact(path)


def read_artifact_files(path: Path, max_bytes: int = MAX_ARTIFACT_BYTES) -> dict[str, bytes]:
    """The files of an artifact directory (`check_artifact` first). Blocking: the gateway
    calls it in a thread."""
    check_artifact(path, max_bytes)
    return {name: (path / name).read_bytes() for name in ARTIFACT_FILES if (path / name).is_file()}


class ClassifierRegistry:
    """Per-tenant scorers for the router, and their promotion."""

    def __init__(self, redis: Any, cache_dir: Path) -> None:
        self.redis = redis
        self.cache_dir = cache_dir
        self.epoch: int | None = None
        self.index: dict[str, dict[str, Any]] = {}
        # tenant -> (version, scorer, reference scores)
        self.loaded: dict[str, tuple[int, DifficultyScorer, list[float]]] = {}

    def scorer_for(self, tenant: str) -> tuple[DifficultyScorer, list[float]] | None:
        entry = self.loaded.get(tenant)
        return None if entry is None else (entry[1], entry[2])

    async def refresh(self) -> None:
        """Load what changed since the last epoch seen (a no-op when nothing did)."""
        raw = await self.redis.get(EPOCH_KEY)
        epoch = int(raw) if raw is not None else 0
        if epoch == self.epoch:
            return
        index = {
            (k.decode() if isinstance(k, bytes) else k): json.loads(v)
            for k, v in (await self.redis.hgetall(INDEX_KEY)).items()
        }
        for tenant, doc in index.items():
            current = doc.get("current")
            held = self.loaded.get(tenant)
            if current is None:
                self.loaded.pop(tenant, None)
            elif held is None or held[0] != current:
                try:
                    self.loaded[tenant] = await self._load(tenant, current)
                    log.info("tenant %s now routes with classifier version %d", tenant, current)
                except (ArtifactError, OSError) as exc:
                    log.warning("classifier %d of %s not loaded: %s", current, tenant, exc)
        for tenant in set(self.loaded) - set(index):
            self.loaded.pop(tenant)
        self.index, self.epoch = index, epoch

    async def load(self, tenant: str, version: int) -> tuple[int, DifficultyScorer, list[float]]:
        """(version, scorer, reference scores) of a stored version (not promoted)."""
        return await self._load(tenant, version)

    async def _load(self, tenant: str, version: int) -> tuple[int, DifficultyScorer, list[float]]:
        digest = hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()
        path = self.cache_dir / f"{digest}-{version}"
        files = None
        if not await asyncio.to_thread((path / MANIFEST).is_file):
            files = await self.redis.hgetall(_files_key(tenant, version))
            if not files:
                raise ArtifactError("no files stored for this version", path)
        # Writing, hashing and parsing grow with the artifact: off the event loop.
        scorer, reference = await asyncio.to_thread(self._unpack, path, files)
        return version, scorer, reference

    def _unpack(self, path: Path, files: dict | None) -> tuple[DifficultyScorer, list[float]]:
        """Write `files` (None: cached already) to `path` and load the scorer (blocking)."""
        if files is not None:
            tmp = Path(tempfile.mkdtemp(dir=self.cache_dir.parent, prefix=".clf-"))
            for name, data in files.items():
                name = name.decode() if isinstance(name, bytes) else name
                if name in ARTIFACT_FILES:
                    (tmp / name).write_bytes(data)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        scorer = check_artifact(path)
        try:
            reference = load_reference_scores(path)
        except ArtifactError:
            reference = []
        return scorer, reference

    async def state(self, tenant: str, audit_limit: int = 20) -> dict[str, Any]:
        raw = await self.redis.hget(INDEX_KEY, tenant)
        doc = json.loads(raw) if raw else {"current": None, "previous": [], "versions": {}}
        entries = [json.loads(x) for x in await self.redis.lrange(AUDIT_KEY, 0, 999)]
        doc["audit"] = [e for e in entries if e.get("tenant") == tenant][:audit_limit]
        return doc

    async def store(self, tenant: str, files: dict[str, bytes], who: str) -> int:
        """Keep a new version's files (not promoted yet); returns its number."""
        version = int(await self.redis.incr(f"sy:clf:next:{tenant}"))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(_files_key(tenant, version), mapping=files)
            await pipe.execute()
        manifest = json.loads(files[MANIFEST])
        meta = {
            "name": manifest.get("name"),
            "manifest_sha256": hashlib.sha256(files[MANIFEST]).hexdigest(),
            "created": time.time(),
            "who": who,
            "adaptation": manifest.get("adaptation"),
        }
        await self._update(tenant, lambda doc: doc["versions"].__setitem__(str(version), meta))
        return version

    async def point(
        self, tenant: str, version: int | None, who: str, action: str, figures: dict | None = None
    ) -> dict[str, Any]:
        """Make `version` (None: the shipped default) the tenant's classifier; audited."""
        old: dict[str, Any] = {}

        def change(doc: dict[str, Any]) -> None:
            if version is not None and str(version) not in doc["versions"]:
                raise KeyError(version)
            old["current"] = doc["current"]
            if action == "rollback":
                doc["previous"] = doc["previous"][:-1]
            elif doc["current"] != version and doc["current"] is not None:
                doc["previous"] = (doc["previous"] + [doc["current"]])[-50:]
            doc["current"] = version

        doc = await self._update(tenant, change)
        entry = {
            "who": who,
            "when": time.time(),
            "tenant": tenant,
            "action": action,
            "old": old["current"],
            "new": version,
            "figures": figures,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(AUDIT_KEY, json.dumps(entry))
            pipe.ltrim(AUDIT_KEY, 0, AUDIT_LEN - 1)
            pipe.incr(EPOCH_KEY)
            await pipe.execute()
        await self.refresh()
        return doc

    async def point_refused(self, tenant: str, version: int, who: str, figures: dict) -> None:
        """Audit a promotion the held-out check refused (nothing changes)."""
        entry = {
            "who": who,
            "when": time.time(),
            "tenant": tenant,
            "action": "refused",
            "old": (await self.state(tenant, 0))["current"],
            "new": version,
            "figures": figures,
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(AUDIT_KEY, json.dumps(entry))
            pipe.ltrim(AUDIT_KEY, 0, AUDIT_LEN - 1)
            await pipe.execute()

    async def _update(self, tenant: str, change) -> dict[str, Any]:  # noqa: ANN001
        """Read-modify-write of the tenant's index entry under WATCH (retried)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(INDEX_KEY)
                    raw = await pipe.hget(INDEX_KEY, tenant)
                    doc = (
                        json.loads(raw)
                        if raw
                        else {"current": None, "previous": [], "versions": {}}
                    )
                    change(doc)
                    pipe.multi()
                    pipe.hset(INDEX_KEY, tenant, json.dumps(doc))
                    await pipe.execute()
                    return doc
                except Exception as exc:  # WatchError: someone else changed it, retry
                    if type(exc).__name__ != "WatchError":
                        raise
                finally:
                    await pipe.reset()


def holdout_figures(
    scorers: dict[str, Any], rows: Sequence[tuple[dict, bool, bool]]
) -> dict[str, Any]:
    """APGR of each scorer (and of prompt length) on held-out rows `(prompt doc, weak_ok,
    strong_ok)`; None where the labels cannot tell (all the same outcome)."""
    views = [
        request_view(r[0].get("prompt") or "", r[0].get("messages"), r[0].get("max_tokens"))
        for r in rows
    ]
    small = [r[1] for r in rows]
    large = [r[2] for r in rows]
    out: dict[str, Any] = {
        "num_holdout_labels": len(rows),
        "needs_large_rate": (
            sum((not s) and lg for s, lg in zip(small, large, strict=True)) / len(rows)
            if rows
            else None
        ),
    }
    table = {name: [s.score_view(v) for v in views] for name, s in scorers.items()}
    table["prompt_length"] = [float(len(v.text)) for v in views]
    for name, scores in table.items():
        apgr = routing_curve(scores, small, large).apgr() if rows else float("nan")
        out[name] = {"apgr": None if apgr != apgr else round(apgr, 4)}
    return out


async def holdout_rows(store, tenant: str) -> list[tuple[dict, bool, bool]]:  # noqa: ANN001
    """The tenant's held-out labels whose text is still kept."""
    labels = [
        lab
        for lab in merge_labels(await store.labels(tenant))
        if is_holdout(lab.request_id) and lab.weak_ok is not None
    ]
    prompts = await store.prompts(tenant, [lab.request_id for lab in labels])
    return [
        (prompts[lab.request_id], lab.weak_ok, lab.strong_ok is not False)
        for lab in labels
        if lab.request_id in prompts
    ]


def check_promotion(figures: dict[str, Any]) -> None:
    """Raise PromotionRefused unless the candidate beats the current classifier."""
    n = figures["num_holdout_labels"]
    cand, cur = figures["candidate"]["apgr"], figures["current"]["apgr"]
    if n < MIN_HOLDOUT_LABELS:
        raise PromotionRefused(
            f"only {n} held-out labels with text (need {MIN_HOLDOUT_LABELS})", figures
        )
    if cand is None or cur is None:
        raise PromotionRefused("the held-out labels are all the same outcome", figures)
    if cand <= cur:
        raise PromotionRefused(
            f"the candidate's held-out APGR {cand:.4f} does not beat the current {cur:.4f}",
            figures,
        )
