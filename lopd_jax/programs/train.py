"""Train with LOPD end to end: ``python -m lopd_jax.train --config=NAME --workdir=DIR [key=value ...]``.

Runs the stages of :mod:`train.loop` (warm-up, evaluation, experience bank, composer cold start,
LOPD steps, evaluation, export, plot); a rerun resumes. Overrides are dotted config keys
(``stages.lopd_steps=8``). On a multi-host slice run the same command on every host
(``tpu_scripts/run.sh``); elsewhere ``--coordinator_address --num_processes --process_id`` or the
``JAX_*`` variables (``docs/pods.md``).

Exit status: 0 done (or preempted with a checkpoint saved: rerun to resume); 2 a problem the
user fixes, named in one line (bad config, key or value, missing path or package, a missing
shard, a partial or corrupt newest checkpoint); 3 the run stopped with an explanation (empty
experience bank, too many non-finite steps); 130 interrupted (the message gives the command that
resumes). A new run that stops before it saved anything removes the files it wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pkgutil
import shlex
import shutil
import signal
import sys
import threading
from typing import Sequence

import jax

import configs
from lopd_jax.io import files
from lopd_jax.io.files import join
from lopd_jax.io.paths import is_url, resolve_path
from lopd_jax.io.startup import describe_devices
from lopd_jax.programs.launcher import check_workdir
from lopd_jax.method.bank import EmptyBankError
from lopd_jax.settings.errors import ConfigError
from configs import load_config
from lopd_jax.settings.overrides import apply_overrides
from lopd_jax.settings.schedule_scale import apply_schedule_scale
from lopd_jax.settings.run_config import CONFIG_FILE, flatten, save_run_config
from lopd_jax.settings.task_data import check_task_data, resolve_data_paths
from models.gguf import UnsupportedGGUFError, is_gguf_path
from models.hf_import import CheckpointMismatchError
from train import distributed, loop
from train.checkpoint import CheckpointError, request_preemption
from train.launch import add_launch_flags, initialize_from_flags
from train.nonfinite import NonFiniteError


def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="python -m lopd_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="a configs/NAME.py config (default tiny)")
    p.add_argument("--workdir", default=None, help="run directory (local or gs://); default: the config's")
    p.add_argument("--allow_config_change", default="", metavar="KEY[,KEY...]",
                   help="rerun in a workdir whose saved config differs on these dotted keys: the finished stages "
                        "are kept and the new values apply from the next unfinished stage on (e.g. "
                        "bank.min_reward after an empty bank). Without it a differing key is refused.")
    add_launch_flags(p)
    p.add_argument("overrides", nargs="*", help="dotted overrides key=value")
    p.epilog = _configs_epilog()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def _configs_epilog() -> str:
    """The ``--help`` text that lists the named configs (``configs/NAME.py``) with their first docstring line."""

    lines = ["named configs (--config=NAME):"]
    for info in sorted(pkgutil.iter_modules(configs.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        doc = (importlib.import_module(f"configs.{info.name}").__doc__ or "").strip().splitlines()
        lines.append(f"  {info.name:12s} {doc[0] if doc else ''}")
    lines.append("overrides: any dotted key of the config, e.g. stages.lopd_steps=8 model.hf_path=/ckpt "
                 "(sections and keys: README, \"Configs and overrides\"; task data: docs/data.md)")
    return "\n".join(lines)


def _exists(path: str) -> bool:
    """Whether a local path or a ``gs://`` prefix exists (a file or any object under it)."""
    return files.exists(path)


def _join(base: str, name: str) -> str:
    return join(base, name)


def resolve_paths(cfg):
    """``cfg`` with its local paths absolute (``workdir``, ``checkpoint.directory``,
    ``model.hf_path``, ``bank.path``, ``bank.embedder_path``; see :mod:`lopd_jax.io.paths`),
    so the run works from any directory and its config.json names where things are."""

    r = resolve_path
    return dataclasses.replace(
        cfg, workdir=r(cfg.workdir),
        checkpoint=dataclasses.replace(cfg.checkpoint, directory=r(cfg.checkpoint.directory)),
        model=dataclasses.replace(cfg.model, hf_path=r(cfg.model.hf_path)),
        bank=dataclasses.replace(cfg.bank, path=r(cfg.bank.path), embedder_path=r(cfg.bank.embedder_path)))


