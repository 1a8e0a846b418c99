"""``triton-npu stubs``: generated modules are clean, typed, deterministic, and catch misuse under mypy.

``--url`` reads the configs from the session's server (``triton_server``) and must give the text a repository gives
for the same models; ``-o`` never replaces a file the tool did not write.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from triton_npu_client import Client, LocalTriton
from triton_npu_client.cli import main
from triton_npu_client.cli._stubs import generate_stubs

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
_DTYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
_DTYPES += ["FP16", "FP32", "FP64", "BF16", "STRING"]

# One model with every dtype as input and output, names that are no identifiers or clash with the
# generated class's own members, an optional input, and a sequence model with string correlation ids.
_EVERY_DTYPE = (
    'name: "every-dtype"\nbackend: "python"\nmax_batch_size: 8\n'
    + "".join(f'input {{ name: "IN_{d}" data_type: TYPE_{d} dims: [ -1 ] }}\n' for d in _DTYPES)
    + "".join(f'output {{ name: "OUT_{d}" data_type: TYPE_{d} dims: [ 2, 3 ] }}\n' for d in _DTYPES)
    + 'input { name: "input.1" data_type: TYPE_FP32 dims: [ 4 ] optional: true }\n'
    + 'input { name: "MODEL_NAME" data_type: TYPE_INT32 dims: [ 1 ] }\n'
    + 'input { name: "class" data_type: TYPE_INT32 dims: [ 1 ] }\n'
)
_SEQUENCE = """
name: "2chat"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "REPLY" data_type: TYPE_STRING dims: [ 1 ] } ]
sequence_batching {
  oldest { max_candidate_sequences: 4 }
  control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]
}
model_transaction_policy { decoupled: true }
"""


def _write(repo: Path, name: str, config: str) -> None:
    (repo / name).mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def every_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch repository: every dtype, odd names, two models whose class names collide, a sequence model."""
    repo = tmp_path_factory.mktemp("repo")
    _write(repo, "every-dtype", _EVERY_DTYPE)
    # "every_dtype" camel-cases to the same class prefix as "every-dtype": the generator must suffix one.
    _write(repo, "every_dtype", _EVERY_DTYPE.replace('"every-dtype"', '"every_dtype"'))
    _write(repo, "2chat", _SEQUENCE)
    (repo / "no_config").mkdir()  # Triton may auto-complete it; the generator skips it
    return repo


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mypy(
    cwd: Path, *files: str, cache: Path = ROOT / ".mypy_cache" / "generated-stubs"
) -> subprocess.CompletedProcess[str]:
    # A cache shared by the tests (numpy's stubs cost seconds to analyse cold), kept in this checkout.
    cmd = [str(BIN / "mypy"), "--strict", "--no-error-summary", "--cache-dir", str(cache), *files]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _lint(cwd: Path, *files: str) -> None:
    ruff = str(BIN / "ruff")
    config = ["--config", str(ROOT / "pyproject.toml")]
    check = subprocess.run([ruff, "check", *config, *files], cwd=cwd, capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout
    fmt = subprocess.run(
        [ruff, "format", "--check", *config, *files], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert fmt.returncode == 0, fmt.stdout


def test_every_dtype_module_is_ruff_and_mypy_strict_clean(every_repo: Path, tmp_path: Path) -> None:
    """The module for a repository with every dtype and odd names passes ruff, ruff format and mypy --strict."""
    generate_stubs(every_repo, tmp_path / "stubs.py")
    _lint(tmp_path, "stubs.py")
    result = _mypy(tmp_path, "stubs.py")
    assert result.returncode == 0, result.stdout


def test_server_models_module_is_clean(tmp_path: Path) -> None:
    """The module for the project's own server_models/ passes ruff and mypy --strict."""
    assert main(["stubs", str(ROOT / "server_models"), "-o", str(tmp_path / "served.py")]) == 0
    _lint(tmp_path, "served.py")
    result = _mypy(tmp_path, "served.py")
    assert result.returncode == 0, result.stdout


def test_generated_classes_carry_names_facts_and_tensors(every_repo: Path, tmp_path: Path) -> None:
    """Class names are CamelCase and de-duplicated; constants and as_dict() use the config's own names."""
    generate_stubs(every_repo, tmp_path / "s.py")
    stubs = _import(tmp_path / "s.py", "stubs_facts")
    assert stubs.__all__ == [
        "EveryDtypeInputs", "EveryDtypeOutputs", "EveryDtype_2Inputs", "EveryDtype_2Outputs",
        "M2chatInputs", "M2chatOutputs",
    ]  # fmt: skip
    chat = stubs.M2chatInputs
    assert (chat.MODEL_NAME, chat.MAX_BATCH_SIZE, chat.SEQUENCE, chat.SEQUENCE_STRATEGY) == ("2chat", 0, True, "oldest")
    assert (chat.STRING_CORRELATION_ID, chat.DECOUPLED) == (True, True)
    assert (stubs.EveryDtypeInputs.MODEL_NAME, stubs.EveryDtype_2Inputs.MODEL_NAME) == ("every-dtype", "every_dtype")
    assert stubs.EveryDtypeInputs.SEQUENCE is False

    arrays = {f"IN_{d}": np.zeros(2, dtype=np.float32) for d in _DTYPES if d != "STRING"}
    inputs = stubs.EveryDtypeInputs(
        **arrays, IN_STRING=["héllo", "wor\0ld"], MODEL_NAME_2=np.ones(1), class_=np.ones(1)
    )
    as_dict = inputs.as_dict()
    # The optional "input.1" was not given, so it is not sent; the renamed fields go under their real names.
    assert sorted(as_dict) == sorted([*arrays, "IN_STRING", "MODEL_NAME", "class"])
    assert as_dict["IN_STRING"].dtype == np.object_
    assert as_dict["IN_STRING"].tolist() == ["héllo", "wor\0ld"]
    with_optional = stubs.EveryDtypeInputs(
        **arrays, IN_STRING=b"x", MODEL_NAME_2=np.ones(1), class_=np.ones(1), input_1=np.ones(4)
    )
    assert "input.1" in with_optional.as_dict()


def test_outputs_read_any_result_shape(every_repo: Path, tmp_path: Path) -> None:
    """from_result reads a mapping, an object with .outputs, and casts to the declared dtype."""
    generate_stubs(every_repo, tmp_path / "o.py")
    stubs = _import(tmp_path / "o.py", "stubs_outputs")

    class WithOutputs:
        def __init__(self) -> None:
            self.outputs = {"REPLY": [b"hi"]}

    by_attr = stubs.M2chatOutputs.from_result(WithOutputs())
    by_key = stubs.M2chatOutputs.from_result({"REPLY": [b"hi"]})
    assert by_attr == by_key
    assert by_key.REPLY.dtype == np.object_
    raw = {f"OUT_{d}": np.zeros((2, 3)) for d in _DTYPES}
    every = stubs.EveryDtypeOutputs.from_result(raw)
    assert every.OUT_FP16.dtype == np.float16
    assert every.OUT_UINT64.dtype == np.uint64
    assert every.OUT_BF16.dtype == np.float32  # BF16 is held as float32


def test_generation_is_deterministic(every_repo: Path) -> None:
    """Two runs give byte-identical modules."""
    assert generate_stubs(every_repo) == generate_stubs(every_repo)


_GOOD = """\
from typing import Any

import numpy as np
import numpy.typing as npt
from stubs import M2chatInputs, M2chatOutputs, ScaleInputs

def make(x: npt.NDArray[np.float32]) -> dict[str, npt.NDArray[Any]]:
    assert ScaleInputs(INPUT0=x).as_dict()["INPUT0"] is x
    chat = M2chatInputs(TEXT=["hello", b"bytes"])
    reply = M2chatOutputs.from_result({"REPLY": [b"x"]})
    assert reply.REPLY.shape == (1,)
    return chat.as_dict()
"""
_BAD = """\
import numpy as np
import numpy.typing as npt
from stubs import M2chatInputs, ScaleInputs

def wrong_name(x: npt.NDArray[np.float32]) -> ScaleInputs:
    return ScaleInputs(INPUT1=x)

def wrong_dtype(x: npt.NDArray[np.float64]) -> ScaleInputs:
    return ScaleInputs(INPUT0=x)

def wrong_bytes(x: int) -> M2chatInputs:
    return M2chatInputs(TEXT=x)
"""


def test_mypy_catches_wrong_input_name_and_dtype(every_repo: Path, tmp_path: Path) -> None:
    """mypy accepts correct use and rejects a wrong input name [call-arg] and wrong dtypes [arg-type]."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _write(repo, "2chat", _SEQUENCE)
    scale = (ROOT / "server_models" / "scale_fp32" / "config.pbtxt").read_text().replace("scale_fp32", "scale")
    _write(repo, "scale", scale)
    generate_stubs(repo, tmp_path / "stubs.py")
    (tmp_path / "good.py").write_text(_GOOD)
    (tmp_path / "bad.py").write_text(_BAD)
    result = _mypy(tmp_path, "good.py", "bad.py")
    errors = re.findall(r"^(\w+\.py):(\d+): error: .*\[([\w-]+)\]$", result.stdout, re.MULTILINE)
    assert set(errors) == {("bad.py", "6", "call-arg"), ("bad.py", "9", "arg-type"), ("bad.py", "12", "arg-type")}
    assert len(errors) == 3, result.stdout


def test_committed_example_module_has_not_drifted() -> None:
    """Regenerating examples/scale_models.py with the command in its docstring gives the committed text."""
    proc = subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "stubs", "server_models", "--model", "scale_fp32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout == (ROOT / "examples" / "scale_models.py").read_text()


def test_example_calls_the_model(triton_server: LocalTriton) -> None:
    """examples/typed_stubs.py sends typed inputs to scale_fp32 and reads typed outputs (2 * input)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "typed_stubs.py"), "--url", f"127.0.0.1:{triton_server.grpc_port}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "scale_fp32: OUTPUT0 = [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0]]"


