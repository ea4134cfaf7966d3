"""Typed run configs: named configs, dotted overrides, JSON round trip, resume checks."""

import json
import os

import pytest

from lopd_jax.settings.config import TrainConfig
from lopd_jax.settings.errors import ConfigError
from configs import known_configs, load_config
from lopd_jax.settings.overrides import apply_overrides, from_dict, to_dict
from lopd_jax.settings.run_config import check_resume, config_diff, load_run_config, save_run_config
from lopd_jax.settings.sections import RolloutConfig, SamplingParams
from tests.paths import ROOT

pytestmark = pytest.mark.timeout(60)

NAMES = ("tiny", "qwen3_4b", "qwen3_8b", "olmo3_7b")


def test_named_configs_load_and_round_trip():
    assert set(NAMES) <= set(known_configs()) and "_paper" not in known_configs()
    for name in NAMES:
        cfg = load_config(name)
        assert isinstance(cfg, TrainConfig)
        assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_paper_hyperparameters_and_tpu_layout():
    for name in ("qwen3_4b", "qwen3_8b", "olmo3_7b"):
        c = load_config(name)
        assert c.model.name == name and c.env.tasks_per_step == 32
        s = c.steps
        assert (s.student_lr, s.composer_lr, s.student_clip, s.composer_clip) == (1e-5, 1e-5, 1.0, 1.0)
        assert (s.loss.margin, s.loss.anchor_weight, s.eta_beta, s.loss.top_m) == (0.05, 0.2, 0.5, 20)
        assert (c.composer.num_latents, c.composer.n_ret, c.composer.depth) == (32, 3, 8)
        assert (c.composer.lora.rank, c.composer.lora.alpha, c.composer.lora.dropout) == (8, 16.0, 0.0)
        assert (c.stages.cold_start_steps, c.stages.cold_start_batch, c.stages.warmup_steps) == (1000, 8, 0)
        assert (c.rollout.sampling.temperature, c.rollout.sampling.top_p, c.rollout.sampling.top_k) == (0.7, 0.95, 20)
        assert (c.rollout.caps.max_env_steps, c.rollout.caps.max_total_tokens) == (30, 40_960)
        # the layouts the compile check measured to fit (docs/results.md): v5p fsdp x tensor 4 for 8B / 7B, v5e for 4B
        mesh = (1, 32, -1) if name == "qwen3_4b" else (1, -1, 4)
        assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == mesh
        assert (dict(c.mesh.rules)["act_embed"] == "tensor") == (name == "qwen3_4b")
        assert (c.model.remat_policy, c.model.attention_impl, s.loss.logits_chunk) == ("full", "splash", 1024)
        assert (s.micro_batch, c.model.param_dtype, c.model.dtype) == (1, "float32", "bfloat16")
        assert c.bank_config().n_ret == 3
    m = load_config("qwen3_8b").model_config()
    assert (m.hidden_size, m.num_layers, m.tie_word_embeddings, m.remat_policy) == (4096, 36, False, "full")
    assert m.lora.rank == 8 and m.dtype == "bfloat16"


def test_tiny_is_small_and_builds():
    c = load_config("tiny")
    assert c.env.tasks_per_step <= 16 and c.stages.lopd_steps <= 60 and c.composer.num_slots <= 16
    m = c.model_config()
    assert m.vocab_size == 896 and m.hidden_size == 64 and m.lora.rank == 4
    from lopd_jax.chat.tokenizers import tiny_tokenizer
    assert len(tiny_tokenizer("qwen3")) <= m.vocab_size
    assert isinstance(c.rollout.caps, RolloutConfig) and c.rollout.caps.max_turn_tokens == 96
    assert isinstance(c.rollout.sampling, SamplingParams) and c.rollout.sampling.top_k == 20
    assert c.checkpoint_dir == "workdirs/tiny/checkpoints"
    from lopd_jax.envs.registry import get_task_source
    source = get_task_source(c.env.source, **c.env.kwargs)
    assert len(source.tasks(c.env.train_split)) >= c.env.tasks_per_step
    assert len(source.tasks(c.env.eval_split)) >= (c.stages.eval_tasks or 1)


