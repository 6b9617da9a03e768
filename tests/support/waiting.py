"""Waiting on a condition, never on the clock: tests poll what they need to be true."""

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
