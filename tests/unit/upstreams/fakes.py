"""A fake HTTP source for the adapters: fixture files (or bytes) served by path."""

import asyncio
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "upstreams"
BASE = "http://upstream:8000"


def fixture(kind: str, name: str) -> bytes:
    return (FIXTURES / kind / name).read_bytes()


class FakeGetter:
    """GET by path: `routes` maps a path to (status, body); others are 404, None to refuse."""

    def __init__(self, routes: dict[str, tuple[int | None, bytes]], refuse: bool = False):
        self.routes = routes
        self.refuse = refuse
        self.asked: list[str] = []

    async def __call__(self, url: str, timeout_s: float) -> tuple[int | None, bytes]:
        assert url.startswith(BASE) and timeout_s > 0
        path = url[len(BASE) :]
        self.asked.append(path)
        if self.refuse:
            return None, b""
        return self.routes.get(path, (404, b'{"detail":"Not Found"}'))


class FakePoster:
    """POST by path: records (path, JSON body) and answers from `routes`."""

    def __init__(self, routes: dict[str, tuple[int, Any]], raises: Exception | None = None):
        self.routes = routes
        self.raises = raises
        self.sent: list[tuple[str, Any]] = []

    async def __call__(self, url: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        assert url.startswith(BASE) and timeout_s > 0
        self.sent.append((url[len(BASE) :], body))
        if self.raises is not None:
            raise self.raises
        return self.routes.get(url[len(BASE) :], (404, None))


def run(coro: Any) -> Any:
    """asyncio.run with a guard, so a hang fails fast."""
    return asyncio.run(asyncio.wait_for(coro, timeout=2.0))
