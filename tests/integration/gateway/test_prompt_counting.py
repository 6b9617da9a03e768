"""The gateway counts a chat's prompt tokens as the worker will: the checkpoint's template
rendered over every message, then tokenized, so quotas and context limits see it all. The
count is bounded first (a text whose bytes cannot fit the context is refused untokenized)
and a big one is tokenized off the event loop, in its tenant's own lane."""

import json
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.serving.prompt_tokens import ByteBound, PoolTokenizer, PromptCounter, byte_bound
from tests.integration.gateway.conftest import Stack, gateway_stack
from tests.integration.gateway.faults_support import Background, wait_until
from workers.api.types import ChatMessage
from workers.engine.tokenizer import CheckpointTokenizer


def messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_chat_count_equals_the_workers_rendered_prompt(demo_dir):
    counter = PromptCounter({"small": PoolTokenizer(str(demo_dir))})
    worker = CheckpointTokenizer(demo_dir)
    for chat in (
        messages(("user", "hello there")),
        messages(
            ("system", "be brief"),
            ("user", "what is 2+2?"),
            ("assistant", "4"),
            ("user", "and 3+3?"),
        ),
        messages(("user", "x" * 2000)),
    ):
        rendered = worker.render_chat([{"role": m.role, "content": m.content} for m in chat])
        expected = len(worker.encode(rendered, add_special_tokens=False))
        assert counter.chat("small", chat) == expected


def test_without_a_tokenizer_every_field_is_estimated():
    counter = PromptCounter({})
    plain = counter.chat("small", [ChatMessage(role="user", content="hi")])
    padded = counter.chat("small", [ChatMessage(role="user", content="hi", name="n" * 300)])
    assert padded >= plain + 100


# -- Bounded, off the event loop, fair by tenant ---------------------------------------------


def test_no_token_stands_for_more_bytes_than_max_token_bytes(demo_dir):
    tok = PoolTokenizer(str(demo_dir))
    assert tok.bound is not None and tok.bound.uncovered == b""
    rng = random.Random(7)
    vocab = list(tok.fast.get_vocab())
    texts = [
        " " * 5000,
        "=" * 5000,
        "a" * 5000,
        "<|im_start|>" * 300,
        "".join(rng.choice(vocab) for _ in range(2000)),  # tokens' own byte-level spellings
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000)),
        "lorem ipsum dolor sit amet " * 200,
    ]
    for text in texts:
        counted = len(tok.fast.encode(text, add_special_tokens=False).ids)
        assert counted >= tok.bound.min_tokens(text) > 0, text[:40]


def test_bytes_a_byte_level_tokenizer_drops_are_left_out_of_the_bound():
    from tokenizers import Tokenizer, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    dropped = "\u0104"  # the byte-level character of byte 0x04: no token of its own
    vocab = {c: i for i, c in enumerate(sorted(set(alphabet) - {dropped}))}
    fast = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bound = byte_bound(json.loads(fast.to_str()))
    assert bound == ByteBound(1, b"\x04")
    for text in ("\x04" * 1000, "a\x04" * 500, "hello"):
        counted = len(fast.encode(text, add_special_tokens=False).ids)
        assert counted >= bound.min_tokens(text), text[:10]
    assert bound.min_tokens("\x04" * 1000) == 0  # all dropped: proves nothing


