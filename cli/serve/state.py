"""What `switchyard serve` keeps on disk: the admin key, where the local stack listens, and
whether the demo key was shown already.

    <data_dir>/admin-key          the generated admin key, mode 0600
    <data_dir>/serve-state.json   first start: demo tenant and key id, when shown
    <cache>/local-stack.json      the last local stack: URL and data_dir, for `switchyard admin`
"""

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

ADMIN_KEY_FILE = "admin-key"
STATE_FILE = "serve-state.json"
POINTER_FILE = "local-stack.json"


def write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read (created 0600, never wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def admin_key(data_dir: Path) -> tuple[str, Path, bool]:
    """(key, its file, created now): the stored key, or a new one stored 0600."""
    path = data_dir / ADMIN_KEY_FILE
    if path.is_file():
        key = path.read_text().strip()
        if key:
            return key, path, False
    key = "sy-admin-" + secrets.token_urlsafe(24)
    write_private(path, key + "\n")
    return key, path, True


def read_state(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(data_dir: Path, state: dict[str, Any]) -> None:
    write_private(data_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")


def pointer_path(cache_dir: Path) -> Path:
    return cache_dir / POINTER_FILE


def write_pointer(cache_dir: Path, url: str, data_dir: Path, key_file: Path | None) -> None:
    doc = {
        "url": url,
        "data_dir": str(data_dir),
        "admin_key_file": str(key_file) if key_file else None,
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    try:
        write_private(pointer_path(cache_dir), json.dumps(doc, indent=2) + "\n")
    except OSError:
        pass  # the admin CLI then needs --url and a key; serving is unaffected


def local_stack(cache_dir: Path) -> dict[str, Any] | None:
    """The last local stack's pointer, or None."""
    try:
        doc = json.loads(pointer_path(cache_dir).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("url"), str) else None


def local_admin_key(cache_dir: Path, url: str) -> str | None:
    """The admin key of the local stack at `url`, if that is the one `serve` started."""
    doc = local_stack(cache_dir)
    if doc is None or doc["url"].rstrip("/") != url.rstrip("/") or not doc.get("admin_key_file"):
        return None
    try:
        return Path(doc["admin_key_file"]).read_text().strip() or None
    except OSError:
        return None
