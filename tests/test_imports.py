"""The package's import graph has no cycle: every module-level import points down the layers
(ptx / runtime below ops, ops below models and the engine), and so do imports deferred into
functions, except the pairs listed in ``DEFERRED_CYCLES`` with the reason."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "llmspeed_numba"

#: Cycles closed only by an import inside a function, each kept on purpose.
DEFERRED_CYCLES = {
    # load_config reads a GGUF file's metadata through gguf_loader, which builds a ModelConfig
    frozenset({"llmspeed_numba.models.config", "llmspeed_numba.models.gguf_loader"}),
}


def _modules():
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _targets(mods, name, is_pkg, node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def _graph(deferred):
    """module -> package modules it imports (at module level; ``deferred``: in functions too);
    a package's own ``__init__`` re-exporting its children is not an edge back."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text())
        deps = set()

        def visit(nodes):
            for node in nodes:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    deps.update(_targets(mods, name, is_pkg, node))
                elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                    continue
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    if deferred:
                        visit(n for n in ast.walk(node) if n is not node
                              and isinstance(n, (ast.Import, ast.ImportFrom)))
                else:
                    for field in ("body", "orelse", "finalbody"):
                        visit(getattr(node, field, []))
                    for handler in getattr(node, "handlers", []):
                        visit(handler.body)

        visit(tree.body)
        graph[name] = {d for d in deps if d in mods and d != name
                       and not name.startswith(d + ".")}
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_level_import_cycle():
    assert _cycles(_graph(deferred=False)) == []


def test_no_deferred_import_cycle_but_the_listed():
    cycles = set(_cycles(_graph(deferred=True)))
    assert cycles <= DEFERRED_CYCLES, sorted(sorted(c) for c in cycles - DEFERRED_CYCLES)


def test_the_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]
