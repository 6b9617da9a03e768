"""What the engine hands back: per-step deltas and whole generations."""

from dataclasses import dataclass

from workers.engine.request import FinishReason


@dataclass
class TokenLogprobs:
    """Log-probability of a chosen token and the top alternatives, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta, not the whole output)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # "" when the engine has no tokenizer
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # why the engine failed this request (finish_reason ERROR)
    # Engine seconds charged so far (totals, not deltas): the request's share of each step
    # it was in, its tokens over the step's times the step's wall time, split by whether
    # its tokens in that step were a prefill chunk or a decode.
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Completion:
    """A whole finished generation (what `LLMEngine.generate` returns)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int
    num_preemptions: int
