"""One request's failure is that request's alone (DESIGN.md 4).

When a batched step raises, `execute_isolated` runs the two halves of the batch again,
recursively, so the request that makes it fail is found in about 2 log2(batch) extra
passes and failed alone while the others get their tokens. Re-running is safe because
a failed step changes nothing the scheduler relies on: KV slots are rewritten with the
same values, the scheduler only advances after a success, the decode workspace drops a
row whose length disagrees, and per-request RNG states are put back (below) so a seeded
request draws the same token it would have drawn in an unperturbed run.

No torch import: generators are handled through their own methods.
"""

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from workers.engine.request import Request

log = logging.getLogger(__name__)

T = TypeVar("T")
Scheduled = list[tuple[Request, int]]


def execute_isolated(
    execute: Callable[[Scheduled], dict[str, T]], scheduled: Scheduled
) -> tuple[dict[str, T], list[tuple[Request, Exception]]]:
    """Run `execute` on the batch; on failure, on its halves until culprits stand alone.

    Returns what the succeeding parts produced (by request id) and each request that
    failed on its own, with its exception. Only `Exception`s are isolated: a
    KeyboardInterrupt or SystemExit still stops the engine.
    """
    saved = _save_generators(scheduled) if len(scheduled) > 1 else None
    try:
        return execute(scheduled), []
    except Exception as exc:
        if saved is None:
            return {}, [(scheduled[0][0], exc)]
        log.warning("a step of %d requests failed (%r); retrying it in halves", len(scheduled), exc)
    _restore_generators(saved)
    mid = len(scheduled) // 2
    produced, failed = execute_isolated(execute, scheduled[:mid])
    more, more_failed = execute_isolated(execute, scheduled[mid:])
    produced.update(more)
    return produced, failed + more_failed


def _save_generators(scheduled: Scheduled) -> list[tuple[Request, Any]]:
    """Each seeded request's RNG state (None: not created yet, the step creates it)."""
    return [
        (req, None if req.generator is None else req.generator.get_state())
        for req, _ in scheduled
        if req.params.seed is not None
    ]


def _restore_generators(saved: list[tuple[Request, Any]]) -> None:
    for req, state in saved:
        if state is None:
            req.generator = None
        else:
            req.generator.set_state(state)
