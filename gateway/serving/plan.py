"""A public request, decoded once into a typed struct, and the pure functions that price it,
bound it and build what is sent upstream. No I/O here: collaborators (tokenizers, the
router, Redis) are called by `gateway.serving.intake`, which feeds their answers in.

Fields a tenant sends that are the operator's are overridden in `upstream_body`:
`priority` (the request's own, checked against its tenant's `priority_ceiling` at intake,
so a tenant cannot promote itself),
`cache_salt` (the tenant's own prefix-cache namespace) and `ignore_eos` (off). Every
other field of the OpenAI request structs in `workers.api.types` passes through; a field
they do not have is refused at decoding (400 `unknown_field`), never dropped.
"""

import math
from dataclasses import dataclass

import msgspec

from cascade.policy import EscalationSettings
from gateway.capacity.balancer import prefix_key
from workers.api.types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    StreamOptions,
    Usage,
)
from workers.api.upstreams.fields import CLIENT_EXTRAS, fields_of, unsupported


class GatewayCompletionRequest(CompletionRequest, kw_only=True, omit_defaults=True):
    switchyard_threshold: float | None = None  # this request's cascade threshold (auto)


class GatewayChatRequest(ChatCompletionRequest, kw_only=True, omit_defaults=True):
    switchyard_threshold: float | None = None


PublicRequest = GatewayCompletionRequest | GatewayChatRequest

MAX_TIMEOUT_HEADER_S = 86_400.0  # an `x-request-timeout` above a day is a mistake: 400


@dataclass(frozen=True, slots=True)
class Plan:
    """What the gateway decided for one request before reserving and queueing it."""

    request_id: str
    tenant_id: str
    pool: str
    route: str  # x-switchyard-route: forced | classifier | overflow | fallback
    chat: bool
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk of a stream
    client_logprobs: bool  # the client asked for logprobs (escalation may add them)
    prompt_tokens: int  # as the pool's worker will count them (template rendered)
    max_tokens: int
    deadline: float  # monotonic seconds
    affinity: bytes | None  # prefix hash for replica affinity
    score: float | None = None  # auto routing only
    threshold: float | None = None
    escalation: EscalationSettings | None = None  # set when an unsure answer re-runs
    n: int = 1  # samples: each may generate max_tokens; the prompt is computed once
    structured: bool = False  # tools or a response_format schema constrain the output
    # Its latency class: the request's `priority` (lower is more urgent), within its
    # tenant's ceiling; scales the pool's TTFT target (`GatewayConfig.priority_ttft_scale`).
    priority: int = 0

    @property
    def attempt_tokens(self) -> int:
        """What one attempt may use: prompt plus every token its `n` samples may generate."""
        return self.prompt_tokens + self.n * self.max_tokens

    @property
    def reserve_tokens(self) -> int:
        """What to reserve before anything runs: every attempt the request may make (an
        escalated request runs twice, and is charged for both)."""
        return self.attempt_tokens * (2 if self.escalation is not None else 1)


def max_tokens_of(req: PublicRequest, default: int, cap: int) -> int:
    """The request's output budget: `max_completion_tokens` (chat) or `max_tokens`, else
    `default`; 400 outside 1..cap."""
    name, value = "max_tokens", req.max_tokens
    if isinstance(req, GatewayChatRequest) and req.max_completion_tokens is not None:
        name, value = "max_completion_tokens", req.max_completion_tokens
    if value is None:
        return default
    if not 1 <= value <= cap:
        raise ApiError(400, f"{name} must be an integer between 1 and {cap}", param=name)
    return value


def check_context(
    prompt_tokens: int,
    max_tokens: int,
    tenant_limit: int | None,
    model_limit: int | None,
    at_least: bool = False,
) -> None:
    """400 when prompt + max_tokens passes the key's context limit or the model's.
    `at_least`: `prompt_tokens` is a lower bound (the prompt was refused uncounted)."""
    total = prompt_tokens + max_tokens
    counted = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    for limit, whose in ((tenant_limit, "this key's"), (model_limit, "the model's")):
        if limit is not None and total > limit:
            raise ApiError(
                400,
                f"prompt ({counted} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"{whose} context limit of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )


