"""`usage.compute_seconds`: the worker sums its samples' engine time into the usage, and
the wire type reads it when sent, and stays as it was (left out) when not."""

import msgspec
import pytest

from workers.api.types import ComputeSeconds, Usage, parse_chunk, parse_summary
from workers.engine.outputs import RequestOutput
from workers.engine.request import FinishReason
from workers.server.openai_format import usage


def sample(prefill_s: float, decode_s: float, num_output_tokens: int) -> RequestOutput:
    return RequestOutput(
        "r", [], "", True, FinishReason.LENGTH, None, 7, num_output_tokens, 4,
        prefill_s=prefill_s, decode_s=decode_s,
    )  # fmt: skip


def test_the_usage_of_n_samples_sums_their_engine_seconds():
    got = usage([sample(0.25, 0.5, 3), sample(0.125, 0.75, 5)])
    assert got["compute_seconds"] == {"prefill_s": 0.375, "decode_s": 1.25}
    assert (got["prompt_tokens"], got["completion_tokens"], got["total_tokens"]) == (7, 8, 15)
    decoded = msgspec.convert(got, Usage).compute()
    assert decoded == ComputeSeconds(prefill_s=0.375, decode_s=1.25)


def test_compute_seconds_are_rounded_to_the_microsecond():
    got = usage([sample(1 / 3, 2 / 3, 1)])
    assert got["compute_seconds"] == {"prefill_s": 0.333333, "decode_s": 0.666667}


@pytest.mark.parametrize("extension", [b"", b', "compute_seconds": null'], ids=["absent", "null"])
def test_a_usage_without_compute_seconds_reads_as_not_reported(extension):
    body = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7%s}}'
    summary = parse_summary(body % extension)
    assert summary is not None and summary.usage is not None
    assert summary.usage.compute() is None and summary.usage.total_tokens == 7


def test_a_streams_final_usage_chunk_carries_compute_seconds():
    data = (
        b'{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
        b'"total_tokens": 7, "compute_seconds": {"prefill_s": 0.01, "decode_s": 0.02}}}'
    )
    chunk = parse_chunk(data)
    assert chunk is not None and chunk.usage is not None
    assert chunk.usage.compute() == ComputeSeconds(prefill_s=0.01, decode_s=0.02)


def test_a_usage_built_without_compute_seconds_encodes_as_before():
    built = Usage(5, 2, 7)
    assert msgspec.json.decode(msgspec.json.encode(built)) == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": None,
    }
    assert msgspec.to_builtins(built).keys() == {
        "prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"
    }  # fmt: skip
