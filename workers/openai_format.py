"""Between the OpenAI wire format and the engine: sampling params in, JSON bodies out."""

import time
from typing import Any

from workers.api import ApiError, ChatCompletionRequest, CompletionRequest
from workers.engine import RequestOutput
from workers.errors import InvalidRequestError
from workers.runner import TokenLogprobs
from workers.sampling_params import SamplingParams
from workers.tokenizer import CheckpointTokenizer

_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0}


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, default_max_tokens: int
) -> SamplingParams:
    """SamplingParams for a request; ApiError(400) naming the field when invalid."""
    if req.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
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
    try:
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
        )
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


def chat_prompt(req: ChatCompletionRequest, tokenizer: CheckpointTokenizer) -> str:
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            parts = [p.get("text") for p in content if p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    try:
        return tokenizer.render_chat(messages)
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class ResponseBuilder:
    """Builds the chunks and bodies of one response, completions or chat."""

    def __init__(
        self, request_id: str, model: str, chat: bool, tokenizer: CheckpointTokenizer | None
    ):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.tok = tokenizer
        self.created = int(time.time())
        self._text_offset = 0

    def _token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False) if self.tok else str(token_id)

    def logprobs(self, entries: list[TokenLogprobs], token_ids: list[int]) -> dict[str, Any]:
        if self.chat:
            content = []
            for lp, tid in zip(entries, token_ids, strict=True):
                text = self._token_text(tid)
                content.append(
                    {
                        "token": text,
                        "logprob": lp.logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := self._token_text(i)),
                                "logprob": v,
                                "bytes": list(t.encode()),
                            }
                            for i, v in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{self._token_text(i): v for i, v in lp.top} for lp in entries],
            "text_offset": offsets,
        }

    def chunk(self, text: str, out: RequestOutput | None, first: bool) -> dict[str, Any]:
        finish = out.finish_reason.value if out is not None and out.finished else None
        finish = "stop" if finish == "abort" else finish
        lps = (
            self.logprobs(out.logprobs, out.new_token_ids)
            if out is not None and out.logprobs
            else None
        )
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or not first else {}
            if first:
                delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(out)}

    def full(
        self, text: str, last: RequestOutput, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        finish = last.finish_reason.value if last.finish_reason else None
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            body = self._envelope("text_completion", [choice])
        if last.stop_reason is not None:
            choice["stop_reason"] = last.stop_reason
        body["usage"] = usage(last)
        return body

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
