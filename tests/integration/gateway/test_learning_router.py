"""The router learns from a tenant's traffic: shadow runs through the gateway over fake
pools whose correctness follows a hidden rule produce labels, `switchyard cascade
retrain` trains, checks and promotes a tenant classifier, and the routed split moves
toward the rule. Also: feedback only from the tenant that made the request, shadow work
not charged, promotion refused with figures, rollback, the audit log."""

import dataclasses
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx

from benchmarks.fake_backend import FakeBackend
from cli.main import main as cli_main
from gateway.app import create_gateway_app
from gateway.config import GatewayConfig
from gateway.runtime.main import build_gateway
from tests.integration.gateway.conftest import ADMIN, Stack, _flush, _wait_ready
from tests.support.servers import serving
from tests.unit.cascade.conftest import synthetic_rows, write_csv

HARD = ("quantum", "torts", "virology", "econometrics")  # the small model gets these wrong
EASY = ("geography", "marketing", "nutrition", "sociology")
FILLER = "which of the following statements is most likely true given the passage".split()


def question(topic: str, rng: random.Random) -> str:
    words = " ".join(rng.choice(FILLER) for _ in range(rng.randint(8, 40)))
    return f"A {topic} question: {words}?\nA. one\nB. two\nAnswer:"


def small_answer(prompt: str) -> str:
    return "The answer is (A)" if any(t in prompt for t in HARD) else "The answer is (B)"


class RuleBackend:
    """A FakeBackend whose non-streaming answers say what `answer(prompt)` says."""

    def __init__(self, name: str, answer) -> None:  # noqa: ANN001
        self.inner = FakeBackend(name=name)
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.inner(scope, receive, send)
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        sent = False

        async def replay():  # noqa: ANN202
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        captured: list[dict] = []

        async def capture(msg) -> None:  # noqa: ANN001
            captured.append(msg)

        await self.inner(scope, replay, capture)
        start, payload = captured[0], b"".join(m.get("body", b"") for m in captured[1:])
        doc = json.loads(payload)
        if start["status"] == 200 and doc.get("choices"):
            doc["choices"][0]["text"] = self.answer(json.loads(body).get("prompt") or "")
        raw = json.dumps(doc).encode()
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": raw})


@contextmanager
def rule_stack(redis_url: str):
    _flush(redis_url)
    with ExitStack() as stack:
        small = RuleBackend("small0", small_answer)
        large = RuleBackend("large0", lambda prompt: "The answer is (B)")
        urls = {
            n: stack.enter_context(serving(b)) for n, b in (("small0", small), ("large0", large))
        }
        cfg = GatewayConfig(
            pools={"small": [urls["small0"]], "large": [urls["large0"]]},
            data_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="sy-gw-")),
            routing_poll_s=0.1,
            admin_key=ADMIN,
            default_pool="small",
            load_poll_interval_s=0.05,
            cascade_small_pool="small",
            cascade_large_pool="large",
        )
        gw = build_gateway(cfg, redis_url)
        url = stack.enter_context(serving(create_gateway_app(gw)))
        _wait_ready(url)
        yield Stack(url, {"small0": small.inner, "large0": large.inner}, urls, redis_url, gw)


