"""`switchyard bench resume`: what a client waits when its stream's worker is killed.

Two `switchyard worker` processes of one model behind a `switchyard gateway` process. Each
round streams a greedy answer through the gateway and SIGKILLs the worker serving it after
`k` tokens (k drawn from 4..`max_cut`); the gateway resumes the stream on the other
replica. Measured: the client's stall, the longest wait for a token from the kill on (the
tokens the dead worker had already sent arrive first, from buffers). Against it,
the unloaded TTFT of the same prompt plus the same `k` tokens of output, as a resume
prefills them, on a replica whose prefix cache has never seen them (the killed one,
restarted): the issue's target is a kill-to-next-token p50/p99 within 2x of that. Every
round also checks the client's text against the uninterrupted answer's.

Then the drain (`drain_tokens` > 0): a stream of that many tokens, and once it is under
way its worker is drained (`POST /drain`, exit when empty) twice over: with no grace (the
worker waits for the answer's end, as every drain did before streams were handed over)
and with `drain_grace_s` (past it the stream is handed over and goes on on the other
replica). Measured: from the drain to the worker's exit; the target is within the grace
plus 1 s. Both answers must be the same text."""

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gateway_paths import gateway_process, make_key, wait_ready
from benchmarks.processes import free_port
from benchmarks.stats import write_report


