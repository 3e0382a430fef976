"""The trainer end to end: config validation, smoke runs of every objective and
replay mode, sharded == single-device, and SIGKILL-and-resume."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import subprocess_env

from gspo_jax import config as config_lib
from gspo_jax import objectives
from gspo_jax.metrics_log import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402

# Metrics that measure time, not math: they differ between any two runs.
TIMING = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time", "tokens_per_s"}


def smoke(**overrides):
    c = default_config.get_config("smoke")
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


# --------------------------------------------------------------------------
# Validation: each error names its field.


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"objective.name": "ppo2"}, "config.objective.name"),
        ({"objective.hparams": {"eps_low": 1.5}}, "config.objective.hparams"),
        ({"objective.hparams": {"not_a_knob": 1.0}}, "config.objective.hparams"),
        ({"rollout.group_size": 1}, "config.rollout.group_size"),
        ({"model.fields.top_k": 8}, "config.model.fields.top_k"),  # smoke has 4 experts
        ({"mesh.data": 3}, "config.mesh"),  # 3 devices of 8
        ({"mesh.data": 3, "mesh.fsdp": -1}, "config.mesh.fsdp"),  # 3 does not divide 8
        ({"mesh.data": -1, "mesh.fsdp": -1}, "config.mesh.fsdp"),  # two free axes
        ({"updates.num_minibatches": 3}, "config.updates.num_minibatches"),  # 16 % 3
        ({"updates.micro_batches": 3}, "config.updates.micro_batches"),
        ({"updates.logprob_micro_batches": 3}, "config.updates.logprob_micro_batches"),  # 16 % 3
        ({"updates.logprob_micro_batches": 4}, "config.updates.logprob_micro_batches"),  # 4 rows, 8 shards
        ({"updates.logprob_micro_batches": 0}, "config.updates.logprob_micro_batches"),
        # Token budgets: below the longest sequence (64 + 16 - 1 = 79 tokens), rows the 8
        # shards do not divide, beside a row count.
        ({"updates.micro_batch_tokens": 78}, "config.updates.micro_batch_tokens"),
        ({"updates.micro_batch_tokens": 3 * 79}, "config.updates.micro_batch_tokens"),
        ({"updates.micro_batch_tokens": 8 * 79, "updates.logprob_micro_batches": 2},
         "config.updates.logprob_micro_batches"),
        ({"updates.routing_replay": "R4"}, "config.updates.routing_replay"),
        ({"updates.gamma_min": 0.0}, "config.updates.gamma_min"),
        ({"task.name": "sudoku"}, "config.task.name"),
        ({"task.name": "arithmetic"}, "config.task.difficulty"),  # "small" is a countdown level
        ({"task.difficulty": "medium"}, "config.task.difficulty"),
        ({"task.name": "gsm8k"}, "config.task.difficulty"),
        ({"seed": -1}, "config.seed"),
        ({"sft.batch_size": 0}, "config.sft.batch_size"),
        ({"gae.lam": 1.5}, "config.gae.lam"),
        ({"model.fields.num_heads": 0}, "config.model.fields.num_heads"),
        ({"advantage": "gae"}, "config.advantage"),  # gae with gspo: no critic
        ({"optimizer.schedule": "exp"}, "config.optimizer.schedule"),
        ({"rollout.top_p": 0.0}, "config.rollout.top_p"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    c = smoke(**overrides)
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.validate(c, num_devices=8)
    assert str(e.value).startswith(field), str(e.value)


def _config_from_command_line(*argv):
    """The config as the trainer's command line builds it (locked, then overridden;
    config_flags reads the overrides from sys.argv)."""
    from unittest import mock

    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config", flag_values=fv, lock_config=True)
    argv = ["train"] + list(argv)
    with mock.patch.object(sys, "argv", argv):
        fv(argv)
    return fv.config


@pytest.mark.parametrize("argv, key, value", [
    (["--config=configs/grpo.py", "--config.objective.hparams.kl_coef=0.0"], "kl_coef", 0.0),
    (["--config=configs/grpo.py", "--config.objective.hparams.eps_high=0.28"], "eps_high", 0.28),
    (["--config=configs/default.py:objective=ppo", "--config.objective.hparams.dual_clip=3.0"], "dual_clip", 3.0),
    (["--config=configs/cispo.py", "--config.objective.hparams.eps_low=0.2"], "eps_low", 0.2),
    (["--config=configs/default.py:objective=dr_grpo", "--config.objective.hparams.norm_len=16"], "norm_len", 16),
    (["--config=configs/sapo.py", "--config.objective.hparams.tau_neg=1.5"], "tau_neg", 1.5),
    (["--config=configs/gmpo_rspo.py", "--config.objective.hparams.gamma_min=0.3"], "gamma_min", 0.3),
    # The deprecated path, moved there by validate (with a notice).
    (["--config=configs/gmpo_rspo.py", "--config.updates.gamma_min=0.3"], "gamma_min", 0.3),
])
def test_every_hyperparameter_can_be_set_from_the_command_line(argv, key, value):
    c = _config_from_command_line(*argv)
    config_lib.validate(c, num_devices=8)
    assert c.objective.hparams[key] == value
    hp = objectives.get(c.objective.name).validate_hyperparameters(dict(c.objective.hparams))
    assert hp[key] == value


def test_config_hyperparameters_are_the_objectives_defaults():
    for name in objectives.names():
        c = default_config.get_config(f"objective={name}")
        defaults = objectives.get(name).defaults
        assert set(c.objective.hparams) == set(defaults)
    c = _config_from_command_line("--config=configs/grpo.py")
    assert c.objective.hparams.kl_coef == 0.04 and c.objective.hparams.dual_clip is None


def test_renaming_the_objective_after_its_hyperparameters_is_refused():
    c = _config_from_command_line("--config=configs/default.py", "--config.objective.name=grpo")
    with pytest.raises(config_lib.ConfigError, match=r"^config\.objective\.name.*'gspo'"):
        config_lib.validate(c, num_devices=8)


def test_config_arguments():
    assert config_lib.parse_arg("objective=grpo,smoke", known=("objective", "smoke")) == {
        "objective": "grpo", "smoke": True}
    assert config_lib.parse_arg("smoke=false", known=("smoke",)) == {"smoke": False}
    assert default_config.get_config("smoke=false").total_rl_steps == default_config.get_config("").total_rl_steps
    assert default_config.get_config("smoke=True").total_rl_steps == 2
    with pytest.raises(config_lib.ConfigError, match="'objetive'.*objective, smoke"):
        default_config.get_config("objetive=grpo")
    from configs import qwen3_moe_gsm8k
    with pytest.raises(config_lib.ConfigError, match="ckpt"):
        qwen3_moe_gsm8k.get_config("objective=gspo")


def test_config_batch_not_divisible_by_batch_shards():
    # 16 sequences / 2 mini-batches = 8 per mini-batch; over 16 batch shards: no.
    c = smoke(**{"mesh.data": 16})
    with pytest.raises(config_lib.ConfigError, match=r"^config\.mesh"):
        config_lib.validate(c, num_devices=16)


def test_default_config_is_valid():
    for arg in ("", "smoke"):
        c = default_config.get_config(arg)
        assert config_lib.validate(c, num_devices=8)["data"] == 8


def test_every_objective_config_is_valid():
    for name in objectives.names():
        config_lib.validate(default_config.get_config(f"objective={name},smoke"), num_devices=1)


# --------------------------------------------------------------------------
# Runs.


def _run_subprocess(workdir, args, devices, *, data_dir, wait=True):
    env = subprocess_env(devices)
    # absl wants --config=... before any --config.<field>=... override.
    cmd = [sys.executable, "-m", "gspo_jax.train", f"--workdir={workdir}"] + list(args) + [
        f"--config.task.data_dir={data_dir}", "--config.progress_bar=False"]
    if wait:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-4000:]
        return out
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _rl_records(workdir):
    return {r["step"]: r for r in read_metrics(workdir) if r["phase"] == "rl"}


def _assert_same_metrics(a, b, *, rtol, atol, steps):
    for s in steps:
        ra, rb = a[s], b[s]
        keys = (set(ra) | set(rb)) - TIMING
        assert set(ra) - TIMING == set(rb) - TIMING, (s, set(ra) ^ set(rb))
        for k in sorted(keys):
            va, vb = ra[k], rb[k]
            if isinstance(va, str):
                assert va == vb, (s, k)
            else:
                np.testing.assert_allclose(np.asarray(va, float), np.asarray(vb, float), rtol=rtol, atol=atol,
                                           err_msg=f"step {s} metric {k}")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


REQUIRED = {"step", "phase", "reward_mean", "entropy", "grad_norm", "clip_frac", "flip_frac", "flip_frac_k0",
            "flip_frac_klast", "flip_frac_vs_sampler", "router_shift_raw", "gamma_raw_mean", "mismatch_kl",
            "mismatch_f2", "mismatch_route", "no_signal_minibatches", "lr", "tokens_per_s"}


# The whole loop for each code path of the trainer: the default objective,
# gradient accumulation over a mesh, DAPO's data shaping, R2 and R3 replay, RSPO's
# router shift (PPO's critic has its own test below). Every objective's train
# step is exercised in tests/test_step.py; the loop around it is the same.
@pytest.mark.parametrize(
    "objective, replay",
    [("gspo", "none"), ("grpo", "none"), ("dapo", "none"), ("gspo", "R2"), ("rspo", "R3")],
)
def test_smoke_trainer_paths_and_replay_modes(objective, replay, data_dir, tmp_path):
    from gspo_jax import train

    c = default_config.get_config(f"objective={objective},smoke")
    c.task.data_dir = data_dir
    c.updates.routing_replay = replay
    c.progress_bar = False
    if objective == "grpo":
        c.updates.micro_batches = 2  # gradient accumulation through the full loop
        # Micro-batches of 4 rows over the 4 batch shards (data x expert); experts over 2,
        # their width over the tensor axis.
        c.mesh.data, c.mesh.expert, c.mesh.tensor = 2, 2, -1
        c.updates.logprob_micro_batches = 4  # the old-policy and reference passes in 4 pieces
    if replay == "R3":
        c.updates.logprob_micro_batches = 2  # the R3 record split with the rows
    records = train.run(c, str(tmp_path))
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"])
        assert r["skipped_total"] == 0
        if replay != "none":
            assert "replay_mismatch" in r
    assert "eval_reward_mean" in rl[-1]
    lines = read_metrics(str(tmp_path))
    assert {r["phase"] for r in lines} == {"sft", "rl"}
    assert os.path.isdir(tmp_path / "checkpoints" / "rl" / "2")


def test_rl_step_summary_of_updates():
    """The step's figures are its updates' metrics merged by their kind (pooled over all
    the step's tokens, not a mean of per-update values); the per-update numbers are each
    update's own."""
    from gspo_jax import rl
    from gspo_jax.metrics import Last, Max, Mean, Min, Std, Sum

    def std(xs):
        xs = np.asarray(xs, np.float32)
        return Std(xs.sum(), (xs * xs).sum(), np.float32(len(xs)))

    tokens = ([0.1, -0.3], [0.2, 0.0, 0.4, -0.1], [0.5, 0.5, -0.2])
    ms = [{"loss": Mean.of(1.0), "logratio_abs_max": Max.of(0.5), "router_shift_min": Min.of(0.9),
           "skipped_total": Max.of(0), "layer": Mean(np.float32([1.0, 2.0]), np.float32(1.0)), "lr": Last.of(0.1),
           "no_signal": Sum.of(1.0), "flip_frac": Mean(np.float32(0.0), np.float32(10.0)), "logratio_std": std(tokens[0])},
          {"loss": Mean.of(3.0), "logratio_abs_max": Max.of(0.2), "router_shift_min": Min.of(0.7),
           "skipped_total": Max.of(1), "layer": Mean(np.float32([3.0, 0.0]), np.float32(1.0)), "lr": Last.of(0.2),
           "no_signal": Sum.of(0.0), "flip_frac": Mean(np.float32(1.0), np.float32(10.0)), "logratio_std": std(tokens[1])},
          {"loss": Mean.of(2.0), "logratio_abs_max": Max.of(0.1), "router_shift_min": Min.of(0.8),
           "skipped_total": Max.of(1), "layer": Mean(np.float32([0.0, 1.0]), np.float32(1.0)), "lr": Last.of(0.3),
           "no_signal": Sum.of(1.0), "flip_frac": Mean(np.float32(15.0), np.float32(30.0)), "logratio_std": std(tokens[2])}]
    out, per_update = rl.summarize_updates(ms)
    assert out["loss"] == 2.0 and out["logratio_abs_max"] == 0.5
    assert out["router_shift_min"] == pytest.approx(0.7) and out["skipped_total"] == 1
    np.testing.assert_allclose(out["layer"], [4 / 3, 1.0], rtol=1e-6)
    assert out["lr"] == pytest.approx(0.3) and out["no_signal_minibatches"] == 2 and "no_signal" not in out
    # Pooled: 16 flips in 50 tokens (the mean of the updates' fractions would be 0.2).
    assert out["flip_frac"] == pytest.approx(16 / 50)
    # The pooled standard deviation of all 9 tokens, not a mean of three.
    assert out["logratio_std"] == pytest.approx(np.std(np.concatenate(tokens)), rel=1e-5)
    assert out["flip_frac_k0"] == 0.0 and out["flip_frac_k1"] == pytest.approx(0.1)
    assert out["flip_frac_klast"] == pytest.approx(0.5)
    assert out["logratio_abs_max_k0"] == 0.5 and out["logratio_abs_max_klast"] == pytest.approx(0.1)
    assert [u["loss"] for u in per_update] == [1.0, 3.0, 2.0]
    assert [u["flip_frac"] for u in per_update] == pytest.approx([0.0, 0.1, 0.5])
    assert per_update[1]["logratio_std"] == pytest.approx(np.std(tokens[1]), rel=1e-5)


def test_routing_replay_on_a_dense_model_is_refused():
    c = default_config.get_config("smoke")
    c.model.fields.num_experts = 0
    c.updates.routing_replay = "R3"
    with pytest.raises(config_lib.ConfigError, match="updates.routing_replay"):
        config_lib.validate(c, 1)


def test_smoke_dense_model(data_dir, tmp_path):
    """A dense policy (model.fields.num_experts=0) through the whole loop with RSPO:
    no router, so gamma = 1 and nothing flips.

    One device, in a subprocess: on 8 fake CPU devices the dense train step, once
    loaded from the persistent compilation cache, hung in XLA:CPU's collectives
    (7 devices waiting in one all-reduce, the 8th in another, until XLA aborts), in
    three runs of three; compiled afresh it ran. The MoE programs do not do this."""
    _run_subprocess(tmp_path, ["--config=configs/default.py:objective=rspo,smoke",
                               "--config.model.fields.num_experts=0"], 1, data_dir=data_dir)
    rl = _rl_records(tmp_path)
    assert sorted(rl) == [0, 1, 2]
    for step_ in (1, 2):
        r = rl[step_]
        assert np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) and r["skipped_total"] == 0
        assert r["router_shift_mean"] == 1.0 and r["flip_frac"] == 0.0
        assert r["flip_frac_layer"] == [] and "mismatch_route" not in r


