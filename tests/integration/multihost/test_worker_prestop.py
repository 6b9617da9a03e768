"""The worker pods' preStop hook (deploy/kubernetes/workers.yaml), run exactly as the
manifest writes it against a real `switchyard worker` inside a network namespace of its own,
where 127.0.0.1:8100 is the "pod's" own loopback as in Kubernetes: it drains the worker
with the control key and returns only once nothing runs or waits, and what was running
finishes whole."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.support.k8s_manifests import MANIFEST_DIR, documents
from tests.support.netns import TwoHosts
from tests.support.servers import REPO_ROOT, wait_ready

POD_URL = "http://127.0.0.1:8100"
CONTROL_KEY = "prestop-test-control-key"
NUM_TOKENS = 200


def _prestop_command() -> list[str]:
    (deployment,) = [
        d
        for d in documents(MANIFEST_DIR / "workers.yaml")
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "switchyard-worker-small"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["lifecycle"]["preStop"]["exec"]["command"]


def test_the_prestop_hook_drains_and_returns_only_once_nothing_runs(
    hosts: TwoHosts, demo_dir: Path, tmp_path: Path
) -> None:
    pod = hosts.a
    # `python` in the hook is the image's interpreter; here the one running the tests.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["SWITCHYARD_WORKER_CONTROL_KEY"] = CONTROL_KEY
    with open(tmp_path / "worker.log", "wb") as log:
        worker = pod.popen(
            [sys.executable, "-m", "cli.main", "worker", "--model", str(demo_dir)]
            + ["--host", "127.0.0.1", "--port", "8100", "--served-model-name", "small"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    pod.call(lambda: wait_ready(POD_URL, 120.0, worker))

    first_chunk = threading.Event()
    stream: dict[str, object] = {}

    def stream_one() -> None:
        body = {"model": "small", "prompt": "hello", "max_tokens": NUM_TOKENS}
        body |= {"ignore_eos": True, "stream": True, "temperature": 0}
        body["stream_options"] = {"include_usage": True}
        tokens, finish = None, None
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{POD_URL}/v1/completions", json=body) as answer:
                assert answer.status_code == 200, answer.read()
                for line in answer.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    first_chunk.set()
        stream["tokens"], stream["finish"] = tokens, finish

    def in_pod_stream() -> None:
        try:
            pod.call(stream_one)
        except BaseException as exc:
            stream["error"] = exc
            first_chunk.set()

    streamer = threading.Thread(target=in_pod_stream)
    streamer.start()
    assert first_chunk.wait(60) and "error" not in stream, stream
    hook = pod.popen(_prestop_command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def watch_until_the_hook_returns() -> tuple[bool, dict]:
        """Whether the hook was seen still running while the worker, already draining,
        held a request; and /load once the hook has returned. Sound because a draining
        worker admits nothing: once its resident count is seen above 0, it was above 0
        at every earlier moment of the drain, the hook's last poll included."""
        held_while_busy = False
        with httpx.Client(timeout=10) as client:
            while True:
                returned = hook.poll() is not None
                load = client.get(f"{POD_URL}/load").json()
                if returned:
                    return held_while_busy, load
                resident = load["num_running"] + load["num_waiting"]
                if load["state"] == "draining" and resident > 0:
                    held_while_busy = True
                time.sleep(0.01)

    held_while_busy, load_after = pod.call(watch_until_the_hook_returns, timeout_s=120)
    output = hook.stdout.read().decode() if hook.stdout else ""
    assert hook.returncode == 0, output
    assert held_while_busy, "the hook never waited on a draining worker that held a request"
    assert load_after["state"] == "draining"
    assert load_after["num_running"] == 0 and load_after["num_waiting"] == 0
    streamer.join(60)
    assert "error" not in stream, stream
    assert stream == {"tokens": NUM_TOKENS, "finish": "length"}, stream

    def refused_now() -> int:
        body = {"model": "small", "prompt": "hello", "max_tokens": 4}
        return httpx.post(f"{POD_URL}/v1/completions", json=body, timeout=10).status_code

    assert pod.call(refused_now) == 503  # drained: takes nothing new
    # Then the kubelet's SIGTERM: the idle worker stops on it, well inside any grace
    # period (as the signal's own status: the container's 143).
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) in (0, -signal.SIGTERM)
