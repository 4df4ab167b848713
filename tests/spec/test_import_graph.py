"""The product's layering, read from its imports (``tests/support/import_graph.py``): no module
and no package imports one that imports it back, and the engine never imports the front ends
(their policy stays in ``server/``; docs/architecture.md, "The packages of server/")."""
from __future__ import annotations

from tests.support.import_graph import cycles, module_graph, package_graph


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph = module_graph()
    assert "server.generation.pipeline" in graph and "engine.core" in graph  # the graph is the product's
    assert cycles(graph) == []


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert "server.generation" in graph["server.http"]
    assert cycles(graph) == []


def test_the_engine_never_imports_the_front_ends():
    for module, targets in module_graph().items():
        if module.split(".")[0] == "engine":
            assert not [t for t in targets if t.split(".")[0] == "server"], module