def _spec(**parts) -> dict:
    base = {
        "model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "byte_fallback": True},
        "normalizer": None,
        "pre_tokenizer": None,
        "added_tokens": [],
    }
    spec = {**base, **parts}
    if spec["model"].get("byte_fallback"):
        spec["model"]["vocab"] = {"a": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    return spec


def test_a_pipeline_that_can_leave_text_uncovered_has_no_byte_bound():
    assert byte_bound(_spec()) == ByteBound(6)  # "<0x0A>" is the longest spelling
    assert byte_bound(_spec(normalizer={"type": "NFKC"})) == ByteBound(24)
    assert byte_bound(_spec(added_tokens=[{"content": "<|a-long-special|>"}])) == ByteBound(18)
    dropping = [
        {"pre_tokenizer": {"type": "Whitespace"}},  # spaces vanish
        {"pre_tokenizer": {"type": "Split", "behavior": "Removed"}},
        {"normalizer": {"type": "Strip"}},
        {"normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}},
        {"normalizer": {"type": "Sequence", "normalizers": [{"type": "BertNormalizer"}]}},
        {"added_tokens": [{"content": "<mask>", "lstrip": True}]},  # takes the spaces before
        {"model": {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]"}},
        {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "unk_token": "<unk>"}},
    ]
    for parts in dropping:
        assert byte_bound(_spec(**parts)) is None, parts
    no_fallback_for_0xff = _spec()
    del no_fallback_for_0xff["model"]["vocab"]["<0xFF>"]
    assert byte_bound(no_fallback_for_0xff) is None


class GatedTokenizer:
    """A pool's Rust tokenizer that records each text over `big_chars` it is asked to encode
    (by its marker, the text's first word) and holds it until `release` is set."""

    def __init__(self, inner, big_chars: int = 50_000) -> None:  # noqa: ANN001
        self.inner, self.big_chars = inner, big_chars
        self.release = threading.Event()
        self.entered: list[str] = []

    def _gate(self, text: str) -> None:
        if len(text) > self.big_chars:
            self.entered.append(next(m for m in MARKERS if m in text))
            assert self.release.wait(30)

    def encode(self, text, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self._gate(text)
        return self.inner.encode(text, **kwargs)

    def encode_batch(self, texts, **kwargs):  # noqa: ANN001, ANN003, ANN201
        for text in texts:
            self._gate(text)
        return self.inner.encode_batch(texts, **kwargs)


MARKERS = ("A1", "A2", "B1", "H1")
SMALL_CHAT = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def big_chat(marker: str, num_bytes: int = 100_000) -> dict:
    """Over count_inline_bytes and under the byte bound: counted, then over the context."""
    content = f"{marker} " + "lorem ipsum " * (num_bytes // 12)
    return {**SMALL_CHAT, "messages": [{"role": "user", "content": content}]}


@contextmanager
def counting_stack(redis_url: str, demo_dir, **config) -> Iterator[tuple[Stack, GatedTokenizer]]:
    with gateway_stack(redis_url, replicas={"small": 1}, **config) as s:
        tok = PoolTokenizer(str(demo_dir))
        gated = tok.fast = GatedTokenizer(tok.fast)
        s.gateway.counter = PromptCounter({"small": tok})
        try:
            yield s, gated
        finally:
            gated.release.set()


def post_in_background(s: Stack, key: str, body: dict) -> Background:
    bg = Background()

    def run() -> None:
        with s.client(key) as c:
            bg.results.append(c.post("/v1/chat/completions", json=body))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    bg.threads.append(t)
    return bg


@pytest.mark.timeout(60)
def test_a_big_prompt_being_counted_leaves_the_gateway_serving_others(redis_url, demo_dir):
    with counting_stack(redis_url, demo_dir) as (s, gated):
        heavy, light = s.tenant("heavy"), s.tenant("light")
        counting = post_in_background(s, heavy, big_chat("H1"))
        wait_until(lambda: gated.entered == ["H1"], 10, "the big prompt is being tokenized")
        with s.client(light) as c:
            r = c.post("/v1/chat/completions", json=SMALL_CHAT, timeout=10)
        assert r.status_code == 200, r.text
        gated.release.set()
        (refused,) = counting.join(10)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.timeout(60)
def test_a_tenants_big_prompts_wait_behind_its_own_not_in_front_of_others(redis_url, demo_dir):
    with counting_stack(redis_url, demo_dir, count_threads=2, count_per_tenant=1) as (s, gated):
        a, b = s.tenant("a"), s.tenant("b")
        first = post_in_background(s, a, big_chat("A1"))
        wait_until(lambda: gated.entered == ["A1"], 10, "a's first is being tokenized")
        second = post_in_background(s, a, big_chat("A2"))
        other = post_in_background(s, b, big_chat("B1"))
        wait_until(lambda: gated.entered == ["A1", "B1"], 10, "b's count goes past a's lane")
        wait_until(lambda: s.gateway.counting.waiting == 1, 10, "a's second waits its turn")
        assert gated.entered == ["A1", "B1"]
        assert s.gateway.counting.running == {"a": 1, "b": 1}
        gated.release.set()
        answers = [bg.join(10)[0] for bg in (first, second, other)]
        assert [r.status_code for r in answers] == [400, 400, 400]
        assert sorted(gated.entered) == ["A1", "A2", "B1"]


@pytest.mark.timeout(60)
def test_a_prompt_whose_bytes_cannot_fit_the_context_is_refused_without_tokenizing(
    redis_url, demo_dir
):
    with counting_stack(redis_url, demo_dir) as (s, gated):
        key = s.tenant("big", tokens_per_day=10**9)
        gated.release.set()  # nothing held: only what reaches the tokenizer is recorded
        with s.client(key) as c:
            r = c.post("/v1/chat/completions", json=big_chat("H1", 1_000_000))
            completion = c.post(
                "/v1/completions",
                json={"model": "small", "prompt": "A1 " + "x" * 900_000, "max_tokens": 2},
            )
        for answer in (r, completion):
            assert answer.status_code == 400, answer.text
            err = answer.json()["error"]
            assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
        assert gated.entered == []
        assert s.usage(key)["tokens_today"] == 0
