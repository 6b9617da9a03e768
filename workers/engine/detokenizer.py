"""Incremental detokenization with stop strings.

Text is emitted only once it is complete: a token that ends inside a multi-byte UTF-8
character decodes to U+FFFD, and we wait for the next token instead of emitting it.
Text that could be the start of a stop string is held back until it is known not to be.
"""

from tokenizers import Tokenizer

# Tokens of context decoded before the new ones, so word-boundary spaces come out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, checking stop strings."""

    __slots__ = (
        "_tok",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_skip_special",
        "_stops",
        "text",
        "_emitted",
        "stop_hit",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._skip_special = skip_special_tokens
        self._stops = stop
        self.text = ""  # all output text so far (cut at a stop string)
        self._emitted = 0  # characters of `text` already handed out
        self.stop_hit: str | None = None

    def push(self, token_id: int, check_stops: bool = True) -> None:
        """Add one output token; sets `stop_hit` when a stop string completes."""
        self._ids.append(token_id)
        decode = self._tok.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        start = max(len(self.text) - max((len(s) for s in self._stops), default=0), 0)
        self.text += new
        for stop in self._stops if check_stops else ():
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[:idx]
                self.stop_hit = stop

    def prime(self, output_token_ids: list[int], emitted_chars: int) -> None:
        """Take output another replica generated (no stop strings checked: it did), of
        whose text the first `emitted_chars` characters are already handed out."""
        for token_id in output_token_ids:
            self.push(token_id, check_stops=False)
        if emitted_chars > len(self.text):
            raise ValueError(
                f"{emitted_chars} characters were handed out of a text of {len(self.text)}"
            )
        self._emitted = emitted_chars

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix until finished."""
        end = len(self.text)
        if not (finished or self.stop_hit):
            end -= self._partial_stop_len()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that a stop string starts with."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
