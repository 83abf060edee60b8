"""The decode worker's engine boundary (decode_worker/engine_api.py) matches what implements it: LLMEngine has every
member of DecodeEngine, the worker's EngineView every member of EngineFigures, and ProcessPort every member of
EnginePort; renaming any of them on one side fails here (the test fakes check themselves against the same
Protocols)."""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Protocol

import pytest

from decode_worker.engine_api import DecodeEngine, EngineFigures, EnginePort
from decode_worker.engine_view import EngineView
from decode_worker.process_port import ProcessPort
from engine.runtime.llm_engine import LLMEngine
from tests.decode_worker.thread_port import ThreadPort


def protocol_members(protocol: type[Protocol]) -> set[str]:
    """The attributes and methods a Protocol (with its bases) asks for."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {name for name in vars(cls) if not name.startswith("_")}
        names |= set(getattr(cls, "__annotations__", {}))
    return names


def instance_members(cls: type) -> set[str]:
    """What an instance of cls has: its class attributes and the `self.name = ...` of its methods."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    assigned = {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for target in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    return assigned | set(dir(cls))


@pytest.mark.parametrize("implementation, protocol", [
    (LLMEngine, DecodeEngine), (EngineView, EngineFigures), (ProcessPort, EnginePort), (ThreadPort, EnginePort),
])
def test_every_member_of_the_protocol_is_implemented(implementation, protocol):
    """Each member the Protocol asks for exists on the implementation."""
    members = protocol_members(protocol)
    assert {"config", "num_free_pages"} <= protocol_members(EngineFigures)  # (the walk found the members)
    missing = members - instance_members(implementation)
    assert not missing, f"{implementation.__name__} lacks {sorted(missing)} of {protocol.__name__}"


def test_a_renamed_member_is_caught():
    """Negative control: a class missing one member of DecodeEngine is reported."""

    members = protocol_members(DecodeEngine)
    assert "add_prefilled" in members

    class Partial:
        def __init__(self) -> None:
            self.config = None

        def add_prefilled_request(self) -> None: ...

    assert {"add_prefilled", "step"} <= members - instance_members(Partial)
