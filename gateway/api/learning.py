"""HTTP of the learning router: `POST /v1/feedback` (tenants) and, behind the admin key,
per-tenant classifiers (`/admin/routing/classifiers/{tenant}`) and label export
(`/admin/routing/labels/{tenant}`)."""

import asyncio
import base64
import binascii
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post, put
from litestar.params import FromPath, FromQuery

from cascade.artifact import ArtifactError
from cascade.labels import training_rows
from gateway.api.admin_base import AdminController, AdminUser, GatewayDep, cascade_of
from gateway.api.bodies import decode_struct
from gateway.gateway import Gateway
from gateway.learning.classifiers import (
    ARTIFACT_FILES,
    PromotionRefused,
    artifact_store,
    check_artifact,
    check_promotion,
    holdout_figures,
    holdout_rows,
    in_store,
    read_artifact_files,
)
from gateway.serving.handler import read_body
from gateway.serving.intake import authenticate
from workers.api.types import ApiError

MAX_UPLOAD_BYTES = 64 * 1024 * 1024  # the classifier body: an artifact's files, base64 encoded
_MAX_JSON_DEPTH = 8


class Feedback(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    outcome: Literal["ok", "not_ok"]
    score: float | None = None


class ClassifierChange(msgspec.Struct, forbid_unknown_fields=True):
    """Exactly one of: `files` (name -> base64, an upload), `path` (an artifact directory
    in this gateway's artifact store, `<data_dir>/classifiers/artifacts`, relative to it;
    its files are stored for every replica), `version` (one stored before). `force` skips
    the held-out check (audited as such)."""

    files: dict[str, str] | None = None
    path: str | None = None
    version: int | None = None
    force: bool = False


def _learner(gw: Gateway):
    router = cascade_of(gw)
    if gw.learner is None:
        raise ApiError(404, "labels are not collected on this gateway", code="not_configured")
    return router, gw.learner


def _upload(change: ClassifierChange, store: Path, scratch: Path) -> dict[str, bytes]:
    """The artifact's files, checked (`check_artifact`). Blocking: run in a thread."""
    if change.path is not None:
        path = in_store(store, change.path)
        if path is None:  # the same answer whether or not it exists
            raise ApiError(
                400, "path must name an artifact directory in the artifact store", param="path"
            )
        try:
            return read_artifact_files(path)
        except ArtifactError as exc:
            raise ApiError(400, f"not a loadable artifact: {exc}", param="path") from None
    files: dict[str, bytes] = {}
    for name, data in (change.files or {}).items():
        if name not in ARTIFACT_FILES:
            raise ApiError(400, f"unexpected artifact file {name!r}", param=f"files.{name}")
        try:
            files[name] = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"files.{name} is not base64", param=f"files.{name}") from None
    for name, data in files.items():
        (scratch / name).write_bytes(data)
    try:
        check_artifact(scratch)
    except ArtifactError as exc:
        raise ApiError(400, f"not a loadable artifact: {exc}", param="files") from None
    return files


def _stage(change: ClassifierChange, data_dir: Path) -> dict[str, bytes]:
    """`_upload` with a scratch directory beside the registry's cache (blocking)."""
    scratch_root = data_dir / "classifiers"
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_root, prefix=".upload-") as scratch:
        return _upload(change, artifact_store(data_dir), Path(scratch))


def learning_routes(gw: Gateway) -> list:
    @post("/v1/feedback", status_code=200)
    async def feedback(request: Request) -> Response:
        """A request takes one feedback: the first is recorded; a repeat of it (the same
        outcome and score: a retry) gets the same 200 and records nothing; a different one
        is a 409 `feedback_exists` that says what was recorded."""
        tenant = await authenticate(gw, request)
        raw = await read_body(request, gw.config.body_timeout_s)
        body = decode_struct(raw, Feedback, max_depth=_MAX_JSON_DEPTH)
        _, learner = _learner(gw)
        ok = body.outcome == "ok"
        recorded = await learner.feedback(gw, tenant.tenant_id, body.request_id, ok, body.score)
        if recorded is None:
            raise ApiError(
                404,
                f"no request {body.request_id!r} of this tenant to label (unknown or expired)",
                param="request_id",
                code="request_not_found",
            )
        if not recorded.first and (recorded.ok, recorded.score) != (ok, body.score):
            first = {"outcome": "ok" if recorded.ok else "not_ok", "score": recorded.score}
            err = ApiError(
                409,
                f"request {body.request_id!r} already has feedback ({first['outcome']}, score "
                f"{first['score']}); a request takes one feedback, and the first stands",
                param="request_id",
                code="feedback_exists",
            )
            return Response({**err.body(), "recorded": first}, status_code=409)
        return Response({"recorded": True, "request_id": body.request_id}, status_code=200)

    return [feedback]


