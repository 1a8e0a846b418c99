"""Provision and run NVIDIA's ``perf_analyzer`` (C++ load generator) without root or apt.

PyPI's ``perf-analyzer`` is a placeholder; the ``tritonclient==2.34.0`` manylinux wheel carries the real
binary at ``tritonclient-2.34.0.data/data/bin/perf_analyzer``. It links ``libb64.so.0d`` and
``libcudart.so.12``; the ``nvidia-pytriton`` wheel ships both (under hashed names) in
``nvidia_pytriton.libs/``, so symlinks with the sonames in the cache folder plus ``LD_LIBRARY_PATH`` are
all it needs. ``$PERF_ANALYZER`` names an existing binary instead (e.g. the one in Triton's SDK image).

Decoupled models (several responses per request, e.g. a chat model streaming tokens) need
``version=DECOUPLED_VERSION``: 2.34's load generator takes *every* response as the end of a request, so it
sends a sequence's next step while the previous one still streams and its concurrency runs away. 2.38
(the first release with decoupled support) waits for the final response, measures latency to the last
response and reports a response throughput. Its wheel carries the binary at the same place, and it needs
the same two libraries from nvidia-pytriton.

Dev tooling, not part of the installed package: used by the benchmarks in ``bench/`` and by tests that load
the real server (both put the repository root on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import fcntl
import io
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from triton_npu_client._local._server import _bundled_root

__all__ = [
    "DECOUPLED_VERSION",
    "PerfAnalyzer",
    "PerfAnalyzerError",
    "PerfAnalyzerUnavailable",
    "PerfResult",
    "arun_perf_analyzer",
    "ensure_perf_analyzer",
    "run_perf_analyzer",
]

_log = logging.getLogger("triton_npu_client.perfanalyzer")

TRITONCLIENT_VERSION = "2.34.0"
# The first tritonclient whose perf_analyzer ends a decoupled request at its final response (see above).
DECOUPLED_VERSION = "2.38.0"
# The only platform tag these wheels are published under (checked on PyPI: py3-none-manylinux1_x86_64).
_WHEEL_PLATFORM = "manylinux1_x86_64"
# soname the binary asks for -> glob of the hashed file auditwheel gave it inside nvidia_pytriton.libs/
_LIBS = {"libb64.so.0d": "libb64-*.so.0d", "libcudart.so.12": "libcudart-*.so.12*"}
_THREAD_ERROR = re.compile(r"^Thread \[\d+\] had error", re.MULTILINE)
_SERVER_COUNT = re.compile(r"^\s*(Inference count|Execution count):\s*(\d+)", re.MULTILINE)


class PerfAnalyzerError(RuntimeError):
    """``perf_analyzer`` failed, erred on requests, or ran too long.

    ``output`` holds its console output; ``errors`` counts the request errors it reported.
    """

    def __init__(self, message: str, *, output: str = "", errors: int = 0) -> None:
        super().__init__(message)
        self.output = output
        self.errors = errors


class PerfAnalyzerUnavailable(PerfAnalyzerError):
    """``perf_analyzer`` cannot be provided on this machine (no download, not x86_64 Linux, libraries missing)."""


def default_cache_dir(version: str = TRITONCLIENT_VERSION) -> Path:
    """``$XDG_CACHE_HOME/triton-npu-client/perf_analyzer-<version>`` (``~/.cache`` by default)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "triton-npu-client" / f"perf_analyzer-{version}"


def _member(version: str) -> str:
    return f"tritonclient-{version}.data/data/bin/perf_analyzer"


@attrs.frozen(kw_only=True)
class PerfAnalyzer:
    """A runnable ``perf_analyzer``: the binary, and the full environment to run it with.

    ``version`` is the tritonclient release it came from; None for a binary named by ``$PERF_ANALYZER``.
    """

    binary: Path
    # The whole process environment (with LD_LIBRARY_PATH set), hence kept out of the repr.
    env: dict[str, str] = attrs.field(repr=False)
    version: str | None = None

    def command(self, args: Sequence[str]) -> list[str]:
        """The argv for running it with ``args``."""
        return [str(self.binary), *args]


