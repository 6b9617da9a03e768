"""Counting prompt tokens the way the target pool's worker will, before dispatch.

A chat is counted as the worker sees it: every message rendered through the checkpoint's
chat template (roles, names and all), then tokenized. A quota or context limit checked on
`content` alone could be passed by padding the other fields. A pool without a local
tokenizer is estimated from the bytes of every field, at `_BYTES_PER_TOKEN_ESTIMATE`; the
reservation is reconciled to the worker's own count afterwards.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from workers.api.tool_prompt import renders_tools, with_tool_prompt
from workers.api.types import ApiError, ChatMessage, Tool, ToolChoice

log = logging.getLogger(__name__)

_CHAT_TOKENS_PER_MESSAGE = 4  # role markers around each message in common chat templates
_BYTES_PER_TOKEN_ESTIMATE = 3  # fallback when a pool has no local tokenizer


class PromptTooLong(Exception):
    """The prompt's bytes alone prove it longer than the limit: it has at least
    `min_tokens` tokens (it was not tokenized)."""

    def __init__(self, min_tokens: int) -> None:
        super().__init__(f"the prompt has at least {min_tokens} tokens")
        self.min_tokens = min_tokens


@dataclass(frozen=True, slots=True)
class ByteBound:
    """What a tokenizer lets a text's bytes prove: no token stands for more than
    `max_token_bytes` of its UTF-8, once the `uncovered` bytes (those with no token of their
    own, which the tokenizer drops) are left out."""

    max_token_bytes: int
    uncovered: bytes = b""

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can be: one linear pass, no tokenizing."""
        data = text.encode()
        if self.uncovered:
            data = data.translate(None, self.uncovered)
        return -(-len(data) // self.max_token_bytes)


class PoolTokenizer:
    """A checkpoint's tokenizer and chat template, loaded from its directory (or a bare
    tokenizer.json, which has no template). `bound`: what a text's bytes prove about its
    tokens (None: nothing, the pipeline may drop or merge text without limit)."""

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
        self.bound = byte_bound(json.loads(self.fast.to_str()))

    def count(self, text: str, limit_tokens: int | None = None) -> int:
        """The text's tokens. `limit_tokens`: raise PromptTooLong, before tokenizing, when
        the text's bytes prove it has more."""
        if limit_tokens is not None and self.bound is not None:
            min_tokens = self.bound.min_tokens(text)
            if min_tokens > limit_tokens:
                raise PromptTooLong(min_tokens)
        # encode_batch releases the GIL while it works (encode holds it): a count on a
        # thread leaves the event loop running.
        return len(self.fast.encode_batch([text], add_special_tokens=False)[0].ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str | None:
        """The prompt the worker will build (tools rendered by the template, or by the
        built-in tool prompt where the template has no tool support); None when the
        checkpoint has no template."""
        if self.hf is None:
            return None
        template = self.hf.chat_template
        if not renders_tools(template if isinstance(template, str) else None):  # as the worker
            messages, tools = with_tool_prompt(messages, tools), None
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


# Normalizers by the most they can shrink a text's UTF-8 bytes (NFKC folds a 3-byte
# fullwidth quote to 1 byte, composes three 3-byte jamo into one syllable; a code point is
# at most 4 bytes). Any other (Strip, StripAccents, BertNormalizer, Precompiled, a regex
# Replace) can drop text without bound.
_NORMALIZER_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
# Pre-tokenizers that keep every byte (a Split or Punctuation only when it keeps its matches).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})


def byte_bound(spec: dict[str, Any]) -> ByteBound | None:
    """What a tokenizer.json `spec` lets a text's bytes prove (`ByteBound`); None where the
    pipeline may leave text uncovered without limit (an unknown token standing for a whole
    word, dropped whitespace, a normalizer that deletes)."""
    shrink = _shrink(spec.get("normalizer"))
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if shrink is None or pre is None or model.get("type") != "BPE":
        return None
    if not isinstance(vocab, dict) or not vocab:
        return None
    uncovered = b""
    if "ByteLevel" in pre:
        chars = _byte_level_chars()
        uncovered = bytes(b for b in range(256) if chars[b] not in vocab)
        if uncovered and spec.get("normalizer") is not None:
            return None  # what is dropped would depend on what the normalizer made
        longest = max(len(token) for token in vocab)  # one character per byte
    elif model.get("byte_fallback"):
        if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None  # a byte without its fallback token becomes an unknown one
        longest = max(len(token.encode()) for token in vocab)
    else:
        return None  # an unknown character becomes an unknown token, or nothing
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None  # such a token takes in the whitespace beside it, however long
    longest_added = [len(a.get("content", "").encode()) for a in added]
    return ByteBound(max([longest * shrink, *longest_added]), uncovered)


def _byte_level_chars() -> dict[int, str]:
    """The character the ByteLevel pre-tokenizer stands each byte for (GPT-2's map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + n)
    return chars


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or []:
            factor = _shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if not isinstance(pattern, str) or not pattern or not content:
            return None
        return -(-len(pattern.encode()) // len(content.encode()))
    return _NORMALIZER_SHRINK.get(kind or "")


def _pre_tokenizers(pre: dict[str, Any] | None) -> set[str] | None:
    if pre is None:
        return set()
    kind = pre.get("type")
    if kind == "Sequence":
        kinds: set[str] = set()
        for part in pre.get("pretokenizers") or []:
            found = _pre_tokenizers(part)
            if found is None:
                return None
            kinds |= found
        return kinds
    if kind not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return None
    return {kind}


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
    template rendered) when the pool has a tokenizer, else a byte-based estimate.

    `limit_tokens`: the most prompt tokens the request may have; a text whose bytes prove
    it longer raises PromptTooLong before it is tokenized (where the pool's tokenizer has a
    `bound`). A count may be over the limit either way: the caller checks it."""

    def __init__(self, tokenizers: dict[str, PoolTokenizer]) -> None:
        self._tok = tokenizers

    def exact_for(self, pool: str) -> bool:
        """Whether text prompts of `pool` are counted by its tokenizer (else estimated)."""
        return pool in self._tok

    def text(self, pool: str, text: str, limit_tokens: int | None = None) -> int:
        tok = self._tok.get(pool)
        if tok is None:
            return -(-len(text.encode()) // _BYTES_PER_TOKEN_ESTIMATE)
        return tok.count(text, limit_tokens)

    def completion(
        self, pool: str, prompt: str | list[Any], limit_tokens: int | None = None
    ) -> int:
        if isinstance(prompt, str):
            return self.text(pool, prompt, limit_tokens)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return self.text(pool, prompt[0], limit_tokens)
        return len(prompt)

    def chat(
        self,
        pool: str,
        messages: list[ChatMessage],
        tools: list[Tool] | None = None,
        tool_choice: ToolChoice | None = None,
        limit_tokens: int | None = None,
    ) -> int:
        """The chat's prompt tokens, the tools' definitions rendered by the template."""
        tool_dicts = _tool_dicts(tools, tool_choice)
        tok = self._tok.get(pool)
        if tok is not None:
            rendered = tok.render_chat([_template_message(m) for m in messages], tool_dicts)
            if rendered is not None:
                return tok.count(rendered, limit_tokens)
        # Each part is at most the whole: a part proven over the limit proves the whole.
        total = 3 + (self.text(pool, json.dumps(tool_dicts), limit_tokens) if tool_dicts else 0)
        for m in messages:
            calls = json.dumps([msgspec.to_builtins(c) for c in m.tool_calls or []])
            fields = (m.role, m.name or "", _text_of(m.content), calls, m.tool_call_id or "")
            total += _CHAT_TOKENS_PER_MESSAGE + self.text(pool, "".join(fields), limit_tokens)
        return total
