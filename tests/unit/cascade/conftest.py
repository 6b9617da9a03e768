"""Tiny synthetic routing datasets: long prompts are the ones only the large model gets."""

import csv
import random
from pathlib import Path

import pytest

from cascade.model import TrainConfig

WORDS = "alpha beta gamma delta theory market cell court value energy which most likely".split()


def synthetic_rows(num: int = 240, num_groups: int = 5, seed: int = 0) -> list[dict]:
    """Rows of the RouteLLM shape; `hard` rows are long, and only the strong model is right."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        hard = i % 4 == 0
        n_words = rng.randint(120, 200) if hard else rng.randint(5, 40)
        prompt = " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\nA. x\nB. y\nAnswer:"
        noisy = rng.random() < 0.05
        rows.append(
            {
                "prompt": prompt,
                "weak_ok": (not hard) != noisy,
                "strong_ok": True,
                "group": f"subject{i % num_groups}",
            }
        )
    return rows


def write_csv(
    path: Path, rows: list[dict], columns: tuple[str, str] = ("weak_ok", "strong_ok")
) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["prompt", *columns, "group"])
        for r in rows:
            writer.writerow([r["prompt"], r["weak_ok"], r["strong_ok"], r["group"]])
    return path


@pytest.fixture
def synthetic_csv(tmp_path: Path) -> Path:
    return write_csv(tmp_path / "routing.csv", synthetic_rows())


@pytest.fixture
def tiny_config() -> TrainConfig:
    return TrainConfig.quick()
