"""The checkpoint's tokenizer: encoding, chat template, and a fast decoder for streaming."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from workers.errors import CheckpointError, InvalidRequestError


class CheckpointTokenizer:
    """Wraps the transformers tokenizer of a model directory."""

    def __init__(self, model_dir: Path) -> None:
        if (
            not (model_dir / "tokenizer.json").is_file()
            and not (model_dir / "tokenizer_config.json").is_file()
        ):
            raise CheckpointError(f"{model_dir} has no tokenizer.json / tokenizer_config.json")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:  # transformers raises many types here
            raise CheckpointError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise CheckpointError(
                f"{model_dir}: only fast (tokenizer.json) tokenizers are supported"
            )
        self.backend: Tokenizer = backend
        self.eos_token_ids = _generation_eos(model_dir) or (
            (self.hf.eos_token_id,) if self.hf.eos_token_id is not None else ()
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; rendered chat prompts pass add_special_tokens=False."""
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text for a chat, with the generation prompt appended; `tools` (OpenAI
        shape) are rendered by the template."""
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use completions", "messages"
            )
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=cast("list[dict[Any, Any] | Callable[..., Any]] | None", tools),
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja errors on malformed messages
            raise InvalidRequestError(
                f"cannot render the chat template: {exc}", "messages"
            ) from exc
        assert isinstance(text, str), "apply_chat_template(tokenize=False) gives text"
        return text


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
