"""The cascade part of `switchyard bench foreign`: a Switchyard worker pool `small` and the
llama-server pool `large` behind one gateway (`cascade_small_pool: small`,
`cascade_large_pool: large`), and the same open-loop mixed load sent three ways: all to
`large`, all to `small`, and `model: auto` (docs/benchmarks/foreign-pools.md).

Easy prompts are short factual questions; hard ones are long multi-step problems. The
shipped difficulty classifier, at its default thresholds, scores every easy one below and
every hard one above its threshold (tests/unit/test_foreign_bench.py checks it), so what
`auto` does to them is the cascade's own decision, not the bench's.
"""

import asyncio
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.foreign_report import summarise_large_load, summarise_way
from benchmarks.gateway_paths import gateway_process, make_key
from benchmarks.loadgen import Outcome, arrival_times, one_request
from benchmarks.processes import child_process, free_port, wait_http

EASY_PROMPTS = (
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "What is the largest ocean on Earth?",
    "How many minutes are in an hour?",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
)
HARD_PROMPTS = (
    "A city requires home-repair contractors who work within its limits to hold a licence, "
    "and a contractor who did not know of the rule agreed to repair a resident's roof. After "
    "the work was done, and done well, the resident learned that the contractor had no "
    "licence and refused to pay. The contractor sues for the price. Reason step by step: "
    "first state what the licensing rule is for (raising revenue or protecting the public), "
    "then explain how courts treat contracts that break a revenue rule as against a "
    "regulatory one, then whether the contractor can recover the reasonable value of work "
    "the resident accepted, and finally give the most likely ruling and the strongest "
    "argument against it.",
    "A company agreed with a builder on a fixed price of 100 million dollars for a new "
    "headquarters, with structural steel a 6 million dollar item. Before work began, a "
    "tornado shut the largest steel mill in the country and the price of steel rose by 20 "
    "percent. The builder told the company, and the two orally agreed to raise the price to "
    "101 million. The builder finished on time, but the company paid only the original 100 "
    "million. Explain step by step whether the oral modification is enforceable: consider "
    "the pre-existing duty rule, the modern rule on modifications made in good faith because "
    "of unanticipated circumstances, the statute of frauds, and whether consideration was "
    "needed. Then say what the builder can recover and why.",
    "A student lent a classmate his car to drive to a concert. On the way, the classmate made "
    "a detour of two miles to buy marijuana from a dealer, then drove on to the theatre, "
    "smoking on the way. While the car was parked outside the theatre, through no fault of "
    "the classmate, another driver hit it and fled; repairs cost 750 dollars. The student "
    "sues the classmate. Work through the problem step by step: what kind of bailment this "
    "is, what duty of care the classmate owed, whether the detour and the drug use were a "
    "deviation that makes him strictly liable, whether they caused the damage at all, and "
    "what the court will most likely decide and why.",
    "A woman leased a condominium for one year. After six months the owner gave her a "
    "written option to buy it for 100,000 dollars before the lease ended, and with his "
    "approval she spent 10,000 dollars remodelling the kitchen to her own taste. A month "
    "before the lease ended the owner wrote that he revoked the option; a week later she "
    "delivered a written acceptance, and he refused to sell. Analyse step by step whether an "
    "enforceable contract was formed: whether the option was supported by consideration, "
    "whether her reliance made it irrevocable, whether the revocation was effective, and "
    "which of her arguments is the strongest, explaining the reasoning behind each step.",
    "During a flight, a passenger stole 100 dollars from the purse of the woman seated "
    "beside him while she was away from her seat, and a flight attendant saw it. He was "
    "arrested on landing and charged under a federal larceny statute. At the trial the "
    "prosecution calls his wife, who is willing to testify that he told her at breakfast the "
    "day before that he planned to steal on the flight. The defence objects on the ground of "
    "spousal privilege. Explain step by step the difference between the spousal testimonial "
    "privilege and the marital communications privilege, who holds each under federal law, "
    "whether each applies to this testimony, and how the court should rule on the objection.",
    "A state university treats a student as a resident, for tuition, only if he is over 21 "
    "and has lived in the state for a year before the last day of registration. A student "
    "moved to the state and enrolled at once, so he paid 1,800 dollars a semester, 400 more "
    "than residents. He sues, claiming the rule is unconstitutional. Reason through the case "
    "step by step: which constitutional provisions he can invoke (equal protection, the "
    "right to travel, due process), what level of scrutiny the court would apply to a "
    "durational residency requirement for tuition, what interests the state can put "
    "forward, and what the court will most likely hold.",
)
MAX_TOKENS = {"easy": 32, "hard": 128}
WAYS = (("large", "large"), ("small", "small"), ("auto", "auto"))  # (way, model sent)

# The worker's engine, as configs/serve.yaml runs the tour's pools, on one core.
WORKER_ENGINE = {
    "dtype": "auto",
    "kv_cache_gib": 0.375,
    "decode_workspace_tokens": 512,
    "decode_workspace_gib": 0.125,
    "threads": 1,
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
}


@dataclass(frozen=True)
class Arrival:
    at_s: float  # since the way started
    kind: str  # "easy" | "hard"
    prompt: str


