"""Every shell block of README.md and docs/*.md, run as a user would (or marked skipped).

The marker sits among the blank / ``<!-- -->`` lines right above a ``bash``, ``sh``,
``shell`` or ``console`` fence; a block without one fails. ``<!-- run -->``: run on CPU
with a fresh runtime-only venv first on PATH (``pip install -c constraints.txt -e .``,
cached in ``.venv-docs/``). ``<!-- run: install=test|tpu|smollm2|bfcl -->``: needs that
extra; runs with the test environment's python (``make test`` installs every extra).
Other ``run:`` options, ``key=value`` with shell quoting: ``args="stages.lopd_steps=1 ..."``
appended to each ``python -m lopd_jax.*`` / ``benchmarks.*`` command (before redirections),
``timeout=SECONDS`` (default 300). ``<!-- skip: reason -->``: not run, for that reason.
Blocks run with ``bash -euo pipefail`` in document order from the root of one copy of the
repository's files, so relative paths work as typed and a block may use an earlier one's
output; JAX_PLATFORMS and the forced CPU device count are unset, as in a new shell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
from tests.paths import ROOT


SHELL = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"<!--\s*(run|skip)\s*(?::\s*(.*?))?\s*-->")
EXTRAS = ("test", "tpu", "smollm2", "bfcl")
OPTIONS = ("install", "args", "timeout")
DEFAULT_TIMEOUT = 300
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
# a program of this repository started with python -m: the place to append ``args``
PROGRAM = re.compile(r"\bpython3?\s+-m\s+(?:lopd_jax|benchmarks)\.\w+")
# where a command's own arguments end: a redirection, pipe, background, separator or comment
ARGS_END = re.compile(r"\s(?:\d?>|<|\||&|;|#)")
VENV_DIR = os.path.join(ROOT, ".venv-docs")
RUNTIME_FILES = ("pyproject.toml", "requirements.txt", "constraints.txt")


def doc_paths() -> list[str]:
    """README.md and docs/*.md, relative to the repository root."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md"] + [f"docs/{f}" for f in docs]


@dataclasses.dataclass
class Block:
    """One shell block: where it is, its text, and its marker (``kind`` None when absent)."""

    path: str
    line: int  # 1-based line of the opening fence
    text: str
    kind: str | None = None  # "run" or "skip"
    options: dict = dataclasses.field(default_factory=dict)
    problem: str | None = None  # a marker that does not parse

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_marker(block: Block, line: str) -> None:
    m = MARKER.fullmatch(line.strip())
    if not m:
        return
    block.kind, rest = m.group(1), (m.group(2) or "").strip()
    if block.kind == "skip":
        if not rest:
            block.problem = "<!-- skip: reason --> needs its reason"
        block.options = {"reason": rest}
        return
    try:
        pairs = [w.split("=", 1) for w in shlex.split(rest)]
    except ValueError as e:
        block.problem = f"run options do not parse: {e}"
        return
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in OPTIONS:
            block.problem = f"run option {'='.join(pair)!r}: expected key=value with key in {OPTIONS}"
            return
    block.options = dict(pairs)
    if block.options.get("install", EXTRAS[0]) not in EXTRAS:
        block.problem = f"install={block.options['install']}: one of {EXTRAS}"
    if not block.options.get("timeout", "1").isdigit():
        block.problem = f"timeout={block.options['timeout']}: seconds, an integer"


def shell_blocks(path: str, text: str) -> list[Block]:
    """The shell blocks of a markdown file with their markers (fences may be indented, as in lists)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in SHELL:
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j])
            block = Block(path, i + 1, body + "\n")
            k = i - 1  # the marker: among the blank and <!-- --> lines right above the fence
            while k >= 0 and (not lines[k].strip() or re.fullmatch(r"<!--.*-->", lines[k].strip())):
                if MARKER.fullmatch(lines[k].strip()):
                    _parse_marker(block, lines[k])
                    break
                k -= 1
            out.append(block)
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    """Every shell block of :func:`doc_paths`, in document order."""
    out = []
    for path in doc_paths():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            out += shell_blocks(path, f.read())
    return out


def with_args(script: str, args: str) -> str:
    """``script`` with ``args`` appended to each command that starts a program of this
    repository (continuation lines joined first; inserted before redirections)."""
    if not args:
        return script
    joined = re.sub(r"[ \t]*\\\n\s*", " ", script)
    out = []
    for line in joined.splitlines():
        m = PROGRAM.search(line)
        if m and not line.lstrip().startswith("#"):
            end = ARGS_END.search(line, m.end())
            cut = end.start() if end else len(line.rstrip())
            line = f"{line[:cut]} {args}{line[cut:]}"
        out.append(line)
    return "\n".join(out) + "\n"


def _stamp() -> str:
    h = hashlib.sha256()
    for name in RUNTIME_FILES:
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def runtime_venv() -> str:
    """The bin directory of ``.venv-docs``: a venv with only the runtime install (rebuilt
    when pyproject.toml, requirements.txt or constraints.txt change)."""
    stamp_file = os.path.join(VENV_DIR, ".runtime-stamp")
    if os.path.isfile(stamp_file) and open(stamp_file).read() == _stamp():
        return os.path.join(VENV_DIR, "bin")
    shutil.rmtree(VENV_DIR, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", VENV_DIR], check=True, timeout=300)
    proc = subprocess.run([os.path.join(VENV_DIR, "bin", "python"), "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", "-c", "constraints.txt", "-e", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(stamp_file, "w") as f:
        f.write(_stamp())
    return os.path.join(VENV_DIR, "bin")


def copy_checkout(dest: str) -> None:
    """The repository's files (tracked, and untracked ones git does not ignore) under ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def user_env(bin_dir: str) -> dict[str, str]:
    """A new user's shell with the venv of ``bin_dir`` active."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS", "VIRTUAL_ENV")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = os.path.dirname(bin_dir)
    return env


BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.kind == "run" and b.problem is None]


def test_every_shell_block_has_a_marker():
    bad = [f"{b.where}: {b.problem or 'no <!-- run --> / <!-- run: ... --> / <!-- skip: reason --> marker'}"
           for b in BLOCKS if b.kind is None or b.problem]
    assert not bad, "shell blocks without a valid marker (tests/test_docs_commands.py says how):\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """One copy of the repository shared by the blocks, which run in document order."""
    dest = str(tmp_path_factory.mktemp("docs") / "lopd-jax")
    copy_checkout(dest)
    return dest


@pytest.mark.process
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_documented_command_runs(block, checkout):
    extra = block.options.get("install")
    bin_dir = os.path.dirname(sys.executable) if extra else runtime_venv()
    script = with_args(block.text, block.options.get("args", ""))
    timeout = int(block.options.get("timeout", DEFAULT_TIMEOUT))
    # its own process group, so a timeout ends every program the block started
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=checkout, env=user_env(bin_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.where} ran past timeout={timeout} s (the marker's timeout= or args= "
                    f"shorten it):\n{script}\n--- output ---\n{out[-3000:]}")
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{script}\n--- output ---\n{out[-5000:]}"


def test_markers_and_args_are_read_as_documented(tmp_path):
    text = ("Intro\n\n<!-- run -->\n```bash\necho hi\n```\n\n"
            "```bash\nunmarked\n```\n"
            "1. step\n   <!-- run: install=tpu args=\"stages.lopd_steps=1 x=2\" timeout=60 -->\n\n"
            "   ```sh\n   python -m lopd_jax.train --config=tiny \\\n       --workdir=w > log 2>&1 &\n   ```\n"
            "<!-- skip: needs a slice -->\n```console\ngcloud ...\n```\n<!-- skip -->\n```bash\nx\n```\n"
            "<!-- run: install=gpu -->\n```bash\nx\n```\n<!-- run: cwd=/ -->\n<!-- quickstart -->\n```bash\nx\n```\n"
            "```text\nnot shell\n```\n")
    blocks = shell_blocks("X.md", text)
    assert [(b.line, b.kind) for b in blocks] == [(4, "run"), (8, None), (14, "run"), (19, "skip"), (23, "skip"),
                                                  (27, "run"), (32, "run")]
    assert blocks[0].options == {} and blocks[0].text == "echo hi\n"
    assert blocks[2].options == {"install": "tpu", "args": "stages.lopd_steps=1 x=2", "timeout": "60"}
    assert blocks[2].text.startswith("python -m lopd_jax.train")
    assert with_args(blocks[2].text, blocks[2].options["args"]) == \
        "python -m lopd_jax.train --config=tiny --workdir=w stages.lopd_steps=1 x=2 > log 2>&1 &\n"
    assert blocks[3].options == {"reason": "needs a slice"} and blocks[3].problem is None
    assert "needs its reason" in blocks[4].problem
    assert "install=gpu" in blocks[5].problem and "'cwd=/'" in blocks[6].problem
    assert with_args("make demo\npython -m benchmarks.x --a=1 | tee o\n", "k=1") == \
        "make demo\npython -m benchmarks.x --a=1 k=1 | tee o\n"
