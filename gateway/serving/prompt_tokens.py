"""Counting prompt tokens the way the target pool's worker will, before dispatch.

A chat is counted as the worker sees it: every message rendered through the checkpoint's
chat template (roles, names and all), then tokenized. A quota or context limit checked on
`content` alone could be passed by padding the other fields. A pool without a local
tokenizer is estimated from the bytes of every field, at `_BYTES_PER_TOKEN_ESTIMATE`; the
reservation is reconciled to the worker's own count afterwards.
"""

import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from workers.api.types import ApiError, ChatMessage, Tool, ToolChoice

log = logging.getLogger(__name__)

_CHAT_TOKENS_PER_MESSAGE = 4  # role markers around each message in common chat templates
_BYTES_PER_TOKEN_ESTIMATE = 3  # fallback when a pool has no local tokenizer


class PoolTokenizer:
    """A checkpoint's tokenizer and chat template, loaded from its directory (or a bare
    tokenizer.json, which has no template)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        self.hf: Any = None
        self.fast: Any = None
        if p.is_dir() and (p / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(p))
            if not getattr(self.hf, "chat_template", None):
                self.hf = None
        from tokenizers import Tokenizer

        self.fast = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))

    def count(self, text: str) -> int:
        return len(self.fast.encode(text, add_special_tokens=False).ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str | None:
        """The prompt the worker will build (tools rendered by the template); None when the
        checkpoint has no template."""
        if self.hf is None:
            return None
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja errors on malformed messages
            raise ApiError(
                400, f"cannot render the chat template: {exc}", param="messages"
            ) from None


def load_tokenizer(path: str) -> PoolTokenizer:
    return PoolTokenizer(path)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the worker gives it to the template (`workers.server.tools.template_messages`):
    earlier calls with their arguments as objects, the call id a tool message answers."""
    msg: dict[str, Any] = {"role": m.role, "content": _text_of(m.content)}
    if m.tool_calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    return msg


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_dicts(tools: list[Tool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools the worker renders: none with `tool_choice: none`."""
    if not tools or choice == "none":
        return None
    out = []
    for t in tools:
        f: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            f["description"] = t.function.description
        f["parameters"] = (
            t.function.parameters if t.function.parameters is not None else {"type": "object"}
        )
        out.append({"type": "function", "function": f})
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p.get("text"), str))
    return content or ""


class PromptCounter:
    """Prompt tokens per pool: exact for token ids, tokenizer-exact for text (the chat
    template rendered) when the pool has a tokenizer, else a byte-based estimate."""

    def __init__(self, tokenizers: dict[str, PoolTokenizer]) -> None:
        self._tok = tokenizers

    def text(self, pool: str, text: str) -> int:
        tok = self._tok.get(pool)
        if tok is None:
            return -(-len(text.encode()) // _BYTES_PER_TOKEN_ESTIMATE)
        return tok.count(text)

    def completion(self, pool: str, prompt: str | list[Any]) -> int:
        if isinstance(prompt, str):
            return self.text(pool, prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return self.text(pool, prompt[0])
        return len(prompt)

    def chat(
        self,
        pool: str,
        messages: list[ChatMessage],
        tools: list[Tool] | None = None,
        tool_choice: ToolChoice | None = None,
    ) -> int:
        """The chat's prompt tokens, the tools' definitions rendered by the template."""
        tool_dicts = _tool_dicts(tools, tool_choice)
        tok = self._tok.get(pool)
        if tok is not None:
            rendered = tok.render_chat([_template_message(m) for m in messages], tool_dicts)
            if rendered is not None:
                return tok.count(rendered)
        total = 3 + (self.text(pool, json.dumps(tool_dicts)) if tool_dicts else 0)
        for m in messages:
            calls = json.dumps([msgspec.to_builtins(c) for c in m.tool_calls or []])
            fields = (m.role, m.name or "", _text_of(m.content), calls, m.tool_call_id or "")
            total += _CHAT_TOKENS_PER_MESSAGE + self.text(pool, "".join(fields))
        return total