def test_example_is_mypy_strict_clean() -> None:
    """The example type-checks against the generated module under mypy --strict."""
    # Run from the checkout, so under pyproject.toml's options (strict, the same as `.venv/bin/mypy`): the project's
    # own cache then serves the whole package, warm after the README's test command ran mypy before pytest (cold,
    # analysing the package and numpy takes this test from about 1 s to about 25 s).
    result = _mypy(ROOT, "examples/typed_stubs.py", "examples/scale_models.py", cache=ROOT / ".mypy_cache")
    assert result.returncode == 0, result.stdout


def test_cli_reports_bad_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing folder, an unknown --model and an unparsable config exit 2 with a message naming the cause."""
    assert main(["stubs", str(tmp_path / "nope")]) == 2
    assert "is not a model repository" in capsys.readouterr().err
    _write(tmp_path, "broken", "name: 'broken'\nmax_batch_size: banana\n")
    assert main(["stubs", str(tmp_path)]) == 2
    assert "not a valid Triton model config" in capsys.readouterr().err
    assert main(["stubs", str(tmp_path), "--model", "absent"]) == 2
    assert "absent" in capsys.readouterr().err


# -- --url: a running server's configs ---------------------------------------------------------------------

# Models of every kind the generator tells apart: batched, every dtype, unbatched, oldest / direct sequences, string
# correlation ids (a config parameter), decoupled.
_FEW = ["dtypes_echo", "scale_fp32", "seq_stats_direct", "seq_stats_string", "seq_stats_stream"]


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then released without listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_code(argv: list[str]) -> int | str | None:
    """``main(argv)``'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


