"""What a pool tells the autoscaler: TTFT p90 over a window, None when nothing was seen."""

from gateway.capacity.fair_queue import QueueConfig
from gateway.capacity.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ttft_p90_over_the_window_and_none_without_streams() -> None:
    clock = Clock()
    pool = Pool(
        "small", [], client=None, queue_config=QueueConfig(), max_inflight_per_worker=1, clock=clock
    )  # type: ignore[arg-type]
    assert pool.ttft_p90_s() is None
    for i in range(10):
        pool.record_ttft(0.1 * (i + 1))  # 0.1 .. 1.0 s
    assert pool.ttft_p90_s() == 1.0
    clock.now += 11  # all of them left the 10 s window
    assert pool.ttft_p90_s() is None
    pool.record_ttft(0.25)
    assert pool.ttft_p90_s() == 0.25
