"""Nothing banyan runs may come from the network or a model file (RELIABILITY A9, F4, G9).

An AST scan of every module under banyan/ (docstrings and comments may name what they refuse):
no pickle, cloudpickle or dill; no ZeroMQ `*_pyobj`; no `torch.load` without `weights_only=True`;
no hard-coded `trust_remote_code=True` (or numpy's `allow_pickle=True`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "banyan"
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill"}
PYOBJ_METHODS = {"recv_pyobj", "send_pyobj"}
TRUE_BANNED = {"trust_remote_code", "allow_pickle"}  # keywords never hard-coded to True


def violations(source: str) -> list[str]:
    """Each unsafe construct in the source, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.Attribute) and node.attr in PYOBJ_METHODS:
            found.append(f"{line}: {node.attr}")
        elif isinstance(node, ast.Attribute) and _name(node.value) in UNSAFE_MODULES:
            found.append(f"{line}: {_name(node.value)}.{node.attr}")
        elif isinstance(node, ast.Call):
            if _is_torch_load(node.func) and not _keyword_is_true(node, "weights_only"):
                found.append(f"{line}: torch.load without weights_only=True")
            found += [f"{line}: {k.arg}=True" for k in node.keywords if k.arg in TRUE_BANNED and _is_true(k.value)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_true(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) == "trust_remote_code" for t in targets):
                found.append(f"{line}: trust_remote_code = True")
    return found


def _is_torch_load(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "load" and _name(func.value) == "torch"


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and _is_true(k.value) for k in call.keywords)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_scan_sees_the_package():
    assert len(MODULES) > 20 and PACKAGE / "ipc" / "core_process.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_unsafe_deserialization(path: Path):
    assert violations(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from dill import loads",
        "from pickle import Unpickler",
        "obj = sock.recv_pyobj()",
        "await socket.send_pyobj(x)",
        "state = torch.load(path)",
        "state = torch.load(path, weights_only=False)",
        "AutoModel.from_pretrained(name, trust_remote_code=True)",
        "trust_remote_code = True",
        "x = torch.serialization.pickle.loads(b)",
        "arr = np.load(f, allow_pickle=True)",
        "class C:\n    trust_remote_code: bool = True",
    ],
)
def test_the_scan_catches(source: str):
    assert violations(source), source


@pytest.mark.parametrize(
    "source",
    [
        '"""Never pickle; never recv_pyobj."""',
        "# torch.load(path) would run code",
        "state = torch.load(path, weights_only=True)",
        "open_model(name, trust_remote_code=config.trust_remote_code)",
        "trust_remote_code: bool = False",
        "data = msgspec.msgpack.decode(raw)",
    ],
)
def test_the_scan_allows(source: str):
    assert violations(source) == []