def check_checkpoint_path(path: str) -> None:
    """ConfigError unless ``model.hf_path`` = ``path`` is a Hugging Face checkpoint directory
    (local or ``gs://``, with a config.json) or a local llama.cpp ``.gguf`` file (checked by
    its magic bytes; the architecture and tensor types are checked when it is opened)."""

    if is_gguf_path(path):
        if not os.path.isfile(path):
            raise ConfigError(f"model.hf_path={path!r}: no such GGUF file; point it at a local .gguf file "
                              "(e.g. `make smollm2` prints SmolLM2's) or at a Hugging Face checkpoint directory.")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(f"model.hf_path={path!r} ends in .gguf but is not a GGUF file (it starts with "
                              f"{magic!r}, not b'GGUF'); give a llama.cpp GGUF file or a checkpoint directory.")
        return
    if not _exists(path):
        raise ConfigError(f"model.hf_path={path!r}: no such checkpoint directory; point it at a Hugging Face "
                          "checkpoint (local dir or gs://), a local .gguf file, or set model.hf_path=none for a "
                          "random-init model.name.")
    if not _exists(_join(path, "config.json")):
        raise ConfigError(f"model.hf_path={path!r} has no config.json; is it a Hugging Face checkpoint? "
                          "(a llama.cpp file must end in .gguf)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_tokenizer_files(m) -> None:
    """ConfigError when the run reads its tokenizer (and chat template) from checkpoint directory
    ``m.hf_path`` (``model.tokenizer`` auto or hf; ``m`` the model section) and that directory
    has no tokenizer files, or no chat template while prompts render with the checkpoint's."""

    path = m.hf_path
    if m.tokenizer not in ("auto", "hf") or is_gguf_path(path):
        return  # a built-in tokenizer, or the tokenizer stored in the GGUF file
    if not any(_exists(_join(path, name)) for name in TOKENIZER_FILES):
        raise ConfigError(f"model.hf_path={path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy "
                          f"the tokenizer files of the model the weights came from into it "
                          f"(tokenizer.save_pretrained(DIR)), or name a built-in tokenizer: model.tokenizer=tiny or "
                          f"qwen3 with model.chat_template=builtin.")
    if not m.uses_checkpoint_template or any(_exists(_join(path, n)) for n in CHAT_TEMPLATE_FILES):
        return
    try:
        config = files.read_json(path, "tokenizer_config.json") or {}
    except ValueError:  # not JSON: transformers would fail on it too
        raise ConfigError(f"model.hf_path={path!r}: tokenizer_config.json is not valid JSON; copy the model's "
                          f"tokenizer files into it again.") from None
    if not config.get("chat_template"):
        raise ConfigError(f"model.hf_path={path!r} has a tokenizer but no chat template (none of "
                          f"{', '.join(CHAT_TEMPLATE_FILES)}, no chat_template in tokenizer_config.json); copy the "
                          f"model's chat template next to its weights, or set model.chat_template=builtin to render "
                          f"prompts with the family's built-in template.")


def resolve_config(argv: Sequence[str] | None = None):
    """The validated :class:`lopd_jax.settings.config.TrainConfig` for ``argv``; ConfigError on problems."""

    return config_of(build_parser().parse_args(argv))


def config_of(args: argparse.Namespace):
    """The validated :class:`lopd_jax.settings.config.TrainConfig` of parsed command-line ``args``
    (the run's saved config: the arm's implications are applied by :func:`train.loop.run`);
    ConfigError on problems."""

    cfg = load_config(args.config)
    overrides = list(args.overrides) + ([f"workdir={args.workdir}"] if args.workdir else [])
    cfg = apply_schedule_scale(resolve_data_paths(resolve_paths(apply_overrides(cfg, overrides))))
    m, b = cfg.model, cfg.bank
    try:
        check_workdir(cfg.workdir)
    except NotADirectoryError as e:
        raise ConfigError(str(e)) from None
    if m.hf_path:
        check_checkpoint_path(m.hf_path)
        check_tokenizer_files(m)
    if b.embedder_path and not _exists(b.embedder_path):
        raise ConfigError(f"bank.embedder_path={b.embedder_path!r}: no such embedder checkpoint.")
    if b.path and not _exists(b.path):
        raise ConfigError(f"bank.path={b.path!r}: no such experience bank directory; drop it to build one.")
    if cfg.stages.warmup_steps and cfg.env.source != "synthetic":
        raise ConfigError(f"stages.warmup_steps={cfg.stages.warmup_steps}: the warm-up trains on oracle "
                          f"demonstrations, which only env.source=synthetic has; set stages.warmup_steps=0.")
    keys = flatten(cfg)
    unknown = [k for k in args.allow_config_change.split(",") if k and k not in keys]
    if unknown:
        raise ConfigError(f"--allow_config_change: {unknown} are not config keys; name dotted keys such as "
                          f"bank.min_reward (the refused run's message lists the keys that differ).")
    check_task_data(cfg)
    return cfg


def run_training(cfg, allow_config_change: Sequence[str] = ()):
    """Save (or check, on resume) ``<workdir>/config.json``, then run every stage of ``cfg``
    with :func:`train.loop.run`; returns its result. Programs that train (this one, sweeps)
    call this rather than ``train.loop.run`` so every run directory holds its config.

    ``allow_config_change``: dotted keys that may differ from a saved config. Any exit of a
    *new* run before it has something to resume from (:func:`has_progress`) -- a config error,
    a missing shard, Ctrl-C -- removes what this call wrote (the workdir if it created it,
    else the entries it added), so the corrected command starts clean."""

    first = jax.process_index() == 0
    existed = _exists(cfg.workdir)
    before = set(os.listdir(cfg.workdir)) if existed and not is_url(cfg.workdir) else None
    # refuses a workdir that holds a run of another config; process 0 checks and writes
    resumed = save_run_config(cfg, allow=allow_config_change) if first else True
    distributed.sync("run_config")
    try:
        return loop.run(cfg, resumed=resumed)
    except BaseException:  # an error or Ctrl-C: a new run with nothing to resume from leaves nothing behind
        if first and not resumed and not has_progress(cfg):
            _undo_new_run(cfg.workdir, existed, before)
        raise


def has_progress(cfg) -> bool:
    """Whether the run of ``cfg`` has anything to resume from: a finished stage
    (``stages.json``) or a step directory in a stage's checkpoints."""
    if _exists(_join(cfg.workdir, "stages.json")):
        return True
    if is_url(cfg.checkpoint_dir):
        return _exists(cfg.checkpoint_dir)
    root = cfg.checkpoint_dir
    stages = os.listdir(root) if os.path.isdir(root) else []
    return any(name.isdigit() for st in stages if os.path.isdir(os.path.join(root, st))
               for name in os.listdir(os.path.join(root, st)))


def _undo_new_run(workdir: str, existed: bool, before: set[str] | None) -> None:
    """Remove what a new run wrote before it stopped: the workdir it created, else the entries
    it added (``before``: the workdir's entries beforehand; None on gs://: its config.json)."""

    if not existed and not is_url(workdir):
        shutil.rmtree(workdir, ignore_errors=True)
    elif before is not None:
        for name in set(os.listdir(workdir)) - before:
            path = os.path.join(workdir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    else:
        files.epath_of(_join(workdir, CONFIG_FILE)).unlink(missing_ok=True)


# problems the user fixes (a config, a path, a package, a checkpoint): one line, exit 2
USER_ERRORS = (ConfigError, CheckpointError, CheckpointMismatchError, UnsupportedGGUFError, FileNotFoundError,
               ImportError)


def _swallows_exceptions(frame) -> bool:
    """Whether ``frame`` runs inside a garbage-collection callback or ``__del__``, where Python
    prints an exception and ignores it (JAX runs one on every collection)."""
    while frame is not None:
        if frame.f_code.co_name in ("__del__", "_xla_gc_callback"):
            return True
        frame = frame.f_back
    return False


def _resume_hint(cfg, argv: Sequence[str] | None) -> str:
    """What to run after Ctrl-C: the same command (it resumes), or say that nothing was kept."""
    command = shlex.join(["python", "-m", "lopd_jax.train", *(sys.argv[1:] if argv is None else argv)])
    if has_progress(cfg):
        return f"The checkpoints are kept; resume with the same command:\n  {command}"
    return f"Nothing was saved yet (this run's files were removed); start again with:\n  {command}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring for exit codes)."""

    args = build_parser().parse_args(argv)
    try:
        cfg = config_of(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    error = initialize_from_flags(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"[lopd] {describe_devices()}", file=sys.stderr, flush=True)
    interrupted = threading.Event()

    def on_ctrl_c(signum, frame):  # noqa: ARG001  (signal handler signature)
        interrupted.set()
        request_preemption()  # the step loops save and stop at their next step
        if not _swallows_exceptions(frame):  # else Python would print the traceback and carry on
            raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_ctrl_c) if main_thread else None
    try:
        allow = [k for k in args.allow_config_change.split(",") if k]
        result = run_training(cfg, allow_config_change=allow)
    except USER_ERRORS as e:  # e.g. a resumed workdir holding another config, a missing shard
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        result = loop.PREEMPTED
    except (EmptyBankError, NonFiniteError) as e:
        print(f"stopped: {e}\nTo rerun in this workdir with a changed setting (the finished stages are kept), "
              f"add --allow_config_change=KEY for each key you change, e.g. --allow_config_change=bank.min_reward.",
              file=sys.stderr)
        return 3
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupted.is_set():
        print(f"\ninterrupted. {_resume_hint(cfg, argv)}", file=sys.stderr)
        return 130
    if result == loop.PREEMPTED:
        print("preempted: state saved; rerun the same command to resume.", file=sys.stderr)
    else:
        print(f"plot: {_join(cfg.workdir, loop.PLOT_FILE)}\n"
              f"export (Hugging Face checkpoint of the student): {_join(cfg.workdir, loop.EXPORT_DIR)}",
              flush=True)
    return 0

