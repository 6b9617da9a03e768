"""`ShardedRunner`: the model runner of one rank of a shard group.

Rank 0 is driven by the engine like any runner: `execute(scheduled, block_tables)`. Before
computing, it sends the step to the other ranks (request ids, where each one's new tokens
start, the new token ids, block tables), then runs its own shard of the forward pass;
rank 0 alone samples, from logits gathered whole. The other ranks sit in `follow`,
rebuilding the same batch from the message and running the same `execute` on it, so the
batch order, the slot mapping and the decode workspace evolve identically on every rank.
"""

import logging
from pathlib import Path

import msgspec

from workers.engine.config import EngineConfig
from workers.engine.request import Request
from workers.runner.runner import ModelRunner, SampledToken
from workers.tp.group import PING, STEP, STOP, ShardGroup, ShardGroupError
from workers.tp.shard import RankShard

log = logging.getLogger(__name__)


class StepItem(msgspec.Struct, array_like=True):
    """One scheduled request of a step, as the other ranks need it."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int  # prompt + output so far (rank 0 samples when the step reaches it)
    new_token_ids: list[int]  # the tokens this step computes


class StepMessage(msgspec.Struct, array_like=True):
    items: list[StepItem]
    block_tables: dict[str, list[int]]


class _Window:
    """`all_token_ids` of a request on a rank other than 0: only this step's tokens."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        if not isinstance(s, slice) or (s.start or 0) < self.start:
            raise IndexError(f"only tokens from {self.start} were sent to this rank")
        stop = None if s.stop is None else s.stop - self.start
        return self.ids[(s.start or 0) - self.start : stop]


class _FollowerRequest:
    """The fields of a Request the runner reads before sampling (ranks other than 0)."""

    __slots__ = ("request_id", "num_computed_tokens", "num_tokens", "all_token_ids")

    def __init__(self, item: StepItem) -> None:
        self.request_id = item.request_id
        self.num_computed_tokens = item.num_computed_tokens
        self.num_tokens = item.num_tokens
        self.all_token_ids = _Window(item.num_computed_tokens, item.new_token_ids)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(StepMessage).decode


def encode_step(scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]) -> bytes:
    items = []
    for req, n in scheduled:
        start = req.num_computed_tokens
        items.append(
            StepItem(req.request_id, start, req.num_tokens, req.all_token_ids[start : start + n])
        )
    tables = {req.request_id: block_tables[req.request_id] for req, _ in scheduled}
    return _encode(StepMessage(items, tables))


def decode_step(payload: bytes) -> tuple[list[tuple[_FollowerRequest, int]], dict]:
    msg = _decode(payload)
    batch = [(_FollowerRequest(it), len(it.new_token_ids)) for it in msg.items]
    return batch, msg.block_tables


class ShardedRunner(ModelRunner):
    """A `ModelRunner` over this rank's shard; collectives go through `group`."""

    def __init__(self, model_dir: Path, config: EngineConfig, group: ShardGroup) -> None:
        self.group = group
        self._forward_done = False
        super().__init__(model_dir, config, RankShard(group))
        forward = self.model.forward

        def forward_as_one_unit(*args, **kwargs):
            try:
                logits = forward(*args, **kwargs)
            except ShardGroupError:
                raise
            except Exception as exc:  # the ranks' collectives are out of step now
                why = f"rank {group.rank}: the forward pass failed: {exc!r}"
                group.mark_failed(exc)
                raise ShardGroupError(why) from exc
            self._forward_done = True
            return logits

        self.model.forward = forward_as_one_unit

    def execute(
        self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]
    ) -> dict[str, SampledToken]:
        """Rank 0: send the step, run this shard, sample. A failure after the forward pass
        (sampling, one request's grammar) is the request's own and may be retried; any
        failure before it leaves the other ranks mid-step, so it fails the group."""
        with self.group.lock:
            self._forward_done = False
            try:
                self.group.send(STEP, encode_step(scheduled, block_tables))
                return super().execute(scheduled, block_tables)
            except Exception as exc:
                if self._forward_done:
                    raise
                why = f"rank 0: a step failed before its forward pass: {exc!r}"
                self.group.mark_failed(exc)
                raise ShardGroupError(why) from exc

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's steps until STOP. Raises ShardGroupError when
        rank 0 goes quiet for longer than a heartbeat plus the collective timeout."""
        cfg = self.group.config
        wait_s = cfg.heartbeat_s + cfg.collective_timeout_s
        num_steps = 0
        while True:
            command, payload = self.group.receive(wait_s)
            if command == STEP:
                batch, tables = decode_step(payload)
                super().execute(batch, tables)
                num_steps += 1
            elif command == STOP:
                log.info("rank %d: stopped by rank 0 after %d steps", self.group.rank, num_steps)
                return
            elif command != PING:
                raise ShardGroupError(f"rank {self.group.rank}: unknown command {command}")
