"""One-way layers of the code, read from the import statements (module- and function-level).

    0 models     the backbone: decoder, LoRA, Hugging Face import / export       (models/)
    1 method     losses, composer, compressor, splice, bank, envs, chat formats,  (lopd_jax/, except layer 3)
                 tokenizers -- what LOPD is, independent of how it is trained
    2 training   mesh, system, steps, sampler, rollout, checkpoints, the loop     (train/)
    3 programs   the run-config schema and parser, named configs, and the         (configs/, PROGRAMS below)
                 command-line programs

A module may import from its own layer and the layers below it, never from a layer above.
A new command-line program or config module in lopd_jax/ goes into PROGRAMS.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"models": 0, "lopd_jax": 1, "train": 2, "configs": 3}
NAMES = ("models", "method", "training", "programs")
PROGRAMS = {
    "lopd_jax.settings.config", "lopd_jax.settings.overrides", "lopd_jax.settings.run_config",  # run-config schema, parser, saved config
    "lopd_jax.train", "lopd_jax.evaluate", "lopd_jax.export", "lopd_jax.compile_check",  # command-line programs
    "lopd_jax.composer_eval",  # reopens a finished run for lopd_jax.evaluate
    "lopd_jax.compile_sampler",  # AOT compile of the rollout sampler
    "lopd_jax.compile_buckets",  # the compile check's length-bucket figures
    "lopd_jax.sweep", "lopd_jax.sweep_report",  # arms x seeds x grid runs and their report
    "lopd_jax.premise",  # the premise check: Base, Base + oracle text, Base + Composer
    "lopd_jax.demo",  # make demo: LOPD from the shipped miniature starting point
    "lopd_jax.acebench_user",  # the suite's ACEBench user simulator (a policy through train.rollout)
}


def layer(module: str) -> int | None:
    """The layer of a dotted module name (None: not part of the project)."""
    top = module.split(".")[0]
    if top not in LAYERS:
        return None
    if any(module == p or module.startswith(p + ".") for p in PROGRAMS):
        return 3
    return LAYERS[top]


def project_modules() -> dict[str, str]:
    """Dotted module name -> file path of every module in the four packages."""
    out = {}
    for pkg in LAYERS:
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


def violations(mods: dict[str, str] | None = None) -> list[str]:
    """Every import that runs from a lower layer to a higher one in ``mods`` (default: the project)."""
    mods = project_modules() if mods is None else mods
    bad = []
    for module, path in sorted(mods.items()):
        own = layer(module)
        for line, target in imports(path, module):
            while target not in mods and "." in target:  # ``from pkg import name``: the module is pkg
                target = target.rpartition(".")[0]
            other = layer(target)
            if other is not None and other > own:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {module} ({NAMES[own]}) imports "
                           f"{target} ({NAMES[other]})")
    return bad


def test_no_import_runs_up_the_layers():
    bad = violations()
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_programs_exist():
    """PROGRAMS names real modules (a renamed program must not silently drop out of the rule)."""
    mods = project_modules()
    assert PROGRAMS <= set(mods), PROGRAMS - set(mods)


@pytest.mark.parametrize("source,line,target", [
    ("from train.steps import make_lopd_step\n", 1, "train.steps"),
    ("import numpy\n\n\ndef f():\n    import lopd_jax.train\n", 5, "lopd_jax.train"),
    ("def f():\n    from lopd_jax import compile_check\n", 2, "lopd_jax.compile_check"),
])
def test_checker_sees_module_and_function_level_imports(tmp_path, source, line, target):
    """The checker itself: an upward import at module level or inside a function is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text(source)
    found = violations({**project_modules(), "models.fake": str(fake)})
    assert [v.split(": ", 1)[1] for v in found if "models.fake" in v] == [
        f"models.fake (models) imports {target} ({NAMES[layer(target)]})"]
    assert [v for v in found if "models.fake" in v][0].split(": ")[0].endswith(f"fake.py:{line}")
