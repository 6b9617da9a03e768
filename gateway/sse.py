"""Server-sent events responses."""

from typing import Any

from litestar.response import Stream


class EventStream(Stream):
    """An SSE response. Litestar lets the handler's default media type win over a
    response's own, so this one insists on text/event-stream."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)
