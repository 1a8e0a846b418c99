"""The package's import graph: layers show in folder names, arrows point down only, and nothing imports in a circle.

Read from the source with ``ast`` (every import counts: module level, ``TYPE_CHECKING`` blocks and imports inside
functions alike, and ``importlib.import_module`` / ``__import__`` of a literal name), so a lazy import cannot hide
an upward arrow.

Three rooms: the client (every folder but ``server/``, in layers), the server toolkit and its engines (``server/``),
and the protocol between them (``_protocol/``: markers, the chat history digest, the chat model's names). The client
and the server each import the protocol and never each other; the protocol imports the standard library only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "triton_npu_client"
ROOT = "triton_npu_client"

# Bottom (0) to top. A module may import its own layer and any lower one.
RANK = {
    "_protocol": 0,  # what the client and the server spell the same: imports nothing of the package (see below)
    "_version": 0,
    "_errors": 0,
    "_trace": 0,  # optional OpenTelemetry spans: imports nothing of the package
    "_wire": 1,
    "_local": 1,
    "_transport": 2,
    "_fleet": 2,  # a transport over several transports (replicas)
    "_model": 2,
    "_call": 3,
    "_sessions": 4,
    "_client": 5,
    "_jobs": 6,
    "_gateway": 7,  # the OpenAI HTTP API, on the public SDK (client, chats, scoring)
    "cli": 8,
    "__init__": 9,
    "__main__": 9,
}
# The server toolkit runs inside Triton's stub: it imports nothing of the client but the protocol, and the client
# imports nothing of it at all (no leaf of it either: what both sides share is the protocol's).
PROTOCOL = f"{ROOT}._protocol"
# Inside the server: its own modules are the generic toolkit; each folder is one model engine, named here on purpose.
# The toolkit imports no engine; an engine imports the toolkit and itself, never another engine. The package's
# __init__ (the facade) re-exports every public name of the toolkit and the engines (lazily), so it may import all.
SERVER = f"{ROOT}.server"
ENGINES = frozenset({"chat", "encoder"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each import of a package module in ``path``: (absolute module name, the names taken from it)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        dynamic = _dynamic_import(node, package)
        if dynamic is not None and dynamic.startswith(ROOT):
            found.append((dynamic, ()))
        elif isinstance(node, ast.Import):
            found.extend((a.name, ()) for a in node.names if a.name.startswith(ROOT))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith(ROOT):
                found.append((target, tuple(a.name for a in node.names)))
    return found


def _dynamic_import(node: ast.AST, package: str) -> str | None:
    """The module ``importlib.import_module("name")`` / ``import_module(".name", __name__)`` / ``__import__("name")``
    names when its first argument is a literal, else None (a name built at run time is the caller's table: see
    test_the_lazy_tables_name_no_server_module)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    first = node.args[0]
    if called not in ("import_module", "__import__") or not isinstance(first, ast.Constant):
        return None
    name = first.value
    if not isinstance(name, str):
        return None
    if not name.startswith("."):
        return name
    level = len(name) - len(name.lstrip("."))
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name.lstrip(".")] if name.lstrip(".") else base)


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (absolute names)."""
    found: set[str] = set()
    for target, names in _import_statements(path):
        found.add(target)
        for alias in names:  # `from . import _x` names a module
            if (PACKAGE.parent / Path(*f"{target}.{alias}".split("."))).with_suffix(".py").exists():
                found.add(f"{target}.{alias}")
    found.discard(_module_name(path))
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _graph_at(package: Path) -> dict[str, set[str]]:
    """The graph of a package laid out at ``package``: a fake tree, for the tests that the checks can fail."""
    global PACKAGE
    saved = PACKAGE
    PACKAGE = package
    try:
        return _graph()
    finally:
        PACKAGE = saved


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_known_layer() -> None:
    """No module sits outside the layer table (a new folder must be placed in it on purpose)."""
    unknown = {m for m in _graph() if _layer(m) not in RANK and _layer(m) != "server"}
    assert unknown == set()
    folders = {p.parent.relative_to(PACKAGE / "server").parts[0] for p in (PACKAGE / "server").glob("*/**/*.py")}
    assert folders == ENGINES  # a new engine folder joins ENGINES; the toolkit has no folders


def _forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports that break the rooms: an upward arrow in the client, the client importing any module of
    ``server/``, the server importing the client, the protocol importing anything of the package."""
    wrong = []
    for module, targets in graph.items():
        layer = _layer(module)
        for target in targets:
            if target == ROOT and layer == "__init__":
                continue
            tlayer = _layer(target)
            if layer == "_protocol":
                ok = tlayer == "_protocol"  # its own modules only
            elif layer == "server":
                ok = tlayer in ("server", "_protocol")
            elif tlayer == "server":
                ok = False  # the client reads what it shares with the server from the protocol, never from server/
            else:
                ok = RANK[tlayer] <= RANK[layer]
            if not ok:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_arrows_point_down_only() -> None:
    """Each import goes to the same layer or a lower one; the client imports no module of server/ (leaves, lazily
    inside a function, by importlib: none); the server toolkit imports only itself and the protocol."""
    assert _forbidden_arrows(_graph()) == []


