"""llama.cpp's `llama-server` as a benchmark peer: built from a pinned source, converted
checkpoints, and a context manager that runs it.

The source is the `llama-cpp-python` sdist from PyPI (it vendors llama.cpp under
``vendor/llama.cpp``), pinned by version and sha256. The build uses ``GGML_NATIVE``, so the
cache directory is keyed by the version and a short hash of the CPU's model name and flags:
a cache copied to another kind of machine is rebuilt rather than run with the wrong
instructions.

Layout under the cache root (default ``~/.cache/switchyard/peers/llama-server``)::

    source-<version>/llama_cpp_python-<version>/   extracted sdist (CPU-independent)
    <version>-<cpukey>[-noamx]/build/bin/llama-server   the binary; build.log beside build/
                                                   (-noamx: built without AMX, host_has_amx)
    gguf/<model>-<contentkey>-<outtype>.gguf       converted checkpoints
    gguf/<model>-<wheelkey>.gguf                   a known model's GGUF from its wheels
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from workers.models.fetch import ensure_wheel
from workers.models.registry import ModelSpec

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz as served by PyPI.
LLAMA_CPP_PYTHON_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGUF_OUTTYPES = ("f32", "bf16")
# The converter imports sentencepiece before it looks for a tokenizer.model; it goes into a
# --target directory of its own, not into the project venv.
CONVERT_EXTRA_REQUIREMENTS = ("sentencepiece==0.2.3",)

Progress = Callable[[str], None]


class LlamaServerError(RuntimeError):
    """A step of building, converting for, or starting llama-server failed.

    `step` names the step ("download", "verify", "configure", "build", "convert", "start");
    `log_path` is where the failing command's output went, when there is one.
    """

    def __init__(self, step: str, message: str, log_path: Path | None = None) -> None:
        super().__init__(f"llama-server {step}: {message}")
        self.step = step
        self.log_path = log_path


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "switchyard" / "peers" / "llama-server"


def cpu_key(cpuinfo: str) -> str:
    """An 8-hex-digit key of the first CPU's model name and flag set in /proc/cpuinfo text.

    Flags are sorted so their order does not matter; other fields (MHz, core id) are ignored.
    """
    model, flags = "", ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
        if not line.strip() and (model or flags):
            break
    return hashlib.sha256(f"{model}\n{flags}".encode()).hexdigest()[:8]


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first CPU's flags in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def host_has_amx() -> bool:
    """Whether this CPU lists AMX tiles. ggml built natively for one runs a tile
    instruction (`tilezero`) before it asks the kernel for AMX state and dies with SIGILL
    (seen on Sapphire Rapids VMs), so such a build leaves AMX out (`NO_AMX_FLAGS`)."""
    try:
        return "amx_tile" in cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


# Explicit -mno-* flags win over -march=native's whatever their order on GCC's line.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def host_cpu_key() -> str:
    try:
        return cpu_key(Path("/proc/cpuinfo").read_text())
    except OSError:
        import platform

        return cpu_key(f"model name: {platform.processor() or platform.machine()}")


def build_dir_name(version: str, cpukey: str, no_amx: bool = False) -> str:
    return f"{version}-{cpukey}" + ("-noamx" if no_amx else "")


def configure_command(source_dir: Path, build_dir: Path, no_amx: bool = False) -> list[str]:
    """The cmake configure line: CPU only, native instructions (less AMX with `no_amx`),
    and nothing that downloads (no curl, no prebuilt web UI from the Hugging Face bucket,
    no npm)."""
    amx = [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    return [*_configure(source_dir, build_dir), *(amx if no_amx else [])]


def _configure(source_dir: Path, build_dir: Path) -> list[str]:
    return [
        "cmake",
        "-S",
        str(source_dir),
        "-B",
        str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
    ]


def build_command(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_llama_cpp_source(
    cache_dir: Path | None = None,
    progress: Progress = print,
    version: str = LLAMA_CPP_PYTHON_VERSION,
    sha256: str = LLAMA_CPP_PYTHON_SDIST_SHA256,
) -> Path:
    """The extracted, verified sdist; returns its ``vendor/llama.cpp`` directory."""
    root = cache_dir or default_cache_root()
    source_root = root / f"source-{version}"
    llama_dir = source_root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    stamp = source_root / ".extracted"
    if stamp.exists() and llama_dir.is_dir():
        return llama_dir
    source_root.mkdir(parents=True, exist_ok=True)
    sdist = source_root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        progress(f"llama-server: downloading llama-cpp-python=={version} sdist from PyPI")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=source_root) as tmp:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:"]
                + ["--no-deps", "--no-cache-dir", f"llama-cpp-python=={version}", "-d", tmp],
                capture_output=True,
                text=True,
            )
            got = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if result.returncode != 0 or len(got) != 1:
                raise LlamaServerError(
                    "download", f"pip download failed: {result.stderr.strip()[-2000:]}"
                )
            got[0].replace(sdist)
        progress(f"llama-server: downloaded in {time.monotonic() - t0:.0f} s")
    progress(f"llama-server: verifying sha256 of {sdist.name}")
    actual = sha256_file(sdist)
    if actual != sha256:
        bad = sdist.with_suffix(".mismatch")
        sdist.replace(bad)
        raise LlamaServerError(
            "verify",
            f"sha256 mismatch for {sdist.name}: expected {sha256}, got {actual}"
            f" (moved aside to {bad})",
        )
    progress("llama-server: extracting")
    with tarfile.open(sdist) as tar:
        tar.extractall(source_root, filter="data")
    if not (llama_dir / "CMakeLists.txt").exists():
        raise LlamaServerError("verify", f"{llama_dir} has no CMakeLists.txt after extracting")
    stamp.write_text(sha256 + "\n")
    return llama_dir


def _run_logged(
    cmd: Sequence[str], log_path: Path, step: str, progress: Progress, t0: float
) -> None:
    """Runs `cmd`, appending its output to `log_path`; reports cmake's [NN%] every 10 points."""
    last_pct = -10
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[") and "%]" in line[:7]:
                pct = int(line[1:4].strip() or 0)
                if pct >= last_pct + 10:
                    last_pct = pct
                    progress(f"llama-server: {step} {pct}% ({time.monotonic() - t0:.0f} s)")
        rc = proc.wait()
    if rc != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise LlamaServerError(step, f"exit status {rc}; see {log_path}\n{tail}", log_path)


