"""Streams that outlive their replica: a Switchyard worker that fails mid-stream (its
connection lost, or silent past the idle bound) hands the stream to another replica of the
same pool, which continues the same answer at the exact token.

A resumable stream asks its worker for each chunk's token ids (`return_token_ids`). The
relay strips them before the client sees the chunk and keeps them here (`StreamLog`), with
the chunks as relayed. On a failure the stream is sent again, to a replica not tried yet,
as a continuation: the same body with the tokens relayed (`resume_token_ids`) and the
characters of text the client has (`resume_text_chars`); the worker prefills prompt plus
output (its prefix cache makes a replica that held them cheap), advances a seeded
generator past their draws, and streams on with no role chunk and nothing twice. Its
chunks are relayed under the first stream's id, and its usage counts the whole output,
so the client sees one stream, one usage and one charge.

What is resumed: one streamed sample (`n` 1), on a pool of Switchyard workers, at most
`GatewayConfig.stream_resumes` times, while the request's deadline has not passed. Tools
and structured outputs too: the worker advances the grammar's matcher over the output and
primes its tool-call reader with the text the first replica's had read (each chunk names
it, `text_chars`), so a call cut in its arguments is sent whole, once, by the continuation.
`n` > 1 and foreign kinds (which take no forced prefix) are not resumed: they end with
today's in-band error, charged what was relayed."""

import json
from typing import Any

from gateway.serving.plan import Plan

_IDS_KEY = b',"token_ids":['
_CHARS_KEY = b',"text_chars":'


def resumable(plan: Plan, kind: str, max_resumes: int) -> str | None:
    """Why a stream cannot be resumed, or None when it can."""
    if max_resumes <= 0:
        return "stream_resumes is 0"
    if not plan.stream or plan.n != 1:
        return "n > 1" if plan.stream else "not a stream"
    if kind != "switchyard":
        return f"a {kind} pool takes no forced prefix"
    return None


class StreamLog:
    """What one resumable stream relayed: its output chunks (as the client got them) and
    their token ids; and, once resumed, the id the continuation's chunks are renamed from."""

    __slots__ = ("token_ids", "chunks", "rename", "resumes", "complete", "reported_chars")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.chunks: list[bytes] = []
        # The characters of text the worker had handed out by its last chunk, as it said
        # (`text_chars`, after the ids); None: it did not say (the count is then ours).
        self.reported_chars: int | None = None
        # Every output chunk named its tokens: False when one did not (a worker that does
        # not know `return_token_ids`), and then what was relayed cannot be continued.
        self.complete = True
        self.rename: tuple[bytes, bytes] | None = None  # (the continuation's id, the first's)
        self.resumes = 0

    def renamed(self, data: bytes) -> bytes:
        """A continuation's event under the first stream's id."""
        if self.rename is None:
            return data
        return data.replace(self.rename[0], self.rename[1], 1)

    def output(self, data: bytes) -> bytes:
        """An output chunk's payload as the client is to get it: its `token_ids` noted and
        cut out (JSON escapes every quote in a string, so the key can only be the worker's
        own; the worker writes it last in its choice, after `finish_reason`, followed by
        `text_chars`, which is cut out and kept too)."""
        start = data.find(_IDS_KEY)
        if start == -1:
            self.complete = False
        else:
            end = data.find(b"]", start + len(_IDS_KEY))
            if end != -1:
                ids = data[start + len(_IDS_KEY) : end]
                if ids:
                    self.token_ids.extend(int(t) for t in ids.split(b","))
                end += 1
                if data.startswith(_CHARS_KEY, end):
                    digits = end + len(_CHARS_KEY)
                    stop = digits
                    while data[stop : stop + 1].isdigit():
                        stop += 1
                    if stop > digits:
                        self.reported_chars = int(data[digits:stop])
                        end = stop
                data = data[:start] + data[end:]
        self.chunks.append(data)
        return data

    def text_chars(self, chat: bool) -> int:
        """Characters of output text the worker handed out (what the continuation must not
        send again): as it said, else the text the client has."""
        if self.reported_chars is not None:
            return self.reported_chars
        total = 0
        for data in self.chunks:
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            for choice in chunk.get("choices") or []:
                if chat:
                    total += len((choice.get("delta") or {}).get("content") or "")
                else:
                    total += len(choice.get("text") or "")
        return total


def continuation(body: bytes, log: StreamLog, chat: bool) -> bytes:
    """The body that continues the stream `log` relayed; the original one when nothing was
    relayed yet (a fresh start is then indistinguishable to the client)."""
    if not log.token_ids:
        return body
    fields: dict[str, Any] = json.loads(body)
    fields["resume_token_ids"] = log.token_ids
    fields["resume_text_chars"] = log.text_chars(chat)
    fields["return_token_ids"] = True
    return json.dumps(fields).encode()


def quoted(request_id: str) -> bytes:
    return b'"' + request_id.encode() + b'"'
