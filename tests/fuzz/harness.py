"""Send one generated request, judge the answer, keep the statistics and the reproducers.

What every answer must be, worker or gateway:
- a status below 500 (a refusal of bad input is 4xx; the load here is one request at a
  time against generous limits, so no 503 is acceptable either);
- a 4xx body in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, and
  `Retry-After` on a 429;
- a 200 JSON body with `usage` whose total is prompt plus completion; a 200 stream that
  ends with `data: [DONE]`, carries no error event, and has the usage chunk when asked;
- all of it within `HANG_S` (no byte for that long, or longer in all, is a hang).
"""

import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, seed, settings

from tests.fuzz.strategies import KEY, Case, plan

HANG_S = 20.0
STRICT = os.environ.get("SWITCHYARD_FUZZ_STRICT") == "1"
DEFAULT_EXAMPLES = 300
MAX_REPRODUCERS = 20


def long_run_examples() -> int | None:
    value = os.environ.get("SWITCHYARD_FUZZ_EXAMPLES")
    return int(value) if value else None


def fuzz_timeout_s() -> float:
    """pytest-timeout for one fuzz test: the default slice, or a second per example."""
    return 300 + (long_run_examples() or 0) * 1.0


def fuzz_groups(default_total: int = DEFAULT_EXAMPLES) -> tuple[list, int | None]:
    """The groups of a run (see `strategies.plan`), each with the decorator for its inner
    `@given`, and the seed. By default a deterministic slice (`derandomize`) of
    `default_total` examples; with SWITCHYARD_FUZZ_EXAMPLES, that many from a random seed
    (printed), or from SWITCHYARD_FUZZ_SEED to replay a run."""
    examples = long_run_examples()
    common = dict(
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # failures are collected, not shrunk
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        derandomize=examples is None,
    )
    run_seed = None
    if examples is not None:
        given_seed = os.environ.get("SWITCHYARD_FUZZ_SEED")
        run_seed = int(given_seed) if given_seed else random.SystemRandom().getrandbits(32)
        print(f"\nfuzz: {examples} examples, seed {run_seed} (SWITCHYARD_FUZZ_SEED to replay)")

    def decorator(n: int):
        chosen = settings(max_examples=n, **common)
        return chosen if run_seed is None else (lambda fn: chosen(seed(run_seed)(fn)))

    groups = [(kind, first, decorator(n)) for kind, first, n in plan(examples or default_total)]
    return groups, run_seed


@dataclass
class Outcome:
    status: int | None  # None: no answer (hang or dropped connection)
    problems: list[str]
    told_tokens: int  # usage.total_tokens the client was told; 0 for errors
    streamed: bool
    elapsed_s: float


def _client_deadline(case: Case) -> bool:
    """The request carries a valid `x-request-timeout`: running out of it is the client's
    choice (408, or an in-band `request_timeout` on a committed stream), not a failure."""
    try:
        timeout_s = float(dict(case.headers).get("x-request-timeout", "nan"))
    except ValueError:
        return False
    return 0 < timeout_s <= 86_400


# Bugs the fuzz found, reported to the owners of gateway/ and workers/ and kept as strict
# xfails in test_regressions.py: counted under `known` (with reproducers), not as failures,
# until fixed. SWITCHYARD_FUZZ_STRICT=1 counts them as failures.
KNOWN_ISSUES: dict = {}  # none open: the client-deadline bugs are fixed (test_regressions.py)