def _one_line(err: str) -> str:
    """The single stderr line of a refused command, without its prefix."""
    assert err.count("\n") == 1, err
    assert err.endswith("\n"), err
    assert err.startswith("triton-npu stubs: "), err
    return err.removeprefix("triton-npu stubs: ").rstrip("\n")


def _stubs(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(["stubs", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _same_but_source(from_disk: str, from_server: str, source: str) -> None:
    """Equal texts but for the docstring line saying how to regenerate the module, which names its source."""
    disk, served = from_disk.splitlines(), from_server.splitlines()
    assert len(disk) == len(served)
    differ = [i for i, (a, b) in enumerate(zip(disk, served, strict=True)) if a != b]
    assert differ == [2], [(disk[i], served[i]) for i in differ]
    assert served[2].startswith(f"Generated by ``triton-npu stubs {source}"), served[2]


async def _ready(url: str) -> list[str]:
    async with Client(url) as client:
        return sorted({m.name for m in await client.repository_index() if m.state == "READY"})


def test_url_gives_the_repository_module_for_a_few_models(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str]
) -> None:
    """--url over gRPC and over HTTP gives, for models of every kind, the module server_models/ gives."""
    models = [arg for m in _FEW for arg in ("--model", m)]
    from_disk = _stubs(capsys, str(ROOT / "server_models"), *models)
    for url in (triton_server.grpc_url, triton_server.http_url):
        _same_but_source(from_disk, _stubs(capsys, "--url", url, *models), f"--url {url} --model dtypes_echo")
    # The facts that differ between the kinds made it into the module (not an empty module twice).
    assert "STRING_CORRELATION_ID: ClassVar[bool] = True" in from_disk  # seq_stats_string's config parameter
    assert 'SEQUENCE_STRATEGY: ClassVar[str | None] = "direct"' in from_disk
    assert "DECOUPLED: ClassVar[bool] = True" in from_disk


def test_url_gives_the_repository_module_for_every_ready_model(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --model, --url takes every READY model of the index: the module server_models/ gives for them.
    Without a source, $TRITON_URL names the server, as for every other verb."""
    ready = asyncio.run(_ready(triton_server.grpc_url))
    assert len(ready) >= 10, ready
    from_disk = _stubs(capsys, str(ROOT / "server_models"), *(arg for m in ready for arg in ("--model", m)))
    from_server = _stubs(capsys, "--url", triton_server.grpc_url)
    _same_but_source(from_disk, from_server, f"--url {triton_server.grpc_url}``")
    assert all(f'MODEL_NAME: ClassVar[str] = "{m}"' in from_server for m in ready)
    monkeypatch.delenv("TRITON_URLS", raising=False)
    monkeypatch.setenv("TRITON_URL", f"127.0.0.1:{triton_server.grpc_port}")  # no scheme: gRPC
    assert _stubs(capsys) == from_server.replace(triton_server.grpc_url, f"grpc://127.0.0.1:{triton_server.grpc_port}")


def test_url_names_a_model_the_server_does_not_have(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A --model that is not READY there is named with the models that are, in one line, exit 2, no file written."""
    out = tmp_path / "stubs.py"
    argv = ["stubs", "--url", triton_server.grpc_url, "--model", "scale_fp32", "--model", "no_such", "-o", str(out)]
    assert _exit_code(argv) == 2
    message = _one_line(capsys.readouterr().err)
    assert "no_such" in message, message
    assert triton_server.grpc_url in message, message
    listed = message.partition("READY there: ")[2].split(", ")
    assert listed == asyncio.run(_ready(triton_server.grpc_url))
    assert not out.exists()


def test_unreachable_url_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A server that does not answer (a closed loopback port): one line naming it, exit 2, no file written."""
    url = f"grpc://127.0.0.1:{_closed_port()}"
    out = tmp_path / "stubs.py"
    assert _exit_code(["stubs", "--url", url, "-o", str(out)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"cannot reach {url}: ")
    assert not out.exists()


def test_source_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Neither a repository nor a URL (nor $TRITON_URL), both, or a malformed URL: one line, exit 2."""
    monkeypatch.delenv("TRITON_URLS", raising=False)
    monkeypatch.delenv("TRITON_URL", raising=False)
    assert _exit_code(["stubs"]) == 2
    assert "MODEL_REPOSITORY" in _one_line(capsys.readouterr().err)
    assert _exit_code(["stubs", str(ROOT / "server_models"), "--url", "127.0.0.1:1"]) == 2
    assert "not both" in _one_line(capsys.readouterr().err)
    assert _exit_code(["stubs", "--url", "127.0.0.1:1,"]) == 2
    assert "empty URL" in _one_line(capsys.readouterr().err)
    assert _exit_code(["stubs", "--model"]) == 2  # argparse's own mistakes too
    assert "--model" in _one_line(capsys.readouterr().err)
    # A repository given wins over $TRITON_URL (which names a closed port: it would fail if it were used).
    monkeypatch.setenv("TRITON_URL", f"127.0.0.1:{_closed_port()}")
    monkeypatch.chdir(ROOT)  # the example's docstring names the repository as "server_models"
    assert _exit_code(["stubs", "server_models", "--model", "scale_fp32"]) == 0
    assert capsys.readouterr().out == (ROOT / "examples" / "scale_models.py").read_text()


# -- -o: never replace what the tool did not write ---------------------------------------------------------


def test_output_refuses_a_file_it_did_not_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing file that is not a generated module is left as it was (one line naming --overwrite, exit 2),
    checked before any connection; --overwrite replaces it, keeping its permissions."""
    monkeypatch.chdir(ROOT)  # the example's docstring names the repository as "server_models"
    repo = ["stubs", "server_models", "--model", "scale_fp32"]
    expected = (ROOT / "examples" / "scale_models.py").read_text()
    mine = tmp_path / "mine.py"
    mine.write_text("my own code\n")
    mine.chmod(0o640)
    assert _exit_code([*repo, "-o", str(mine)]) == 2
    assert "--overwrite" in _one_line(capsys.readouterr().err)
    # Found before connecting: the closed port would give another message.
    assert _exit_code(["stubs", "--url", f"127.0.0.1:{_closed_port()}", "-o", str(mine)]) == 2
    assert "--overwrite" in _one_line(capsys.readouterr().err)
    assert mine.read_text() == "my own code\n"
    assert _exit_code([*repo, "-o", str(mine), "--overwrite"]) == 0
    assert mine.read_text() == expected
    assert mine.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]  # no temporary file left beside it


def test_output_replaces_a_module_it_wrote(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regenerating over a module the tool wrote (the README's command) needs no --overwrite; a new file is
    created; a missing folder, a directory and a symlink are refused without --overwrite."""
    monkeypatch.chdir(ROOT)  # the example's docstring names the repository as "server_models"
    out = tmp_path / "stubs.py"
    assert _exit_code(["stubs", str(ROOT / "server_models"), "--model", "scale_fp32", "-o", str(out)]) == 0
    assert capsys.readouterr().err == f"wrote {out}\n"
    assert _exit_code(["stubs", str(ROOT / "server_models"), "--model", "minilm", "-o", str(out)]) == 0
    assert 'MODEL_NAME: ClassVar[str] = "minilm"' in out.read_text()
    capsys.readouterr()

    base = ["stubs", "server_models", "--model", "scale_fp32", "-o"]
    assert _exit_code([*base, str(tmp_path / "absent" / "s.py")]) == 2
    assert "does not exist" in _one_line(capsys.readouterr().err)
    assert _exit_code([*base, str(tmp_path)]) == 2
    assert "directory" in _one_line(capsys.readouterr().err)
    target = tmp_path / "target.py"
    target.write_text("the link's target\n")
    link = tmp_path / "link.py"
    link.symlink_to(target)
    assert _exit_code([*base, str(link)]) == 2
    assert "--overwrite" in _one_line(capsys.readouterr().err)
    assert _exit_code([*base, str(link), "--overwrite"]) == 0
    # The link itself is replaced by the module; what it pointed to is untouched.
    assert not link.is_symlink()
    assert link.read_text() == (ROOT / "examples" / "scale_models.py").read_text()
    assert target.read_text() == "the link's target\n"
    assert sorted(os.listdir(tmp_path)) == ["link.py", "stubs.py", "target.py"]  # no temporary file left