@attrs.frozen(kw_only=True)
class PerfResult:
    """One load level measured by ``perf_analyzer`` (the last row of its CSV report).

    Latencies are client-side, in microseconds (for a decoupled model under 2.38, to a request's last
    response). ``response_throughput_s`` counts every response of a decoupled model (0.0 when the report has
    no such column: before 2.38). ``server_inference_count`` / ``server_execution_count`` come from the
    server statistics perf_analyzer prints for the measured window (0 when absent).
    """

    concurrency: int
    throughput_infer_s: float
    p50_latency_us: int
    p90_latency_us: int
    p95_latency_us: int
    p99_latency_us: int
    errors: int
    server_inference_count: int = 0
    server_execution_count: int = 0
    response_throughput_s: float = 0.0
    output: str = attrs.field(default="", repr=False)

    @property
    def avg_batch_size(self) -> float:
        """Average executed batch size on the server during the measurement (0.0 when unknown)."""
        if self.server_execution_count == 0:
            return 0.0
        return self.server_inference_count / self.server_execution_count


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    # A file lock serialises concurrent provisioners (other processes, other test workers); the
    # extraction itself also ends in an atomic rename, so a reader never sees a half-written binary.
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_platform(version: str) -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise PerfAnalyzerUnavailable(
            f"perf_analyzer {version} from PyPI exists for x86_64 Linux only "
            f"(this is {sys.platform}/{platform.machine()}); set PERF_ANALYZER to a binary built for this machine"
        )


def _pytriton_libs() -> Path:
    found = _bundled_root()
    if found is None:
        raise PerfAnalyzerUnavailable(
            "perf_analyzer needs libb64 and libcudart from the nvidia-pytriton wheel: "
            "pip install 'triton-npu-client[server]'"
        )
    return found[1]


def _link_libs(cache: Path) -> None:
    libs = _pytriton_libs()
    for soname, pattern in _LIBS.items():
        candidates = sorted(libs.glob(pattern))
        if not candidates:
            raise PerfAnalyzerUnavailable(f"no {pattern} in {libs}: the nvidia-pytriton wheel looks incomplete")
        link = cache / soname
        tmp = cache / f".{soname}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(candidates[-1])
        os.replace(tmp, link)


