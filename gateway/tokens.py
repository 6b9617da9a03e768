"""Counting prompt tokens with the target pool's tokenizer, before dispatch."""

import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

_CHAT_TOKENS_PER_MESSAGE = 4  # role markers around each message in common chat templates
_BYTES_PER_TOKEN_ESTIMATE = 3  # fallback when a pool has no local tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


class PromptCounter:
    """Prompt tokens per pool: exact for token ids, tokenizer-exact for text when the pool
    has a tokenizer, otherwise a byte-based estimate. Chat adds a few tokens per message
    for the template; the reservation is reconciled to the worker's count afterwards."""

    def __init__(self, tokenizers: dict[str, Tokenizer]) -> None:
        self._tok = tokenizers

    def text(self, pool: str, text: str) -> int:
        tok = self._tok.get(pool)
        if tok is None:
            return -(-len(text.encode()) // _BYTES_PER_TOKEN_ESTIMATE)
        return len(tok.encode(text).ids)

    def completion(self, pool: str, prompt: Any) -> int:
        if isinstance(prompt, str):
            return self.text(pool, prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return self.text(pool, prompt[0])
        return len(prompt) if isinstance(prompt, list) else 0

    def chat(self, pool: str, messages: list[dict[str, Any]]) -> int:
        total = 3
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            total += _CHAT_TOKENS_PER_MESSAGE + self.text(pool, content or "")
        return total
