"""Which waiting requests count against a worker's short line (pure, no torch)."""

from workers.engine.stats import QueueSnapshot
from workers.server.admission import backlog


def snap(waiting: list[int], running: int = 0, seats: int = 64, free_kv: int = 8192):
    return QueueSnapshot(waiting, running, seats, free_kv, block_size=16)


def test_a_burst_that_fits_seats_and_kv_has_no_backlog_and_the_next_fits():
    line = backlog(snap([100] * 63), 100)
    assert line.num_requests == 0 and line.num_tokens == 0 and line.fits


def test_requests_beyond_the_free_seats_count_against_the_line():
    line = backlog(snap([10] * 10, running=60), 10)
    assert line.num_requests == 6 and line.num_tokens == 60 and not line.fits


def test_requests_whose_prompt_does_not_fit_the_free_kv_count():
    # 4 blocks of 16 free: the first (2 blocks) and the second (2 blocks) fit, not the third.
    line = backlog(snap([20, 30, 5], free_kv=64), 5)
    assert line.num_requests == 1 and line.num_tokens == 5 and not line.fits


def test_once_the_head_is_blocked_everything_behind_it_waits_too():
    # Strict order: a small request behind a big one is not seated ahead of it.
    line = backlog(snap([1000, 1, 1], free_kv=256), 1)
    assert line.num_requests == 3 and not line.fits


def test_a_full_batch_counts_the_whole_line():
    line = backlog(snap([5, 5], running=64), 5)
    assert line.num_requests == 2 and line.num_tokens == 10 and not line.fits
