"""`triton-npu fleet` and `--url` lists, in process, against the session server.

One server given as two URLs (127.0.0.1 and localhost: two replica keys, one server) plus a closed port, which
must show as down. Usage mistakes are one line on stderr and exit 2, before any connection or server start.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest

from triton_npu_client import Client, LocalTriton
from triton_npu_client.cli import main

MODEL = "scale_fp32"


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released without listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_code(argv: list[str]) -> int | str | None:
    """``main(argv)``'s exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


def rows(text: str) -> dict[str, list[str]]:
    """The table's replica lines by URL, split into columns (the last, the error, may hold spaces)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("grpc://", "http://")):
            cells = line.split(None, 7)
            out[cells[0]] = cells
    return out


def models_listed(text: str) -> dict[str, str]:
    """``--models``: the line under each replica's line, by URL."""
    out, url = {}, ""
    for line in text.splitlines():
        if line.startswith("grpc://"):
            url = line.split()[0]
        elif m := re.fullmatch(r"\s+models: (.*)", line):
            out[url] = m.group(1)
    return out


async def _ready_models_and_infer(url: str, n: int) -> tuple[str, ...]:
    async with Client(url) as client:
        model = await client.model(MODEL)
        for i in range(n):
            out = await model.infer(INPUT0=np.array([i], np.float32))
            assert out["OUTPUT0"].reshape(-1).tolist() == [2.0 * i]
        # Triton counts a request in its statistics just after answering it: wait until it has counted ours.
        async with asyncio.timeout(30):
            while sum(st.success_count for st in await client.inference_statistics(MODEL)) < n:
                await asyncio.sleep(0.01)
        index = await client.repository_index()
        return tuple(sorted(m.name for m in index if m.state == "READY"))


def test_fleet_shows_each_replica_and_the_dead_one_down(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str]
) -> None:
    port = triton_server.grpc_port
    ready = asyncio.run(_ready_models_and_infer(triton_server.grpc_url, 3))
    dead = closed_port()
    urls = [f"grpc://127.0.0.1:{port}", f"grpc://localhost:{port}", f"grpc://127.0.0.1:{dead}"]

    code = main([
        "fleet", "--url", f"{urls[0]},{urls[1]}", "--url", urls[2], "--models",
        "--metrics-port", str(triton_server.metrics_port),
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1, (out, err)  # one replica is down
    table = rows(out)
    assert sorted(table) == sorted(urls), out
    for url in urls[:2]:
        cells = table[url]
        assert cells[1] == "ready", cells
        assert cells[2] == str(len(ready)), cells
        assert cells[3].isdigit(), cells  # pending, from the metrics port
        assert int(cells[4].replace(",", "")) >= 3, cells  # at least the inferences above answered
        assert cells[5].replace(",", "").isdigit(), cells
        assert cells[7] == "-", cells
    down = table[urls[2]]
    assert down[1:4] == ["DOWN", "0", "-"], down
    assert "ConnectError" in down[7], down
    assert models_listed(out) == {urls[0]: ", ".join(ready), urls[1]: ", ".join(ready), urls[2]: "(none)"}, out
    assert MODEL in ready


def test_fleet_all_ready_exits_0_and_a_dns_name_lists_its_addresses(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str]
) -> None:
    port = triton_server.grpc_port
    assert main(["fleet", "--url", f"grpc://127.0.0.1:{port}", "--url", f"grpc://localhost:{port}"]) == 0
    out, _ = capsys.readouterr()
    assert [c[1] for c in rows(out).values()] == ["ready", "ready"], out

    # Every address of the name is a replica, keyed by address; the server listens on 127.0.0.1 only.
    addresses = {str(i[4][0]) for i in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
    code = main(["fleet", "--url", f"dns+grpc://localhost:{port}"])
    out, _ = capsys.readouterr()
    table = rows(out)
    assert table[f"grpc://127.0.0.1:{port}"][1] == "ready", out
    assert len(table) == len(addresses), out
    assert code == (0 if addresses == {"127.0.0.1"} else 1), out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--url", "grpc://127.0.0.1:8001,http://127.0.0.1:8000"], "must all be gRPC"),
        (["--url", "grpc://127.0.0.1:8001", "--url", "https://127.0.0.1:8000"], "must all be gRPC"),
        (["--url", "grpc://user:hunter2@127.0.0.1:8001"], "user info"),
        (["--url", "ftp://127.0.0.1:8001"], "unsupported URL scheme"),
        (["--url", "grpc://127.0.0.1:8001,"], "empty URL"),
        (["--url", "grpc://127.0.0.1:99999"], "port"),
        ([], "required: --url"),
        (["--url", "grpc://127.0.0.1:8001", "--timeout", "0"], "seconds > 0"),
    ],
)
def test_fleet_usage_mistakes_are_one_line_and_exit_2(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TRITON_URL", "TRITON_URLS"):
        monkeypatch.delenv(name, raising=False)  # else --url has a default
    code = exit_code(["fleet", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("triton-npu fleet: "), err
    assert expected in err, err
    assert "hunter2" not in err


def test_a_url_without_a_scheme_is_grpc_and_triton_url_is_the_default(
    triton_server: LocalTriton, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = triton_server.grpc_port
    monkeypatch.delenv("TRITON_URLS", raising=False)
    monkeypatch.delenv("TRITON_URL", raising=False)
    assert main(["fleet", "--url", f"127.0.0.1:{port}"]) == 0
    assert list(rows(capsys.readouterr().out)) == [f"grpc://127.0.0.1:{port}"]
    monkeypatch.setenv("TRITON_URL", f"127.0.0.1:{port}")
    assert main(["fleet"]) == 0  # no --url: $TRITON_URL
    assert list(rows(capsys.readouterr().out)) == [f"grpc://127.0.0.1:{port}"]
    monkeypatch.setenv("TRITON_URLS", f"grpc://127.0.0.1:{port},localhost:{port}")
    assert main(["fleet"]) == 0  # $TRITON_URLS first
    assert sorted(rows(capsys.readouterr().out)) == [f"grpc://127.0.0.1:{port}", f"grpc://localhost:{port}"]
    monkeypatch.setenv("TRITON_URLS", f"grpc://127.0.0.1:{port},")
    assert exit_code(["fleet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "$TRITON_URLS: an empty URL" in err


def test_score_and_chat_refuse_mixed_urls_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"INPUT0": [1.0]}\n')
    mixed = "grpc://127.0.0.1:1,http://127.0.0.1:2"
    code = main(["score", "--model", MODEL, "--input", str(source), "--output", str(tmp_path / "out.jsonl"),
                 "--url", mixed])  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert "must all be gRPC" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written, no server started

    assert main(["chat", "--url", mixed]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    assert err.startswith("triton-npu chat: "), err
    assert "must all be gRPC" in err, err


def test_score_over_two_urls_of_one_server(
    triton_server: LocalTriton, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = triton_server.grpc_port
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"INPUT0": [float(i)]}) + "\n" for i in range(20)))
    output = tmp_path / "out.jsonl"
    code = main(["score", "--model", MODEL, "--input", str(source), "--output", str(output), "--no-progress",
                 "--url", f"grpc://127.0.0.1:{port}", "--url", f"grpc://localhost:{port}"])  # fmt: skip
    assert code == 0, capsys.readouterr()
    got = [json.loads(line)["OUTPUT0"] for line in output.read_text().splitlines()]
    assert got == [[2.0 * i] for i in range(20)]
