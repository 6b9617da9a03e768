"""The `logprobs` of a response, in OpenAI's two shapes, built as the tokens arrive.

A large answer (n samples x top alternatives x tokens, bounded by
`RequestLimits.max_logprob_entries`) is never walked at its end: each engine step's
entries are turned into JSON fragments when that step's output reaches the event loop
(`ChoiceLogprobs.add`), a few hundred entries at most, and the finished object is those
fragments joined (`ChoiceLogprobs.value`). Token texts are decoded once per token id for
the worker's life (`TokenTexts`), not once per entry.
"""

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from workers.engine.outputs import TokenLogprobs

_ENCODE = msgspec.json.Encoder().encode


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """Each token id as a response shows it: its text decoded alone (special tokens kept)
    and that text's UTF-8 bytes. Decoded once per id; at most the vocabulary is held.
    Without a tokenizer a token's text is its id. Event-loop use only (not thread-safe)."""

    __slots__ = ("_tokenizer", "_known")

    def __init__(self, tokenizer: _Decoder | None) -> None:
        self._tokenizer = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, its UTF-8 bytes); the list is shared: read it, never change it."""
        known = self._known.get(token_id)
        if known is None:
            tok = self._tokenizer
            text = tok.decode([token_id], skip_special_tokens=False) if tok else str(token_id)
            known = self._known[token_id] = (text, list(text.encode()))
        return known

    def __len__(self) -> int:
        return len(self._known)


def chat_entries(
    texts: TokenTexts, entries: list[TokenLogprobs], token_ids: list[int]
) -> list[dict[str, Any]]:
    """`logprobs.content` items of chat (ChatCompletionTokenLogprob), one per token."""
    content = []
    for lp, tid in zip(entries, token_ids, strict=True):
        text, raw = texts(tid)
        top = []
        for i, v in lp.top:
            t, b = texts(i)
            top.append({"token": t, "logprob": v, "bytes": b})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return content


class ChoiceLogprobs:
    """One choice's `logprobs` object: chat (`content`, `refusal`) or completions (`tokens`,
    `token_logprobs`, `top_logprobs`, `text_offset`, offsets counted across its tokens).

    `delta` gives the object of one stream chunk; `add` keeps a step's entries as encoded
    fragments and `value` joins them into the whole object, for a non-streaming answer.
    """

    __slots__ = ("_texts", "_chat", "_offset", "_parts")

    def __init__(self, texts: TokenTexts, chat: bool, after: Sequence[int] = ()) -> None:
        self._texts = texts
        self._chat = chat
        # Completions: characters of the choice's tokens so far (`after`: the tokens a
        # resumed stream's other replica sent).
        self._offset = sum(len(texts(t)[0]) for t in after)
        # Encoded items without their brackets, one list per array of the object.
        self._parts: list[list[bytes]] = [[]] if chat else [[], [], [], []]

    def _arrays(self, entries: list[TokenLogprobs], token_ids: list[int]) -> list[list[Any]]:
        if self._chat:
            return [chat_entries(self._texts, entries, token_ids)]
        texts = self._texts
        tokens = [texts(t)[0] for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        top = [{texts(i)[0]: v for i, v in lp.top} for lp in entries]
        return [tokens, [lp.logprob for lp in entries], top, offsets]

    def delta(self, entries: list[TokenLogprobs], token_ids: list[int]) -> dict[str, Any]:
        """The `logprobs` of a stream chunk carrying these tokens."""
        arrays = self._arrays(entries, token_ids)
        if self._chat:
            return {"content": arrays[0], "refusal": None}
        return dict(zip(_COMPLETION_KEYS, arrays, strict=True))

    def add(self, entries: list[TokenLogprobs], token_ids: list[int]) -> None:
        """Keep these tokens' entries (encoded now, in order) for `value`."""
        if not token_ids:
            return
        for parts, items in zip(self._parts, self._arrays(entries, token_ids), strict=True):
            parts.append(_ENCODE(items)[1:-1])

    def value(self) -> msgspec.Raw:
        """The whole object of every token `add`ed, as JSON (a join of the fragments)."""
        arrays = [b"[" + b",".join(parts) + b"]" for parts in self._parts]
        if self._chat:
            return msgspec.Raw(b'{"content":' + arrays[0] + b',"refusal":null}')
        fields = (
            b'"%s":%s' % (k.encode(), a) for k, a in zip(_COMPLETION_KEYS, arrays, strict=True)
        )
        return msgspec.Raw(b"{" + b",".join(fields) + b"}")


_COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
