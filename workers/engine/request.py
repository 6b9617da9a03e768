"""A request's state inside the engine (hot, in-process: a plain class with slots)."""

import enum
from typing import Any

from workers.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the caller aborted (client disconnect)
    DEADLINE = "deadline"  # dropped at dequeue: its deadline had passed before any prefill
    ERROR = "error"  # the engine failed on this request alone; the output carries why


class Request:
    """One generation: prompt, output so far, and how far its KV has been computed.

    `num_computed_tokens` counts tokens of `all_token_ids` whose KV is in the cache; the
    scheduler's only job is to move it forward. Lower `priority` values are served first.
    `tenant` is whose work it is, for the scheduler's fair share of each step's prefill
    budget (None: one shared, anonymous tenant).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "params",
        "priority",
        "tenant",
        "arrival_time",
        "deadline",
        "cache_salt",
        "eos_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "finish_reason",
        "stop_reason",
        "arrival_step",
        "generator",
        "first_token_time",
        "first_scheduled_time",
        "guide",
        "fork_of",
        "resumed_chars",
        "resumed_text",
        "num_prefill_tokens",
        "prefill_s",
        "decode_s",
        "spec_token_ids",
        "spec_haystack",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        priority: int = 0,
        tenant: str | None = None,
        deadline: float | None = None,
        cache_salt: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.arrival_time = arrival_time
        self.deadline = deadline  # absolute, on the engine's clock; None = no deadline
        self.cache_salt = cache_salt
        self.eos_token_ids = eos_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.arrival_step = 0  # scheduler step at which it (re)joined the waiting queue
        self.generator: Any = None  # the runner's per-request RNG when `params.seed` is set
        self.first_token_time: float | None = None
        self.first_scheduled_time: float | None = None
        # Structured outputs: the grammar matcher (`workers.engine.structured.Guide`); None: free.
        self.guide: Any = None
        # n > 1: the id of the sample whose prompt KV this one reuses (held back until that
        # one's prefill is done, so the prompt's blocks come from the prefix cache).
        self.fork_of: str | None = None
        # Resumed from another replica's output (`LLMEngine.make_request`): the characters
        # of its text the client already has, and that text (what a tool-call reader read
        # of it). Its output tokens are set before it is added.
        self.resumed_chars = 0
        self.resumed_text = ""
        # Tokens its latest admission set out to prefill (the scheduler sets it): the
        # prompt, plus the output it already had when resumed or readmitted after a
        # preemption. A step computing positions below it is prefill; at or past it, decode.
        self.num_prefill_tokens = len(self.prompt_token_ids)
        # Engine seconds it was charged: its share of every step it was in (its tokens over
        # the step's, times the step's wall time), prefill and decode apart (the engine).
        self.prefill_s = 0.0
        self.decode_s = 0.0
        # Speculative decoding: the tokens proposed to follow its last token this step (the
        # engine sets them before scheduling; the scheduler trims them to what it schedules).
        # Never part of `all_token_ids` until verified and appended.
        self.spec_token_ids: list[int] = []
        # `all_token_ids` as the proposer searches them (`speculative.token_bytes`), kept
        # and extended by the new tokens each step; None until it first proposes.
        self.spec_haystack: bytearray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def num_draft_tokens(self, num_new: int) -> int:
        """Of `num_new` tokens scheduled from `num_computed_tokens`, those past its last token:
        a verify chunk's drafts (`spec_token_ids`); 0 for a decode or a prefill chunk."""
        return max(0, self.num_computed_tokens + num_new - self.num_tokens)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