def test_the_protocol_imports_the_standard_library_only() -> None:
    """_protocol/ imports its own modules and the standard library, nothing else (no numpy: the client reads it
    without the toolkit's dependencies, the stub without the client's)."""
    outside = []
    for path in sorted((PACKAGE / "_protocol").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module or ""]
            else:
                continue
            outside += [f"{path.name}: {n}" for n in names if n.partition(".")[0] not in sys.stdlib_module_names]
    assert outside == []
    assert (PACKAGE / "_protocol" / "__init__.py").is_file()


def test_the_lazy_tables_name_no_server_module() -> None:
    """The package's lazy table (names loaded on first use, by a module name built at run time) names no module of
    server/ either: the one way around the import graph above is closed too."""
    import triton_npu_client

    modules = set(triton_npu_client._LAZY.values())  # "._client", ...: relative to the package
    assert modules
    assert [m for m in modules if m.lstrip(".").split(".")[0] == "server"] == []


def test_the_checker_sees_the_client_import_the_server_and_the_protocol_import_the_client(tmp_path: Path) -> None:
    """The room rule can fail: a client module importing a server leaf (lazily, in a function, and by importlib), a
    protocol module importing the client, and the server importing the client are all found; the server and the
    client importing the protocol are not."""
    root = tmp_path / ROOT
    for folder in ("_sessions", "_protocol", "server"):
        (root / folder).mkdir(parents=True)
    (root / "_sessions" / "x.py").write_text(
        "from .._protocol import EMPTY\n"
        "def f():\n    from ..server._state import S\n"
        "def g():\n    import importlib\n    return importlib.import_module('..server', __name__)\n"
    )
    (root / "_protocol" / "y.py").write_text("from .._errors import TritonError\n")
    (root / "server" / "z.py").write_text("from .._protocol import EMPTY\nfrom .._sessions import x\n")
    assert _forbidden_arrows(_graph_at(root)) == [
        f"{ROOT}._protocol.y -> {ROOT}._errors",
        f"{ROOT}._sessions.x -> {SERVER}",
        f"{ROOT}._sessions.x -> {SERVER}._state",
        f"{SERVER}.z -> {ROOT}._sessions",
        f"{SERVER}.z -> {ROOT}._sessions.x",
    ]


def _server_part(module: str) -> str:
    """Which part of the server ``module`` is: "facade" (the package's __init__), "toolkit", or its engine's folder."""
    if module == SERVER:
        return "facade"
    folder = module.split(".")[2]
    return folder if folder in ENGINES else "toolkit"


def _server_arrows_across(graph: dict[str, set[str]]) -> list[str]:
    """The imports inside the server that cross from one part to a part it may not import."""
    crossing = []
    for module, targets in graph.items():
        if not module.startswith(f"{SERVER}.") and module != SERVER:
            continue
        part = _server_part(module)
        for target in targets:
            if not target.startswith(f"{SERVER}.") and target != SERVER:
                continue  # the client, or a server module importing it: test_arrows_point_down_only's concern
            tpart = _server_part(target)
            if not (part == "facade" or tpart == "toolkit" or tpart == part):
                crossing.append(f"{module} -> {target}")
    return sorted(crossing)


def test_the_toolkit_imports_no_engine_and_engines_not_each_other() -> None:
    """server/ imports no engine folder; server/<engine>/ imports the toolkit and itself, never another engine nor
    the facade (which re-exports every engine)."""
    assert _server_arrows_across(_graph()) == []