def test_unknown_config_name():
    with pytest.raises(ConfigError, match=r"did you mean qwen3_8b.*known configs"):
        load_config("qwen3_8")
    with pytest.raises(ConfigError, match="known configs"):
        load_config("../etc")


def test_overrides_parse_each_type():
    c = apply_overrides(TrainConfig(), [
        "steps.margin=0.1", "--rollout.temperature=1", "env.tasks_per_step=16", "rollout.enable_thinking=true",
        "model.dtype=bfloat16", "stages.eval_tasks=none", "bank.max_obs_chars=null", "model.hf_path=/ckpt",
        "model.name=None", "composer.lora.targets=q,v", "composer.lora.rank=4", "env.kwargs={\"seed\": 3}",
        "env.kwargs.n_train_per_family=8", "env.kwargs.families=[\"bank.deposit\"]", "seed=1e3",
        "mesh.rules=[[\"vocab\", null], [\"act_batch\", [\"data\", \"fsdp\"]]]", "workdir=a=b",
    ])
    assert c.steps.loss.margin == 0.1 and c.rollout.sampling.temperature == 1.0 and isinstance(c.rollout.sampling.temperature, float)
    assert c.env.tasks_per_step == 16 and c.rollout.enable_thinking is True and c.model.dtype == "bfloat16"
    assert c.stages.eval_tasks is None and c.bank.max_obs_chars is None
    assert c.model.hf_path == "/ckpt" and c.model.name is None
    assert c.composer.lora.targets == ("q", "v") and c.composer.lora.rank == 4
    assert c.env.kwargs == {"seed": 3, "n_train_per_family": 8, "families": ["bank.deposit"]}
    assert c.seed == 1000 and c.workdir == "a=b"
    assert c.mesh.rules == (("vocab", None), ("act_batch", ("data", "fsdp")))
    assert from_dict(to_dict(c)) == c
    assert set(config_diff(TrainConfig(), c)) >= {"steps.margin", "composer.lora.targets", "env.kwargs"}


