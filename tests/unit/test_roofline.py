"""The roofline cost model of `switchyard bench engine` (pure arithmetic)."""

from benchmarks.roofline import (
    Machine,
    ModelShape,
    Reading,
    StepCost,
    bandwidth_rates,
    gemm_rates,
    roofline_s,
    serial_s,
    step_cost,
)

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


def test_quantized_weights_count_the_bytes_they_hold():
    """A decode step's weights are what the runner holds (int8: about a quarter of fp32's
    bytes), not parameters x itemsize: the roofline of a quantized engine counts them."""
    full = step_cost(SHAPE, 4, [10], [], 1)
    weights = (8 * SHAPE.layer_params + 8192 * 512 + 512) * 4
    quarter = step_cost(SHAPE, 4, [10], [], 1, weight_bytes=weights / 4)
    assert full.bytes - quarter.bytes == weights * 3 / 4
    assert quarter.flops == full.flops


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


def test_the_machine_is_the_best_source_of_each_measurement():
    a = Reading({"torch": 2e11, "native": 4e11}, {"copy": 4e10, "sum": 3e10})
    assert a.machine == Machine(gemm_flops=4e11, bandwidth=4e10)
    b = Reading({"torch": 3e11}, {"copy": 2e10, "sum": 6e10})
    both = a.best_with(b)
    assert both.gemm == {"torch": 3e11, "native": 4e11}
    assert both.stream == {"copy": 4e10, "sum": 6e10}
    assert both.machine == Machine(gemm_flops=4e11, bandwidth=6e10)
    assert a.best_with(None) is a
    assert a.as_dict()["gemm_gflops_by"] == {"native": 400.0, "torch": 200.0}


def test_the_gemm_peak_includes_our_kernel_where_it_is_built():
    import torch

    from workers.runner import native

    rates = gemm_rates(torch.float32, size=128, repeats=1)
    assert rates["torch"] > 0
    assert ("native" in rates) == (native.linear("float32") is not None)
    assert set(bandwidth_rates(num_bytes=2**20, repeats=1)) == {"copy", "sum"}


class FakeClock:
    """perf_counter for `roofline`, advanced only by the timed function."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_best_rate_times_every_repeat_within_its_budget_and_only_the_warm_up_past_it(
    monkeypatch,
):
    from benchmarks import roofline

    clock = FakeClock()
    monkeypatch.setattr(roofline.time, "perf_counter", clock)
    calls = []

    def work_for(seconds: list[float]):
        def fn() -> None:
            clock.now += seconds[len(calls)]
            calls.append(seconds[len(calls)])

        return fn

    # Fast calls: the warm-up, then every repeat; the best is the fastest repeat's.
    assert roofline._best_rate(work_for([1.0, 0.5, 0.25, 0.5]), 10.0, repeats=3) == 40.0
    assert len(calls) == 4
    # A warm-up past the budget is the only call, and its rate is the answer.
    calls.clear()
    assert roofline._best_rate(work_for([20.0]), 10.0, repeats=3, budget_s=5.0) == 0.5
    assert len(calls) == 1
    # Repeats stop once the budget is spent.
    calls.clear()
    rate = roofline._best_rate(work_for([2.0, 2.0, 4.0, 1.0]), 8.0, repeats=3, budget_s=5.0)
    assert rate == 4.0 and len(calls) == 3
