"""The admin usage CSV: no cell a spreadsheet would take for a formula."""

import csv
import io

from gateway.api.usage import CSV_COLUMNS, to_csv

FORMULA_STARTS = ("-", "=", "+", "@", "\t", "\r")


def _row(tenant: str, model: str) -> dict:
    return {"tenant_id": tenant, "model": model, **dict.fromkeys(CSV_COLUMNS, 1)}


def test_every_text_cell_starting_like_a_formula_gets_a_quote_and_numbers_stay_numbers():
    rows = [_row(f"{c}2-3", f"{c}cmd|' /C calc'!A0") for c in FORMULA_STARTS]
    rows.append({**_row("acme", "small"), "mean_latency_ms": None})
    parsed = list(csv.reader(io.StringIO(to_csv(rows, "model"), newline="")))
    assert parsed[0] == ["tenant_id", "model", *CSV_COLUMNS]
    for (tenant, model, *numbers), c in zip(parsed[1:], FORMULA_STARTS, strict=False):
        assert (tenant, model) == (f"'{c}2-3", f"'{c}cmd|' /C calc'!A0")
        assert numbers == ["1"] * len(CSV_COLUMNS)
    latency = 2 + CSV_COLUMNS.index("mean_latency_ms")
    assert parsed[-1][:2] == ["acme", "small"] and parsed[-1][latency] == ""