def _eventually(predicate, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _ask(c: httpx.Client, prompt: str, spent: list[int]) -> httpx.Response:
    r = c.post("/v1/completions", json={"model": "auto", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    spent.append(r.json()["usage"]["total_tokens"])
    return r


def _large_rate(c: httpx.Client, topics, rng: random.Random, spent: list[int]) -> float:  # noqa: ANN001
    n = 40
    routed = [
        _ask(c, question(rng.choice(topics), rng), spent).headers["x-switchyard-model"]
        for _ in range(n)
    ]
    return routed.count("large") / n


def test_shadow_labels_retrain_and_promotion_move_the_split_toward_the_rule(redis_url, tmp_path):
    rng = random.Random(7)
    with rule_stack(redis_url) as s:
        key = s.tenant("acme")
        other = s.tenant("intruder")
        learning = {"shadow_fraction": 1.0, "keep_prompts": True, "feedback": True}
        with s.admin() as a:
            r = a.put(
                "/admin/routing",
                json={
                    "learning": {"acme": learning},
                    "shadow_tokens_per_minute": 10**9,
                    "tenant_target_fractions": {"acme": 0.5},
                },
            )
            assert r.status_code == 200, r.text
        time.sleep(0.3)
        with s.client(key) as c:
            spent: list[int] = []
            before_hard = _large_rate(c, HARD, rng, spent)
            before_easy = _large_rate(c, EASY, rng, spent)
            request_ids = []
            for i in range(320):
                r = _ask(c, question((HARD + EASY)[i % 8], rng), spent)
                request_ids.append(r.headers["x-request-id"])
            # Feedback: only the tenant that made the request can label it.
            fb = {"request_id": request_ids[0], "outcome": "ok"}
            assert c.post("/v1/feedback", json=fb).status_code == 200
            with s.client(other) as intruder:
                assert intruder.post("/v1/feedback", json=fb).status_code == 404
            assert c.post("/v1/feedback", json={**fb, "outcome": "meh"}).status_code == 400

        def labels() -> dict:
            with s.admin() as a:
                return a.get("/admin/routing/labels/acme", params={"split": "all"}).json()

        assert _eventually(lambda: labels()["num_labels"] >= 400 + 1)
        with s.admin() as a:
            assert a.get("/admin/routing/labels/intruder").json()["num_labels"] == 0
        # Shadow runs are the operator's, never the tenant's: usage counts routed answers only.
        assert s.usage(key)["tokens_today"] == sum(spent)  # (a minute window may roll over)
        assert s.backends["small0"].total + s.backends["large0"].total == 2 * len(spent)
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'switchyard_cascade_shadow_runs_total{outcome="run"}' in metrics
        rows = labels()["rows"]
        hard_rows = [r for r in rows if any(t in r["prompt"] for t in HARD)]
        assert hard_rows and not any(r["weak_ok"] for r in hard_rows if r["source"] == "shadow")

        base = write_csv(tmp_path / "base.csv", synthetic_rows(240))
        argv = ["cascade", "retrain", "--tenant", "acme", "--url", s.url, "--admin-key", ADMIN]
        argv += ["--data", str(base), "--out", str(tmp_path / "retrain"), "--quick"]
        assert cli_main(argv) == 0
        with s.admin() as a:
            state = a.get("/admin/routing/classifiers/acme").json()
        assert state["current"] == 1
        promoted = state["audit"][0]
        assert promoted["action"] == "promote" and promoted["who"] == "cli"
        figures = promoted["figures"]
        assert figures["candidate"]["apgr"] > figures["current"]["apgr"]

        time.sleep(0.3)  # every replica polls within routing_poll_s
        with s.client(key) as c:
            after_hard = _large_rate(c, HARD, rng, spent)
            after_easy = _large_rate(c, EASY, rng, spent)
        print(
            f"large share hard/easy: before {before_hard}/{before_easy}, "
            f"after {after_hard}/{after_easy}"
        )
        assert after_hard - after_easy > 0.6, (after_hard, after_easy)
        assert after_hard - after_easy > before_hard - before_easy + 0.4

        # A candidate that does not beat the current one is refused, with the figures.
        again = tmp_path / "retrain"
        artifact = next(p for p in again.iterdir() if p.is_dir())
        argv = ["cascade", "promote", "--tenant", "acme", "--url", s.url, "--admin-key", ADMIN]
        assert cli_main([*argv, "--artifact", str(artifact)]) == 3
        with s.admin() as a:
            state = a.get("/admin/routing/classifiers/acme").json()
            assert state["current"] == 1 and state["audit"][0]["action"] == "refused"
            r = a.post("/admin/routing/classifiers/acme/rollback")
            assert r.status_code == 200 and r.json()["current"] is None
        time.sleep(0.3)
        with s.client(key) as c:
            assert _large_rate(c, HARD, rng, spent) - _large_rate(c, EASY, rng, spent) < 0.6


def test_escalations_are_labelled_and_shadow_runs_stay_within_the_operator_budget(redis_url):
    from tests.integration.gateway.conftest import gateway_stack

    with gateway_stack(redis_url, cascade_small_pool="small", cascade_large_pool="large") as s:
        key = s.tenant("esc")
        settings = {
            "default_threshold": 1.0,  # everything small
            "escalation": {"esc": {"enabled": True, "min_mean_logprob": -1.0}},
            "learning": {"esc": {"shadow_fraction": 1.0, "judge": "exact"}},
            "shadow_tokens_per_minute": 30,  # about two shadow runs of these requests
        }
        with s.admin() as a:
            assert a.put("/admin/routing", json=settings).status_code == 200
        time.sleep(0.3)
        with s.client(key) as c:
            s.backends["small0"].logprob = -5.0  # unsure: escalated, labelled by the judge
            r = c.post("/v1/completions", json={"model": "auto", "prompt": "hi", "max_tokens": 4})
            assert r.headers["x-switchyard-route"] == "escalated"
            s.backends["small0"].logprob = -0.01  # sure: not escalated, shadowed if budget
            for _ in range(6):
                prompt = {"model": "auto", "prompt": "a" * 40, "max_tokens": 4}
                assert c.post("/v1/completions", json=prompt).status_code == 200

        def labels() -> list[dict]:
            with s.admin() as a:
                return a.get("/admin/routing/labels/esc", params={"split": "all"}).json()

        assert _eventually(lambda: labels()["num_labels"] >= 2)
        time.sleep(0.3)
        doc = labels()
        metrics = httpx.get(f"{s.url}/metrics").text
        runs = _sample(metrics, 'switchyard_cascade_shadow_runs_total{outcome="run"}')
        shed = _sample(metrics, 'switchyard_cascade_shadow_runs_total{outcome="budget"}')
        assert runs + shed == 6 and 1 <= runs <= 2 and shed >= 4, (runs, shed)
        assert doc["num_labels"] == 1 + runs
        # keep_prompts is off: labels hold features only, nothing to train on
        assert doc["rows"] == [] and doc["skipped"]["no_prompt"] == 1 + runs
        assert (
            'switchyard_cascade_labels_total{source="escalation",verdict="not_ok"} 1.0' in metrics
        )


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _shadow_outcomes(gw) -> float:  # noqa: ANN001
    return sum(
        gw.registry.get_sample_value("switchyard_cascade_shadow_runs_total", {"outcome": o}) or 0
        for o in ("run", "busy", "budget", "failed")
    )


def _num_labels(s: Stack, tenant: str) -> int:
    with s.admin() as a:
        return a.get(f"/admin/routing/labels/{tenant}", params={"split": "all"}).json()[
            "num_labels"
        ]


def test_one_tenant_cannot_spend_the_whole_shadow_budget(redis_url):
    """Budget for ten shadow runs a minute; one tenant sends four requests for each of the
    other's. Before the budget was shared, the heavy one got eight of the ten and the light
    one two."""
    from tests.integration.gateway.conftest import gateway_stack

    with gateway_stack(redis_url, cascade_small_pool="small", cascade_large_pool="large") as s:
        keys = {t: s.tenant(t) for t in ("heavy", "light")}
        body = {"model": "auto", "prompt": [5, 6, 7, 8], "max_tokens": 6}  # 10 tokens a run
        learning = {"shadow_fraction": 1.0, "judge": "exact"}
        settings = {
            "learning": {"heavy": learning, "light": learning},
            "shadow_tokens_per_minute": 10 * 10,
        }
        with s.admin() as a:
            assert a.put("/admin/routing", json=settings).status_code == 200
        assert _eventually(lambda: s.gateway.router.settings.shadow_tokens_per_minute == 100)
        clients = {t: s.client(k) for t, k in keys.items()}
        try:
            order = [("heavy", "heavy", "heavy", "heavy", "light")[i % 5] for i in range(50)]
            for i, tenant in enumerate(order):
                assert clients[tenant].post("/v1/completions", json=body).status_code == 200
                # one shadow decision per request, in request order
                assert _eventually(lambda n=i + 1: _shadow_outcomes(s.gateway) >= n)
        finally:
            for c in clients.values():
                c.close()
        runs = s.gateway.registry.get_sample_value(
            "switchyard_cascade_shadow_runs_total", {"outcome": "run"}
        )
        assert _eventually(lambda: _num_labels(s, "heavy") + _num_labels(s, "light") == runs)
        heavy, light = _num_labels(s, "heavy"), _num_labels(s, "light")
        print(f"shadow labels: heavy {heavy}, light {light}")
        # Within one minute 5 and 5; should the minute turn, each gets at most 5 in the next.
        assert light >= 5 and heavy <= 10, (heavy, light)


@contextmanager
def _second_gateway(s: Stack):
    """Another gateway over the same Redis and workers (a replica of `s.gateway`)."""
    with tempfile.TemporaryDirectory(prefix="sy-gw-") as data_dir:
        cfg = dataclasses.replace(s.gateway.config, data_dir=data_dir)
        gw = build_gateway(cfg, s.redis_url)
        with serving(create_gateway_app(gw)) as url:
            _wait_ready(url)
            yield url


def test_a_request_takes_one_feedback_however_often_and_wherever_it_is_posted(redis_url):
    """The first feedback stands: the same one again (a retry) is the same 200 and writes
    nothing; a different one is a 409 saying what was recorded. 300 posts at once through
    two gateways, half of them the other outcome, leave one label. Before, every post was
    a label of its own (20,000 posts: 20,000 labels)."""
    from tests.integration.gateway.conftest import gateway_stack

    with gateway_stack(redis_url, cascade_small_pool="small", cascade_large_pool="large") as s:
        key = s.tenant("acme")
        settings = {
            "default_threshold": 1.0,  # everything small: a feedback labels the small answer
            "default_target_fraction": None,
            "learning": {"acme": {"feedback": True, "keep_prompts": True}},
        }
        with s.admin() as a:
            assert a.put("/admin/routing", json=settings).status_code == 200
        assert _eventually(lambda: s.gateway.router.settings.learning.get("acme") is not None)
        auth = {"authorization": f"Bearer {key}"}
        with _second_gateway(s) as url2, httpx.Client(headers=auth, timeout=30) as c:
            asks = [s.url, url2]
            rids = []
            for i in range(2):
                r = c.post(
                    f"{asks[i]}/v1/completions",
                    json={"model": "auto", "prompt": f"2+{i}?", "max_tokens": 4},
                )
                assert r.status_code == 200 and r.headers["x-switchyard-model"] == "small"
                rids.append(r.headers["x-request-id"])
            one, two = rids
            fb = {"request_id": one, "outcome": "ok", "score": 0.75}
            assert _eventually(lambda: c.post(f"{s.url}/v1/feedback", json=fb).status_code == 200)
            first = c.post(f"{url2}/v1/feedback", json=fb)  # a retry, through the other one
            assert (first.status_code, first.json()) == (200, {"recorded": True, "request_id": one})
            conflict = c.post(f"{url2}/v1/feedback", json={**fb, "outcome": "not_ok"})
            assert conflict.status_code == 409, conflict.text
            doc = conflict.json()
            assert doc["error"]["code"] == "feedback_exists"
            assert doc["error"]["param"] == "request_id" and one in doc["error"]["message"]
            assert doc["recorded"] == {"outcome": "ok", "score": 0.75}
            assert c.post(f"{s.url}/v1/feedback", json={**fb, "score": 0.5}).status_code == 409

            def post(i: int) -> int:
                body = {"request_id": two, "outcome": ("ok", "not_ok")[i % 2]}
                return c.post(f"{asks[i % 2]}/v1/feedback", json=body).status_code

            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(post, range(300)))
        # One outcome won: every post of it is a 200, every post of the other a 409.
        oks, not_oks = set(statuses[0::2]), set(statuses[1::2])
        assert (oks, not_oks) in (({200}, {409}), ({409}, {200})), statuses
        with s.admin() as a:
            doc = a.get("/admin/routing/labels/acme", params={"split": "all"}).json()
        assert doc["num_labels"] == 2, doc["num_labels"]
        rows = sorted((r["request_id"], r["source"], r["weak_ok"]) for r in doc["rows"])
        won = oks == {200}  # the posts saying "ok" won
        assert rows == sorted([(one, "feedback", True), (two, "feedback", won)])
