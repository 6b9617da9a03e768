"""Tiny, deterministic Llama checkpoints for demos and tests, built fully offline.

`make_demo_checkpoints` writes two Hugging Face checkpoints, `small` (about 2M parameters)
and `large` (about 20M parameters, grouped-query attention), that share one byte-level BPE
tokenizer trained on the docstrings of a fixed list of Python standard library modules.
Weights come from fixed seeds, so two runs on the same Python and library versions
write byte-identical `model.safetensors` and `tokenizer.json`. The weights are random:
the models produce gibberish, but they exercise the whole serving path.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)

VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Sorted, import-safe, side-effect-free modules present in every CPython install.
CORPUS_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "heapq", "html", "http.client", "inspect", "io",
    "ipaddress", "itertools", "json", "logging", "math", "operator", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "shutil", "socket", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)  # fmt: skip


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape and seed of one demo checkpoint."""

    name: str
    seed: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


DEMO_MODELS = (
    # 2 * 4096 * 128 embedding/head + 4 layers * 262k = about 2.1M parameters.
    DemoModelSpec("small", seed=1234, hidden_size=128, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    # 2 * 4096 * 384 embedding/head + 8 layers * 2.16M = about 20.4M parameters, GQA 6:2.
    DemoModelSpec("large", seed=5678, hidden_size=384, intermediate_size=1536,
                  num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2),
)  # fmt: skip


def iter_stdlib_docstrings(module_names: tuple[str, ...] = CORPUS_MODULES) -> Iterator[str]:
    """Yield docstrings of the modules, and of the classes and functions they define."""
    for module_name in sorted(module_names):
        module = importlib.import_module(module_name)
        if doc := inspect.getdoc(module):
            yield doc
        for _, obj in sorted(vars(module).items()):
            # Only objects defined here: re-exports would repeat other modules' text.
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if doc := inspect.getdoc(obj):
                yield doc
            if inspect.isclass(obj):
                for _, member in sorted(vars(obj).items()):
                    if inspect.isfunction(member) and (doc := inspect.getdoc(member)):
                        yield doc


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on corpus and wrap it as a transformers tokenizer with ChatML."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocab, so any UTF-8 text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_model(spec: DemoModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Build a randomly initialised float32 Llama from spec, seeded for reproducibility."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
    )
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


@contextmanager
def _hf_progress_bars_off() -> Iterator[None]:
    """Hide transformers' own bars (e.g. "Writing model shards"); ours covers each step."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def make_demo_checkpoints(out_dir: Path, *, show_progress: bool = True) -> dict[str, Path]:
    """Write the `small` and `large` demo checkpoints under out_dir/small and out_dir/large.

    Returns {"small": path, "large": path}. Existing files in those directories are
    overwritten. Takes a few seconds on CPU; the output depends only on the Python,
    torch, tokenizers and transformers versions.
    """
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {}
    bar = tqdm(total=2 + len(DEMO_MODELS), disable=not show_progress, unit="step")
    with bar, _hf_progress_bars_off():
        bar.set_description("corpus")
        with warnings.catch_warnings():
            # Reading docs of deprecated aliases (typing.io, typing.re) warns.
            warnings.simplefilter("ignore", DeprecationWarning)
            corpus = list(iter_stdlib_docstrings())
        bar.update()

        bar.set_description("tokenizer")
        tokenizer = train_tokenizer(corpus)
        bar.update()

        for spec in DEMO_MODELS:
            bar.set_description(f"model {spec.name}")
            model_dir = out_dir / spec.name
            model = build_model(spec, tokenizer)
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            logger.info(
                "wrote demo checkpoint %r (%d parameters) to %s",
                spec.name, model.num_parameters(), model_dir,
            )  # fmt: skip
            paths[spec.name] = model_dir
            bar.update()
    return paths
