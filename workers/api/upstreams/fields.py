"""Which of the worker contract's request fields beyond OpenAI's each kind of server takes.

Switchyard's request structs (`workers.api.types`) carry extras a worker honours (`top_k`,
`min_p`, `min_tokens`, `stop_token_ids`) and two the gateway sets for the
operator (`cache_salt`, the tenant's prefix-cache namespace, and `priority`). A foreign
server may refuse a field it does not know (a hosted API answers 400), or ignore it, which
would answer a request as if the field had been honoured. So the gateway sends a kind only
the fields it takes: an operator field a kind lacks is left out (the tenant loses nothing it
asked for), and a client's extra that the pool's kind cannot honour is refused at intake
(400 naming it), never dropped.
"""

from dataclasses import dataclass

# The extras a client may set, with their "not set" values (as the structs default them).
CLIENT_EXTRAS: dict[str, object] = {
    "top_k": (0, -1),
    "min_p": (0.0,),
    "min_tokens": (0,),
    "stop_token_ids": (None, []),
}
# `ignore_eos` is not one: the gateway sends it off to every pool (the operator's field).


@dataclass(frozen=True)
class RequestFields:
    """What one kind of server takes beyond the OpenAI fields."""

    extras: frozenset[str]  # of CLIENT_EXTRAS
    cache_salt: bool  # it namespaces its prefix cache by `cache_salt`
    priority: bool  # it schedules by a request's `priority` (lower first)


_ALL = frozenset(CLIENT_EXTRAS)
FIELDS: dict[str, RequestFields] = {
    "switchyard": RequestFields(_ALL, cache_salt=True, priority=True),
    # vLLM's OpenAI server: all the sampling extras; `cache_salt` since 0.9; `priority`
    # only under `--scheduling-policy priority` (else a request with one is an error).
    "vllm": RequestFields(_ALL, cache_salt=True, priority=False),
    # SGLang's OpenAI server takes the sampling extras; no cache salt.
    "sglang": RequestFields(_ALL, cache_salt=False, priority=False),
    # llama-server: top_k and min_p in its completion parameters.
    "llamacpp": RequestFields(frozenset({"top_k", "min_p"}), cache_salt=False, priority=False),
    # TGI's Messages API, Ollama's and a hosted API's OpenAI compatibility: OpenAI's fields.
    "tgi": RequestFields(frozenset(), cache_salt=False, priority=False),
    "ollama": RequestFields(frozenset(), cache_salt=False, priority=False),
    "openai": RequestFields(frozenset(), cache_salt=False, priority=False),
}


def fields_of(kind: str) -> RequestFields:
    """The fields `kind` takes; an unknown kind is treated as a strict OpenAI server."""
    return FIELDS.get(kind, FIELDS["openai"])


def unsupported(kind: str, values: dict[str, object]) -> list[str]:
    """The client extras set in `values` (field -> value) that `kind` cannot honour."""
    taken = fields_of(kind).extras
    return [
        name
        for name, unset in CLIENT_EXTRAS.items()
        if name not in taken and name in values and values[name] not in unset  # type: ignore[operator]
    ]