def test_restart_without_sft_or_rl_checkpoint_keeps_one_step_zero(data_dir, tmp_path):
    """No SFT phase and no RL checkpoint yet: a restart writes RL step 0 afresh, and
    the log holds it once."""
    from gspo_jax import train

    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.sft.steps, c.total_rl_steps, c.progress_bar = 0, 0, False
    train.run(c, str(tmp_path))
    train.run(c, str(tmp_path))
    assert [(r["phase"], r["step"]) for r in read_metrics(str(tmp_path))] == [("rl", 0)]


def test_metrics_log_cut_lines(tmp_path):
    from gspo_jax.metrics_log import MetricsWriter

    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for s in range(3):
        w.write(s, "rl", {"r": s})
    w._f.write('{"step": 3, "phase": "rl", "r": 0.')  # a crash cuts the last line
    w.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
    w = MetricsWriter(str(tmp_path), resume_step=-1, resume_phase="rl", tensorboard=False)
    w.close()
    assert read_metrics(str(tmp_path)) == []
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "phase": "rl"}\n{"step": \n{"step": 2, "phase": "rl"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        read_metrics(str(tmp_path))
    # A damaged line that is not the last one is not silently dropped on resume either.
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        MetricsWriter(str(tmp_path), resume_step=1, resume_phase="rl", tensorboard=False)
    # Valid JSON that is not a record: the file and line, not a raw KeyError.
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "phase": "rl"}\n[1, 2]\n{"step": 2, "phase": "rl"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a metrics record"):
        MetricsWriter(str(tmp_path), resume_step=1, resume_phase="rl", tensorboard=False)


def test_collect_across_an_epoch_boundary_with_a_repeated_example(data_dir, tmp_path):
    """A prompt batch across an epoch boundary may hold one example twice (tail of one
    epoch, head of the next); the sampler still gets distinct prompt ids."""
    from gspo_jax import rl, run_parts
    from gspo_jax.data import PromptSource
    from gspo_jax.tasks.countdown import CountdownConfig

    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.progress_bar = False
    t = run_parts.RunParts(c, str(tmp_path))
    n, g = int(c.rollout.prompts_per_step), int(c.rollout.group_size)
    # Epochs of 2n + 2 examples, so that the batch of step 2 crosses one, and a seed
    # whose epoch 1 starts with one of epoch 0's last two examples.
    small = CountdownConfig.make(min_count=3, max_count=3, max_number=9, max_target=30,
                                 train_size=2 * n + 2, test_size=16)
    for seed in range(1000):
        src = PromptSource("countdown", "train", data_dir=str(tmp_path), config=small, seed=seed)
        if len(set(src.indices(2 * n, n).tolist())) < n:
            break
    assert len(set(src.indices(2 * n, n).tolist())) < n
    t.train_data = src
    phase = rl.RLPhase(t, t.init_params)
    batch, _ = phase.prepare(phase.collect_batch(2, version=0), 2)
    assert batch["mask"].shape[0] == n * g
    assert np.isfinite(batch["advantages"]).all()


def test_smoke_ppo_with_critic(data_dir, tmp_path):
    """PPO with a value head and GAE advantages through the whole loop."""
    from configs import ppo

    from gspo_jax import train

    c = ppo.get_config("smoke")
    c.task.data_dir = data_dir
    records = train.run(c, str(tmp_path))
    last = [r for r in records if r["phase"] == "rl"][-1]
    assert last["step"] == 2
    for key in ("value_loss", "value_error", "value_clip_frac"):
        assert np.isfinite(last[key]), key
    assert last["value_loss"] > 0


def test_sharded_run_matches_single_device(data_dir, tmp_path):
    """(data=2, fsdp=2, expert=2) on 8 fake devices == one device, per metric."""
    cfg = "--config=configs/default.py:smoke"
    one = tmp_path / "one"
    eight = tmp_path / "eight"
    _run_subprocess(one, [cfg], 1, data_dir=data_dir)
    _run_subprocess(eight, [cfg, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.expert=2"], 8,
                    data_dir=data_dir)
    a, b = _rl_records(one), _rl_records(eight)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    # Float tolerance: reductions are split differently across devices.
    _assert_same_metrics(a, b, rtol=2e-3, atol=2e-4, steps=[1, 2])


def test_sigkill_and_resume_matches_uninterrupted(data_dir, tmp_path):
    args = ["--config=configs/default.py:smoke", "--config.total_rl_steps=6", "--config.checkpoint_every=1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run_subprocess(full, args, 1, data_dir=data_dir)

    proc = _run_subprocess(cut, args, 1, data_dir=data_dir, wait=False)
    ckpt = cut / "checkpoints" / "rl"
    deadline = time.time() + 600
    killed_after = None
    while time.time() < deadline and proc.poll() is None:
        # Finished checkpoints only (orbax writes into "<step>.orbax-checkpoint-tmp" first).
        steps = [int(d) for d in os.listdir(ckpt) if d.isdigit()] if ckpt.is_dir() else []
        steps = [s for s in steps if (ckpt / str(s) / "_CHECKPOINT_METADATA").exists()]
        if steps and max(steps) >= 2:
            proc.send_signal(signal.SIGKILL)
            killed_after = max(steps)
            break
        time.sleep(0.05)
    proc.wait()
    assert killed_after is not None and killed_after < 6, "the run finished before it could be killed"
    _run_subprocess(cut, args, 1, data_dir=data_dir)

    a, b = _rl_records(full), _rl_records(cut)
    assert sorted(b) == [0, 1, 2, 3, 4, 5, 6]
    # Same program, same inputs, same device: the resumed steps are bit-identical.
    _assert_same_metrics(a, b, rtol=0, atol=0, steps=[1, 2, 3, 4, 5, 6])
    lines = [json.loads(l) for l in open(cut / "metrics.jsonl")]
    assert len([l for l in lines if l["phase"] == "rl"]) == 7, "resume must not duplicate log lines"


@pytest.mark.parametrize(
    "module, arg",
    [
        ("default", ""),
        ("grpo", "variant=grpo"),
        ("grpo", "variant=dr_grpo"),
        ("grpo", "variant=dapo"),
        ("gspo", "variant=gspo_token,eps=paper"),
        ("cispo", ""),
        ("gmpo_rspo", "variant=gmpo"),
        ("gmpo_rspo", "gamma_min=0.3,replay=R2"),
        ("sapo", ""),
        ("qwen3_moe_gsm8k", "ckpt=/ckpt"),
        ("ppo", ""),
        ("stability", "variant=grpo"),
        ("stability", "variant=grpo_r3,minibatches=4,lr=1e-4"),
        ("stability", "variant=rspo"),
    ],
)
def test_config_files_validate(module, arg):
    import importlib

    mod = importlib.import_module(f"configs.{module}")
    for a in (arg, f"{arg},smoke" if arg else "smoke"):
        c = mod.get_config(a)
        config_lib.validate(c, num_devices=8)


@pytest.mark.parametrize("module", ["grpo", "stability"])
def test_config_file_rejects_unknown_variant(module):
    import importlib

    with pytest.raises(config_lib.ConfigError, match="variant"):
        importlib.import_module(f"configs.{module}").get_config("variant=grpo2")


def test_compilation_cache_directory_from_environment_wins(tmp_path):
    from gspo_jax import train

    current = jax.config.jax_compilation_cache_dir  # set by conftest's environment
    assert current
    assert train.enable_compilation_cache(str(tmp_path / "other")) == current
    assert jax.config.jax_compilation_cache_dir == current
    assert not (tmp_path / "other").exists()


def test_compilation_cache_directory_that_cannot_be_made_is_skipped(tmp_path, capsys):
    from gspo_jax import train

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    current = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert train.enable_compilation_cache(str(blocker / "xla")) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", current)
    assert "config.compilation_cache_dir" in capsys.readouterr().out
