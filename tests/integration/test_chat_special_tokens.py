"""A chat template that writes BOS, with a tokenizer that also adds BOS: chat prompts get
exactly one (the template's), plain completions keep the tokenizer's."""

import json
import shutil

import httpx
import pytest
from tokenizers import Tokenizer, processors

from tests.support.worker import running_worker
from workers.models.demo import BOS_TOKEN, CHATML_TEMPLATE

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def bos_model_dir(demo_dir, tmp_path_factory):
    """The demo checkpoint, with a tokenizer that adds BOS and a template that writes it."""
    path = tmp_path_factory.mktemp("bos") / "small"
    shutil.copytree(demo_dir, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text("{{ bos_token }}" + CHATML_TEMPLATE)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_prompt_has_one_bos_and_completions_still_get_one(bos_model_dir):
    with running_worker(bos_model_dir) as worker:
        tok = worker.engine.tokenizer
        bos = tok.backend.token_to_id(BOS_TOKEN)
        rendered = tok.render_chat(MESSAGES)
        assert rendered.startswith(BOS_TOKEN) and tok.encode(rendered)[:2] == [bos, bos]
        body = {"model": "small", "max_tokens": 1, "temperature": 0}

        r = httpx.post(f"{worker.url}/v1/chat/completions", json={**body, "messages": MESSAGES})
        assert r.status_code == 200, r.text
        ids = tok.encode(rendered, add_special_tokens=False)
        assert ids[:2] != [bos, bos]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)

        r = httpx.post(f"{worker.url}/v1/completions", json={**body, "prompt": "Hello there"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("Hello there"))
        assert tok.encode("Hello there")[0] == bos
