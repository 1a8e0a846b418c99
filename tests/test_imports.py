"""What importing costs: the client loads no server-toolkit module at all (what it shares with the server is the
protocol's, ``_protocol``), and no torch; the toolkit's names still resolve as model.py files use them. Each check
runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

import triton_npu_client.server as toolkit

HEAVY = ("torch", "tokenizers", "safetensors", "transformers", "triton_python_backend_utils")


def _fresh(code: str) -> dict[str, Any]:
    """Run ``code`` in a new interpreter; what it loaded: the toolkit's modules and the heavy packages."""
    report = (
        "import json, sys\n"
        "print(json.dumps({\n"
        "    'toolkit': sorted(m for m in sys.modules if m.startswith('triton_npu_client.server.')),\n"
        "    'server': 'triton_npu_client.server' in sys.modules,\n"
        "    'protocol': 'triton_npu_client._protocol' in sys.modules,\n"
        f"    'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules),\n"
        "}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code + "\n" + report], capture_output=True, text=True, check=True, timeout=120
    )
    loaded: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_importing_the_client_loads_no_toolkit_module_and_no_torch() -> None:
    """`from triton_npu_client import Client, score` and a client made from it load no module of server/, not even
    its package; what they share with it (markers, the digest) comes from the protocol."""
    loaded = _fresh(
        "from triton_npu_client import Client, score\n"
        "import asyncio\n"
        "async def main():\n"
        "    async with Client('grpc://127.0.0.1:1') as client:\n"
        "        repr(client)\n"
        "asyncio.run(main())\n"
    )
    assert (loaded["toolkit"], loaded["server"], loaded["heavy"]) == ([], False, [])
    assert loaded["protocol"]  # the classifier and the chat sessions read it


def test_every_public_client_name_loads_no_toolkit_module() -> None:
    """Every name of the client's public namespace (sessions, jobs, the launcher too) leaves the toolkit unloaded."""
    loaded = _fresh("import triton_npu_client as t\nfor name in t.__all__:\n    getattr(t, name)\n")
    assert (loaded["toolkit"], loaded["server"]) == ([], False)
    assert "torch" not in loaded["heavy"]


def test_the_toolkit_package_loads_its_modules_on_first_use() -> None:
    """`import triton_npu_client.server` loads none of its modules; a name loads its own module when first used."""
    assert _fresh("import triton_npu_client.server")["toolkit"] == []
    loaded = _fresh("from triton_npu_client.server import SequenceSlots")
    assert "triton_npu_client.server._state" in loaded["toolkit"]
    assert "triton_npu_client.server.chat._chat_model" not in loaded["toolkit"]
    # An engine loads the toolkit and itself: the chat model leaves the encoder's folder unloaded.
    chat = _fresh("from triton_npu_client.server import ChatModel")["toolkit"]
    assert "triton_npu_client.server.chat._chat_model" in chat
    assert [m for m in chat if m.startswith("triton_npu_client.server.encoder")] == []


def test_model_py_imports_still_work() -> None:
    """What the server_models' model.py files import resolves, in a fresh interpreter, to the toolkit's objects."""
    code = (
        "from triton_npu_client.server import ChatModel, EncoderModel, RunningStatsModel, TokenizerModel\n"
        "from triton_npu_client.server import SEQUENCE_BUSY, SequenceBatching, StepLoop, forward_tables\n"
        "from triton_npu_client.server.chat._chat_model import ChatModel as C\n"
        "from triton_npu_client.server.chat._tables import forward_tables as forward\n"
        "assert ChatModel is C and forward_tables is forward and SEQUENCE_BUSY.startswith('[triton-npu:')\n"
    )
    assert _fresh(code)["toolkit"]  # it ran, and loaded what it used


def test_every_toolkit_name_resolves_and_is_listed() -> None:
    """Each name of the toolkit's __all__ resolves (once, then it is a plain attribute); dir() lists them all; an
    unknown name raises AttributeError."""
    for name in toolkit.__all__:
        value = getattr(toolkit, name)
        assert vars(toolkit)[name] is value
    assert set(toolkit.__all__) <= set(dir(toolkit))
    assert sorted(toolkit.__all__) == sorted(set(toolkit.__all__))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = toolkit.no_such_name
