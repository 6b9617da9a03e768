"""Incremental detokenization: whole characters only, stop strings across tokens."""

from pathlib import Path

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.tokenizer import CheckpointTokenizer


def stream(tok: CheckpointTokenizer, text: str, stop: list[str] | None = None):
    """Feed the byte-level tokens of `text` one at a time; collect deltas."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend, [], stop or [])
    deltas = []
    for i, t in enumerate(ids):
        detok.push(t)
        deltas.append(detok.delta(finished=i == len(ids) - 1 or detok.stop_hit is not None))
        if detok.stop_hit:
            break
    return deltas, detok


def test_streamed_text_equals_the_full_decode_and_never_splits_a_character(demo_dir: Path):
    tok = CheckpointTokenizer(demo_dir)
    text = "naïve café ✓ 日本語 🎉 end"
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_single_byte_tokens_of_a_multibyte_character_wait_for_the_whole_character(demo_dir: Path):
    tok = CheckpointTokenizer(demo_dir)
    vocab = tok.backend.get_vocab()
    # Byte-level BPE: the three bytes of "✓" (e2 9c 93) as their single-byte tokens.
    byte_tokens = [vocab[c] for c in ("â", "ľ", "ĵ")]
    detok = IncrementalDetokenizer(tok.backend, [], [])
    out = []
    for t in byte_tokens:
        detok.push(t)
        out.append(detok.delta(finished=False))
    assert out == ["", "", "✓"]


def test_stop_string_spanning_tokens_cuts_the_text_before_it(demo_dir: Path):
    tok = CheckpointTokenizer(demo_dir)
    deltas, detok = stream(tok, "alpha beta STOP gamma", stop=["ST" + "OP"])
    assert detok.stop_hit == "STOP"
    assert "".join(deltas) == "alpha beta "


def test_text_that_may_start_a_stop_string_is_held_back(demo_dir: Path):
    tok = CheckpointTokenizer(demo_dir)
    detok = IncrementalDetokenizer(tok.backend, [], ["<end>"])
    for t in tok.encode("hello <en", add_special_tokens=False):
        detok.push(t)
    assert detok.delta(finished=False) == "hello "
    assert detok.delta(finished=True) == "<en"
