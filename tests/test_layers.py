"""Floors of the code, read from the import statements (module- and function-level), top first.

    9 programs   the command lines (``lopd_jax/*.py``) and their bodies            lopd_jax/*.py,
                 (``lopd_jax/programs/``: train, evaluate, export, sweep, premise,   lopd_jax/programs/
                 demo, the compile checks, the evaluation suite)
    8 train      training only: mesh, system, jitted steps, length-aware batches,  train/
                 checkpoints, metrics, the stages and the loop (``train/loop.py``)
    7 rollout    inference: the engine, its device calls, paged steps, sampling,   lopd_jax/rollout/
                 the inference layout, chat episodes
    6 configs    the named run configs and their lookup                            configs/
    5 planning   plans and estimates: bucket and pack plans, length model, step    lopd_jax/planning/
                 and collective estimates, engine and RL-step schedule models
    4 settings   the run config schema: sections, overrides, the saved config,     lopd_jax/settings/
                 arms, the lengths section
    3 envs       environments and task sources, grouped by benchmark               lopd_jax/envs/
    2 chat       chat formats, templates, tokenizers, tool-call limits             lopd_jax/chat/
    1 method     what LOPD is: losses, composer, compressor, splice, bank,         lopd_jax/method/
                 embedders, text context, evaluation statistics
    0 base       the backbone (decoder, LoRA, HF / GGUF import and export); the    models/, lopd_jax/core/,
                 shared vocabulary (types, shapes, defaults); files, paths, start   lopd_jax/io/

A module imports from its own floor and the floors below it, never from a floor above, and
no set of project modules imports itself round a circle (function-level imports count:
they hide a circle, they do not break it). docs/architecture.md draws the floors.
"""

import ast
import os
import re

import pytest

from tests.paths import ROOT

PACKAGES = ("models", "lopd_jax", "train", "configs")
NAMES = ("base", "method", "chat", "envs", "settings", "planning", "configs", "rollout", "train", "programs")
# the floor of each package (longest prefix wins); lopd_jax's own modules are the programs
FLOORS = {
    "models": 0, "lopd_jax.io": 0, "lopd_jax.core": 0, "lopd_jax": 0,
    "lopd_jax.method": 1,
    "lopd_jax.chat": 2,
    "lopd_jax.envs": 3,
    "lopd_jax.settings": 4,
    "lopd_jax.planning": 5,
    "configs": 6,
    "lopd_jax.rollout": 7,
    "train": 8,
    "lopd_jax.programs": 9,
}