@pytest.mark.parametrize("override, message", [
    ("steps.margn=0.1", r"unknown key 'steps.margn'.*did you mean margin"),
    ("stepz.margin=0.1", r"no field 'stepz'.*did you mean steps"),
    ("lopd_steps=8", r"no field 'lopd_steps'; did you mean stages\.lopd_steps"),  # the section is named
    ("model.dtype=bf16", r"model.dtype='bf16': choose one of \['float32', 'bfloat16', 'float16'\]"),
    ("steps.top_m=1.5", r"steps.top_m='1.5': expected an int"),
    ("steps.margin=big", r"steps.margin='big': expected a float"),
    ("rollout.enable_thinking=maybe", r"expected a bool"),
    ("rollout.top_p=2", r"rollout.top_p='2': top_p must be in \(0, 1\], got 2.0"),
    ("steps.student_mode=half", r"steps.student_mode='half'.*choose from"),
    ("composer.lora.targets=q,zz", r"composer.lora.targets.*unknown"),
    ("composer.lora=3", r"composer.lora is a section"),
    ("env.source.x=1", r"'source' is a str, not a section"),
    ("steps.margin", r"must look like dotted.key=value"),
    ("model.tokenizer=hf", r"needs model.hf_path"),
    ("stages.eval_tasks=0", r"stages.eval_tasks=0 must be >= 1"),
    ("env.kwargs=[1]", r"expected a JSON object"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainConfig(), [override])


def test_inline_objects_keep_their_sections_keys():
    """Sampling, episode caps and loss settings are objects of their own whose fields read
    as the section's keys (overrides, config.json, the resume diff)."""
    d = to_dict(TrainConfig())
    assert {"temperature", "top_k", "max_env_steps", "enable_thinking"} <= set(d["rollout"])
    assert {"margin", "logits_chunk", "eta_beta"} <= set(d["steps"])
    assert not {"sampling", "caps"} & set(d["rollout"]) and "loss" not in d["steps"]
    c = apply_overrides(TrainConfig(), ["rollout.top_k=5", "steps.anchor_weight=0.3"])
    assert c.rollout.sampling.top_k == 5 and c.steps.loss.anchor_weight == 0.3
    assert set(config_diff(TrainConfig(), c)) == {"rollout.top_k", "steps.anchor_weight"}
    assert from_dict(to_dict(c)) == c


def test_type_checked_construction():
    with pytest.raises(ConfigError, match=r"seed='1' has type str; expected int"):
        TrainConfig(seed="1")
    with pytest.raises(ConfigError, match="unknown keys"):
        from_dict({"steps": {"margin": 0.1, "marign": 2}})


def test_run_config_resume(tmp_path):
    cfg = apply_overrides(load_config("tiny"), [f"workdir={tmp_path}"])
    assert save_run_config(cfg) is False
    assert load_run_config(str(tmp_path)) == cfg
    longer = apply_overrides(cfg, ["stages.lopd_steps=100", "checkpoint.keep=5", "mesh.tensor=2", "mesh.fsdp=-1"])
    assert save_run_config(longer) is True
    assert load_run_config(str(tmp_path)).stages.lopd_steps == 100
    changed = apply_overrides(longer, ["steps.margin=0.1", "composer.num_latents=8"])
    with pytest.raises(ConfigError, match=r"steps.margin: saved 0.05, now 0.1") as e:
        save_run_config(changed)
    assert "composer.num_latents" in str(e.value) and "stages.lopd_steps" in str(e.value)
    check_resume(cfg, longer)  # allowed keys only
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_run_config(str(tmp_path))


def test_hf_path_architecture_check(tmp_path):
    from models.config import named_config
    from models.hf_config import to_hf_config
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(named_config("tiny_qwen3"))))
    ok = apply_overrides(TrainConfig(), [f"model.hf_path={tmp_path}", "model.name=tiny_qwen3"])
    assert ok.model_config().hidden_size == 64 and ok.model_config().lora is not None
    bad = apply_overrides(ok, ["model.name=tiny_olmo3"])
    with pytest.raises(ConfigError, match="disagrees with"):
        bad.model_config()
    assert apply_overrides(ok, ["model.name=none"]).model_config().num_layers == 2
    with pytest.raises(ConfigError, match="random-init models only"):
        apply_overrides(ok, ["model.vocab_size=1024"])
    # cross-field checks wait for the whole list: the order of overrides does not matter
    tiny = load_config("tiny")
    for order in ([f"model.hf_path={tmp_path}", "model.vocab_size=none", "model.tokenizer=hf"],
                  ["model.tokenizer=hf", "model.vocab_size=none", f"model.hf_path={tmp_path}"]):
        assert apply_overrides(tiny, order).model.tokenizer == "hf"


def test_warmup_lr_schedule():
    """``stages.warmup_lr_schedule``: constant by default; cosine ramps up over 5% of the
    steps, peaks at ``warmup_lr`` and decays to 10% of it; a typo names the choices."""
    import pytest

    from lopd_jax.settings.errors import ConfigError
    from lopd_jax.programs.train import resolve_config
    from train.warmup import learning_rate

    base = ["--config=tiny", "stages.warmup_steps=200", "stages.warmup_lr=4e-3"]
    assert learning_rate(resolve_config(base).stages) == 4e-3
    sched = learning_rate(resolve_config([*base, "stages.warmup_lr_schedule=cosine"]).stages)
    assert float(sched(0)) == 0.0
    assert abs(float(sched(5)) - 2e-3) < 1e-9  # halfway up the 10-step ramp
    assert abs(float(sched(10)) - 4e-3) < 1e-9
    assert 4e-4 < float(sched(105)) < 4e-3
    assert abs(float(sched(200)) - 4e-4) < 1e-9
    with pytest.raises(ConfigError, match="warmup_lr_schedule='cos'.*'cosine'"):
        resolve_config([*base, "stages.warmup_lr_schedule=cos"])