# The command that builds llama-server into the cache (what scripts/setup.sh runs).
BUILD_COMMAND = ".venv/bin/python -m benchmarks.peers build-llama-server"


def built_llama_server(cache_dir: Path | None = None) -> Path | None:
    """The cached `llama-server` built for this CPU; None when it is not built (nothing is
    built here: `ensure_llama_server` does that)."""
    out_dir = (cache_dir or default_cache_root()) / build_dir_name(
        LLAMA_CPP_PYTHON_VERSION, host_cpu_key(), host_has_amx()
    )
    binary = out_dir / "build" / "bin" / "llama-server"
    if (out_dir / ".built").exists() and os.access(binary, os.X_OK):
        return binary
    return None


def ensure_llama_server(
    cache_dir: Path | None = None, progress: Progress = print, jobs: int | None = None
) -> Path:
    """The path of a built `llama-server`; builds it (about 15 min on 2 cores) on first use.

    `cache_dir` is the cache root (default ``~/.cache/switchyard/peers/llama-server``); the
    build lands in ``<root>/<version>-<cpukey>/``. `jobs` defaults to the CPU count.
    A second call with a finished build returns at once.
    """
    root = cache_dir or default_cache_root()
    cached = built_llama_server(root)
    if cached is not None:
        return cached
    no_amx = host_has_amx()
    out_dir = root / build_dir_name(LLAMA_CPP_PYTHON_VERSION, host_cpu_key(), no_amx)
    binary = out_dir / "build" / "bin" / "llama-server"
    stamp = out_dir / ".built"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaServerError("configure", f"{tool!r} not found on PATH; install it")
    source = ensure_llama_cpp_source(root, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "build.log"
    log_path.write_text("")
    t0 = time.monotonic()
    progress(f"llama-server: configuring (log {log_path})")
    configure = configure_command(source, out_dir / "build", no_amx)
    _run_logged(configure, log_path, "configure", progress, t0)
    progress(f"llama-server: building llama-server (configured in {time.monotonic() - t0:.0f} s)")
    build = build_command(out_dir / "build", jobs or os.cpu_count() or 1)
    _run_logged(build, log_path, "build", progress, t0)
    if not os.access(binary, os.X_OK):
        raise LlamaServerError("build", f"build finished but {binary} is missing", log_path)
    stamp.write_text(f"{LLAMA_CPP_PYTHON_VERSION}\n")
    progress(f"llama-server: built {binary} in {time.monotonic() - t0:.0f} s")
    return binary


# -- checkpoints -------------------------------------------------------------------------


def model_content_key(model_dir: Path) -> str:
    """A 12-hex-digit key of a checkpoint directory: each file's name, size and mtime.

    Cheap (no hashing of weights) and changes whenever a file is rewritten.
    """
    parts = []
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            st = path.stat()
            parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def gguf_cache_path(root: Path, model_dir: Path, outtype: str) -> Path:
    return root / "gguf" / f"{model_dir.name}-{model_content_key(model_dir)}-{outtype}.gguf"


def registry_gguf(
    spec: ModelSpec,
    wheels_dir: Path,
    *,
    cache_dir: Path | None = None,
    pip_args: Sequence[str] = (),
    show_progress: bool = False,
) -> Path:
    """A known model's GGUF exactly as its pinned wheels carry it (the default model's is
    Q4_1): no conversion, llama-server reads it as it is.

    The wheels are the ones `switchyard models fetch` keeps (`wheels_dir`, verified by
    sha256, downloaded only when missing); the GGUF is extracted once into
    ``<root>/gguf/<name>-<key>.gguf``, `key` a hash of the wheels' sha256s.
    """
    root = cache_dir or default_cache_root()
    key = hashlib.sha256("".join(p.sha256 for p in spec.parts).encode()).hexdigest()[:12]
    out = root / "gguf" / f"{spec.name}-{key}.gguf"
    if out.exists():
        return out
    wheels = [ensure_wheel(p, wheels_dir, list(pip_args), show_progress) for p in spec.parts]
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".partial-{os.getpid()}")
    try:
        with partial.open("wb") as dst:
            for part, wheel in zip(spec.parts, wheels, strict=True):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def ensure_convert_deps(root: Path, progress: Progress = print) -> Path:
    """A directory (for PYTHONPATH) holding the converter's packages this venv lacks."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    target = root / f"convert-deps-{tag}"
    stamp = target / ".installed"
    wanted = "\n".join(CONVERT_EXTRA_REQUIREMENTS) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    progress(f"llama-server: installing {', '.join(CONVERT_EXTRA_REQUIREMENTS)} into {target}")
    shutil.rmtree(target, ignore_errors=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps"]
        + ["--quiet", "--target", str(target), *CONVERT_EXTRA_REQUIREMENTS],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise LlamaServerError("convert", f"pip install --target failed: {result.stderr[-2000:]}")
    stamp.write_text(wanted)
    return target


def convert_command(llama_dir: Path, model_dir: Path, out_path: Path, outtype: str) -> list[str]:
    return [
        sys.executable,
        str(llama_dir / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outfile",
        str(out_path),
        "--outtype",
        outtype,
    ]


def convert_to_gguf(
    model_dir: Path,
    out_path: Path | None = None,
    outtype: str = "f32",
    *,
    cache_dir: Path | None = None,
    progress: Progress = print,
) -> Path:
    """Converts a local Hugging Face checkpoint to GGUF with the vendored converter.

    The result is cached under ``<root>/gguf/`` keyed by the directory's contents and
    `outtype`; with `out_path` it is also hard-linked (or copied) there and `out_path` is
    returned, else the cached path is. Runs under this interpreter (it needs torch,
    transformers, numpy and safetensors) with the vendored ``gguf-py`` on PYTHONPATH, and
    offline: the tokenizer comes from `model_dir`.
    """
    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"outtype must be one of {GGUF_OUTTYPES}, not {outtype!r}")
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").exists():
        raise LlamaServerError("convert", f"{model_dir} has no config.json")
    root = cache_dir or default_cache_root()
    cached = gguf_cache_path(root, model_dir, outtype)
    if not cached.exists():
        llama_dir = ensure_llama_cpp_source(root, progress)
        deps = ensure_convert_deps(root, progress)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        log_path = cached.with_suffix(".log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(llama_dir / "gguf-py"), str(llama_dir), str(deps)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        progress(f"llama-server: converting {model_dir.name} to GGUF {outtype}")
        t0 = time.monotonic()
        with log_path.open("w") as log:
            rc = subprocess.run(
                convert_command(llama_dir, model_dir, partial, outtype),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            ).returncode
        if rc != 0 or not partial.exists():
            tail = log_path.read_text()[-3000:]
            raise LlamaServerError("convert", f"exit status {rc}; see {log_path}\n{tail}", log_path)
        partial.replace(cached)
        progress(f"llama-server: converted in {time.monotonic() - t0:.0f} s -> {cached}")
    if out_path is None:
        return cached
    out_path = Path(out_path)
    if out_path.resolve() != cached.resolve():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.unlink(missing_ok=True)
        try:
            os.link(cached, out_path)
        except OSError:
            shutil.copyfile(cached, out_path)
    return out_path


# -- running -----------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(
    binary: Path,
    gguf: Path,
    *,
    port: int,
    num_slots: int = 4,
    ctx_per_slot: int = 2048,
    num_threads: int = 2,
    host: str = "127.0.0.1",
    alias: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The llama-server command line: `num_slots` parallel sequences sharing a context of
    ``num_slots * ctx_per_slot`` tokens, continuous batching, and the GGUF's own chat
    template rendered by jinja."""
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        host,
        "--port",
        str(port),
        "-np",
        str(num_slots),
        "-c",
        str(num_slots * ctx_per_slot),
        "--cont-batching",
        "-t",
        str(num_threads),
        "-tb",
        str(num_threads),
        "--jinja",
        "--no-webui",
    ]
    if alias:
        cmd += ["--alias", alias]
    return cmd + list(extra_args)


