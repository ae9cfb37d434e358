"""The product's import graph, read from source: modules, the imports between them (inside
functions and under ``if TYPE_CHECKING:`` too), circles, and the client's rooms.

``python -m tests.import_graph`` prints the rooms of ``client/`` and ``service/`` with their
line counts, the import arrows between rooms, and any circle.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The one installed name: ``ckptstore.client.api`` is the repository's ``client/api.py``.
PACKAGE = "ckptstore."


def repo_name(target: str) -> str:
    """An imported module's name as the repository lays it out (``ckptstore.client.x`` -> ``client.x``)."""
    return target[len(PACKAGE) :] if target.startswith(PACKAGE) else target


#: The client's packages by job; the modules directly in client/ are the floor.
ROOMS = ("saving", "loading", "resume", "http", "formats", "distributed", "integrations", "cli")


def module_name(path: Path) -> str:
    """``client/saving/plan.py`` -> ``client.saving.plan``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules(top: str) -> dict[str, Path]:
    """Every module under ``top`` (``client`` or ``service``), by dotted name."""
    return {module_name(path): path for path in sorted((ROOT / top).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that module ``name`` (at ``path``) imports anywhere in its body.

    ``from a import b`` is ``a.b`` where that is a module, else ``a`` (``from client import
    default_client`` imports the package ``client``); ``import a.b.c`` is the longest known
    prefix of ``a.b.c``. Relative imports are resolved against the module's package.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = repo_name(node.module or "")
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for target in map(repo_name, targets):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph(top: str = "client") -> dict[str, set[str]]:
    """Module -> the modules of ``top`` it imports, at module level or inside functions."""
    every = product_modules(top)
    return {name: imports_of(name, path, set(every)) for name, path in every.items()}


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every absolute import in ``path`` (``torch.distributed`` is ``torch``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(repo_name(alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(repo_name(node.module).split(".")[0])
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[start] = seen
    components = {frozenset({a, *(b for b in reach[a] if a in reach.get(b, ()))}) for a in graph}
    return sorted(sorted(c) for c in components if len(c) > 1)


def room_of(module: str) -> str:
    """``client.saving.plan`` -> ``saving``; a floor module (``client.api``) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else ""


def arrows(source_room: str, target_rooms: set[str]) -> list[str]:
    """Imports from the modules of ``source_room`` into any of ``target_rooms``."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in import_graph().items()
        if name != "client" and room_of(name) == source_room
        for target in targets
        if target != "client" and room_of(target) in target_rooms
    )


def service_room_of(module: str) -> str:
    """``service.api.pages`` -> ``api``; a module directly in service/ -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / "service" / parts[1]).is_dir()) else ""


def room_arrows(top: str) -> Counter[tuple[str, str]]:
    """(source room, target room) -> how many module imports cross between them, for ``top``."""
    room = room_of if top == "client" else service_room_of
    counted: Counter[tuple[str, str]] = Counter()
    for name, targets in import_graph(top).items():
        for target in targets:
            if name != top and target != top and room(name) != room(target):
                counted[(room(name) or "(floor)", room(target) or "(floor)")] += 1
    return counted


def room_lines(top: str) -> Counter[str]:
    """Room -> lines of Python in it, for ``top``; the modules directly in it are ``(floor)``."""
    room = room_of if top == "client" else service_room_of
    lines: Counter[str] = Counter()
    for name, path in product_modules(top).items():
        lines[room(name) or "(floor)"] += len(path.read_text().splitlines())
    return lines


def report() -> str:
    """The rooms of client/ and service/, their line counts, the arrows between them, and circles."""
    out = []
    for top in ("client", "service"):
        modules = product_modules(top)
        out.append(f"## {top}/ ({len(modules)} modules)\n\n| room | lines |\n|---|---|")
        out += [f"| {room} | {lines} |" for room, lines in sorted(room_lines(top).items())]
        out.append("\n| from | to | imports |\n|---|---|---|")
        out += [f"| {a} | {b} | {n} |" for (a, b), n in sorted(room_arrows(top).items())]
        out.append(f"\ncircles: {circles(import_graph(top)) or 'none'}\n")
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