def test_no_import_cycles() -> None:
    """No circle among modules (Tarjan's strongly connected components, all of size 1)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_a_cycle_and_an_upward_arrow(tmp_path: Path) -> None:
    """The checks above can fail: a lazy upward import inside a function is found."""
    fake = tmp_path / ROOT / "_model"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("def f():\n    from .._client import Model\n")
    graph = _graph_at(tmp_path / ROOT)
    assert graph == {"triton_npu_client._model.x": {"triton_npu_client._client"}}
    assert RANK[_layer("triton_npu_client._client")] > RANK[_layer("triton_npu_client._model.x")]


def test_the_checker_sees_an_engine_importing_another_and_the_toolkit_importing_an_engine(tmp_path: Path) -> None:
    """The server rule can fail: an engine reaching into another engine or through the facade, and a toolkit module
    (lazily, in a function) reaching into an engine, are all found; the facade importing an engine and an engine
    importing the toolkit are not."""
    server = tmp_path / ROOT / "server"
    for folder in ("chat", "encoder"):
        (server / folder).mkdir(parents=True)
    (server / "__init__.py").write_text("from .chat import x\n")
    (server / "_state.py").write_text("")
    (server / "_y.py").write_text("def f():\n    from .chat import x\n")
    (server / "chat" / "x.py").write_text("from .._state import S\nfrom ..encoder import z\nfrom .. import ChatModel\n")
    (server / "encoder" / "z.py").write_text("from .._state import S\n")
    graph = _graph_at(tmp_path / ROOT)
    assert _server_arrows_across(graph) == [
        f"{SERVER}._y -> {SERVER}.chat",
        f"{SERVER}._y -> {SERVER}.chat.x",
        f"{SERVER}.chat.x -> {SERVER}",
        f"{SERVER}.chat.x -> {SERVER}.encoder",
        f"{SERVER}.chat.x -> {SERVER}.encoder.z",
    ]


# -- private names stay inside their layer -------------------------------------------------------------------------


def _private_reaches(path: Path) -> list[str]:
    """Imports in ``path`` that reach a private part of another layer: a module under the layer's package
    (``.._model._build``) or an underscore name (``from .._model import _fmt``). A layer's package ``__init__``
    is its public face; what it does not export, other layers do not use."""
    name = _module_name(path)
    layer = _layer(name)
    found = []
    for target, names in _import_statements(path):
        if target == ROOT or _layer(target) == layer:
            continue
        deeper = target != f"{ROOT}.{_layer(target)}"
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]  # a module or a name
        if deeper or private:
            found.append(f"{name} -> {target}" + (f" ({', '.join(private)})" if private else ""))
    return found


def test_no_private_import_across_layers() -> None:
    """Another layer is used through its package only: no ``from .._model._build import …``, no ``_names``."""
    reaches = [r for path in sorted(PACKAGE.rglob("*.py")) for r in _private_reaches(path)]
    assert reaches == []


def test_the_checker_sees_a_private_import_across_layers(tmp_path: Path) -> None:
    """The rule above can fail: a private module of another layer, and a private name from its package."""
    fake = tmp_path / ROOT / "_jobs"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text(
        "from .._model._build import build_request\nfrom .._model import _plans\nfrom . import _score\n"
    )
    global PACKAGE
    saved = PACKAGE
    PACKAGE = tmp_path / ROOT
    try:
        reaches = _private_reaches(fake / "x.py")
    finally:
        PACKAGE = saved
    assert reaches == [
        "triton_npu_client._jobs.x -> triton_npu_client._model._build",
        "triton_npu_client._jobs.x -> triton_npu_client._model (_plans)",
    ]


# The chat engine's three owners (vLLM v1's cut): the scheduler (_chat) decides, the block manager (_blocks) owns
# blocks, the runner (_runner) computes. The runner may read block tables and pools, never decide ownership.
CHAT = f"{SERVER}.chat"
RUNNER_MAY_NOT_IMPORT = frozenset({f"{CHAT}._chat", f"{CHAT}._chat_model", f"{CHAT}._template"})
#: What the runner may use of a block manager: its pools and their shape, nothing that takes or frees a block.
RUNNER_READS_OF_BLOCKS = frozenset({"keys", "values", "null_block", "block_size", "blocks_for"})


def _runner_violations(path: Path) -> list[str]:
    found = [f"imports {target}" for target in sorted(_imports(path)) if target in RUNNER_MAY_NOT_IMPORT]
    found += [
        f"imports {name} from {target}"
        for target, names in _import_statements(path)
        if target == f"{CHAT}._blocks"
        for name in names
        if name not in ("BlockManager", "BlockTable")
    ]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        # self.blocks.<attr> / blocks.<attr> inside the ModelRunner class: only the reads listed above.
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        named_blocks = (
            isinstance(owner, ast.Attribute) and owner.attr == "blocks"
            and isinstance(owner.value, ast.Name) and owner.value.id == "self"
        )  # fmt: skip
        if named_blocks and node.attr not in RUNNER_READS_OF_BLOCKS:
            found.append(f"uses self.blocks.{node.attr} (line {node.lineno})")
    return found


def test_the_runner_imports_no_scheduler_and_reads_only_pools_of_the_block_manager() -> None:
    assert _runner_violations(PACKAGE / "server" / "chat" / "_runner.py") == []


def test_the_runner_check_sees_a_scheduler_import_and_a_block_decision(tmp_path: Path) -> None:
    fake = PACKAGE / "server" / "chat" / "_runner_probe_tmp.py"
    fake.write_text(
        "from ._chat import ChatEngine\nfrom ._blocks import CacheFull\n"
        "class R:\n    def f(self):\n        self.blocks.reserve(1, 0, 1)\n        return self.blocks.keys\n"
    )
    try:
        assert _runner_violations(fake) == [
            f"imports {CHAT}._chat",
            f"imports CacheFull from {CHAT}._blocks",
            "uses self.blocks.reserve (line 5)",
        ]
    finally:
        fake.unlink()