def floor(module: str) -> int | None:
    """The floor of a dotted module name (None: not part of the project)."""
    if module.split(".")[0] not in PACKAGES:
        return None
    if module.startswith("lopd_jax.") and module.count(".") == 1 and module not in {
            f"lopd_jax.{p}" for p in ("io", "core", "method", "chat", "envs", "settings", "planning", "rollout",
                                      "programs")}:
        return FLOORS["lopd_jax.programs"]  # lopd_jax/NAME.py: a command line
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path of every module in the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def imports(path: str, module: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import in the file, at any depth (functions too);
    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def edges(mods: dict[str, str]) -> list[tuple[str, int, str]]:
    """``(module, line, imported project module)`` for every project import in ``mods``."""
    out = []
    for module, path in sorted(mods.items()):
        for line, target in imports(path, module):
            while target not in mods and "." in target:  # ``from pkg import name``: the module is pkg
                target = target.rpartition(".")[0]
            if target in mods and target != module:
                out.append((module, line, target))
    return out


def violations(mods: dict[str, str] | None = None) -> list[str]:
    """Every import that runs from a lower floor to a higher one in ``mods`` (default: the project)."""
    mods = project_modules() if mods is None else mods
    bad = []
    for module, line, target in edges(mods):
        own, other = floor(module), floor(target)
        if other > own:
            bad.append(f"{os.path.relpath(mods[module], ROOT)}:{line}: {module} ({NAMES[own]}) imports "
                       f"{target} ({NAMES[other]})")
    return bad


def cycles(mods: dict[str, str] | None = None) -> list[list[str]]:
    """The import circles among ``mods`` (default: the project): every strongly connected set of
    two or more modules, sorted, each as its sorted module names (Tarjan's algorithm)."""
    mods = project_modules() if mods is None else mods
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, _, target in edges(mods):
        graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_runs_up_the_floors():
    bad = violations()
    assert not bad, "imports from a lower floor to a higher one:\n" + "\n".join(bad)


def test_no_import_circle():
    """No module reaches itself through imports, inside a package (``train/``) or across them."""
    found = cycles()
    assert not found, "import circles (move the shared piece down to a module every user can import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_floor():
    """Each project module is on a named floor, and each floor's package exists (a renamed
    package must not silently drop out of the rule)."""
    mods = project_modules()
    assert all(floor(m) is not None for m in mods)
    assert set(FLOORS) <= set(mods), set(FLOORS) - set(mods)
    assert {floor(m) for m in mods} == set(range(len(NAMES)))


def test_nothing_in_train_imports_the_loop():
    """``train/loop.py`` is the top of ``train/``: it orchestrates the stages; the pieces they
    share live below it."""
    users = sorted({m for m, _, t in edges(project_modules()) if t == "train.loop" and m.startswith("train.")})
    assert not users, users


@pytest.mark.parametrize("module,expected", [
    ("models.decoder", 0), ("lopd_jax.io.files", 0), ("lopd_jax.core.types", 0),
    ("lopd_jax.method.losses", 1), ("lopd_jax.chat.base", 2), ("lopd_jax.envs.base", 3),
    ("lopd_jax.envs.code.grading", 3), ("lopd_jax.settings.config", 4), ("lopd_jax.planning.pack_plan", 5),
    ("lopd_jax.planning", 5), ("configs.tiny", 6), ("configs", 6), ("lopd_jax.rollout.engine", 7),
    ("train.loop", 8), ("lopd_jax.train", 9), ("lopd_jax.programs.train", 9), ("lopd_jax.programs", 9),
    ("numpy", None),
])
def test_floor_of(module, expected):
    assert floor(module) == expected


@pytest.mark.parametrize("source,line,target", [
    ("from train.steps import make_lopd_step\n", 1, "train.steps"),
    ("import numpy\n\n\ndef f():\n    import lopd_jax.train\n", 5, "lopd_jax.train"),
    ("def f():\n    from lopd_jax import export\n", 2, "lopd_jax.export"),
    ("from lopd_jax.chat import base\n", 1, "lopd_jax.chat.base"),
])
def test_checker_sees_module_and_function_level_imports(tmp_path, source, line, target):
    """The checker itself: an upward import at module level or inside a function is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    found = violations({**project_modules(), "lopd_jax.method.fake": str(fake)})
    mine = [v for v in found if "lopd_jax.method.fake" in v]
    assert [v.split(": ", 1)[1] for v in mine] == [
        f"lopd_jax.method.fake (method) imports {target} ({NAMES[floor(target)]})"]
    assert mine[0].split(": ")[0].endswith(f"fake.py:{line}")


@pytest.mark.parametrize("sources,expected", [
    # a module-level circle of two
    ({"a": "import train.b\n", "b": "from train import a\n"}, [["train.a", "train.b"]]),
    # three modules, the circle closed by a function-level import
    ({"a": "from train.b import x\n", "b": "import train.c\n", "c": "def f():\n    from train.a import y\n"},
     [["train.a", "train.b", "train.c"]]),
    # one-way imports: no circle
    ({"a": "import train.b\n", "b": "import train.c\n", "c": "import numpy\n"}, []),
    # two separate circles
    ({"a": "import train.b\n", "b": "import train.a\n", "c": "import train.d\n", "d": "import train.c\n"},
     [["train.a", "train.b"], ["train.c", "train.d"]]),
])
def test_checker_finds_circles(tmp_path, sources, expected):
    """The circle finder itself, on made-up modules (module- and function-level imports)."""
    mods = {}
    for name, src in sources.items():
        (tmp_path / f"{name}.py").write_text(src)
        mods[f"train.{name}"] = str(tmp_path / f"{name}.py")
    assert cycles(mods) == expected


def test_checker_finds_a_circle_through_a_project_module(tmp_path):
    """The finder on the project itself: ``train/training_stage.py`` with one function-level
    import of ``train/loop.py`` (which imports it) closes a circle, and it is reported."""
    looped = tmp_path / "training_stage.py"
    with open(os.path.join(ROOT, "train", "training_stage.py")) as f:
        looped.write_text(f.read() + "\n\ndef _back():\n    from train.loop import run\n")
    found = cycles({**project_modules(), "train.training_stage": str(looped)})
    assert any({"train.training_stage", "train.loop"} <= set(c) for c in found), found


def test_every_command_is_a_console_script():
    """Each command line ``lopd_jax/NAME.py`` is installed as ``lopd-NAME`` (pyproject)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    commands = sorted(m for m in project_modules() if floor(m) == FLOORS["lopd_jax.programs"]
                      and m.count(".") == 1 and not m.startswith("lopd_jax.programs"))
    assert commands, "no command lines found"
    assert sorted(scripts.values()) == sorted(f"{m}:main" for m in commands), (scripts, commands)


def test_no_checkout_on_sys_path_in_tests_or_benchmarks():
    """Tests and benchmarks import the installed packages (``make`` installs them editable;
    pytest's ``pythonpath`` and ``python -m benchmarks.NAME`` cover the rest): none puts the
    checkout on ``sys.path`` itself. A parity benchmark may add the upstream checkout the user
    names (``--upstream``), which is not ours to install."""
    found = []
    for folder in ("tests", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(n for n in files if n.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    for i, line in enumerate(f, 1):
                        if re.search(r"sys\.path\.(insert|append)\(", line) and "args.upstream" not in line:
                            found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_inference_floor_needs_nothing_from_training():
    """``lopd_jax/rollout/`` (the engine and episodes) imports nothing from ``train/`` and the
    static sampler (and its decode step) is not part of the library."""
    mods = project_modules()
    assert not [e for e in edges(mods) if e[0].startswith("lopd_jax.rollout") and e[2].startswith("train")]
    assert not [m for m in mods if m.rpartition(".")[2] in ("sampler", "decode_step")], \
        "the static sampler and its unrolled decode step belong to benchmarks/"


def test_envs_grouped_by_benchmark():
    """``lopd_jax/envs/`` holds the shared environment interface and one folder per benchmark
    family (plus the worker processes they share), not one flat list."""
    flat = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "lopd_jax", "envs")) if f.endswith(".py"))
    assert flat == ["__init__", "base", "envscaler", "privileged", "registry"], flat


def test_tests_mirror_the_package():
    """Every folder under ``tests/`` names a package folder (``models``, ``train``, ``configs``
    or a sub-package of ``lopd_jax``, or ``benchmarks``), so a module's tests are found where
    the module lives; only repository-wide checks sit at the top of ``tests/``."""
    homes = {"models", "train", "configs", "benchmarks"} | {
        d for d in os.listdir(os.path.join(ROOT, "lopd_jax")) if os.path.isdir(os.path.join(ROOT, "lopd_jax", d))}
    folders = {d for d in os.listdir(os.path.join(ROOT, "tests"))
               if os.path.isdir(os.path.join(ROOT, "tests", d)) and d not in ("fixtures", "__pycache__")}
    assert folders, "no test folders"
    assert not folders - homes, f"tests/ folders with no package folder to mirror: {sorted(folders - homes)}"
    for d in folders:
        assert os.path.exists(os.path.join(ROOT, "tests", d, "__init__.py")), f"tests/{d}/__init__.py is missing"
