"""Finding the request that makes a batched step fail (workers.engine.isolation), with fakes."""

from workers.engine.isolation import execute_isolated
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams


def make_batch(n: int, seeded: bool = False) -> list[tuple[Request, int]]:
    params = SamplingParams(seed=7) if seeded else SamplingParams()
    return [(Request(f"r{i}", [1, 2], params, arrival_time=0.0), 1) for i in range(n)]


class Recorder:
    """A fake `execute` that fails any batch holding a culprit, and counts its calls."""

    def __init__(self, culprits: set[str]) -> None:
        self.culprits = culprits
        self.calls: list[list[str]] = []

    def __call__(self, batch):
        ids = [r.request_id for r, _ in batch]
        self.calls.append(ids)
        if self.culprits & set(ids):
            raise ValueError("bad row")
        return {rid: f"token-of-{rid}" for rid in ids}


def test_a_batch_that_succeeds_runs_once():
    run = Recorder(set())
    produced, failed = execute_isolated(run, make_batch(8))
    assert failed == [] and len(produced) == 8 and len(run.calls) == 1


def test_one_culprit_is_found_and_everyone_else_gets_their_token():
    run = Recorder({"r5"})
    produced, failed = execute_isolated(run, make_batch(8))
    assert [r.request_id for r, _ in failed] == ["r5"]
    assert isinstance(failed[0][1], ValueError)
    assert produced == {f"r{i}": f"token-of-r{i}" for i in range(8) if i != 5}
    assert len(run.calls) <= 1 + 2 * 3  # bisection: about 2 log2(8) extra runs


def test_several_culprits_each_fail_alone():
    run = Recorder({"r0", "r6"})
    produced, failed = execute_isolated(run, make_batch(7))
    assert sorted(r.request_id for r, _ in failed) == ["r0", "r6"]
    assert set(produced) == {"r1", "r2", "r3", "r4", "r5"}


def test_a_single_request_that_fails_is_reported_not_raised():
    run = Recorder({"r0"})
    produced, failed = execute_isolated(run, make_batch(1))
    assert produced == {} and [r.request_id for r, _ in failed] == ["r0"]


class FakeGenerator:
    def __init__(self, state: int) -> None:
        self.state = state

    def get_state(self) -> int:
        return self.state

    def set_state(self, state: int) -> None:
        self.state = state


def test_seeded_rng_states_are_put_back_before_the_retry():
    batch = make_batch(4, seeded=True)
    for i, (req, _) in enumerate(batch[:3]):
        req.generator = FakeGenerator(100 + i)  # r3 has none yet: the step would create it
    seen: list[dict] = []

    def execute(part):
        seen.append({r.request_id: getattr(r.generator, "state", None) for r, _ in part})
        for req, _ in part:  # drawing noise advances each generator
            if req.generator is None:
                req.generator = FakeGenerator(0)
            req.generator.state += 1000
        if any(r.request_id == "r2" for r, _ in part):
            raise RuntimeError("fails after sampling")
        return {r.request_id: 1 for r, _ in part}

    produced, failed = execute_isolated(execute, batch)
    assert [r.request_id for r, _ in failed] == ["r2"]
    # Every retry saw the states from before the failed attempt (r3: not created yet).
    assert seen[1] == {"r0": 100, "r1": 101}
    assert seen[2] == {"r2": 102, "r3": None}
    assert batch[0][0].generator.state == 1100 and batch[3][0].generator.state == 1000