def _download_binary(cache: Path, version: str) -> Path:
    target = cache / "perf_analyzer"
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", _WHEEL_PLATFORM, "--dest", tmp, "--quiet",
            f"tritonclient=={version}",
        ]  # fmt: skip
        _log.debug("downloading perf_analyzer: %s", cmd)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired as err:
            raise PerfAnalyzerUnavailable(f"downloading the tritonclient {version} wheel timed out") from err
        wheels = sorted(Path(tmp).glob(f"tritonclient-{version}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise PerfAnalyzerUnavailable(
                f"could not download tritonclient=={version} ({_WHEEL_PLATFORM}) with pip "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
            )
        member = _member(version)
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src, open(Path(tmp) / "pa", "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (KeyError, zipfile.BadZipFile) as err:
            raise PerfAnalyzerUnavailable(f"{wheels[0].name} has no usable {member}") from err
        staged = Path(tmp) / "pa"
        staged.chmod(staged.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(staged, target)
    return target


def _env_for(lib_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def ensure_perf_analyzer(cache_dir: Path | None = None, *, version: str = TRITONCLIENT_VERSION) -> PerfAnalyzer:
    """Return a runnable ``perf_analyzer``, downloading and preparing it once per cache folder.

    ``version``: the tritonclient wheel to take it from (``DECOUPLED_VERSION`` for decoupled models); each
    version has its own default cache folder. ``$PERF_ANALYZER`` overrides both. Idempotent and safe under
    concurrent callers. Raises :class:`PerfAnalyzerUnavailable` when it cannot be provided (no network,
    not x86_64 Linux, nvidia-pytriton missing).
    """
    explicit = os.environ.get("PERF_ANALYZER")
    if explicit:
        path = Path(explicit)
        if not os.access(path, os.X_OK):
            raise PerfAnalyzerUnavailable(f"PERF_ANALYZER={explicit} is not an executable file")
        return PerfAnalyzer(binary=path, env=_env_for(None))
    _check_platform(version)
    cache = (cache_dir or default_cache_dir(version)).expanduser().resolve()
    with _locked(cache):
        target = cache / "perf_analyzer"
        if not target.is_file():
            _download_binary(cache, version)
        # Re-linked every time: cheap, and follows an upgraded nvidia-pytriton whose hashed names changed.
        _link_libs(cache)
    return PerfAnalyzer(binary=target, env=_env_for(cache), version=version)


def _int(value: str) -> int:
    return int(float(value)) if value.strip() else 0


def parse_report(csv_text: str, output: str) -> PerfResult:
    """Build a :class:`PerfResult` from perf_analyzer's ``-f`` CSV report and its console output."""
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    if not rows:
        raise PerfAnalyzerError("perf_analyzer wrote an empty report", output=output)
    row = rows[-1]
    try:
        result = PerfResult(
            concurrency=_int(row.get("Concurrency", "0")),
            throughput_infer_s=float(row["Inferences/Second"]),
            p50_latency_us=_int(row.get("p50 latency", "")),
            p90_latency_us=_int(row.get("p90 latency", "")),
            p95_latency_us=_int(row.get("p95 latency", "")),
            p99_latency_us=_int(row.get("p99 latency", "")),
            errors=len(_THREAD_ERROR.findall(output)),
            response_throughput_s=float(row.get("Response Throughput", "").strip() or 0.0),
            output=output,
        )
    except (KeyError, ValueError) as err:
        raise PerfAnalyzerError(f"cannot read perf_analyzer's report: {err!r}", output=output) from err
    # The console block of the last load level holds its server-side counts.
    counts: dict[str, int] = {}
    for name, value in _SERVER_COUNT.findall(output):
        counts[name] = int(value)
    return attrs.evolve(
        result,
        server_inference_count=counts.get("Inference count", 0),
        server_execution_count=counts.get("Execution count", 0),
    )


def _finish(proc_rc: int, output: str, report: Path) -> PerfResult:
    csv_text = report.read_text() if report.is_file() else ""
    if proc_rc != 0 or not csv_text:
        raise PerfAnalyzerError(
            f"perf_analyzer exited with {proc_rc}: {_tail(output)}",
            output=output,
            errors=len(_THREAD_ERROR.findall(output)),
        )
    return parse_report(csv_text, output)


def _tail(output: str, n: int = 5) -> str:
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def _check_args(args: Sequence[str]) -> None:
    if "-f" in args:
        raise ValueError("run_perf_analyzer writes the CSV report itself; do not pass -f")


def run_perf_analyzer(pa: PerfAnalyzer, args: Sequence[str], *, timeout_s: float = 120.0) -> PerfResult:
    """Run ``perf_analyzer`` with ``args`` (one load level) and parse its report.

    ``args`` are perf_analyzer's own options (``-m``, ``-u``, ``-i grpc``, ``--concurrency-range N``,
    ``--measurement-mode count_windows``, ...); the CSV report path is added here. Raises
    :class:`PerfAnalyzerError` when it fails, errs or runs past ``timeout_s``. Blocking: from async code
    use :func:`arun_perf_analyzer`.
    """
    _check_args(args)
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        report = Path(tmp) / "report.csv"
        cmd = pa.command([*args, "-f", str(report)])
        _log.debug("running %s", cmd)
        try:
            proc = subprocess.run(
                cmd, env=pa.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
            raise PerfAnalyzerError(f"perf_analyzer ran past {timeout_s} s", output=out) from err
        return _finish(proc.returncode, proc.stdout, report)


async def arun_perf_analyzer(pa: PerfAnalyzer, args: Sequence[str], *, timeout_s: float = 120.0) -> PerfResult:
    """Async :func:`run_perf_analyzer`: the event loop keeps running; cancelling kills perf_analyzer."""
    _check_args(args)
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as tmp:
        report = Path(tmp) / "report.csv"
        proc = await asyncio.create_subprocess_exec(
            *pa.command([*args, "-f", str(report)]),
            env=pa.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(timeout_s):
                stdout, _ = await proc.communicate()
        except BaseException as err:
            # Timeout or cancellation: never leave a load generator running behind us.
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if isinstance(err, TimeoutError):
                raise PerfAnalyzerError(f"perf_analyzer ran past {timeout_s} s") from err
            raise
        assert proc.returncode is not None
        return _finish(proc.returncode, stdout.decode(errors="replace"), report)
