"""HTTP of the learning router: `POST /v1/feedback` (tenants) and, behind the admin key,
per-tenant classifiers (`/admin/routing/classifiers/{tenant}`) and label export
(`/admin/routing/labels/{tenant}`)."""

import base64
import binascii
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec
from litestar import Request, Response, Router, delete, get, post, put
from litestar.params import FromPath, FromQuery

from cascade.artifact import ArtifactError, load_artifact
from cascade.labels import training_rows
from gateway.api.admin import _require_admin, _router
from gateway.gateway import Gateway
from gateway.learning.classifiers import (
    ARTIFACT_FILES,
    PromotionRefused,
    check_promotion,
    holdout_figures,
    holdout_rows,
    read_artifact_files,
)
from gateway.serving.handler import read_body
from gateway.serving.intake import authenticate
from workers.api.types import ApiError
from workers.api.validation import check_json_depth

MAX_UPLOAD_BYTES = 64 * 1024 * 1024  # an artifact's files, base64 encoded


class Feedback(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    outcome: Literal["ok", "not_ok"]
    score: float | None = None


class ClassifierChange(msgspec.Struct, forbid_unknown_fields=True):
    """Exactly one of: `files` (name -> base64, an upload), `path` (an artifact directory
    this gateway can read; its files are stored for every replica), `version` (one
    stored before). `force` skips the held-out check (audited as such)."""

    files: dict[str, str] | None = None
    path: str | None = None
    version: int | None = None
    force: bool = False


def _decode(raw: bytes, kind: type) -> Any:
    check_json_depth(raw, 8)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _learner(gw: Gateway):
    router = _router(gw)
    if gw.learner is None:
        raise ApiError(404, "labels are not collected on this gateway", code="not_configured")
    return router, gw.learner


def _upload(change: ClassifierChange, scratch: Path) -> dict[str, bytes]:
    if change.path is not None:
        try:
            return read_artifact_files(Path(change.path))
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
        load_artifact(scratch)
    except ArtifactError as exc:
        raise ApiError(400, f"not a loadable artifact: {exc}", param="files") from None
    return files


def learning_routes(gw: Gateway) -> list:
    @post("/v1/feedback", status_code=200)
    async def feedback(request: Request) -> dict[str, Any]:
        tenant = await authenticate(gw, request)
        body = _decode(await read_body(request, gw.config.body_timeout_s), Feedback)
        _, learner = _learner(gw)
        found = await learner.feedback(
            gw, tenant.tenant_id, body.request_id, body.outcome == "ok", body.score
        )
        if not found:
            raise ApiError(
                404,
                f"no request {body.request_id!r} of this tenant to label (unknown or expired)",
                param="request_id",
                code="request_not_found",
            )
        return {"recorded": True, "request_id": body.request_id}

    @get("/admin/routing/classifiers/{tenant:str}")
    async def classifier_state(request: Request, tenant: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        return await _registry(gw).state(tenant)

    @put("/admin/routing/classifiers/{tenant:str}", status_code=200)
    async def put_classifier(request: Request, tenant: FromPath[str]) -> Response:
        _require_admin(gw, request)
        raw = await request.body()
        if len(raw) > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"request body over {MAX_UPLOAD_BYTES} bytes")
        change = _decode(raw, ClassifierChange)
        if sum(x is not None for x in (change.files, change.path, change.version)) != 1:
            raise ApiError(400, "give exactly one of files, path, version")
        if await gw.store.get_tenant(tenant) is None:
            raise ApiError(404, f"unknown tenant {tenant!r}", code="tenant_not_found")
        registry = _registry(gw)
        who = request.headers.get("x-admin-user", "admin")
        router, learner = _learner(gw)
        version = change.version
        if version is None:
            scratch_root = Path(gw.config.data_dir) / "classifiers"
            scratch_root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=scratch_root, prefix=".upload-") as scratch:
                files = _upload(change, Path(scratch))
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
        figures = holdout_figures({"candidate": candidate[1], "current": current}, rows)
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

    @post("/admin/routing/classifiers/{tenant:str}/rollback", status_code=200)
    async def rollback(request: Request, tenant: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        registry = _registry(gw)
        state = await registry.state(tenant)
        previous = state["previous"][-1] if state["previous"] else None
        if state["current"] is None:
            raise ApiError(409, f"{tenant!r} already routes with the default classifier")
        who = request.headers.get("x-admin-user", "admin")
        return {"tenant": tenant, **await registry.point(tenant, previous, who, "rollback")}

    @delete("/admin/routing/classifiers/{tenant:str}", status_code=200)
    async def use_default(request: Request, tenant: FromPath[str]) -> dict[str, Any]:
        _require_admin(gw, request)
        who = request.headers.get("x-admin-user", "admin")
        return {"tenant": tenant, **await _registry(gw).point(tenant, None, who, "default")}

    @get("/admin/routing/labels/{tenant:str}")
    async def export_labels(
        request: Request, tenant: FromPath[str], split: FromQuery[str] = "train"
    ) -> dict[str, Any]:
        _require_admin(gw, request)
        if split not in ("train", "holdout", "all"):
            raise ApiError(400, "split must be train, holdout or all", param="split")
        _, learner = _learner(gw)
        labels = await learner.store.labels(tenant)
        prompts = await learner.store.prompts(tenant, [lab.request_id for lab in labels])
        rows, skipped = training_rows(labels, prompts, split)
        return {"tenant": tenant, "num_labels": len(labels), "rows": rows, "skipped": skipped}

    return [feedback, classifier_state, put_classifier, rollback, use_default, export_labels]


def _registry(gw: Gateway):
    router = _router(gw)
    if router.classifiers is None:
        raise ApiError(404, "per-tenant classifiers are not configured", code="not_configured")
    return router.classifiers


def learning_router(gw: Gateway) -> Router:
    return Router(path="/", route_handlers=learning_routes(gw))