class LlamaServer:
    """A running llama-server: starts on enter, stops (SIGTERM, then SIGKILL) on exit.

    `cpus` pins the process to those core ids. `base_url` ends in ``/v1``; `pid` is the
    server's process id. Output goes to ``<log_dir>/llama-server-<port>.log``.
    """

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        *,
        log_dir: Path,
        num_slots: int = 4,
        ctx_per_slot: int = 2048,
        num_threads: int | None = None,
        cpus: Sequence[int] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        alias: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.cpus = tuple(cpus) if cpus else None
        threads = num_threads or (len(self.cpus) if self.cpus else os.cpu_count() or 1)
        self.command = server_command(
            binary,
            gguf,
            port=self.port,
            num_slots=num_slots,
            ctx_per_slot=ctx_per_slot,
            num_threads=threads,
            host=host,
            alias=alias,
            extra_args=extra_args,
        )
        self.log_path = Path(log_dir) / f"llama-server-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("llama-server is not running")
        return self._proc.pid

    def _log_tail(self, num_lines: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-num_lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=pin if cpus else None,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        health = f"http://{self.host}:{self.port}/health"
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    rc = self._proc.returncode
                    self._proc = None
                    raise LlamaServerError(
                        "start", f"exited with status {rc}:\n{self._log_tail()}", self.log_path
                    )
                try:
                    if client.get(health).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise LlamaServerError(
            "start",
            f"/health not 200 after {self.startup_timeout_s:.0f} s:\n{self._log_tail()}",
            self.log_path,
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def describe(binary: Path) -> dict[str, str]:
    """Version line of a built binary, for reports."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return {"binary": str(binary), "version": (out.stdout + out.stderr).strip().splitlines()[0]}


__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "LLAMA_CPP_PYTHON_SDIST_SHA256",
    "LlamaServer",
    "LlamaServerError",
    "BUILD_COMMAND",
    "built_llama_server",
    "convert_to_gguf",
    "cpu_key",
    "ensure_llama_server",
    "registry_gguf",
    "server_command",
]
