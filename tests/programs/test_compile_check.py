"""The AOT compile check: run configs + overrides on a small TPU topology (libtpu, no chips), and the\nsame step inputs as the trainer."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tests.paths import ROOT


def _has_libtpu():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


TINY_TPU = ["model.attention_impl=splash", "steps.micro_batch=1", "env.tasks_per_step=8",
            "rollout.max_total_tokens=128", "composer.max_experience_tokens=32", "model.attention_block_q=128",
            "model.attention_block_kv=128", "steps.logits_chunk=64"]


@pytest.mark.process
@pytest.mark.skipif(not _has_libtpu(), reason="libtpu not installed (pip install -r requirements-tpu.txt)")
def test_compile_check_tiny_on_v5p_8(tmp_path):
    """The TPU layout of the named configs: splash kernel under shard_map (Mosaic lowering)
    and 2 micro-batches per step (8 trajectories over 4 chips, 1 per micro-step), all set
    by dotted overrides of the tiny run config."""
    out = tmp_path / "report.json"
    env = dict(os.environ, XLA_FLAGS="")
    env.pop("JAX_PLATFORMS", None)
    cmd = [sys.executable, "-m", "lopd_jax.compile_check", "--config=tiny", "--topology=v5p-8", *TINY_TPU,
           f"--json={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["chips"] == 4 and report["fits"] and report["attention"] == "splash"
    assert report["micro_batch"] == 1 and report["batch"] == 8 and report["seq"] == 128
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert 0 < report["per_chip_gib"]["total"] < 1.0
    assert report["model_flops"] > 0
    assert "per chip GiB" in proc.stdout


def test_compile_check_and_trainer_build_the_same_step():
    """From one config name and overrides, the compile check's step inputs are the ones the
    trainer's RunContext builds its LOPD system from (model, composer, step, mesh, shapes,
    latent-block layout)."""
    from lopd_jax.programs.compile_check import parse_args, run_config, step_inputs
    from configs import load_config
    from lopd_jax.settings.overrides import apply_overrides
    from train.run_context import RunContext

    overrides = ["env.kwargs.n_train_per_family=1", "env.kwargs.n_heldout_per_family=1", "steps.micro_batch=2",
                 "rollout.max_total_tokens=300", "model.attention_impl=blockwise", "mesh.fsdp=4", "mesh.data=2"]
    args = parse_args(["--config=tiny", "--topology=cpu:8", *overrides])
    spec, layout = step_inputs(run_config(args))
    ctx = RunContext(apply_overrides(load_config("tiny"), overrides))
    assert spec == ctx.spec and layout == ctx.layout
    assert (spec.batch, spec.seq, spec.exp_len) == (8, 384, 256)
    assert ctx.model_cfg == spec.model and spec.model.attention_impl == "blockwise"
    assert ctx.system.step_cfg == spec.steps and spec.steps.micro_batch == 2
    assert ctx.mesh.shape == {"data": 2, "fsdp": 4, "tensor": 1}
    assert ctx.seq_buckets() == (spec.seq,)


def test_compile_check_rejects_unknown_config_key():
    from lopd_jax.programs.compile_check import main

    assert main(["--config=tiny", "--topology=cpu:8", "steps.top_mm=3"]) == 2


def test_compile_check_rejects_unknown_topology(capsys):
    from lopd_jax.programs.compile_check import main, topology_devices

    with pytest.raises(ValueError, match="unknown topology 'v9x-8'; known: .*v5p-32.*cpu:N"):
        topology_devices("v9x-8")
    assert main(["--config=tiny", "--topology=v9x-8", "--dry_run"]) == 2  # a usage error, not "does not fit" (1)
    assert "unknown topology" in capsys.readouterr().err


@pytest.mark.parametrize("topology", ["v5p-33", "v5e-3", "cpu:0", "cpu:x", "v5p"])
def test_compile_check_refuses_a_topology_by_name(topology, capsys):
    """Not a slice name (v5p-33 is no 16-chip slice) or no device count: exit 2, the name quoted."""
    from lopd_jax.programs.compile_check import EXIT_BAD_ARGS, main

    assert main(["--config=tiny", f"--topology={topology}", "--dry_run"]) == EXIT_BAD_ARGS
    assert f"unknown topology {topology!r}" in capsys.readouterr().err


@pytest.mark.process
def test_compile_check_exit_codes_are_distinct_and_in_help(tmp_path):
    """Without libtpu (a stand-in package that fails to import, put first on the path) a TPU
    topology cannot compile here: exit 3 with the way on, not 1 (\"does not fit\")."""
    from lopd_jax.programs.compile_check import EXIT_CODES, exit_codes_epilog

    assert sorted(EXIT_CODES) == [0, 1, 2, 3] and all(f"  {c}  " in exit_codes_epilog() for c in EXIT_CODES)
    fake = tmp_path / "no_libtpu" / "libtpu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libtpu hidden by the test')\n")
    # (importing JAX here set TPU_LIBRARY_PATH, which would find the real libtpu)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("TPU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.compile_check", "--config=tiny", "--topology=v5p-8",
                           "--dry_run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "make tpu" in proc.stderr and "Traceback" not in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "lopd_jax.compile_check", "--help"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300).stdout
    assert "exit status:" in help_text and "cannot compile here" in help_text


