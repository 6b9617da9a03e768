"""Per-request sampling parameters, validated once at admission."""

from dataclasses import dataclass, field

from workers.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| at most this (OpenAI's range)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` and `min_p == 0` turn
    those filters off. `seed` makes a sampled request reproducible on its own.
    `logprobs` is None for none, or the number of top alternatives (0 = only the
    chosen token's log-probability). `logit_bias` maps token ids to what is added to
    their logits before any sampling (greedy included), in [-100, 100]; log-probabilities
    stay those of the model's own distribution. `num_speculative_tokens`: drafts the
    engine may verify per step for this request (speculative decoding, within the pool's
    `engine.speculative.num_tokens`); 0 = off, None = the pool's default.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be an integer >= 1", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature must be between 0 and 2", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k must be an integer >= 0 (0 disables)", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens must be between 0 and max_tokens", "min_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids must be non-negative integers", "stop_token_ids"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs"
            )
        n = self.num_speculative_tokens
        if n is not None and (not isinstance(n, int) or n < 0):
            raise InvalidRequestError(
                "num_speculative_tokens must be an integer >= 0 (0 = off)",
                "num_speculative_tokens",
            )
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise InvalidRequestError("logit_bias keys must be token ids >= 0", "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # False for NaN
                raise InvalidRequestError(
                    f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
                    "logit_bias",
                )
