"""`PUT /admin/routing/classifiers/{tenant}` over real HTTP and Redis: a `path` names an
artifact in the gateway's artifact store and nothing else (outside it, existing or not, the
same 400), a manifest names only the artifact's own files (no host file is hashed), an
artifact's files are bounded in size before any is read, the body cap is the documented
64 MiB, and the work is done off the event loop (another request is answered meanwhile)."""

import base64
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest

import gateway.api.learning as learning_api
from cascade.classifier import DEFAULT_ARTIFACT
from gateway.learning.classifiers import MAX_ARTIFACT_BYTES, artifact_store
from tests.integration.gateway.conftest import gateway_stack

URL = "/admin/routing/classifiers/acme"
OUTSIDE = "path must name an artifact directory in the artifact store"


@pytest.fixture
def cascade(redis_url):
    with gateway_stack(redis_url, cascade_small_pool="small", cascade_large_pool="large") as s:
        s.tenant("acme")
        yield s


def _store(stack) -> Path:
    store = artifact_store(stack.gateway.config.data_dir)
    store.mkdir(parents=True, exist_ok=True)
    return store


def _copy(dest: Path) -> Path:
    shutil.copytree(DEFAULT_ARTIFACT, dest, ignore=shutil.ignore_patterns("eval"))
    return dest


def _rehash(artifact: Path, extra: dict[str, str] | None = None) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = hashlib.sha256((artifact / name).read_bytes()).hexdigest()
    manifest["files"].update(extra or {})
    (artifact / "manifest.json").write_text(json.dumps(manifest))


def _files(artifact: Path) -> dict[str, str]:
    return {
        p.name: base64.b64encode(p.read_bytes()).decode() for p in artifact.iterdir() if p.is_file()
    }


def _put(stack, body: dict, timeout: float = 60) -> httpx.Response:
    with stack.admin() as a:
        return a.put(URL, json={**body, "force": True}, timeout=timeout)


def _bad(r: httpx.Response, status: int, text: str, param: str | None = "path") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert text in error["message"] and error.get("param") == param, error


def test_a_path_outside_the_artifact_store_is_refused_the_same_whether_it_exists(cascade, tmp_path):
    store = _store(cascade)
    elsewhere = _copy(tmp_path / "loadable")  # a real artifact, but not in the store
    (store / "link").symlink_to(elsewhere, target_is_directory=True)
    for path in (str(elsewhere), str(tmp_path / "missing"), "../../..", "link", "/etc", ""):
        _bad(_put(cascade, {"path": path}), 400, OUTSIDE)
    _copy(store / "mine")
    for path in ("mine", str(store / "mine")):
        r = _put(cascade, {"path": path})
        assert r.status_code == 200, r.text
    assert r.json()["current"] == 2


def test_a_manifest_cannot_make_the_gateway_hash_a_host_file(cascade, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's own file")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    artifact = _copy(tmp_path / "upload")
    _rehash(artifact, {str(secret): digest})  # the right hash: it would load
    r = _put(cascade, {"files": _files(artifact)})
    _bad(r, 400, "the manifest may name only", "files")
    inside = _copy(_store(cascade) / "named")
    _rehash(inside, {os.path.relpath(secret, inside): digest})  # ../../..: the same file
    _bad(_put(cascade, {"path": str(inside)}), 400, "the manifest may name only")
    linked = _copy(_store(cascade) / "linked")
    (linked / "reference_scores.json").unlink()
    (linked / "reference_scores.json").symlink_to(secret)
    _bad(_put(cascade, {"path": str(linked)}), 400, "is not a regular file")


def test_an_artifact_over_the_cap_is_refused_before_it_is_read(cascade):
    artifact = _copy(_store(cascade) / "huge")
    with (artifact / "reference_scores.json").open("r+b") as f:
        f.truncate(1536 * 1024 * 1024)  # 1.5 GB, sparse: nothing to read if nobody reads it
    r = _put(cascade, {"path": str(artifact)}, timeout=5)
    _bad(r, 400, f"over the {MAX_ARTIFACT_BYTES} allowed")


def test_the_body_cap_is_the_documented_64_mib(cascade, tmp_path):
    artifact = _copy(tmp_path / "padded")
    model = artifact / "model.json"
    model.write_bytes(model.read_bytes() + b" " * (30 * 1024 * 1024))  # still valid JSON
    _rehash(artifact)
    files = _files(artifact)
    assert 40 * 1024 * 1024 < len(json.dumps(files)) < 64 * 1024 * 1024
    r = _put(cascade, {"files": files})
    assert r.status_code == 200, r.text[:300]
    with cascade.admin() as a:
        state = a.get(URL).json()
    assert state["current"] == r.json()["current"]
    with cascade.admin() as a:
        over = a.put(URL, content=b"{" + b" " * (64 * 1024 * 1024) + b"}", timeout=60)
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"


def test_reading_an_artifact_by_path_leaves_the_event_loop_free(cascade, monkeypatch):
    """The read waits until another request has been answered: if it ran on the event
    loop, nothing else could be answered and the wait would run out."""
    _copy(_store(cascade) / "slow")
    started, answered = threading.Event(), threading.Event()
    real = learning_api.read_artifact_files

    def read_when_answered(path):  # noqa: ANN001, ANN202
        started.set()
        answered.wait(10)
        return real(path)

    monkeypatch.setattr(learning_api, "read_artifact_files", read_when_answered)
    result: list[httpx.Response] = []
    upload = threading.Thread(target=lambda: result.append(_put(cascade, {"path": "slow"})))
    upload.start()
    try:
        assert started.wait(10)
        r = httpx.get(f"{cascade.url}/health", timeout=5)
        assert r.status_code == 200
        answered.set()
    finally:
        answered.set()
        upload.join(30)
    assert result and result[0].status_code == 200, result
