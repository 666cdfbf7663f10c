"""The package's shape: every module imports on its own, the seam between notebooks and library holds, no
import circle, and the cluster modules import one way only.

The seam: a notebook's parameters (``dsr1kit.params``) are read by ``steps/`` (one module per notebook) and
the command line (``cli/``) alone; they turn them into the small typed configs each library package owns, so
no library function takes a notebook's parameter object ``p`` and nothing in the library imports ``steps``.

`dsr1kit.cluster.rendezvous` (ranks, node list, MASTER_ADDR/PORT) is what both the
checks and training need; it must import no other cluster module, so training does
not pull in the checks and no cluster module can close a circle through it. The
import graph is read with `ast`, function-local imports included, because a circle
hidden in a function body still breaks whichever side is imported first.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dsr1kit"
NEUTRAL = "dsr1kit.cluster.rendezvous"
OPTIONAL = ("vllm", "ray", "bitsandbytes")  # a module may need these; nothing else may be missing


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


MODULES = _modules()


# -- every module imports by itself -------------------------------------------------------------
IMPORT_EACH = r"""
import importlib, json, sys, traceback
optional = set(sys.argv[2].split(","))
results = {}
for name in sys.argv[1].split(","):
    for loaded in [m for m in sys.modules if m == "dsr1kit" or m.startswith("dsr1kit.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
        results[name] = "ok"
    except ModuleNotFoundError as err:
        missing = (err.name or "").split(".")[0]
        results[name] = f"skip: {missing}" if missing in optional else traceback.format_exc(limit=-3)
    except BaseException:
        results[name] = traceback.format_exc(limit=-3)
print(json.dumps(results))
"""


def test_every_module_imports_on_its_own():
    """Each module starts from no dsr1kit module loaded, so a missing import or an order dependence shows."""
    names = sorted(MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, ",".join(names), ",".join(OPTIONAL)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == set(names)
    failed = {name: out for name, out in results.items() if out != "ok" and not out.startswith("skip: ")}
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())


# -- the import graph ----------------------------------------------------------------------------
def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module named by `from X import …` inside `module`."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str, known: set[str]) -> dict[str, int]:
    """dsr1kit modules `module` imports anywhere in `source` (module level or in a function) → first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            # `from pkg import sub` imports the submodule; `from mod import name` the module itself
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import dsr1kit.x.y.attr` style: the longest module
                target = target.rpartition(".")[0]
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    known = set(MODULES)
    return {m: imports_of(m, p.read_text(), known) for m, p in MODULES.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [
        f"  {a} imports {b} ({MODULES[a].relative_to(ROOT)}:{graph[a][b]})"
        for a in component
        for b in graph[a]
        if b in component
    ]
    return "import circle:\n" + "\n".join(edges)


def _reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, {})
    return seen


def test_the_graph_sees_function_local_and_relative_imports():
    """The checker itself: a circle hidden in a function body must be an edge."""
    known = {"dsr1kit.cluster", "dsr1kit.cluster.net", "dsr1kit.cluster.slurm", "dsr1kit.params"}
    source = "from .. import params as P\ndef f():\n    from .slurm import resolve_ipv4\n"
    assert imports_of("dsr1kit.cluster.net", source, known) == {
        "dsr1kit.params": 1,
        "dsr1kit.cluster.slurm": 3,
    }
    assert _cycles({"a": {"b": 1}, "b": {"a": 2}, "c": {"a": 1}}) == [["a", "b"]]


SEAM = ("dsr1kit.steps", "dsr1kit.cli")  # the only readers of notebook parameters


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == pkg or module.startswith(pkg + ".") for pkg in packages)


def _library() -> list[str]:
    return [m for m in MODULES if not _in(m, SEAM) and m not in ("dsr1kit.params", "dsr1kit.__main__")]


def test_only_steps_import_the_notebook_parameters():
    """The command line too reads them through steps/ (steps/parameters.py)."""
    graph = import_graph()
    readers = {
        m: graph[m]["dsr1kit.params"]
        for m in MODULES
        if not _in(m, ("dsr1kit.steps",)) and m != "dsr1kit.params" and "dsr1kit.params" in graph[m]
    }
    assert not readers, (
        "library modules importing dsr1kit.params (build a config in steps/ instead): "
        + ", ".join(f"{MODULES[m].relative_to(ROOT)}:{line}" for m, line in readers.items())
    )


def test_the_library_never_imports_steps():
    graph = import_graph()
    wrong = {
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m in _library()
        for target, line in graph[m].items()
        if _in(target, ("dsr1kit.steps",))
    }
    assert not wrong, "\n".join(sorted(wrong))


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[str]:
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg)))]


def test_no_library_function_takes_a_notebooks_parameters():
    """A parameter named ``p`` is a notebook's parameter object in this code base: nothing would say which
    fields the function reads."""
    found = []
    for m in _library():
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and "p" in _parameters(
                node
            ):
                found.append(
                    f"{MODULES[m].relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', 'lambda')}"
                )
    assert not found, "library functions taking `p`:\n" + "\n".join(found)


def test_package_inits_only_export():
    """A package's ``__init__`` says what is in it and re-exports; its logic lives in named modules."""
    bodies = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for name, path in MODULES.items()
        if path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    assert not bodies, "\n".join(bodies)


def test_no_import_circle():
    graph = import_graph()
    circles = _cycles(graph)
    assert not circles, "\n".join(_describe(c, graph) for c in circles)


def test_no_import_circle_runs_through_a_cluster_module():
    graph = import_graph()
    circles = [c for c in _cycles(graph) if any(m.startswith("dsr1kit.cluster") for m in c)]
    assert not circles, "\n".join(_describe(c, graph) for c in circles)


def test_rendezvous_imports_no_cluster_module_and_nothing_it_imports_comes_back():
    graph = import_graph()
    assert NEUTRAL in graph
    below = _reachable(graph, NEUTRAL)
    assert not {m for m in below if m.startswith("dsr1kit.cluster.")}, (
        f"{NEUTRAL} must not import other cluster modules, but reaches {sorted(below)}"
    )
    assert NEUTRAL not in below, f"{NEUTRAL} reaches itself through {sorted(below)}"


LOADED = r"""
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("dsr1kit") or m.split(".")[0] == "torch")))
"""


def _loaded_by(module: str) -> set[str]:
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, module], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_rendezvous_alone_loads_no_other_cluster_module_and_no_torch():
    """slurm/prelude.sh runs on every node before anything else: no checks, no torch."""
    loaded = _loaded_by(NEUTRAL)
    others = {m for m in loaded if m.startswith("dsr1kit.cluster.") and m != NEUTRAL}
    assert not others, f"importing {NEUTRAL} also loaded {sorted(others)}"
    assert "torch" not in loaded


def test_training_joins_ranks_without_the_cluster_checks():
    loaded = _loaded_by("dsr1kit.train.dist")
    assert NEUTRAL in loaded
    assert not {m for m in loaded if m.startswith("dsr1kit.cluster.") and m != NEUTRAL}, sorted(loaded)


def _top_functions(module: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(MODULES[module].read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_notebook_step_has_the_same_shape():
    """One ``verdict(result)`` per step module; a step that plans memory does it as
    ``memory_plan(p, machine=None, …)``, the name steps/plans.py and notebook 00 look for."""
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    step_modules = [f"dsr1kit.steps.{nb.stem.split('_', 1)[1]}" for nb in notebooks]
    assert len(step_modules) >= 5 and all(m in MODULES for m in step_modules), step_modules
    wrong = []
    for m in step_modules:
        functions = _top_functions(m)
        verdict = functions.get("verdict")
        if verdict is None or len(verdict.args.args) != 1:
            wrong.append(f"{m}: verdict must take one result")
        plan = functions.get("memory_plan")
        if plan is not None and [a.arg for a in plan.args.args[:2]] != ["p", "machine"]:
            wrong.append(f"{m}: memory_plan must start (p, machine)")
        wrong += [f"{m}: {name} beside memory_plan" for name in functions if name == "memory_plans"]
        if "main" in functions:
            wrong.append(f"{m}: a command line of its own (it belongs in dsr1kit/cli/)")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is its module's own: another module of the library or a bench script
    that needs it asks for it to be made public, so a rename inside a module never breaks another."""
    sources = [*MODULES.values(), *sorted((ROOT / "bench").glob("*.py"))]
    crossing = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").split(".")[0] in ("dsr1kit", "bench")
            ):
                crossing += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert not crossing, "\n".join(crossing)


# -- which package may import which (docs/architecture.md's table says the same) ---------------------------
ALLOWED = {
    "params": set(),
    "run": {"cluster"},
    "cluster": {"model", "plan"},
    "embedded": {"data", "model"},
    "model": {"embedded"},  # the embedded models' names resolve to their built folders (built on first use)
    "plan": {"embedded", "model"},
    "data": {"run"},
    "benchmarks": {"data"},
    "train": {"benchmarks", "cluster", "data", "embedded", "model", "plan", "run"},
    "inspection": {"embedded", "model", "plan", "run"},
    "infer": {"benchmarks", "cluster", "data", "embedded", "inspection", "model", "plan", "run"},
    "measure": {"data", "embedded", "infer", "model", "run", "train"},
}
EVERYTHING = {"steps", "cli"}  # the seam and the command line may import any package


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph() -> dict[str, dict[str, str]]:
    """package -> {package it imports: where, as file:line}."""
    out: dict[str, dict[str, str]] = {}
    for m, targets in import_graph().items():
        for target, line in targets.items():
            a, b = _package(m), _package(target)
            if a != b and a and b:
                out.setdefault(a, {}).setdefault(b, f"{MODULES[m].relative_to(ROOT)}:{line}")
    return out


def test_each_package_imports_only_what_the_architecture_allows():
    wrong = [
        f"{a} imports {b} ({where}); allowed: {sorted(ALLOWED.get(a, set())) or 'nothing of the kit'}"
        for a, targets in package_graph().items()
        if a not in EVERYTHING and a != "__main__"
        for b, where in targets.items()
        if b not in ALLOWED.get(a, set())
    ]
    assert not wrong, "\n".join(wrong)


def test_the_architecture_table_is_the_allowed_imports():
    """docs/architecture.md's "may import" column, package by package, equals ALLOWED."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0] != "`package`":
            name = cells[0].strip("`").rstrip("/")
            allowed = re.sub(r"\([^)]*\)", "", cells[3])  # the asides in parentheses name no package
            table[name] = (
                "everything" if allowed.startswith("everything") else set(re.findall(r"`(\w+)`", allowed))
            )
    expected = {**{k: v for k, v in ALLOWED.items()}, **{k: "everything" for k in EVERYTHING}}
    assert table == expected


# -- steps/ is a seam, not the application ---------------------------------------------------------------
STEP_LIMITS = {"all": 1300, "module": 250, "function": 40}
STEP_HELPERS = {"parameters", "preflight", "plans", "hari_configs", "serve_configs"}  # shared by steps


def _step_modules() -> list[str]:
    return [m for m in MODULES if m.startswith("dsr1kit.steps.")]


def test_steps_stay_a_page_per_notebook():
    """A step turns its notebook's parameters into configs and calls the library: no pipeline of its own."""
    sizes = {m: len(MODULES[m].read_text().splitlines()) for m in [*_step_modules(), "dsr1kit.steps"]}
    assert sum(sizes.values()) <= STEP_LIMITS["all"], sizes
    assert not {m: n for m, n in sizes.items() if n > STEP_LIMITS["module"]}
    long = [
        f"{MODULES[m].relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for m in _step_modules()
        for node in ast.walk(ast.parse(MODULES[m].read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > STEP_LIMITS["function"]
    ]
    assert not long, "\n".join(long)


def test_no_step_imports_another_step():
    """A notebook's step module imports the shared config walks (hari_configs, serve_configs), never another
    notebook's step; steps/plans.py alone looks each step's plans up by notebook name (notebook 00's look
    ahead and `dsr1kit plan`)."""
    graph = import_graph()
    notebook_steps = {m for m in _step_modules() if m.rpartition(".")[2] not in STEP_HELPERS}
    assert len(notebook_steps) == 5, notebook_steps
    wrong = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m in [*notebook_steps, *(f"dsr1kit.steps.{h}" for h in STEP_HELPERS - {"plans"})]
        for target, line in graph[m].items()
        if target in notebook_steps
    ]
    assert not wrong, "\n".join(wrong)