def test_cpu_topology_names_the_device_count_it_needs():
    """In a process whose JAX already started with 8 CPU devices, cpu:16 says what to set
    (a fresh ``python -m lopd_jax.compile_check --topology=cpu:N`` sets it itself)."""
    from lopd_jax.programs.compile_check import main, topology_devices

    with pytest.raises(ValueError, match="needs 16 CPU devices but JAX started with 8; start the process with "
                                         "XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        topology_devices("cpu:16")
    assert main(["--config=tiny", "--topology=cpu:16", "--dry_run"]) == 2


@pytest.mark.process
def test_cpu_topology_sets_its_own_device_count(tmp_path):
    """``--topology=cpu:4`` in a new process without XLA_FLAGS: the check simulates 4 devices itself."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.compile_check", "--config=tiny", "--topology=cpu:4",
                           "--dry_run", f"--json={out}", "mesh.fsdp=-1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["chips"] == 4


def _named_configs():
    import pkgutil

    import configs
    return sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if not m.name.startswith("_"))


@pytest.mark.parametrize("name", _named_configs())
def test_every_named_config_resolves_up_to_the_compile(name, tmp_path, capsys):
    """Each configs/NAME.py, without weights or task data, gets as far as compiling: config,
    tokenizer (a stated placeholder where the family has none built in), latent-block
    layout, mesh and step shapes (8 simulated devices; a v5p slice in test_quickstart)."""
    from lopd_jax.programs.compile_check import main

    out = tmp_path / "r.json"
    # qwen3_4b is laid out for v5e-64 and up (fsdp 32); here its fsdp axis shrinks to fit 8 devices
    fit = {"qwen3_4b": ["mesh.fsdp=4"]}.get(name, [])
    assert main([f"--config={name}", "--topology=cpu:8", "--dry_run", f"--json={out}", *fit]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["chips"] == 8 and report["batch"] >= 1 and report["seq"] >= 128
    assert report["latent_block_tokens"] > 0 and report["model_flops"] > 0
    assert "resolved, not compiled" in capsys.readouterr().out


def test_model_flops_scale_with_tokens():
    from lopd_jax.programs.compile_check import model_flops
    from lopd_jax.method.composer import ComposerConfig
    from models.config import named_config

    cfg = named_config("qwen3_8b")
    a = model_flops(cfg, ComposerConfig(), 1, 4096, 1024, 100)["total"]
    b = model_flops(cfg, ComposerConfig(), 2, 4096, 1024, 100)["total"]
    assert abs(b / a - 2) < 1e-9
    # 8B-class: ~6 N per student token dominates; N ~ 7e9 non-embedding parameters
    assert 6 * 6e9 * 4096 < a < 6 * 6e9 * 4096 * 4


def test_splash_kernel_flops_counts_calls_by_phase_and_causal_blocks():
    from lopd_jax.programs.compile_check import splash_kernel_flops

    # shapes as XLA:TPU prints them: layouts, tuple outputs, a leading (vmapped) batch dim
    hlo = (
        "  %splash_mha_fwd_segmented_residuals.3 = (f32[128,128]{1,0:T(8,128)}, bf16[2,4,1024,128]{3,2,1,0}, "
        "f32[2,4,1024,128]{3,2,1,0}) custom-call(%a, %b), custom_call_target=\"tpu_custom_call\"\n"
        "  %splash_mha_dkv_segmented_no_residuals.1 = (f32[128,128]{1,0}, bf16[2,2,1024,128]{2,1,0}, "
        "bf16[2,2,1024,128]{2,1,0}) custom-call(%c), custom_call_target=\"tpu_custom_call\"\n"
        "  %gte = bf16[2,4,1024,128]{3,2,1,0} get-tuple-element(%splash_mha_fwd_segmented_residuals.3), index=1\n"
    )
    blocks = 2 * 3 / 2  # 1024 tokens in blocks of 512: 3 causal blocks
    per_block_matmul = 2 * 512 * 512 * 128
    fwd = 2 * 4 * blocks * 2 * per_block_matmul  # batch 2, 4 q heads, 2 matmuls
    dkv = 2 * (2 * 2) * blocks * 4 * per_block_matmul  # 2 kv heads x 2 q per kv, 4 matmuls
    assert splash_kernel_flops(hlo, 512, q_per_kv=2) == fwd + dkv
    # a block larger than the sequence is capped to it: one 1024-block per sequence
    assert splash_kernel_flops(hlo, 2048, q_per_kv=2) == (2 * 4 * 2 + 2 * 4 * 4) * 2 * 1024 * 1024 * 128


def test_kernel_block_pairs_follow_the_segments():
    """Segments of 300, 200, 260 and 100 tokens in a 1,024-token row, blocks of 128 (ranges
    [1], [1], [1,2], [2,3], [3], [3,4], [4], padding): 16 causal block pairs of 36, and
    each row's own in the LOPD FLOPs (student and teacher rows, whole blocks)."""
    from lopd_jax.programs.compile_check import kernel_block_pairs, model_flops
    from models.config import named_config

    assert kernel_block_pairs((300, 200, 260, 100), 1024, 128) == (1 + 2 + 3 + 2 + 2 + 3 + 2 + 1, 128)
    assert kernel_block_pairs((1024,), 1024, 128) == (36, 128)
    assert kernel_block_pairs((), 1024, 128) == (8, 128)  # a padding row: its diagonal only
    assert kernel_block_pairs((100,), 100, 512) == (1, 128)  # the block is capped at the row
    mcfg = named_config("tiny_qwen3").replace(attention_block_q=128)
    from lopd_jax.method.composer import ComposerConfig
    ccfg = ComposerConfig()
    whole = model_flops(mcfg, ccfg, 1, 1024, 32, 0, segments=4)
    skip = model_flops(mcfg, ccfg, 1, 1024, 32, 0, segments=4, row_layouts=[[300, 200, 260, 100]])
    per_pair = 2 * 2 * 128 * 128 * mcfg.num_heads * mcfg.head_dim * mcfg.num_layers
    # whole-row attention counts 1024^2 / 2 causally, the kernel 16 whole blocks
    full = 2 * 2 * 1024 ** 2 * mcfg.num_heads * mcfg.head_dim * mcfg.num_layers / 2
    assert whole["student"] - skip["student"] == pytest.approx(3 * (full - 16 * per_pair))
    with pytest.raises(ValueError, match="row_layouts has 2 rows for a batch of 1"):
        model_flops(mcfg, ccfg, 1, 1024, 32, 0, row_layouts=[[10], [20]])


def test_paper_configs_give_concrete_step_shapes():
    """The release-parity configs leave experience inputs uncut (``None``); the compile
    check still gets one concrete shape per input (the documented bucket assumption)."""
    from configs import load_config
    from train.step_spec import UNCUT_EXP_LEN, abstract_lopd_batch, step_spec

    for name in ("qwen3_8b", "qwen3_4b"):
        cfg = load_config(name)
        assert cfg.composer.max_experience_tokens is None
        spec = step_spec(cfg)
        assert spec.exp_len == UNCUT_EXP_LEN
        for x in abstract_lopd_batch(spec).values():
            assert all(isinstance(d, int) and d > 0 for d in x.shape), x


@pytest.mark.process
def test_tpu_worker_version_check(tmp_path):
    """tpu_scripts/check_versions.py (run by setup.sh on every worker) reads the lock's pins
    and fails on a missing package, a version off the lock, or jax and jaxlib apart."""
    spec = importlib.util.spec_from_file_location("check_versions", os.path.join(ROOT, "tpu_scripts", "check_versions.py"))
    cv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cv)
    f = tmp_path / "c.txt"
    f.write_text("# lock\njax==0.10.2\njaxlib==0.10.2  # cpu\nlibtpu==0.0.42.1\nnumpy>=1\n")
    expected = cv.pins(str(f))
    assert expected == {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"}
    assert cv.check(expected, dict(expected)) == []
    problems = cv.check(expected, {"jax": "0.11.0", "jaxlib": "0.10.2", "libtpu": None})
    assert len(problems) == 3
    assert any("jax 0.11.0 is installed, the lock says 0.10.2" in p for p in problems)
    assert any("libtpu is not installed" in p for p in problems)
    assert any("jax 0.11.0 and jaxlib 0.10.2 differ" in p for p in problems)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tpu_scripts", "check_versions.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == (0 if _has_libtpu() else 1), proc.stdout + proc.stderr
    assert proc.stdout.startswith("jax ")


def test_compile_check_steps_follow_the_run_config():
    """The steps the check compiles are the ones the run trains with: warm-up (when it runs),
    the cold start (composer arms), then the arm's step; ``--steps`` picks some, by name."""
    from lopd_jax.programs.compile_buckets import stage_steps
    from lopd_jax.programs.compile_check import selected_steps
    from configs import load_config
    from lopd_jax.settings.overrides import apply_overrides

    tiny = load_config("tiny")
    assert stage_steps(tiny) == ["warmup", "cold_start", "lopd"]
    assert stage_steps(load_config("qwen3_8b")) == ["cold_start", "lopd"]  # real checkpoints skip the warm-up
    assert stage_steps(apply_overrides(tiny, ["arm=grpo", "arms.group_size=4"])) == ["warmup", "grpo"]
    assert stage_steps(apply_overrides(tiny, ["arm=sdft", "stages.warmup_steps=0"])) == ["text"]
    assert stage_steps(apply_overrides(tiny, ["arm=lopd_frozen_composer"])) == ["warmup", "cold_start", "lopd"]
    assert selected_steps(tiny, "cold_start, lopd") == ["cold_start", "lopd"]
    with pytest.raises(ValueError, match="--steps='packing': choose from warmup, cold_start, lopd, grpo, text"):
        selected_steps(tiny, "packing")


def test_step_flops_add_up_to_the_lopd_step():
    """The per-step FLOP models are parts of the LOPD step's: the cold start drops the student
    and the anchor, the warm-up and GRPO are the student alone."""
    from lopd_jax.programs.compile_check import model_flops, step_flops
    from lopd_jax.method.composer import ComposerConfig
    from models.config import named_config

    cfg, ccfg = named_config("qwen3_8b"), ComposerConfig()
    f = model_flops(cfg, ccfg, 2, 4096, 1024, 100)
    flops = {k: step_flops(k, cfg, ccfg, 2, 4096, 1024, 100, ctx_tokens=256) for k in
             ("warmup", "cold_start", "lopd", "grpo", "text")}
    assert flops["lopd"] == f["total"] == flops["warmup"] + flops["cold_start"] + f["anchor"]
    assert flops["grpo"] == flops["warmup"] < flops["text"] < flops["warmup"] * 1.5 < flops["lopd"]


def test_compile_check_compiles_each_steps_buckets(tmp_path, capsys):
    """With length buckets, every step the run trains with compiles its pass shapes (here the
    GRPO arm's warm-up and GRPO steps: 2 shapes each + their updates, on 2 CPU devices; no
    padded LOPD step, which this arm does not run) and prints per step the largest pass's
    memory, model FLOPs per real token padded and length-aware."""
    from lopd_jax.programs.compile_check import main

    out = tmp_path / "r.json"
    args = ["--config=tiny", "--topology=cpu:2", "arm=grpo", "arms.group_size=4", "rollout.max_total_tokens=256",
            "lengths.buckets=128", "lengths.prompt_median=40", "lengths.turn_median=20", "lengths.obs_median=10",
            f"--json={out}"]
    assert main(args) == 0
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert report["steps"] == ["warmup", "grpo"] and "per_chip_gib" not in report  # no padded LOPD compile
    assert "padded LOPD step not compiled" in text and "mean episode" in text
    for kind, name in (("warmup", "warm-up (SFT) step, 8 rows"), ("grpo", "GRPO step, 8 rows")):
        rep = report["length_steps"][kind]
        assert [(p["rows"], p["seq"]) for p in rep["passes"]] == [(8, 128), (8, 256)]
        assert rep["largest"]["seq"] == 256 and rep["largest"]["per_chip_gib"]["total"] > 0
        est = rep["estimate"]
        assert est["bucketed"]["flops_per_real_token"] < est["padded"]["flops_per_real_token"]
        assert name in text
    assert text.count("largest pass 8x256 per chip GiB") == 2 and text.count("model FLOPs per real token") == 2


PACKED_TINY = ["rollout.max_total_tokens=256", "lengths.buckets=128", "lengths.packing=true",
               "composer.max_experience_tokens=32", "lengths.prompt_median=40", "lengths.turn_median=20",
               "lengths.obs_median=10"]


def _tiny_system(overrides, chips=2):
    import jax

    from lopd_jax.programs.compile_check import build_system, parse_args, run_config, step_inputs

    cfg = run_config(parse_args(["--config=tiny", f"--topology=cpu:{chips}", *overrides]))
    spec, layout = step_inputs(cfg)
    return cfg, spec, build_system(spec, layout, jax.devices()[:chips])


def test_compile_check_prints_packed_figures(tmp_path, capsys):
    """``--estimate_only`` with ``lengths.packing=true``: nothing compiles, and every step prints
    padded, bucketed and packed real shares of row tokens (packed >= bucketed >= padded) and
    FLOPs per real token (packed attention within trajectories <= over whole rows); on a TPU
    generation, the step times from the executed FLOPs."""
    from lopd_jax.programs.compile_buckets import length_lines, length_report
    from lopd_jax.programs.compile_check import main, step_flops_fn

    out = tmp_path / "r.json"
    assert main(["--config=tiny", "--topology=cpu:2", "--estimate_only", *PACKED_TINY, f"--json={out}"]) == 0
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert report["estimate_only"] and "per_chip_gib" not in report and "nothing compiled" in text
    assert report["steps"] == ["warmup", "cold_start", "lopd"]
    for kind, rep in report["length_steps"].items():
        assert "passes" not in rep and rep["packing"]
        p, b, k = (rep["estimate"][s] for s in ("padded", "bucketed", "packed"))
        assert 0 < p["real_fraction"] <= b["real_fraction"] <= k["real_fraction"] <= 1, kind
        assert 0 < k["flops"] < k["executed_flops"], kind
        assert p["flops"] == p["executed_flops"] and b["flops"] == b["executed_flops"]
        assert max(k["segments"].values()) > 1  # rows really hold several trajectories
    assert text.count("real share of row tokens: padded") == 3 and text.count("packed") >= 9
    # a TPU generation's peak gives the step times (from the executed FLOPs)
    cfg, spec, system = _tiny_system(PACKED_TINY)
    rep = length_report(cfg, spec, system, "v5p", 2, step_flops_fn("lopd", cfg, spec, system), compile_passes=False)
    line, comm = length_lines(rep, None)[-2:]
    assert "from executed FLOPs: padded" in line and "bucketed/packed" in line
    assert "ICI collectives, not overlapped (mesh data=1 fsdp=2 tensor=1)" in comm
    est = rep["estimate"]
    assert est["packed"]["seconds"] == est["packed"]["executed_flops"] / (2 * 459e12)
    for side in ("padded", "bucketed", "packed"):
        e = est[side]
        assert e["collective_seconds"] > 0 and e["seconds_with_collectives"] == e["seconds"] + e["collective_seconds"]


def _real_pass(kind, spec, cfg, system):
    """(plan, pass) of the first packed pass :func:`train.packed_batches.packed_batch` builds from a batch with
    the ``kind`` step's keys (8 trajectories of 20..100 tokens)."""
    import numpy as np

    from lopd_jax.programs.compile_buckets import _abstract_pass
    from train.packed_batches import packed_batch

    lengths = [100, 60, 50, 40, 30, 90, 20, 70]
    b = {k: np.zeros(v.shape, v.dtype) for k, v in _abstract_pass(cfg, spec, kind, 8, spec.seq).items()}
    for i, n in enumerate(lengths):
        b["attention_mask"][i, :n] = True
        b["loss_mask"][i, n // 2:n] = 1
    for k, v in (("insert_at", 1), ("ctx_len", 3), ("row_weight", 1), ("exp_mask", True)):
        if k in b:
            b[k][...] = v
    b.pop("row_valid"), b.pop("row_index")
    splice = system.layout if kind in ("lopd", "cold_start") else None
    pb = packed_batch(b, (spec.seq,), 2 * spec.seq, 2, splice)
    return pb.plan[0], pb.passes[0]


def test_abstract_packed_pass_is_the_trainers_and_compiles():
    """The compile check's abstract packed pass has every key, shape and dtype of the pass the
    trainer builds (every step kind); a tiny packed LOPD pass (teacher rows with a latent
    block per segment) and its update compile on 2 CPU devices."""
    from lopd_jax.programs.compile_buckets import abstract_packed_pass, block_width, length_lines, length_report
    from lopd_jax.programs.compile_check import step_flops_fn

    overrides = ["rollout.max_total_tokens=256", "lengths.packing=true", "composer.max_experience_tokens=32",
                 "lengths.prompt_median=40", "lengths.turn_median=20", "lengths.obs_median=10"]
    for kind, arm in (("lopd", "lopd"), ("cold_start", "lopd"), ("warmup", "lopd"), ("grpo", "grpo"),
                      ("text", "sdft")):
        cfg, spec, system = _tiny_system(overrides + [f"arm={arm}"])
        plan, real = _real_pass(kind, spec, cfg, system)
        assert plan.segments > 1
        abstract = abstract_packed_pass(cfg, spec, kind, len(plan.rows), plan.seq, plan.segments,
                                        block_width(cfg, system, kind))
        got = {k: (v.shape, v.dtype) for k, v in abstract.items()}
        assert got == {k: (v.shape, v.dtype) for k, v in real.items()}, kind
    cfg, spec, system = _tiny_system(overrides)
    rep = length_report(cfg, spec, system, "cpu", 2, step_flops_fn("lopd", cfg, spec, system), kind="lopd")
    (p,) = rep["passes"]
    assert (p["rows"], p["seq"]) == (8, 256) and p["segments"] == max(rep["estimate"]["packed"]["segments"].values())
    assert p["per_chip_gib"]["total"] > 0 and rep["update_per_chip_gib"]["total"] > 0
    assert "compiled 1 packed pass shapes (rows x seq x segments 8x256x" in "\n".join(length_lines(rep, None))


def test_largest_only_compiles_one_pass_per_step(tmp_path, capsys):
    """``--largest_only``: no padded step, and per step only the pass of the longest rows
    (the cap), with its memory and the update's."""
    from lopd_jax.programs.compile_check import main

    out = tmp_path / "r.json"
    assert main(["--config=tiny", "--topology=cpu:2", "--largest_only", "--steps=lopd", *PACKED_TINY,
                 f"--json={out}"]) == 0
    report = json.loads(out.read_text())
    assert "per_chip_gib" not in report and report["fits"]
    rep = report["length_steps"]["lopd"]
    assert [p["seq"] for p in rep["passes"]] == [max(rep["buckets"])] and rep["largest"] == rep["passes"][0]
    assert rep["update_per_chip_gib"]["total"] > 0
    assert "padded LOPD step not compiled (--largest_only)" in capsys.readouterr().out