@dataclass
class FuzzStats:
    name: str
    seed: int | None = None
    inputs: int = 0
    statuses: Counter = field(default_factory=Counter)
    streams: int = 0
    five_xx: int = 0
    hangs: int = 0
    dropped: int = 0
    bad_answers: int = 0  # < 500 but not the right shape
    stalls: int = 0  # the worker not idle and ready after a request
    mis_charges: int = 0
    slots_left: int = 0
    tokens_told: int = 0  # usage.total_tokens told to clients, all requests
    tokens_expected: int | None = None  # gateway: told to the counted tenant's clients
    tokens_counted: int | None = None  # gateway: that tenant's Redis tokens_today
    slowest_s: float = 0.0
    known: Counter = field(default_factory=Counter)  # KNOWN_ISSUES seen, by name
    failures: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def record(self, case: Case, out: Outcome) -> bool:
        """Count the outcome; True when it is one of KNOWN_ISSUES (not judged further)."""
        self.inputs += 1
        self.statuses[str(out.status)] += 1
        self.streams += out.streamed
        self.tokens_told += out.told_tokens
        self.slowest_s = max(self.slowest_s, out.elapsed_s)
        known = [name for name, seen in KNOWN_ISSUES.items() if seen(case, out)]
        if known and not STRICT:
            self.known[known[0]] += 1
            if self.known[known[0]] <= 2:
                problem = f"known issue {known[0]}: {out.problems}"
                self.failures.append({"problem": problem, "request": case.describe()})
            return True
        if out.status is not None and out.status >= 500:
            self.five_xx += 1
        for problem in out.problems:
            if problem.startswith("hang"):
                self.hangs += 1
            elif problem.startswith("dropped"):
                self.dropped += 1
            elif not problem.startswith("5xx"):
                self.bad_answers += 1
            self.fail(problem, case)
        return False

    def fail(self, problem: str, case: Case) -> None:
        if len(self.failures) < MAX_REPRODUCERS:
            self.failures.append({"problem": problem, "request": case.describe()})

    @property
    def ok(self) -> bool:
        return not (
            self.five_xx or self.hangs or self.dropped or self.bad_answers or self.stalls
            or self.mis_charges or self.slots_left or self.tokens_counted != self.tokens_expected
        )  # fmt: skip

    def summary(self) -> str:
        return (
            f"fuzz {self.name}: {self.inputs} inputs ({self.streams} streamed) in "
            f"{time.monotonic() - self.started:.1f} s, 5xx={self.five_xx} hangs={self.hangs} "
            f"dropped={self.dropped} bad_answers={self.bad_answers} stalls={self.stalls} "
            f"mis_charges={self.mis_charges} slots_left={self.slots_left} "
            f"tokens told={self.tokens_told} counter/expected={self.tokens_counted}/"
            f"{self.tokens_expected} slowest={self.slowest_s:.2f} s "
            f"known={dict(self.known)} "
            f"statuses={dict(sorted(self.statuses.items()))} seed={self.seed}"
        )

    def report(self) -> None:
        """Print the summary (and reproducers); merge the figures into $SWITCHYARD_FUZZ_REPORT."""
        print("\n" + self.summary())
        for f in self.failures:
            print(f"  {f['problem']}\n    {f['request']}")
        path = os.environ.get("SWITCHYARD_FUZZ_REPORT")
        if not path:
            return
        data = {}
        if os.path.exists(path):
            with open(path) as fh:
                data = json.load(fh)
        data[self.name] = {
            k: v for k, v in vars(self).items() if k not in ("started", "statuses", "known")
        } | {
            "statuses": dict(self.statuses),
            "known": dict(self.known),
            "elapsed_s": time.monotonic() - self.started,
        }
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2)


def send(client: httpx.Client, case: Case, key: str = "") -> Outcome:
    """POST the case, read the whole answer within HANG_S, and judge it."""
    headers = [(k, v.replace(KEY, key)) for k, v in case.headers]
    headers = [(k.encode(), v.encode("latin-1", "replace")) for k, v in headers]
    t0 = time.monotonic()
    try:
        with client.stream("POST", case.path, content=case.content, headers=headers) as r:
            streamed = r.headers.get("content-type", "").startswith("text/event-stream")
            if streamed:
                events = []
                for line in r.iter_lines():
                    if time.monotonic() - t0 > HANG_S:
                        return Outcome(r.status_code, ["hang: stream still open"], 0, True, HANG_S)
                    if line.startswith("data: "):
                        events.append(line[6:])
                problems, told = judge_stream(r.status_code, events, case)
            else:
                problems, told = judge_json(r.status_code, r.read(), r.headers)
            return Outcome(r.status_code, problems, told, streamed, time.monotonic() - t0)
    except httpx.TimeoutException as exc:
        return Outcome(None, [f"hang: {exc!r}"], 0, False, time.monotonic() - t0)
    except httpx.TransportError as exc:
        return Outcome(None, [f"dropped: {exc!r}"], 0, False, time.monotonic() - t0)