def prompt_room(max_tokens: int, *limits: int | None) -> int | None:
    """The most prompt tokens `check_context` can accept beside `max_tokens` under every
    given context limit (None: no limit); None when no limit is given."""
    known = [limit for limit in limits if limit is not None]
    return min(known) - max_tokens if known else None


def timeout_of(header: str | None, default_s: float) -> float:
    """Seconds the client gives the request: `x-request-timeout` (capped at `default_s`),
    else `default_s`. 400 for anything but a finite positive number up to a day."""
    if header is None:
        return default_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_HEADER_S):
        raise ApiError(
            400,
            f"x-request-timeout must be a number of seconds in (0, {MAX_TIMEOUT_HEADER_S:g}]",
            param="x-request-timeout",
            code="invalid_header",
        )
    return min(value, default_s)


def affinity_of(req: PublicRequest) -> bytes | None:
    """The prefix that requests sharing a cache should agree on: the system prompt of a
    chat, the head of a completion prompt."""
    if isinstance(req, GatewayChatRequest):
        first = req.messages[0] if req.messages else None
        if first is not None and first.role == "system" and isinstance(first.content, str):
            return prefix_key(first.content) if first.content else None
        return None
    prompt = req.prompt
    if isinstance(prompt, list):
        ints = [p for p in prompt[:256] if isinstance(p, int)]
        return prefix_key(ints) if ints else None
    return prefix_key(prompt) if prompt else None