@dataclass
class ResumeBenchOptions:
    out_dir: Path
    model_dir: Path
    kills: int = 20
    max_tokens: int = 80
    max_cut: int = 40
    seed: int = 0
    drain_tokens: int = 2000  # 0: no drain measurement
    drain_grace_s: float = 10.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Workers:
    def __init__(self, model_dir: Path, tmp: Path) -> None:
        self.model_dir, self.tmp = model_dir, tmp
        self.config = tmp / "worker.yaml"
        self.config.write_text("engine:\n  calibrate: false\n")
        self.procs: dict[str, subprocess.Popen] = {}
        for _ in range(2):
            url = f"http://127.0.0.1:{free_port()}"
            self.procs[url] = self._start(url)
        for url, proc in self.procs.items():
            wait_ready(url, "/ready", {}, 180, proc)

    def _start(self, url: str) -> subprocess.Popen:
        port = url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "cli", "worker", "--model", str(self.model_dir)]
        cmd += ["--port", port, "--served-model-name", "small", "--config", str(self.config)]
        log = open(self.tmp / f"worker-{port}.log", "ab")  # noqa: SIM115 (the child's)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def running(self) -> str | None:
        for url, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    if httpx.get(f"{url}/load", timeout=2).json()["num_running"] > 0:
                        return url
                except httpx.HTTPError:
                    continue
        return None

    def restart(self, url: str) -> None:
        proc = self.procs[url]
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        self.procs[url] = self._start(url)
        wait_ready(url, "/ready", {}, 180, self.procs[url])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _body(round_: int, max_tokens: int, **extra: Any) -> dict:
    prompt = f"Story {round_}: tell me a long story about a lighthouse keeper and the sea."
    return {
        "model": "small",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def _killed_stream(
    gateway: str, key: str, body: dict, cut: int, workers: _Workers
) -> tuple[str, float, str]:
    """Stream through the gateway, SIGKILL its worker after `cut` tokens: the text, the
    client's stall (the longest wait for a token from the kill on: tokens the dead worker
    had sent arrive first, then the gap while the stream moves, then the continuation's),
    and the killed worker's URL."""
    text, n, killed_at, victim = "", 0, 0.0, ""
    arrivals: list[float] = []
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                content = choice["delta"].get("content") or ""
                if killed_at:
                    arrivals.append(time.monotonic())
                text += content
                n += 1
                if n == cut:
                    victim = workers.running() or ""
                    if not victim:
                        raise RuntimeError("no worker was running the stream")
                    killed_at = time.monotonic()
                    os.kill(workers.procs[victim].pid, signal.SIGKILL)
    if not killed_at or not arrivals:
        raise RuntimeError("the stream ended before its worker was killed")
    times = [killed_at, *arrivals]
    stall = max(b - a for a, b in zip(times, times[1:], strict=False))
    return text, stall, victim


def _token_ids(worker: str, body: dict) -> tuple[list[int], list[str]]:
    """The uninterrupted answer from `worker` directly: its token ids and chunk texts."""
    ids, texts = [], []
    with httpx.stream(
        "POST",
        f"{worker}/v1/chat/completions",
        json={**body, "return_token_ids": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    ids.extend(choice.get("token_ids") or [])
                    texts.append(choice["delta"].get("content") or "")
    return ids, texts


def _resume_ttft(worker: str, body: dict, ids: list[int], texts: list[str], cut: int) -> float:
    """Seconds to the first token of a resume after `cut` tokens, sent to `worker`."""
    resumed = {
        **body,
        "resume_token_ids": ids[:cut],
        "resume_text_chars": len("".join(texts[:cut])),
    }
    t0 = time.monotonic()
    with httpx.stream("POST", f"{worker}/v1/chat/completions", json=resumed, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"choices":[{' in line:
                return time.monotonic() - t0
    raise RuntimeError("the resume sent no token")


def _drained_stream(
    gateway: str, key: str, body: dict, workers: "_Workers", grace_s: float | None
) -> tuple[str, float, float]:
    """Stream `body` through the gateway and drain its worker once 16 tokens are in: the
    client's text, seconds from the drain to the worker's exit, and the stream's length."""
    got: dict[str, Any] = {"text": "", "n": 0}
    under_way = threading.Event()

    def read() -> None:
        headers = {"authorization": f"Bearer {key}"}
        try:
            with httpx.stream(
                "POST", f"{gateway}/v1/chat/completions", json=body, headers=headers,
                timeout=600,
            ) as r:  # fmt: skip
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        got["error"] = chunk["error"]
                    for choice in chunk.get("choices") or []:
                        got["text"] += choice["delta"].get("content") or ""
                        got["n"] += 1
                        if got["n"] == 16:
                            under_way.set()
        finally:
            under_way.set()
            got["ended"] = time.monotonic()

    t0 = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    under_way.wait(120)
    victim = workers.running()
    if victim is None:
        raise RuntimeError("no worker was running the stream")
    drained_at = time.monotonic()
    r = httpx.post(f"{victim}/drain", json={"exit_when_empty": True, "grace_s": grace_s})
    r.raise_for_status()
    workers.procs[victim].wait(900)
    drain_s = time.monotonic() - drained_at
    reader.join(900)
    if "error" in got:
        raise RuntimeError(f"the drained stream failed: {got['error']}")
    workers.restart(victim)
    return got["text"], drain_s, got["ended"] - t0


def _drain_figures(opts: ResumeBenchOptions, gateway: str, key: str, workers: "_Workers") -> dict:
    body = _body(-1, opts.drain_tokens, ignore_eos=True)
    print(f"  drain: a {opts.drain_tokens}-token stream, its worker drained with no grace",
          flush=True)  # fmt: skip
    before_text, before_s, before_len = _drained_stream(gateway, key, body, workers, None)
    print(f"    exited {before_s:.1f} s after the drain (the stream took {before_len:.1f} s); "
          f"now with a grace of {opts.drain_grace_s:g} s", flush=True)  # fmt: skip
    after_text, after_s, after_len = _drained_stream(
        gateway, key, body, workers, opts.drain_grace_s
    )
    print(f"    exited {after_s:.1f} s after the drain (the stream took {after_len:.1f} s)",
          flush=True)  # fmt: skip
    return {
        "tokens": opts.drain_tokens,
        "grace_s": opts.drain_grace_s,
        "before_s": before_s,
        "after_s": after_s,
        "stream_before_s": before_len,
        "stream_after_s": after_len,
        "texts_identical": before_text == after_text,
    }


def run_resume_bench(opts: ResumeBenchOptions) -> dict:
    from gateway.runtime.embedded_redis import EmbeddedRedis

    rng = random.Random(opts.seed)
    gaps, refs, mismatches = [], [], 0
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sy-bench-resume-") as d:
        tmp = Path(d)
        redis = EmbeddedRedis(tmp / "redis")
        workers = _Workers(opts.model_dir, tmp)
        try:
            urls = list(workers.procs)
            with gateway_process(
                tmp, urls[0], redis.url, pools={"small": urls}, load_poll_interval_s=0.1
            ) as (gateway, _):
                key = make_key(gateway, "bench-resume")
                for round_ in range(opts.kills):
                    cut = rng.randint(4, opts.max_cut)
                    body = _body(round_, opts.max_tokens)
                    text, gap, victim = _killed_stream(gateway, key, body, cut, workers)
                    survivor = next(u for u in urls if u != victim)
                    ids, texts = _token_ids(survivor, body)
                    mismatches += text != "".join(texts)
                    workers.restart(victim)  # cold: it has never seen this prompt
                    refs.append(_resume_ttft(victim, body, ids, texts, cut))
                    gaps.append(gap)
                    print(
                        f"  kill {round_ + 1}/{opts.kills}: after {cut} tokens, a stall of "
                        f"{gap * 1e3:.0f} ms (unloaded resume TTFT {refs[-1] * 1e3:.0f} ms)",
                        flush=True,
                    )
                drain = _drain_figures(opts, gateway, key, workers) if opts.drain_tokens else None
        finally:
            workers.stop()
            redis.close()
    data = {
        "kills": opts.kills,
        "model": str(opts.model_dir),
        "max_tokens": opts.max_tokens,
        "texts_not_identical": mismatches,
        "stall_after_kill_ms": {
            "p50": statistics.median(gaps) * 1e3,
            "p99": _percentile(gaps, 0.99) * 1e3,
        },
        "unloaded_resume_ttft_ms": {
            "p50": statistics.median(refs) * 1e3,
            "p99": _percentile(refs, 0.99) * 1e3,
        },
        "drain": drain,
        "elapsed_s": time.perf_counter() - t_start,
    }
    ratio_p50 = data["stall_after_kill_ms"]["p50"] / data["unloaded_resume_ttft_ms"]["p50"]
    ratio_p99 = data["stall_after_kill_ms"]["p99"] / data["unloaded_resume_ttft_ms"]["p99"]
    data["ratio_p50"], data["ratio_p99"] = ratio_p50, ratio_p99
    met = ratio_p50 <= 2 and ratio_p99 <= 2 and mismatches == 0
    lines = [
        f"# Streams resumed after a SIGKILL ({opts.kills} kills)",
        "",
        f"Model `{opts.model_dir.name}`, greedy, {opts.max_tokens} tokens, killed after 4 to "
        f"{opts.max_cut} tokens. The stall is the client's longest wait for a token from the "
        "kill on; the reference is a resume of the same prompt and tokens on a "
        "cold replica, unloaded.",
        "",
        "| figure | p50 ms | p99 ms |",
        "|---|---|---|",
        "| the client's stall after the kill | "
        f"{data['stall_after_kill_ms']['p50']:.0f} | "
        f"{data['stall_after_kill_ms']['p99']:.0f} |",
        "| unloaded TTFT of prompt + prefix | "
        f"{data['unloaded_resume_ttft_ms']['p50']:.0f} | "
        f"{data['unloaded_resume_ttft_ms']['p99']:.0f} |",
        f"| ratio | {ratio_p50:.2f} | {ratio_p99:.2f} |",
        "",
        f"Texts not identical to the uninterrupted answer: {mismatches} of {opts.kills}.",
        "",
        f"Target (the stall <= 2x the unloaded TTFT, p50 and p99; every text "
        f"identical): {'met' if met else 'NOT met'}",
    ]
    if drain is not None:
        drain_met = drain["after_s"] <= drain["grace_s"] + 1 and drain["texts_identical"]
        same = "identical" if drain["texts_identical"] else "NOT identical"
        lines += [
            "",
            f"## Draining a replica that holds a {drain['tokens']}-token stream",
            "",
            "| drain | worker exited after | the stream took |",
            "|---|---|---|",
            f"| no grace (waits for the answer) | {drain['before_s']:.1f} s | "
            f"{drain['stream_before_s']:.1f} s |",
            f"| grace {drain['grace_s']:g} s, then handed over | {drain['after_s']:.1f} s | "
            f"{drain['stream_after_s']:.1f} s |",
            "",
            f"The two answers' texts are {same}. Target (exit within the grace + 1 s, the "
            f"same text): {'met' if drain_met else 'NOT met'}",
        ]
    write_report(opts.out_dir, "resume", data, "\n".join(lines))
    return data
