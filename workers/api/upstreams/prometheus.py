"""Prometheus exposition text, read into the few sums the adapters need."""

import math

from prometheus_client.parser import text_string_to_metric_families

MAX_EXPOSITION_BYTES = 8 << 20  # a /metrics page past this is not read


def parse_exposition(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]] | None:
    """Every sample of the page, by sample name: [(labels, value), ...]. None when the page
    is too large or does not parse. Counters appear under their `_total` sample names."""
    if len(body) > MAX_EXPOSITION_BYTES:
        return None
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(body.decode("utf-8")):
            for sample in family.samples:
                if math.isfinite(sample.value):
                    samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    except (ValueError, UnicodeDecodeError, IndexError, KeyError, TypeError):
        return None
    return samples


def metric_sum(samples: dict[str, list[tuple[dict[str, str], float]]], *names: str) -> float | None:
    """The sum over every label set of the first of `names` the page has (later names are
    older spellings); None when it has none of them."""
    for name in names:
        if name in samples:
            return sum(value for _, value in samples[name])
    return None


def metric_mean(
    samples: dict[str, list[tuple[dict[str, str], float]]], *names: str
) -> float | None:
    """Like metric_sum, but the mean: for fractions (KV usage) reported once per engine."""
    for name in names:
        if samples.get(name):
            values = [value for _, value in samples[name]]
            return sum(values) / len(values)
    return None


def label_value(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str
) -> str | None:
    """The value of `label` on `name`'s samples when all of them agree; None otherwise."""
    values = {labels.get(label) for labels, _ in samples.get(name, [])}
    value = values.pop() if len(values) == 1 else None
    return value if isinstance(value, str) and value else None


def has_prefix(samples: dict[str, list[tuple[dict[str, str], float]]], *prefixes: str) -> bool:
    """Whether any sample's name starts with one of `prefixes` (`vllm:`, `sglang:`...)."""
    return any(name.startswith(prefixes) for name in samples)
