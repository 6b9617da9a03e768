"""Between the OpenAI wire format and the engine: sampling params in, JSON bodies out.

Bad input raises ApiError, or the engine's InvalidRequestError (naming the field), which
the app's one exception handler turns into the same OpenAI-shaped 400.
"""

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from workers.api.tool_prompt import renders_tools, with_tool_prompt
from workers.api.types import ApiError, ChatCompletionRequest, CompletionRequest
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarSpec
from workers.engine.tokenizer import CheckpointTokenizer
from workers.server.logprobs import ChoiceLogprobs, TokenTexts
from workers.server.tools import ToolPlan, ToolStream, template_messages, tool_grammar

_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0}


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, default_max_tokens: int
) -> SamplingParams:
    """SamplingParams for a request; ApiError or InvalidRequestError (400) naming the
    field when invalid."""
    if req.n < 1:
        raise ApiError(400, "n must be at least 1", param="n")
    for name, neutral in _UNSUPPORTED.items():
        if getattr(req, name) != neutral:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
        if req.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k == -1 else req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        logit_bias=dict(req.logit_bias or {}),
        num_speculative_tokens=req.num_speculative_tokens,
    )


def grammar_of(
    req: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None
) -> GrammarSpec | None:
    """What the output is constrained to: a forced tool call, else `response_format`."""
    if tools is not None:
        forced = tool_grammar(tools, getattr(req, "parallel_tool_calls", True))
        if forced is not None:
            return forced
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec.from_schema({"type": "object"})
    if rf.json_schema is None:
        raise ApiError(
            400,
            "response_format of type json_schema needs `json_schema`",
            param="response_format",
        )
    schema = rf.json_schema.schema
    return GrammarSpec.from_schema(schema if schema is not None else {"type": "object"})


def chat_prompt(
    req: ChatCompletionRequest, tokenizer: CheckpointTokenizer, tools: ToolPlan | None = None
) -> str:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    extras = template_messages(req)
    for m, extra in zip(req.messages, extras, strict=True):
        content = m.content
        if isinstance(content, list):
            parts = [p.get("text") for p in content if p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(parts)
        messages.append({**extra, "content": content or ""})
    tool_dicts = tools.tools if tools is not None else None
    if not renders_tools(tokenizer.chat_template):
        return tokenizer.render_chat(with_tool_prompt(messages, tool_dicts))
    return tokenizer.render_chat(messages, tool_dicts)


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """The usage of a request's samples: the prompt once, every sample's output, and the
    extension `compute_seconds` (`workers.api.types.ComputeSeconds`): every sample's
    engine time, in seconds rounded to the microsecond."""
    first = outs[0]
    completion = sum(o.num_output_tokens for o in outs)
    return {
        "prompt_tokens": first.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens},
        "compute_seconds": {
            "prefill_s": round(sum(o.prefill_s for o in outs), 6),
            "decode_s": round(sum(o.decode_s for o in outs), 6),
        },
    }


def _finish(out: RequestOutput | None, tool_calls: bool) -> str | None:
    if out is None or not out.finished:
        return None
    reason = "stop" if out.finish_reason is None else out.finish_reason.value
    reason = "stop" if reason == "abort" else reason
    return "tool_calls" if tool_calls and reason == "stop" else reason


class ResponseBuilder:
    """Builds the chunks and bodies of one response, completions or chat, of `n` choices.

    With tools in use (`tools` a ToolPlan), each choice's text goes through a ToolStream:
    content and `tool_calls` deltas while streaming, `message.tool_calls` at the end.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        texts: TokenTexts,
        n: int = 1,
        tools: ToolPlan | None = None,
        *,
        resumed: str | None = None,
        resumed_ids: Sequence[int] = (),
        token_ids: bool = False,
    ):
        # Continuing another replica's stream (`resumed`: the text its client has, of the
        # tokens `resumed_ids`): no role chunk, the tool-call reader goes on from that text
        # and completions' logprobs offsets from those tokens.
        self.resumed = resumed is not None
        # Each chunk's choice names its token ids and the characters of text handed out so
        # far (what a continuation's `resume_text_chars` is).
        self.token_ids = token_ids
        self.text_chars = [len(resumed or "")] * n
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        # Each choice's logprobs, built as its tokens arrive (stream deltas or whole).
        self.logprobs = [ChoiceLogprobs(texts, chat, resumed_ids) for _ in range(n)]
        self.tools = [ToolStream(tools) for _ in range(n)] if tools is not None else None
        if self.tools is not None and resumed:
            for reader in self.tools:
                reader.push(resumed)  # what it makes certain was sent by the other replica

    def chunk(
        self, text: str, out: RequestOutput | None, first: bool, index: int = 0
    ) -> dict[str, Any]:
        lps = (
            self.logprobs[index].delta(out.logprobs, out.new_token_ids)
            if out is not None and out.logprobs
            else None
        )
        self.text_chars[index] += len(text)
        if not self.chat:
            finish = _finish(out, False)
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
            if finish is not None and out is not None and out.stop_reason is not None:
                choice["stop_reason"] = out.stop_reason
            if self.token_ids:
                self._name_tokens(choice, out, index)
            return self._envelope("text_completion", [choice])
        delta: dict[str, Any] = {}
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools[index].push(text)
            if out is not None and out.finished:
                text += self.tools[index].flush()
        if first and not self.resumed:
            delta["role"] = "assistant"
        if text or (first and not calls):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        finish = _finish(out, self.tools is not None and bool(self.tools[index].ids))
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        if finish is not None and out is not None and out.stop_reason is not None:
            choice["stop_reason"] = out.stop_reason  # as the whole answer's choice has it
        if self.token_ids:
            self._name_tokens(choice, out, index)
        return self._envelope("chat.completion.chunk", [choice])

    def _name_tokens(self, choice: dict[str, Any], out: RequestOutput | None, index: int) -> None:
        """The extension a resuming gateway reads and cuts out (`gateway.serving.resume`):
        last in the choice, the chunk's token ids, then the text handed out so far."""
        choice["token_ids"] = out.new_token_ids if out is not None else []
        choice["text_chars"] = self.text_chars[index]

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(outs)}

    def choice(
        self, index: int, text: str, last: RequestOutput, logprobs: msgspec.Raw | None
    ) -> dict[str, Any]:
        """One choice of a whole (non-streaming) response; `logprobs` as
        `self.logprobs[index].value()` gives it, None when none were asked for."""
        if not self.chat:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": _finish(last, False),
            }
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                stream = self.tools[index]
                stream.text = text
                calls = stream.calls()
                message["content"] = stream.content()
                if calls:
                    message["tool_calls"] = calls
            choice = {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _finish(last, bool(calls)),
            }
        if last.stop_reason is not None:
            choice["stop_reason"] = last.stop_reason
        return choice

    def full(self, choices: list[dict[str, Any]], lasts: list[RequestOutput]) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(obj, choices), "usage": usage(lasts)}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
