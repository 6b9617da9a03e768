"""The step message rank 0 sends: the other ranks rebuild exactly the batch's tokens."""

from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.tp.runner import decode_step, encode_step


def test_a_step_round_trips_with_only_the_new_tokens_of_each_request():
    decode = Request("a", [5, 6, 7, 8], SamplingParams(), arrival_time=0.0)
    decode.append_token(9)
    decode.num_computed_tokens = 4
    prefill = Request("b", list(range(10, 30)), SamplingParams(), arrival_time=0.0)
    prefill.num_computed_tokens = 8
    scheduled = [(decode, 1), (prefill, 7)]
    tables = {"a": [3, 4], "b": [0, 1, 2, 7], "unscheduled": [9]}
    batch, got_tables = decode_step(encode_step(scheduled, tables))
    assert got_tables == {"a": [3, 4], "b": [0, 1, 2, 7]}
    (a, na), (b, nb) = batch
    assert (a.request_id, a.num_computed_tokens, a.num_tokens, na) == ("a", 4, 5, 1)
    assert a.all_token_ids[4:5] == [9]
    assert (b.num_computed_tokens, b.num_tokens, nb) == (8, 20, 7)
    assert b.all_token_ids[8:15] == list(range(18, 25))
