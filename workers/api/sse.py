"""Server-sent events over Litestar: the response type the worker and the gateway stream.

Separate from the wire types so that importing those pulls in no web framework.
"""

import asyncio
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse

MEDIA_TYPE = "text/event-stream"
_ITERABLES = (Iterable, Iterator, AsyncIterable, AsyncIterator)


class EventStream(Stream):
    """An SSE response, always `text/event-stream` (Litestar lets a handler's default
    media type win over a response's own), sent by `EventStreamResponse`."""

    def to_asgi_response(  # type: ignore[override]
        self,
        app: Any,
        request: Any,
        *,
        background: Any = None,
        cookies: Any = None,
        encoded_headers: Any = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: Any = None,
        status_code: int | None = None,
        type_encoders: Any = None,
    ) -> "EventStreamResponse":
        headers = {**headers, **self.headers} if headers is not None else self.headers
        cookies = self.cookies if cookies is None else itertools.chain(self.cookies, cookies)
        iterator = self.iterator
        if not isinstance(iterator, _ITERABLES) and callable(iterator):
            iterator = iterator()
        return EventStreamResponse(
            background=self.background or background,
            content_length=0,
            cookies=cookies,
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers=headers,
            is_head_response=is_head_response,
            iterator=iterator,
            media_type=MEDIA_TYPE,
            status_code=self.status_code or status_code,
        )


class EventStreamResponse(ASGIStreamingResponse):
    """Litestar's streaming response, its body sent without an anyio task group: one task
    relays the events while this one waits for the client to leave, and the relay is
    cancelled if it does (so the events' iterator runs its cleanup: a worker aborts the
    request, the gateway settles it). Litestar's task group cost ~6% of the gateway's CPU
    per 16-event stream, most of it anyio delivering the cancellation of the listener
    once the stream had ended."""

    __slots__ = ()

    async def send_body(self, send: Any, receive: Any) -> None:
        streaming = asyncio.ensure_future(self._stream(send))
        listening = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            if not streaming.done():  # the client left (or this task is cancelled)
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
        if not streaming.cancelled():
            streaming.result()  # the relay's own error, if it had one


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
