"""The gateway counts a chat's prompt tokens as the worker will: the checkpoint's template
rendered over every message, then tokenized, so quotas and context limits see it all."""

from gateway.serving.prompt_tokens import PoolTokenizer, PromptCounter
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
