"""Relaying a worker's SSE stream to the client as bytes.

Events are forwarded as received (never re-encoded), several per write when the worker
sent several at once. Only the events that carry usage or an error are decoded, through
the wire contract (`workers.api.types.StreamChunk`): the usage chunk is noted (and dropped
unless the client asked for it), and an error event ends the relay after forwarding it.
Every other event is an output chunk, recognised by its bytes, and counts one token (the
worker's contract: one chunk per token) for the charge of a stream that is cut short; a
foreign server's chat chunk that only announces the role (no content yet) does not.
After `[DONE]` the rest of the upstream body is drained so its keep-alive connection is
reused; a byte of body after it is one nobody asked for, and drops the connection.

The worker is untrusted input: its stream may take at most `max_bytes` in all (an event
that never ends included), and the usage it reports is billed clamped (`plan.billed`)
and forwarded as billed, so the client is told what it is charged.

Recognising by bytes is sound because JSON escapes every quote inside a string: the key
`"usage"` (quote, usage, quote) or `"choices"` cannot occur inside any text a model
wrote, only as the chunk's own keys, however the JSON is spaced.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from gateway.serving.flight import Attempt
from gateway.serving.plan import Plan, billed, counts, note_usage, with_usage_cost
from gateway.serving.resume import StreamLog
from quota.budget import NANOS
from workers.api.client import UpstreamError, UpstreamResponse
from workers.api.types import Usage, parse_chunk

DONE = b"data: [DONE]\n\n"
_DECODE_IF = (b'"usage"', b'"error"')  # the only events whose content the relay reads
_OUTPUT_CHUNK = b'"choices"'  # without usage: an output chunk (the worker sends no other)
_ROLE = b'"role"'  # a chat stream's first chunk (a worker's carries its first token too)


class StreamTimeout(Exception):
    """The worker sent nothing for `idle_s` (`deadline` False), or the request's deadline
    passed mid-stream (`deadline` True)."""

    def __init__(self, message: str, deadline: bool) -> None:
        super().__init__(message)
        self.deadline = deadline


class StreamAborted(Exception):
    """The gateway cut the stream (its flight was aborted: shutdown)."""


class StreamHandedOver(UpstreamError):
    """A draining worker handed a resumable stream over (its `handed_over` event): it is
    to go on on another replica, never reach the client as an error."""


HANDED_OVER = "handed_over"  # the worker's error code for it (workers/server/responses.py)


async def _next(
    it: AsyncIterator[bytes], attempt: Attempt, deadline: float, idle_s: float
) -> bytes | None:
    """The upstream body's next raw piece (None at its end), awaited within the idle bound
    and the deadline. The pending read is on `attempt.reading`, so an abort can cancel it."""
    left_s = deadline - time.monotonic()
    wait_s = min(idle_s, left_s)
    if wait_s <= 0:
        raise StreamTimeout("the request's deadline passed mid-stream", deadline=True)
    read = asyncio.ensure_future(anext(it))
    attempt.reading = read
    try:
        done, _ = await asyncio.wait({read}, timeout=wait_s)
    finally:
        attempt.reading = None
        if not read.done():
            read.cancel()
    if not done:
        if left_s <= idle_s:
            raise StreamTimeout("the request's deadline passed mid-stream", deadline=True)
        raise StreamTimeout(f"the worker sent nothing for {wait_s:.1f} s", deadline=False)
    if read.cancelled():
        raise StreamAborted("the stream was cut by the gateway")
    try:
        return read.result()
    except StopAsyncIteration:
        return None


async def relay(
    upstream: UpstreamResponse,
    attempt: Attempt,
    plan: Plan,
    idle_s: float,
    max_bytes: int,
    log: StreamLog | None = None,
    cost: Callable[[], int] | None = None,
) -> AsyncIterator[bytes]:
    """Forward the upstream's SSE events, noting usage and progress in `attempt.served`.
    `log`: a resumable stream's (`gateway.serving.resume`): output chunks' token ids are
    kept there and cut out, and a continuation's events renamed to the first stream's id.

    Ends after `[DONE]` or an error event. Raises UpstreamError when the worker dies
    mid-stream or sends more than `max_bytes` (StreamHandedOver when, draining, it hands a
    resumable stream over), StreamTimeout when it goes silent or the
    request's deadline passes, StreamAborted when the gateway cuts it; the caller reports
    those in-band. `cost`: what the request has cost so far (nanos), told in the usage
    event as `usage.cost` (None: unpriced, the event as the worker sent it).
    """
    served = attempt.served
    pending: list[bytes] = []  # the pieces of an event not ended yet
    received = 0
    it = upstream.aiter_raw()
    while (piece := await _next(it, attempt, plan.deadline, idle_s)) is not None:
        received += len(piece)
        if received > max_bytes:
            raise UpstreamError(f"the worker's stream went past {max_bytes} bytes")
        if pending:
            # Joined only once an event ends (in this piece, or across the boundary), so
            # an event arriving in many pieces costs its length, not its length squared.
            if b"\n\n" not in piece and not (piece[:1] == b"\n" and pending[-1][-1:] == b"\n"):
                pending.append(piece)
                continue
            pending.append(piece)
            buffer = b"".join(pending)
            pending.clear()
        elif b"\n\n" not in piece:
            pending.append(piece)
            continue
        else:
            buffer = piece
        *events, rest = buffer.split(b"\n\n")
        if rest:
            pending.append(rest)
        out: list[bytes] = []
        finished = False
        for event in events:
            event = event.strip(b"\r\n")
            if not event:
                continue
            if event.startswith(b":"):
                out.append(event + b"\n\n")  # the worker's heartbeat
                continue
            if not event.startswith(b"data:"):
                continue
            data = event[5:].strip()
            if data == b"[DONE]":
                out.append(DONE)
                finished = True
                break
            if log is not None and log.rename is not None:
                data = log.renamed(data)
            if _DECODE_IF[0] not in data and _DECODE_IF[1] not in data:
                if _OUTPUT_CHUNK in data and not (_ROLE in data and _announces_only(data)):
                    served.tokens_relayed += 1
                if log is not None and _OUTPUT_CHUNK in data:
                    data = log.output(data)
                out.append(b"data: " + data + b"\n\n")
                continue
            chunk = parse_chunk(data)
            if chunk is not None:
                if chunk.choices:
                    served.tokens_relayed += 1
                if chunk.usage is not None:
                    note_usage(served, chunk.usage)
                    if not plan.wants_usage:
                        if not chunk.choices:
                            continue
                        # A server that puts usage on its last output chunk (llama-server's
                        # completions): the chunk goes on, without what was not asked for.
                        data = _without_usage(data)
                    else:
                        data = _as_billed(data, chunk.usage, plan, attempt, cost)
                if chunk.error is not None:
                    if log is not None and chunk.error.code == HANDED_OVER:
                        if out:
                            yield b"".join(out)
                        raise StreamHandedOver(chunk.error.message)
                    out.append(b"data: " + data + b"\n\n" + DONE)
                    finished = True
                    break
            out.append(b"data: " + data + b"\n\n")
        if out:
            yield b"".join(out)
        if finished:
            await _drain(it)
            return


def _as_billed(
    data: bytes,
    reported: Usage,
    plan: Plan,
    attempt: Attempt,
    cost: Callable[[], int] | None = None,
) -> bytes:
    """The usage event as the client is to see it: as sent, unless the worker claimed more
    than the request could have produced (then with the usage it is billed), and with what
    it cost where the request is priced."""
    bill = billed(plan, attempt.served)
    same = counts(reported) == counts(bill)
    if same and cost is None:
        return data
    if same and cost is not None:
        spliced = with_usage_cost(data, cost() / NANOS)
        if spliced is not None:
            return spliced
    chunk = msgspec.json.decode(data)  # an object: parse_chunk decoded it
    if not same:
        chunk["usage"] = msgspec.to_builtins(bill)
    if cost is not None and isinstance(chunk.get("usage"), dict):
        chunk["usage"]["cost"] = cost() / NANOS
    return msgspec.json.encode(chunk)


def _announces_only(data: bytes) -> bool:
    """A chunk that only announces the assistant's role, with no content or tool call yet:
    vLLM's and llama-server's first chat chunk, sent before any token. Not a token, so
    neither the first token's time nor the count of what was relayed takes it."""
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or delta.get("content") or delta.get("tool_calls"):
            return False
    return True


def _without_usage(data: bytes) -> bytes:
    chunk = msgspec.json.decode(data)  # an object: parse_chunk decoded it
    chunk.pop("usage", None)
    return msgspec.json.encode(chunk)


async def _drain(it: AsyncIterator[bytes]) -> None:
    """Read what is left (the chunked terminator) so the connection can be reused. Body
    bytes there are unasked for: reading stops, so closing drops the connection."""
    try:
        async with asyncio.timeout(1.0):
            async for piece in it:
                if piece:
                    return
    except (UpstreamError, TimeoutError):
        pass