def judge_json(status: int, content: bytes, headers: httpx.Headers) -> tuple[list[str], int]:
    try:
        body = json.loads(content)
    except ValueError:
        return [f"{_cls(status)}: {status} with a body that is not JSON: {content[:200]!r}"], 0
    if status == 200:
        return _usage_problems(body.get("usage") if isinstance(body, dict) else None)
    problems = []
    if status >= 500:
        problems.append(f"5xx: {status} {content[:300]!r}")
    elif not 400 <= status < 500:
        problems.append(f"unexpected status {status}: {content[:200]!r}")
    problems += _error_shape(body, status)
    if status == 429 and "retry-after" not in headers:
        problems.append("429 without Retry-After")
    return problems, 0


def judge_stream(status: int, events: list[str], case: Case) -> tuple[list[str], int]:
    if status != 200:
        return [f"{_cls(status)}: a stream with status {status}"], 0
    if not events or events[-1] != "[DONE]":
        return [f"stream did not end with [DONE] (last: {events[-1:]!r})"], 0
    problems, told = [], 0
    for data in events[:-1]:
        try:
            chunk = json.loads(data)
        except ValueError:
            problems.append(f"event that is not JSON: {data[:200]!r}")
            continue
        if "error" in chunk:
            err = chunk["error"]
            if _client_deadline(case) and isinstance(err, dict):
                if err.get("code") == "request_timeout":  # the client's own budget ran out
                    problems += _error_shape(chunk, 408)
                    continue
            kind = "5xx" if isinstance(err, dict) and err.get("type") == "server_error" else "bad"
            problems.append(f"{kind}: error event in a 200 stream: {data[:300]}")
            problems += _error_shape(chunk, 400)
        elif chunk.get("usage"):
            usage_problems, told = _usage_problems(chunk["usage"])
            problems += usage_problems
    if case.wants_usage and not told:
        problems.append("stream asked for usage and got no usage chunk")
    return problems, told


def _cls(status: int) -> str:
    return "5xx" if status >= 500 else "bad"


def _usage_problems(usage: object) -> tuple[list[str], int]:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if not isinstance(usage, dict) or not all(isinstance(usage.get(k), int) for k in keys):
        return [f"200 without usage: {usage!r}"], 0
    total = usage["total_tokens"]
    if total != usage["prompt_tokens"] + usage["completion_tokens"]:
        return [f"usage total is not prompt + completion: {usage}"], total
    return [], total


def _error_shape(body: object, status: int) -> list[str]:
    err = body.get("error") if isinstance(body, dict) else None
    ok = (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(err, dict)
        and {"message", "type", "param", "code"} <= set(err)
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )
    return [] if ok else [f"error body not OpenAI-shaped ({status}): {str(body)[:300]}"]


def busy_load(http: httpx.Client, worker_url: str, timeout_s: float = 5.0) -> dict | None:
    """Poll the worker's /load until it is ready with nothing resident (None), for at most
    `timeout_s`; past that, the last /load (a stalled or leaking worker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = http.get(f"{worker_url}/load", timeout=5).json()
        idle = (load["state"], load["kv_blocks_used"], load["num_running"], load["num_waiting"])
        if idle == ("ready", 0, 0, 0):
            return None
        if time.monotonic() > deadline:
            return load
        time.sleep(0.005)
