"""Request bodies of the gateway's own API: bounded in size and nesting, then decoded strictly
into a msgspec Struct. A bad body is an `ApiError(400)` whose `param` names the offending
field as a dotted path (`limits.tokens_per_minute`), so it goes out OpenAI-shaped.

The decode is explicit rather than a typed `data: SomeStruct` parameter because Litestar
converts `data` with `strict=False`, where `"100"` would pass as a limit and `"false"` as a
boolean; msgspec's strict decode refuses both.
"""

import re
from typing import Any, TypeVar

import msgspec
from litestar import Request

from gateway.api.admin_base import provide_gateway
from gateway.serving.handler import read_body
from workers.api.types import ApiError
from workers.api.validation import check_json_depth

T = TypeVar("T")  # a msgspec Struct, or dict[str, Any] for a free-form JSON object

ADMIN_MAX_BODY_BYTES = 1024 * 1024
ADMIN_MAX_JSON_DEPTH = 16

# msgspec's messages end in "- at `$.a.b[0]`" (none at the top level); a dict's values are
# at "$.a[...]", which names no key, so the dict itself is the param.
_AT = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)(?:\[\.\.\.\])?[^`]*`$")
_FIELD = re.compile(r"^Object (?:contains unknown|missing required) field `(.+)`$", re.DOTALL)


def param_of(message: str) -> str | None:
    """The dotted path of the field a msgspec ValidationError message is about; None when it
    is about the body as a whole ("Expected `object`, got `array`")."""
    at = _AT.search(message)
    path = at.group(1).lstrip(".") if at else ""
    field = _FIELD.match(message[: at.start()] if at else message)
    if field:
        path = f"{path}.{field.group(1)}" if path else field.group(1)
    return path or None


def decode_struct(raw: bytes, kind: type[T], max_depth: int = ADMIN_MAX_JSON_DEPTH) -> T:
    """`raw` (JSON) as a `kind`, strictly typed; ApiError(400) naming the bad field."""
    check_json_depth(raw, max_depth)
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        param = param_of(str(exc))
        if param is None and str(exc).startswith("Expected `object`"):
            raise ApiError(400, "the request body must be a JSON object") from None
        raise ApiError(400, _with_fields(str(exc), kind), param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


async def read_struct(
    request: Request,
    kind: type[T],
    max_bytes: int = ADMIN_MAX_BODY_BYTES,
    max_depth: int = ADMIN_MAX_JSON_DEPTH,
    timeout_s: float | None = None,
) -> T:
    """The request's body as a `kind` (decode_struct); an empty body is `{}`, one over
    `max_bytes` a 413, one not in within `timeout_s` a 408 (None: the gateway's
    `body_timeout_s`, so a client trickling a body holds nothing for long)."""
    if timeout_s is None:
        timeout_s = provide_gateway(request.app.state).config.body_timeout_s
    raw = await read_body(request, timeout_s)
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    return decode_struct(raw or b"{}", kind, max_depth)


def _with_fields(message: str, kind: Any) -> str:
    """An unknown-field message with the fields the object may hold."""
    if not message.startswith("Object contains unknown field"):
        return message
    struct = _struct_at(msgspec.inspect.type_info(kind), (param_of(message) or "").split(".")[:-1])
    if struct is None:
        return message
    return f"{message}; fields are {', '.join(f.encode_name for f in struct.fields)}"


def _struct_at(info: Any, path: list[str]) -> "msgspec.inspect.StructType | None":
    for name in [*path, None]:
        while isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        if isinstance(info, msgspec.inspect.UnionType):
            info = next((t for t in info.types if isinstance(t, msgspec.inspect.StructType)), None)
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        if name is None:
            return info
        info = next((f.type for f in info.fields if f.encode_name == name), None)
    return None
