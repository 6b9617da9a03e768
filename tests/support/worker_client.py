"""The tests read workers through the same client as the gateway and the supervisor
(`workers.api.client.WorkerClient`), so a change to the wire contract breaks them too."""

import asyncio
from typing import Any

import msgspec

from workers.api.client import WorkerClient
from workers.api.types import LoadReport


async def _load(url: str) -> LoadReport | None:
    async with WorkerClient() as client:
        return await client.load(url, timeout_s=5.0)


def load_report(url: str) -> LoadReport:
    """The worker's `/load` as the typed report; AssertionError when it has none."""
    report = asyncio.run(_load(url))
    assert report is not None, f"{url}/load did not answer with a LoadReport"
    return report


def load(url: str) -> dict[str, Any]:
    """`load_report` as a dict, for tests that index it."""
    return msgspec.structs.asdict(load_report(url))
