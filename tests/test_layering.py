"""The layering rule (CONTRIBUTING.md, "How the code is laid out"): a module imports only from its
own package or from lower layers, and no modules import each other in a cycle. Read from the
source with `ast`, so imports inside functions (the lazy CLI's) count as much as top-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Low -> high. "leaves" are the top-level modules (errors, diskspace, hardware, families): they
# import nothing of shardtune. `__main__` only starts the CLI.
LAYERS = ["leaves", "config", "telemetry", "distributed", "data", "model", "checkpoint", "publish", "check", "rank",
          "launch", "train", "evaluation", "plan", "resolve", "sweep", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}
PACKAGE = ROOT / "src" / "shardtune"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """The layer of a module `shardtune.<pkg>...`, or of a top-level module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "leaves"  # shardtune/__init__.py
    if parts[1] == "__main__":
        return "cli"
    return parts[1] if parts[1] in RANK else "leaves"


def imports(path: Path, modules: set[str]):
    """(line, imported module) for every shardtune import in the file; a relative import is
    reported as its own problem (imports are absolute)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                yield node.lineno, None
                continue
            base = node.module or ""
            for alias in node.names:  # `from shardtune.x import y`: y is a module or a name in x
                target = f"{base}.{alias.name}"
                yield node.lineno, target if target in modules else base
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def check(root: Path) -> list[str]:
    """Every layering problem and import cycle under the package folder `root`, as file:line lines."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    top = root.name
    problems, graph = [], {m: {} for m in files}
    packages = {m.split(".")[1] for m, path in files.items() if path.parent != root}
    problems += [f"{root.name}/{name}/ is a package with no place in LAYERS; add it where it belongs"
                 for name in sorted(packages - set(RANK))]
    for module, path in files.items():
        where = path.relative_to(root.parent.parent)
        for line, target in imports(path, modules):
            if target is None:
                problems.append(f"{where}:{line}: relative import; write `from {top}.<package>.<module> import ...`")
                continue
            if target != top and not target.startswith(top + "."):
                continue
            while target not in modules and "." in target:  # `import shardtune.x.y.name` -> its module
                target = target.rsplit(".", 1)[0]
            if RANK[layer(target)] > RANK[layer(module)]:
                problems.append(f"{where}:{line}: {module} ({layer(module)}) imports {target} "
                                f"({layer(target)}), a higher layer; order: {' < '.join(LAYERS)}")
            if target != module:
                graph[module].setdefault(target, line)
    for cycle in cycles(graph):
        steps = [f"{files[a].relative_to(root.parent.parent)}:{graph[a][b]} imports {b}"
                 for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)]
        problems.append("import cycle: " + "; ".join(steps))
    return problems


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), in import order."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # walk inside the group from its first module until a module repeats
        path, v = [], min(group)
        while v not in path:
            path.append(v)
            v = min(w for w in graph[v] if w in group)
        found.append(path[path.index(v):])
    return found


def test_shardtune_follows_the_layering_rule():
    assert PACKAGE.is_dir()
    problems = check(PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_check_finds_upward_and_relative_imports_cycles_and_unplaced_packages(tmp_path):
    root = tmp_path / "src" / "pkg"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "config/__init__.py": "",
        "config/schema.py": "import os\n\ndef f():\n    from pkg.train import rel\n",
        "train/__init__.py": "",
        "train/step.py": "from pkg.train.optim import lr\nfrom pkg.errors import E\n",
        "train/optim.py": "from pkg.config import schema\nimport pkg.train.step\n",
        "train/rel.py": "from . import step\n",
        "serve/__init__.py": "",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    problems = check(root)
    assert any(p.startswith("src/pkg/config/schema.py:4: pkg.config.schema (config) imports pkg.train.rel (train)")
               for p in problems), problems
    assert "import cycle: src/pkg/train/optim.py:2 imports pkg.train.step; " \
           "src/pkg/train/step.py:1 imports pkg.train.optim" in problems, problems
    assert any(p.startswith("src/pkg/train/rel.py:1: relative import") for p in problems), problems
    assert "pkg/serve/ is a package with no place in LAYERS; add it where it belongs" in problems
    assert len(problems) == 4, problems


def test_each_test_file_imports_only_helpers_it_can_reach_alone():
    """A test module may import another test module only from its own folder (pytest puts the
    file's folder and tests/ on the path); helpers shared across folders live in conftest.py."""
    tests = ROOT / "tests"
    problems = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.module if isinstance(node, ast.ImportFrom) else None
            if name and name.startswith("test_") and not (path.parent / f"{name}.py").is_file():
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name} from another folder")
    assert not problems, "\n".join(problems)
