"""The roofline cost model of `switchyard bench engine` (pure arithmetic)."""

from benchmarks.roofline import Machine, ModelShape, StepCost, roofline_s, serial_s, step_cost

SHAPE = ModelShape(
    hidden=512,
    intermediate=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    vocab=8192,
)


def test_weights_are_read_once_per_step_whatever_the_batch():
    one = step_cost(SHAPE, 4, [0], [], 1)
    many = step_cost(SHAPE, 4, [0] * 64, [], 64)
    weights = (8 * SHAPE.layer_params + 8192 * 512 + 512) * 4
    assert one.bytes > weights and many.bytes < 64 * weights
    assert many.flops > 60 * one.flops  # FLOPs grow with the batch, weight bytes do not


def test_decode_reads_its_whole_context_and_bf16_halves_the_bytes():
    short = step_cost(SHAPE, 4, [10], [], 1)
    long = step_cost(SHAPE, 4, [1010], [], 1)
    assert long.bytes - short.bytes == 1000 * SHAPE.kv_values_per_token * 4
    half = step_cost(SHAPE, 2, [1010], [], 1)
    assert half.bytes < 0.55 * long.bytes + 8192 * 4  # logits stay fp32


def test_a_prefill_chunk_counts_causal_pairs_after_its_context():
    cost = step_cost(SHAPE, 4, [], [(100, 4)], 1)
    linear_and_head = step_cost(SHAPE, 4, [], [(0, 4)], 1).flops - 4 * 10 * 8 * 64 * 8
    pairs = 4 * 100 + 10
    assert cost.flops == linear_and_head + 4 * pairs * 8 * 64 * 8


def test_roofline_is_the_larger_of_memory_and_compute_time():
    m = Machine(gemm_flops=1e12, bandwidth=1e10)
    assert roofline_s(StepCost(1e9, 1e9), m) == 0.1
    assert roofline_s(StepCost(1e6, 1e12), m) == 1.0


def test_the_no_overlap_bound_adds_memory_and_compute_time():
    m = Machine(gemm_flops=1e12, bandwidth=1e10)
    assert serial_s(StepCost(1e9, 1e11), m) == 0.2  # 0.1 s of bytes, then 0.1 s of FLOPs
    assert serial_s(StepCost(1e9, 1e11), m) == 2 * roofline_s(StepCost(1e9, 1e11), m)
