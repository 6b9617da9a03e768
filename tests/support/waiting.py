"""Waiting on a condition, never on the clock: tests poll what they need to be true."""

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
