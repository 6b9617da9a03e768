"""Waiting on a condition, never on the clock: tests poll what they need to be true."""

import asyncio
import socket
import time
from collections.abc import Callable


def eventually(predicate: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """True as soon as `predicate()` is truthy; False if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


async def settles(predicate: Callable[[], object], max_passes: int = 1000) -> None:
    """Let the running event loop's other tasks run until `predicate()` is truthy (no clock:
    one loop pass at a time); AssertionError if it is not within `max_passes`."""
    for _ in range(max_passes):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not true after {max_passes} event-loop passes: {predicate}")


def closed_after(sock: socket.socket, t0: float, limit_s: float) -> float:
    """Seconds from `t0` until the peer closes `sock` (reading and discarding what it
    sends), waiting at most `limit_s`."""
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0