def test_task_data_is_checked_before_anything_is_written(tmp_path):
    """The paper configs' EnvScaler source without its files is a config error naming the
    key and the doc section; bad files too; the shipped samples resolve (paths made absolute)."""
    from lopd_jax.programs.train import main, resolve_config

    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"env.kwargs.train_path=<file>.*docs/data.md, section \"EnvScaler "
                                          r"scenarios\".*data/samples/envscaler_train.jsonl"):
        resolve_config(["--config=qwen3_8b", f"--workdir={workdir}"])
    assert main(["--config=qwen3_8b", f"--workdir={workdir}"]) == 2 and not workdir.exists()
    with pytest.raises(ConfigError, match=r"env.kwargs.paths=<file>.*TACO problems"):
        resolve_config(["--config=tiny", "env.source=taco", "stages.warmup_steps=0", "env.kwargs={}"])
    with pytest.raises(ConfigError, match=r"no_such.jsonl.*does not exist.*TACO problems"):
        resolve_config(["--config=tiny", "env.source=taco", "stages.warmup_steps=0",
                        f"env.kwargs={{\"paths\": \"{tmp_path / 'no_such.jsonl'}\"}}"])
    with pytest.raises(ConfigError, match=r"read from local disk; copy them first \(gcloud storage cp"):
        resolve_config(["--config=qwen3_8b", "env.kwargs.train_path=gs://b/envscaler_train.jsonl"])
    root = ROOT
    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = resolve_config(["--config=qwen3_8b", "env.kwargs.train_path=data/samples/envscaler_train.jsonl",
                              "env.kwargs.heldout_path=data/samples/envscaler_heldout.jsonl"])
    finally:
        os.chdir(cwd)
    assert cfg.env.kwargs["train_path"] == os.path.join(root, "data", "samples", "envscaler_train.jsonl")


def test_a_new_run_stopped_by_a_config_error_leaves_no_trace(tmp_path):
    """What :func:`lopd_jax.programs.train.run_training` undoes after a config error in a new run:
    the workdir it created, or only its config.json in a workdir that existed."""
    from lopd_jax.programs.train import _undo_new_run

    new = tmp_path / "new"
    save_run_config(apply_overrides(load_config("tiny"), [f"workdir={new}"]))
    _undo_new_run(str(new), existed=False, before=None)
    assert not new.exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    before = {p.name for p in old.iterdir()}
    save_run_config(apply_overrides(load_config("tiny"), [f"workdir={old}"]))
    _undo_new_run(str(old), existed=True, before=before)
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]


def test_resume_with_allowed_config_change(tmp_path):
    """A differing key names the flag that lets it through; with the flag the run's config is updated."""
    cfg = apply_overrides(load_config("tiny"), [f"workdir={tmp_path}"])
    save_run_config(cfg)
    changed = apply_overrides(cfg, ["bank.min_reward=0.25", "steps.margin=0.1"])
    with pytest.raises(ConfigError, match=r"(?s)2 key\(s\) differ.*another workdir.*"
                                          r"--allow_config_change=bank.min_reward,steps.margin"):
        save_run_config(changed)
    with pytest.raises(ConfigError, match=r"steps.margin: saved"):
        save_run_config(changed, allow=["bank.min_reward"])
    assert save_run_config(changed, allow=["bank.min_reward", "steps.margin"]) is True
    assert load_run_config(str(tmp_path)).bank.min_reward == 0.25
    from lopd_jax.programs.train import resolve_config
    with pytest.raises(ConfigError, match=r"\['bank.min_rewrd'\] are not config keys"):
        resolve_config(["--config=tiny", "--allow_config_change=bank.min_reward,bank.min_rewrd"])


def test_train_help_lists_the_named_configs(capsys):
    from lopd_jax.programs.train import build_parser

    text = build_parser().format_help()
    for name in ("tiny", "miniature", "qwen3_4b", "qwen3_8b", "olmo3_7b"):
        assert f"\n  {name} " in text
    assert "--allow_config_change" in text and "docs/data.md" in text


def test_shipped_demo_start_resumes_under_the_current_configs():
    """The demo's starting point was saved with its config; the run that continues it
    (lopd_jax.demo.train_command) must not be refused for a key the configs changed since."""
    from lopd_jax.programs.demo import START_DIR, start_args
    from lopd_jax.settings.run_config import check_resume, load_run_config

    config, overrides = start_args(START_DIR)
    current = apply_overrides(load_config(config), [*overrides, "seed=0"])
    check_resume(load_run_config(START_DIR), current, allow=("seed",))
