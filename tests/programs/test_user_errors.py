"""Every failure a user can fix exits 2 with one line that names the fix, and leaves the workdir
as it was (issue 51 item 3): each case runs the command as a user types it
(``python -m lopd_jax.NAME ...``). :func:`test_no_console_script_shows_a_traceback` walks every
console script over generic bad inputs (a file where a folder goes, a folder where a file goes,
an empty file, a truncated file, a missing path) and fails on any traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.paths import ROOT


def lopd(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m lopd_jax.NAME args`` from the checkout's root."""
    return subprocess.run([sys.executable, "-m", f"lopd_jax.{name}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def assert_one_line(proc: subprocess.CompletedProcess, *fix: str) -> str:
    """Exit 2, no traceback, exactly one line on stderr (``error: ...``) holding each of ``fix``."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for words in fix:
        assert words in lines[0], lines[0]
    return lines[0]


def tree(path: str) -> dict[str, bytes] | None:
    """Every file under ``path`` (or ``path`` itself) with its bytes; None when it is absent."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return {"": open(path, "rb").read()}
    out = {}
    for base, dirs, names in os.walk(path):
        for n in dirs + names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, path)] = open(p, "rb").read() if os.path.isfile(p) else b"<dir>"
    return out


@pytest.fixture(scope="module")
def tokenizerless_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 written by ``models.save_pretrained`` without a tokenizer."""
    from flax import nnx

    from models import save_pretrained
    from models.config import named_config
    from models.decoder import Decoder

    path = str(tmp_path_factory.mktemp("ckpt") / "no_tokenizer")
    model = Decoder(named_config("tiny_qwen3", vocab_size=512, dtype="float32", param_dtype="float32"),
                    rngs=nnx.Rngs(0))
    written = save_pretrained(model, path, dtype="float32")
    assert "config.json" in written and not [f for f in written if "token" in f]
    return path


@pytest.mark.process
def test_a_checkpoint_without_tokenizer_files(tokenizerless_checkpoint, tmp_path):
    workdir = str(tmp_path / "run")
    proc = lopd("train", "--config=tiny", f"--workdir={workdir}", f"model.hf_path={tokenizerless_checkpoint}",
                "model.vocab_size=none", "model.name=none")
    assert_one_line(proc, "holds no tokenizer files", "tokenizer.save_pretrained", "model.tokenizer=")
    assert not os.path.exists(workdir)


@pytest.mark.process
def test_a_checkpoint_with_a_tokenizer_but_no_chat_template(tokenizerless_checkpoint, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tokenizerless_checkpoint, ckpt)
    with open(os.path.join(ckpt, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    workdir = str(tmp_path / "run")
    proc = lopd("train", "--config=tiny", f"--workdir={workdir}", f"model.hf_path={ckpt}", "model.vocab_size=none",
                "model.name=none")
    assert_one_line(proc, "no chat template", "model.chat_template=builtin")
    assert not os.path.exists(workdir)


@pytest.mark.process
def test_train_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    assert_one_line(lopd("train", "--config=tiny", f"--workdir={path}"), "is a file", "give a directory")
    assert_one_line(lopd("train", "--config=tiny", f"--workdir={path}/run"), "lies under a file")
    assert path.read_text() == "mine\n"


@pytest.mark.process
def test_sweep_report_on_a_missing_run():
    assert_one_line(lopd("sweep_report", "base-composer", "/nosuch"), "no config.json", "--workdir of a training run")


@pytest.mark.process
def test_sweep_refuses_a_missing_or_file_workdir(tmp_path):
    missing = str(tmp_path / "nosuch")
    assert_one_line(lopd("sweep", f"--workdir={missing}", "--report_only"), "no such sweep directory",
                    "drop --report_only")
    assert not os.path.exists(missing)
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    assert_one_line(lopd("sweep", f"--workdir={path}"), "is a file")
    assert path.read_text() == "mine\n"


@pytest.mark.process
@pytest.mark.parametrize("args, fix", [
    (["stages.lopd_stepz=2"], ("unknown key 'stages.lopd_stepz'", "did you mean lopd_steps")),
    (["--seeds=abc"], ("--seeds='abc'", "comma-separated integers")),
    (["--seeds=,"], ("--seeds names no seed",)),
    (["--parallel=0"], ("--parallel=0", "at least one")),
    (["--start=/nosuch"], ("not a demo starting point", "--pack")),
], ids=["misspelt_key", "seeds_abc", "no_seeds", "parallel_0", "no_start"])
def test_demo_checks_its_arguments_before_any_run(tmp_path, args, fix):
    workdir = tmp_path / "demo"
    workdir.mkdir()
    (workdir / "keep.txt").write_text("mine\n")
    before = tree(str(workdir))
    assert_one_line(lopd("demo", f"--workdir={workdir}", *args), *fix)
    assert tree(str(workdir)) == before  # no start/, seed*/ or logs


@pytest.mark.process
def test_demo_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    assert_one_line(lopd("demo", f"--workdir={path}"), "is a file", "give a directory")
    assert path.read_text() == "mine\n"


@pytest.mark.process
def test_an_existing_out_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    before = tree(str(out))
    missing_run = str(tmp_path / "run")
    assert_one_line(lopd("export", f"--workdir={missing_run}", f"--out={out}"), "exists", "--overwrite")
    text = tmp_path / "notes.txt"
    text.write_text("mine\n")
    assert_one_line(lopd("export", f"--workdir={missing_run}", f"--out={text}"), "is a file")
    gguf = tmp_path / "model.gguf"
    gguf.write_text("not a gguf\n")
    assert_one_line(lopd("convert_gguf", f"--gguf={gguf}", f"--out={out}"), "exists", "--overwrite")
    assert_one_line(lopd("convert_gguf", f"--gguf={gguf}", f"--out={tmp_path / 'new'}"), "not a readable GGUF")
    assert tree(str(out)) == before and text.read_text() == "mine\n"
    # --overwrite passes the check: the next problem is the missing run
    assert_one_line(lopd("export", f"--workdir={missing_run}", f"--out={out}", "--overwrite"), "no config.json")


@pytest.mark.process
def test_evaluate_refuses_an_existing_out(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("{}")
    proc = lopd("evaluate", "--model=tiny", f"--out={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # argparse's error: usage, then one line
    assert re.search(r"error: --out=.* exists; pass --overwrite", proc.stderr.splitlines()[-1])
    assert out.read_text() == "{}"


# ----------------------------------------------------------------------------- the walk


def bad_inputs(root: str) -> dict[str, str]:
    """The generic bad inputs, made under ``root``: ``file`` (text where a folder goes),
    ``empty`` (an empty file), ``missing``, ``folder`` (an empty folder where a file goes) and
    ``truncated`` (a folder of cut-off files: config.json, model.safetensors, stages.json,
    start.json, metrics.jsonl; and ``truncated.gguf``)."""
    os.makedirs(os.path.join(root, "folder"))
    paths = {k: os.path.join(root, k) for k in ("file", "empty", "missing", "folder", "truncated")}
    with open(paths["file"], "w") as f:
        f.write("some notes\n")
    open(paths["empty"], "w").close()
    os.makedirs(paths["truncated"])
    cut = {"config.json": '{"model_type": "qwen3", "hidden_si', "model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00"
           b"\x00{\"w\": {\"dty", "stages.json": '{"warmup": {"do', "start.json": '{"config": "mini',
           "metrics.jsonl": '{"stage": "lopd", "st', "tokenizer_config.json": '{"chat_te'}
    for name, data in cut.items():
        with open(os.path.join(paths["truncated"], name), "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
    with open(os.path.join(root, "truncated.gguf"), "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00\x02\x00")
    return paths


GENERIC = ("file", "empty", "missing", "folder", "truncated")
HF = ["model.vocab_size=none", "model.name=none"]
# (argument template, the inputs {X} takes): arguments that fail fast, never a run that starts
WALK: dict[str, list[tuple[list[str], tuple[str, ...]]]] = {
    "train": [(["--config=tiny", "--workdir={W}/run", "model.hf_path={X}", *HF], GENERIC),
              (["--config=tiny", "--workdir={X}", "bank.path={missing}"], GENERIC),
              (["--config={X}", "--workdir={W}/run"], GENERIC)],
    "evaluate": [(["--model={X}", "--num_tasks=1"], GENERIC + ("gguf",)),
                 (["--composer_from={X}", "--num_tasks=1"], GENERIC),
                 (["--model=tiny", "--out={X}"], ("file", "empty", "folder", "truncated"))],
    "export": [(["--workdir={X}", "--out={W}/out"], GENERIC), (["--workdir={missing}", "--out={X}"], GENERIC)],
    "compile_check": [(["--config=tiny", "--topology=cpu:1", "--dry_run", "model.hf_path={X}", *HF],
                       GENERIC + ("gguf",))],
    "compile_sampler": [(["--config=tiny", "--topology=cpu:1", "model.hf_path={X}", *HF], GENERIC)],
    "convert_gguf": [(["--gguf={X}", "--out={W}/out"], GENERIC + ("gguf",)),
                     (["--gguf={missing}", "--out={X}"], GENERIC)],
    "demo": [(["--workdir={W}/demo", "--start={X}"], GENERIC), (["--workdir={X}", "--start={missing}"], GENERIC),
             (["--pack={X}", "--start={W}/start"], GENERIC)],
    "premise": [(["--workdir={X}"], GENERIC)],
    "sweep": [(["--workdir={X}", "--report_only"], ("file", "empty", "missing"))],
    "sweep_report": [(["base-composer", "{X}"], GENERIC)],
}


@pytest.mark.process
def test_no_console_script_shows_a_traceback(tmp_path):
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        scripts = re.findall(r'^lopd-[\w-]+ = "lopd_jax\.(\w+):main"', f.read(), re.M)
    assert sorted(scripts) == sorted(WALK), "a console script the walk does not cover"
    procs = {}
    for name, cases in WALK.items():
        root = str(tmp_path / name)
        inputs = bad_inputs(root)
        inputs["gguf"] = os.path.join(root, "truncated.gguf")
        subst = lambda a, x: a.format(X=inputs[x], W=os.path.join(root, "work"), **inputs)  # noqa: E731
        argvs = [[subst(a, x) for a in args] for args, xs in cases for x in xs]
        result = os.path.join(root, "result.json")
        procs[name] = (subprocess.Popen([sys.executable, "-m", "tests.programs.walk_driver", name, result,
                                         json.dumps(argvs)], cwd=ROOT), result)
    escaped, calls = [], 0
    for name, (proc, result) in procs.items():
        assert proc.wait(timeout=600) == 0, name
        with open(result) as f:
            for r in json.load(f):
                calls += 1
                if r["traceback"] or "Traceback" in r["stderr"]:
                    escaped.append(f"lopd-{name.replace('_', '-')} {' '.join(r['argv'])}:\n"
                                   f"{(r['traceback'] or r['stderr'])[-1500:]}")
    print(f"\n{calls} calls, {len(escaped)} tracebacks")
    assert not escaped, "\n\n".join(escaped)
