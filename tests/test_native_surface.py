"""The native module's surface against its stub (tutti_cluster/_native.pyi), and the native options
against TuttiConfig: neither can drift without a failing test."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from tutti_cluster import TuttiConfig, _native
from tutti_cluster.config import NATIVE_FIELDS, native_options

STUB = Path(_native.__file__).parent / "_native.pyi"
if not STUB.exists():  # an editable install keeps the stub in the source tree
    STUB = Path(__file__).resolve().parents[1] / "tutti_cluster" / "_native.pyi"


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for base in node.bases:  # inherited members (Store is a UnitStore)
                if isinstance(base, ast.Name) and base.id in names:
                    names[node.name] |= names[base.id]
            names[""].add(node.name)
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[""].add(node.target.id)
    return names


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_the_stub_names_exactly_what_the_module_has():
    stub = _stub_names()
    module = {n for n in _public(_native) if not inspect.ismodule(getattr(_native, n))}
    assert stub[""] == module
    for cls, members in stub.items():
        if not cls:
            continue
        have = _public(getattr(_native, cls))
        if issubclass(getattr(_native, cls), int) or hasattr(getattr(_native, cls), "__members__"):  # py::enum_
            have = set(getattr(_native, cls).__members__)
        assert members - {"__init__"} == have, cls


# StoreOptions fields the store derives from the configuration and its call (native_options),
# and the one it leaves at its native value (io_workers is not bound).
DERIVED = {"paths", "capacity", "memory_paths", "memory_capacity", "unit_blocks", "backend", "read_only", "file_gid"}


def test_every_native_option_is_a_config_field_or_derived():
    """A native option shares its name with the TuttiConfig field it comes from (one name end to
    end), whose default is the native one (one definition), or is derived from the configuration."""
    native = _native.StoreOptions()
    assert set(NATIVE_FIELDS) | DERIVED == _public(native)
    assert set(NATIVE_FIELDS) <= set(TuttiConfig.model_fields)
    c = TuttiConfig()
    mine = native_options(c, backend="cpu", unit_blocks=c.unit_tokens // 16)
    for field in NATIVE_FIELDS:
        default = TuttiConfig.model_fields[field].default
        assert default == getattr(native, field) == getattr(mine, field), field