def is_structured(req: PublicRequest) -> bool:
    """Tools or a JSON response format: the cascade's flag for constrained output."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        return True
    if isinstance(req, GatewayChatRequest):
        return bool(req.tools) and req.tool_choice != "none"
    return False


def client_logprobs(req: PublicRequest) -> bool:
    if isinstance(req, GatewayChatRequest):
        return req.logprobs
    return req.logprobs is not None


def check_upstream_fields(req: PublicRequest, pool: str, kind: str) -> None:
    """Refuse (400) a request that sets an extra `pool`'s kind of server cannot honour: it
    would be dropped or refused there, never answered as asked."""
    bad = unsupported(kind, {name: getattr(req, name) for name in CLIENT_EXTRAS})
    if bad:
        raise ApiError(
            400,
            f"model {pool!r} is served by {kind}, which does not take `{bad[0]}`",
            param=bad[0],
            code="unsupported_parameter",
        )


def upstream_body(
    req: PublicRequest,
    plan: Plan,
    cache_salt: str,
    pool: str | None = None,
    with_logprobs: bool = False,
    kind: str = "switchyard",
    model: str | None = None,
    token_ids: bool = False,
) -> bytes:
    """The JSON body sent to a worker of `pool` (default: the plan's): the tenant's request
    with the model set, the output budget explicit, usage always requested on streams, the
    operator's fields overridden and gateway-only fields removed. `with_logprobs`: ask for
    the chosen tokens' logprobs (escalation needs them to judge the answer). `kind`: the
    pool's kind of server, which is sent only the operator fields it takes
    (`workers.api.upstreams.fields`); `model`: the name it serves (default: the pool's)."""
    fields = fields_of(kind)
    changes: dict = {
        "model": model or pool or plan.pool,
        "max_tokens": plan.max_tokens,
        "priority": plan.priority if fields.priority else 0,
        "cache_salt": cache_salt if fields.cache_salt else None,
        "ignore_eos": False,
        "switchyard_threshold": None,
    }
    if kind != "switchyard":  # a speed hint our engine takes; another server may refuse it
        changes["num_speculative_tokens"] = None
    if isinstance(req, GatewayChatRequest):
        changes["max_completion_tokens"] = None
        if with_logprobs:
            changes["logprobs"] = True
    elif with_logprobs and req.logprobs is None:
        changes["logprobs"] = 0
    if plan.stream:
        changes["stream_options"] = StreamOptions(include_usage=True)
    if token_ids:  # a resumable stream (gateway/serving/resume.py): each chunk's token ids
        changes["return_token_ids"] = True
    return msgspec.json.encode(msgspec.structs.replace(req, **changes))


@dataclass(slots=True)
class Served:
    """What one attempt delivered, for the charge."""

    accepted: bool = False  # a worker took the request (status 200) and started on it
    usage_prompt_tokens: int | None = None  # from the worker's usage, when it came
    usage_completion_tokens: int | None = None
    usage_cached_tokens: int = 0  # prompt tokens the worker's prefix cache served
    tokens_relayed: int = 0  # chunks with output forwarded (one per token from a worker)
    # The engine seconds the worker reported for it (usage.compute_seconds, prefill plus
    # decode; None: not reported). Untrusted: bounded by the attempt's wall time when priced.
    usage_compute_s: float | None = None


def note_usage(served: Served, usage: Usage | None) -> None:
    """Keep the worker's usage report (None: it sent none)."""
    if usage is None:
        return
    served.usage_prompt_tokens = usage.prompt_tokens
    served.usage_completion_tokens = usage.completion_tokens
    details = usage.prompt_tokens_details
    served.usage_cached_tokens = details.cached_tokens if details is not None else 0
    compute = usage.compute()
    if compute is not None and math.isfinite(compute.prefill_s + compute.decode_s):
        served.usage_compute_s = max(0.0, compute.prefill_s) + max(0.0, compute.decode_s)


def billed(plan: Plan, served: Served) -> Usage:
    """What one attempt is billed. The worker's usage when it came, clamped to what the
    request could have produced (a worker is untrusted input): the completion to
    `n * max_tokens` and, on a stream, to the output chunks relayed (one per token); the
    whole to the attempt's budget (`attempt_tokens`: the gateway's prompt count is an
    estimate where it has no tokenizer, so the worker's may be larger); cached tokens to
    the prompt. Else, for a request a worker accepted and then lost (stream cut, client
    gone), the prompt plus what was relayed, never more than the attempt's budget; else
    nothing (refused, never dispatched)."""
    budget = plan.n * plan.max_tokens
    if served.usage_completion_tokens is not None:
        if plan.stream:
            budget = min(budget, served.tokens_relayed)
        completion = _clamp(served.usage_completion_tokens, budget)
        reported = served.usage_prompt_tokens
        reported = plan.prompt_tokens if reported is None else reported
        prompt = _clamp(reported, plan.attempt_tokens - completion)
        cached = _clamp(served.usage_cached_tokens, prompt)
    elif served.accepted:
        prompt, completion, cached = plan.prompt_tokens, min(served.tokens_relayed, budget), 0
    else:
        prompt = completion = cached = 0
    details = PromptTokensDetails(cached) if cached else None
    return Usage(prompt, completion, prompt + completion, details)


def _clamp(value: int, most: int) -> int:
    return max(0, min(value, most))


def counts(usage: Usage) -> tuple[int, int, int]:
    """(prompt, completion, total) tokens: what a bill and a worker's report compare on."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def charge(plan: Plan, served: Served) -> int:
    """Tokens to charge for one attempt: `billed(...).total_tokens`."""
    return billed(plan, served).total_tokens


_USAGE_KEY = b'"usage":'


def with_usage_cost(data: bytes, cost: float) -> bytes | None:
    """`data` (a JSON answer or chunk) with `"cost": cost` first in its usage object, spliced
    in without decoding the whole; None where that cannot be done safely (no usage object,
    or more than one). `"usage":` cannot occur inside a JSON string (its quotes would be
    escaped), so the key found is the usage member's."""
    at = data.find(_USAGE_KEY)
    if at < 0 or data.find(_USAGE_KEY, at + 1) >= 0:
        return None
    brace = at + len(_USAGE_KEY)
    while brace < len(data) and data[brace] in b" \t\r\n":
        brace += 1
    if brace >= len(data) or data[brace] != ord("{"):
        return None
    rest = data[brace + 1 :].lstrip()
    if not rest or rest[0] == ord("}"):
        return None
    return b'%s{"cost":%s,%s' % (data[:brace], repr(cost).encode(), data[brace + 1 :])
