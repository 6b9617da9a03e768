"""One `/metrics` for a gateway of several processes on one port.

A scrape lands on whichever process the kernel gave the connection (SO_REUSEPORT), so each
process also serves its own registry on a private loopback port, recorded in
`procs_dir/<pid>.json` while it runs. The process that takes the scrape fetches every
sibling's text exposition concurrently (a short timeout; a dead or slow sibling is left
out) and answers with all of them merged: one HELP and TYPE per family, every sample with
a `process="<index>"` label. A process that restarts keeps its index, so its counters
restart from zero under the same label, which Prometheus' `rate` reads as a reset.
"""

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PROCESS_LABEL = "process"
_HEAD_LIMIT = 8192  # bytes of request head the private endpoint reads


def merge_expositions(texts: Mapping[str, str]) -> list[Metric]:
    """The families of several text expositions (process label value -> text) as one:
    families in first-seen order, each sample labelled `process=<its key>`."""
    merged: dict[str, Metric] = {}
    for process, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = into
            for sample in family.samples:
                labels = {**sample.labels, PROCESS_LABEL: process}
                into.samples.append(sample._replace(labels=labels))
    return list(merged.values())


class _Families:
    """What `generate_latest` renders: fixed families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> bytes:
    """Families in the Prometheus text format."""
    return generate_latest(_Families(families))  # type: ignore[arg-type]


class ProcessMetrics:
    """This process's part in a multi-process gateway's `/metrics`."""

    def __init__(
        self, registry: CollectorRegistry, index: int, procs_dir: Path, timeout_s: float = 1.0
    ) -> None:
        self.registry = registry
        self.index = index
        self.procs_dir = Path(procs_dir)
        self.timeout_s = timeout_s  # per sibling fetch
        self.record = self.procs_dir / f"{os.getpid()}.json"
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Serve this registry on a loopback port and record it for the siblings."""
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0, limit=_HEAD_LIMIT)
        port = self._server.sockets[0].getsockname()[1]
        self.procs_dir.mkdir(parents=True, exist_ok=True)
        doc = {"index": self.index, "pid": os.getpid(), "port": port}
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.record)  # siblings never read half a record

    async def close(self) -> None:
        self.record.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def exposition(self) -> bytes:
        """Every live process's metrics, merged, each sample labelled with its process."""
        siblings = [r for r in self._records() if r["pid"] != os.getpid()]
        fetched = await asyncio.gather(*(self._fetch(r["port"]) for r in siblings))
        texts = {str(self.index): generate_latest(self.registry).decode()}
        for record, text in zip(siblings, fetched, strict=True):
            if text is not None:
                texts[str(record["index"])] = text
        order = sorted(texts, key=int)
        return render(merge_expositions({k: texts[k] for k in order}))

    def _records(self) -> list[dict]:
        records = []
        for path in self.procs_dir.glob("*.json"):
            try:
                doc = json.loads(path.read_text())
                records.append({k: int(doc[k]) for k in ("index", "pid", "port")})
            except (OSError, ValueError, KeyError, TypeError):
                continue  # removed meanwhile, or not ours
        return records

    async def _fetch(self, port: int) -> str | None:
        """A sibling's exposition; None if it does not answer within the timeout."""
        try:
            return await asyncio.wait_for(self._get(port), self.timeout_s)
        except (OSError, TimeoutError, ValueError) as exc:
            log.debug("metrics of the process on port %d left out: %r", port, exc)
            return None

    @staticmethod
    async def _get(port: int) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            raw = await reader.read()
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.0 200"):
            raise ValueError(f"answered {head[:40]!r}")
        return body.decode()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Any request on the private port: this process's registry, then close."""
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s * 5)
            body = generate_latest(self.registry)
            head = (
                "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