def _registry(gw: Gateway):
    router = cascade_of(gw)
    if router.classifiers is None:
        raise ApiError(404, "per-tenant classifiers are not configured", code="not_configured")
    return router.classifiers


class ClassifierController(AdminController):
    """Per-tenant classifiers (upload, promote past the held-out check, roll back) and the
    labels to train them on."""

    path = "/admin/routing"

    @get("/classifiers/{tenant:str}")
    async def classifier_state(self, gw: GatewayDep, tenant: FromPath[str]) -> dict[str, Any]:
        return await _registry(gw).state(tenant)

    @put("/classifiers/{tenant:str}", status_code=200, request_max_body_size=MAX_UPLOAD_BYTES)
    async def put_classifier(
        self, gw: GatewayDep, request: Request, tenant: FromPath[str], who: AdminUser = "admin"
    ) -> Response:
        raw = await read_body(request, gw.config.body_timeout_s)
        if len(raw) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"request body over {MAX_UPLOAD_BYTES} bytes")
        # Up to 64 MiB of JSON and base64: decoded, written and checked off the event loop.
        change = await asyncio.to_thread(
            decode_struct, raw or b"{}", ClassifierChange, _MAX_JSON_DEPTH
        )
        if sum(x is not None for x in (change.files, change.path, change.version)) != 1:
            raise ApiError(400, "give exactly one of files, path, version")
        if await gw.store.get_tenant(tenant) is None:
            raise ApiError(404, f"unknown tenant {tenant!r}", code="tenant_not_found")
        registry = _registry(gw)
        router, learner = _learner(gw)
        version = change.version
        if version is None:
            files = await asyncio.to_thread(_stage, change, Path(gw.config.data_dir))
            version = await registry.store(tenant, files, who)
        state = await registry.state(tenant)
        if str(version) not in state["versions"]:
            raise ApiError(404, f"no stored version {version} for {tenant!r}", param="version")
        try:
            candidate = await registry.load(tenant, version)
        except ArtifactError as exc:
            raise ApiError(400, f"version {version} does not load: {exc}") from None
        current = router.scorer_for(tenant)[0]
        rows = await holdout_rows(learner.store, tenant)
        figures = await asyncio.to_thread(
            holdout_figures, {"candidate": candidate[1], "current": current}, rows
        )
        figures["candidate"]["version"] = version
        figures["current"]["version"] = state["current"]
        if not change.force:
            try:
                check_promotion(figures)
            except PromotionRefused as exc:
                await registry.point_refused(tenant, version, who, figures)
                err = ApiError(409, str(exc), code="promotion_refused")
                return Response({**err.body(), "figures": figures}, status_code=409)
        action = "promote-forced" if change.force else "promote"
        doc = await registry.point(tenant, version, who, action, figures)
        return Response({"tenant": tenant, **doc, "figures": figures}, status_code=200)

    @post("/classifiers/{tenant:str}/rollback", status_code=200)
    async def rollback(
        self, gw: GatewayDep, tenant: FromPath[str], who: AdminUser = "admin"
    ) -> dict[str, Any]:
        registry = _registry(gw)
        state = await registry.state(tenant)
        previous = state["previous"][-1] if state["previous"] else None
        if state["current"] is None:
            raise ApiError(409, f"{tenant!r} already routes with the default classifier")
        return {"tenant": tenant, **await registry.point(tenant, previous, who, "rollback")}

    @delete("/classifiers/{tenant:str}", status_code=200)
    async def use_default(
        self, gw: GatewayDep, tenant: FromPath[str], who: AdminUser = "admin"
    ) -> dict[str, Any]:
        return {"tenant": tenant, **await _registry(gw).point(tenant, None, who, "default")}

    @get("/labels/{tenant:str}")
    async def export_labels(
        self, gw: GatewayDep, tenant: FromPath[str], split: FromQuery[str] = "train"
    ) -> dict[str, Any]:
        if split not in ("train", "holdout", "all"):
            raise ApiError(400, "split must be train, holdout or all", param="split")
        _, learner = _learner(gw)
        labels = await learner.store.labels(tenant)
        prompts = await learner.store.prompts(tenant, [lab.request_id for lab in labels])
        rows, skipped = training_rows(labels, prompts, split)
        return {"tenant": tenant, "num_labels": len(labels), "rows": rows, "skipped": skipped}