def mixed_arrivals(
    rate_per_s: float, duration_s: float, hard_share: float, seed: int
) -> list[Arrival]:
    """Poisson arrivals over `duration_s`, each hard with probability `hard_share`, the
    prompt drawn from its kind's list; the same seed gives every way the same load."""
    rng = random.Random(seed)
    out = []
    for at in arrival_times(rate_per_s, duration_s, rng):
        kind = "hard" if rng.random() < hard_share else "easy"
        out.append(Arrival(at, kind, rng.choice(HARD_PROMPTS if kind == "hard" else EASY_PROMPTS)))
    return out


def chat_body(arrival: Arrival, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": arrival.prompt}],
        "max_tokens": MAX_TOKENS[arrival.kind],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _offer(url: str, key: str, model: str, arrivals: list[Arrival]) -> list[Outcome]:
    outcomes = [Outcome(a.kind, 0, a.at_s) for a in arrivals]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        start, tasks = time.perf_counter(), []
        for a, outcome in zip(arrivals, outcomes, strict=True):
            delay = a.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = chat_body(a, model)
            tasks.append(asyncio.ensure_future(one_request(http, url, key, body, outcome)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


class LargeLoadSampler:
    """llama-server's `/metrics` read every `interval_s` on a thread of its own while a
    way runs: slots processing, requests waiting, and its token counters."""

    def __init__(self, base_url: str, interval_s: float = 0.5) -> None:
        self.url = f"{base_url}/metrics"
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> dict[str, float]:
        from workers.api.upstreams.prometheus import metric_sum, parse_exposition

        samples = parse_exposition(httpx.get(self.url, timeout=2).content) or {}
        names = ("requests_processing", "requests_deferred", "tokens_predicted_total")
        names += ("prompt_tokens_total",)
        return {n: metric_sum(samples, f"llamacpp:{n}") or 0.0 for n in names}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self.read())
            except httpx.HTTPError:
                continue

    def __enter__(self) -> "LargeLoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@contextmanager
def worker_process(model_dir: Path, tmp: Path) -> Iterator[tuple[str, int]]:
    """`switchyard worker` on `model_dir` answering to `small`; yields (URL, pid) once
    /ready answers (after its calibration)."""
    port = free_port()
    cfg = tmp / "worker.yaml"
    cfg.write_text(
        yaml.safe_dump({"engine": WORKER_ENGINE, "worker": {"max_waiting_requests": 32}})
    )
    cmd = [sys.executable, "-m", "cli.main", "worker", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--config", str(cfg), "--served-model-name", "small"]
    log_path = tmp / "worker.log"
    with child_process(cmd, log_path) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, "/ready", timeout_s=600.0, proc=proc, log_path=log_path)
        yield url, proc.pid


def _wait_idle(sampler: LargeLoadSampler, timeout_s: float = 60.0) -> None:
    """Until llama-server runs and queues nothing (a way's stragglers are done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = sampler.read()
        if m["requests_processing"] == 0 and m["requests_deferred"] == 0:
            return
        time.sleep(0.5)


def run_cascade(
    tmp: Path,
    llama_base: str,
    redis_url: str,
    model_dir: Path,
    *,
    num_slots: int,
    ttft_target_s: float,
    poll_interval_s: float,
    rate_per_s: float,
    duration_s: float,
    hard_share: float,
    seed: int,
    alias: str,
) -> dict[str, Any]:
    """The three ways over one stack; each way's summary (or its error) by name."""
    arrivals = mixed_arrivals(rate_per_s, duration_s, hard_share, seed)
    out: dict[str, Any] = {
        "arrivals": len(arrivals),
        "hard": sum(a.kind == "hard" for a in arrivals),
    }
    with worker_process(model_dir, tmp) as (worker_url, _):
        pools = {
            "small": [worker_url],
            "large": {"kind": "llamacpp", "urls": [llama_base], "model": alias},
        }
        with gateway_process(
            tmp,
            worker_url,
            redis_url,
            pools=pools,
            ttft_target_s={"small": ttft_target_s, "large": ttft_target_s},
            load_poll_interval_s=poll_interval_s,
            cascade_small_pool="small",
            cascade_large_pool="large",
        ) as (gw, _proc):
            key = make_key(gw, "bench-cascade")
            probe = LargeLoadSampler(llama_base)
            for way, model in WAYS:
                print(f"bench foreign: cascade, {len(arrivals)} requests to model {model}")
                try:
                    _wait_idle(probe)
                    before = probe.read()
                    t0 = time.perf_counter()
                    with LargeLoadSampler(llama_base) as sampler:
                        outcomes = asyncio.run(_offer(f"{gw}/v1", key, model, arrivals))
                    elapsed = time.perf_counter() - t0
                    after = probe.read()
                    out[way] = summarise_way(outcomes, elapsed) | {
                        "model": model,
                        "large": summarise_large_load(
                            sampler.samples, before, after, elapsed, num_slots
                        ),
                    }
                except Exception as e:  # noqa: BLE001 (a way that fails is an error row)
                    out[way] = {"model": model, "error": f"{type(e).__name__}: {e}"[:400]}
    return out
