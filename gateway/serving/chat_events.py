"""What the translations of a chat-completions SSE stream into another API's events share
(`messages_stream.MessagesStream`, `responses_stream.ResponsesStream`): cutting the bytes
relayed into events as they arrive (an event split across writes waits for its end) and
decoding each `data:` payload. Pure: no I/O."""

import json
from typing import Any


class ChatEvents:
    """`feed(bytes)` returns the other API's events those bytes complete: each decoded
    chunk goes to `chunk`, the stream's `[DONE]` to `done`; nothing once `ended`."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    @property
    def ended(self) -> bool:
        raise NotImplementedError

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def done(self) -> list[bytes]:
        raise NotImplementedError

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        while not self.ended and b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            for line in raw.split(b"\n"):
                if line.startswith(b"data:"):
                    out.extend(self.event(line[5:].strip()))
        return b"".join(out)

    def event(self, payload: bytes) -> list[bytes]:
        """The events for one chat `data:` payload (none for one that is not JSON)."""
        if self.ended:
            return []
        if payload == b"[DONE]":
            return self.done()
        try:
            chunk = json.loads(payload)
        except ValueError:
            return []
        return self.chunk(chunk) if isinstance(chunk, dict) else []
