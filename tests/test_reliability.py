"""What users and clusters do to a run: resuming with another config, two trainers in
one workdir, SIGTERM, deleted warm-start checkpoints, non-finite parameters, unknown
config keys, and a vocabulary padded beyond the tokenizer's."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env
from flax import nnx

from gspo_jax import config as config_lib
from gspo_jax import safety, sft
from gspo_jax.metrics import compute_all
from gspo_jax.metrics_log import read_metrics
from gspo_jax.models import ModelConfig, Transformer
from gspo_jax.rollout import Sampler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _smoke(data_dir, objective="gspo", **overrides):
    c = default_config.get_config(f"objective={objective},smoke")
    c.task.data_dir = data_dir
    c.update_from_flattened_dict(overrides)  # a misspelt key fails the RunParts's validation
    return c


def _fake_checkpoint(workdir, c):
    """A workdir as a finished SFT step leaves it: a step directory and config.json."""
    os.makedirs(os.path.join(workdir, "checkpoints", "sft", "2", "state"))
    safety.save_run_config(c, str(workdir))


# --------------------------------------------------------------------------
# Resuming with another config.


def test_resume_with_another_objective_is_refused_and_config_json_kept(data_dir, tmp_path):
    from gspo_jax import train

    original = _smoke(data_dir, "gspo")
    _fake_checkpoint(tmp_path, original)
    before = (tmp_path / "config.json").read_text()
    other = _smoke(data_dir, "grpo", **{"sft.steps": 5, "model.fields.d_model": 64})
    with pytest.raises(config_lib.ConfigError) as e:
        train.run(other, str(tmp_path))
    msg = str(e.value)
    assert "config.objective.name: 'gspo' -> 'grpo'" in msg
    assert "config.sft.steps: 2 -> 5" in msg and "config.model.fields.d_model: 32 -> 64" in msg
    assert "config.objective.hparams.eps_high" in msg  # the hyperparameters changed with it
    assert (tmp_path / "config.json").read_text() == before
    assert not (tmp_path / ".lock").exists()  # released on the way out


def test_fields_that_may_change_on_resume_are_accepted(data_dir, tmp_path):
    original = _smoke(data_dir)
    _fake_checkpoint(tmp_path, original)
    later = _smoke(data_dir, **{"total_rl_steps": 10, "eval_every": 5, "log_every": 3,
                                "checkpoint_every": 2, "progress_bar": True, "mesh.data": 2, "mesh.fsdp": -1})
    safety.check_resume_config(later, str(tmp_path))  # no error
    assert safety.config_differences(safety.config_record(original), safety.config_record(later)) == []


def test_a_fresh_workdir_takes_any_config(data_dir, tmp_path):
    safety.save_run_config(_smoke(data_dir), str(tmp_path))  # config.json but no checkpoint
    safety.check_resume_config(_smoke(data_dir, "grpo"), str(tmp_path))


# --------------------------------------------------------------------------
# One trainer per workdir.


def test_a_second_trainer_in_a_live_workdir_is_refused(tmp_path):
    first = safety.WorkdirLock(str(tmp_path))
    first.acquire()
    with pytest.raises(RuntimeError, match=rf"in use by another trainer \(pid {os.getpid()}"):
        safety.WorkdirLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / ".lock").exists()
    second = safety.WorkdirLock(str(tmp_path))
    second.acquire()
    second.release()


def test_the_lock_of_a_trainer_that_is_gone_is_taken_over(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)  # a process that has exited
    import socket

    (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    lock = safety.WorkdirLock(str(tmp_path))
    lock.acquire()
    assert "taking over" in capsys.readouterr().out
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    # Another host: alive while its heartbeat is fresh, taken over once stale.
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(RuntimeError, match="elsewhere"):
        safety.WorkdirLock(str(tmp_path), stale_after=60).acquire()
    old = time.time() - 120
    os.utime(tmp_path / ".lock", (old, old))
    lock = safety.WorkdirLock(str(tmp_path), stale_after=60)
    lock.acquire()
    lock.release()


# --------------------------------------------------------------------------
# Signals.


def test_second_signal_exits_at_once():
    script = (
        "import os, signal, time\n"
        "from gspo_jax.safety import GracefulShutdown\n"
        "with GracefulShutdown() as g:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert g.requested\n"
        "    print('first handled', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('not reached', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "first handled" in proc.stdout and "not reached" not in proc.stdout
    assert "SIGTERM again: exiting now" in proc.stderr


def test_sigterm_finishes_the_step_checkpoints_and_resumes(data_dir, tmp_path):
    """SIGTERM during the warm start: the trainer finishes its step, saves a checkpoint
    of it, says so and exits with 128 + 15; the same command then resumes after that
    step and completes, with each SFT step logged once."""
    args = [sys.executable, "-m", "gspo_jax.train", "--config=configs/default.py:smoke",
            f"--workdir={tmp_path}", f"--config.task.data_dir={data_dir}", "--config.sft.steps=60",
            "--config.checkpoint_every=1000", "--config.total_rl_steps=1"]
    env = subprocess_env(1)
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM after sft step")]
    assert stopped, err[-2000:]
    step_ = int(stopped[0].split("sft step ")[1].split(";")[0])
    assert 3 <= step_ < 60, "the warm start finished before the signal"
    assert os.path.isdir(tmp_path / "checkpoints" / "sft" / str(step_))  # not a multiple of 1000
    assert not (tmp_path / ".lock").exists()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sft = [r["step"] for r in read_metrics(str(tmp_path)) if r["phase"] == "sft"]
    assert sft == list(range(1, 61))


# --------------------------------------------------------------------------
# Deleted warm-start checkpoints, non-finite parameters.


def test_a_folder_whose_config_json_is_not_a_runs_is_refused(data_dir, tmp_path):
    """A Hugging Face checkpoint given as --workdir: its config.json would be replaced
    by the run's. Refused before anything is written."""
    from gspo_jax import train

    hf = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(config_lib.ConfigError, match=r"config\.json is not a gspo_jax run's config "
                       r"\(model_type 'qwen3_moe': a Hugging Face checkpoint\?\)"):
        train.run(_smoke(data_dir), str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text()) == hf
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_deleted_warm_start_checkpoints_are_not_rerun(data_dir, tmp_path, capsys):
    """RL has begun; the warm start's checkpoints are deleted. Without a KL term RL
    resumes from its own checkpoint and the warm start is not repeated (its records
    appear once); with one, the run stops and names the checkpoint it needs. Replaced by
    another warm start's (another seed), they are refused by the checksum of pi_ref the
    RL checkpoint recorded."""
    import shutil

    from gspo_jax import rl, train

    c = _smoke(data_dir, **{"total_rl_steps": 1, "progress_bar": False, "seed": 1})
    train.run(c, str(tmp_path / "a"))
    other_sft = tmp_path / "other_sft"  # a warm start of another seed
    shutil.copytree(tmp_path / "a" / "checkpoints" / "sft", other_sft)
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "sft")
    c = _smoke(data_dir, **{"total_rl_steps": 2, "progress_bar": False, "seed": 1})
    train.run(c, str(tmp_path / "a"))
    recs = read_metrics(str(tmp_path / "a"))
    assert [r["step"] for r in recs if r["phase"] == "sft"] == [1, 2]
    assert [r["step"] for r in recs if r["phase"] == "rl"] == [0, 1, 2]
    sft_dir = tmp_path / "a" / "checkpoints" / "sft"
    assert not sft_dir.exists() or not os.listdir(sft_dir)

    g = tmp_path / "grpo"
    c = _smoke(data_dir, "grpo", **{"total_rl_steps": 1, "progress_bar": False})  # KL to pi_ref on
    train.run(c, str(g))
    meta = json.loads((g / "checkpoints" / "rl" / "1" / "meta" / "metadata").read_text())
    assert meta["reference"]["source"] == "warm start checkpoint sft/2"
    # The warm start's checkpoints replaced by another's: refused, nothing written.
    own = tmp_path / "own_sft"
    shutil.move(g / "checkpoints" / "sft", own)
    shutil.copytree(other_sft, g / "checkpoints" / "sft")
    before = (g / "metrics.jsonl").read_text()
    c = _smoke(data_dir, "grpo", **{"total_rl_steps": 2, "progress_bar": False})
    with pytest.raises(rl.ReferenceChanged, match=r"reference policy rebuilt from 'warm start "
                       r"checkpoint sft/2' has checksum [0-9a-f]{8}, but .* checksum "
                       + meta["reference"]["checksum"]):
        train.run(c, str(g))
    assert "finishing the checkpoint" not in capsys.readouterr().out  # no save was in flight
    assert (g / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(g / "checkpoints" / "rl")) == ["1"]
    # The warm start back, but a tokenizer that encodes otherwise (its files edited in
    # place): each checkpoint records the tokenizer's fingerprint, and it is refused.
    from gspo_jax.checkpoint import SourceChanged
    from gspo_jax.run_parts import RunParts

    shutil.rmtree(g / "checkpoints" / "sft")
    shutil.move(own, g / "checkpoints" / "sft")
    assert len(meta["tokenizer"]) == 16
    sources = RunParts.sources
    try:
        RunParts.sources = lambda self: {"tokenizer": "0123456789abcdef"}
        with pytest.raises(SourceChanged, match=r"checkpoints/sft/2: config\.tokenizer encodes text "
                           rf"differently .*fingerprint {meta['tokenizer']}, now 0123456789abcdef"):
            train.run(c, str(g))
    finally:
        RunParts.sources = sources
    assert (g / "metrics.jsonl").read_text() == before
    # Deleted: the run names the checkpoint it needs.
    shutil.rmtree(g / "checkpoints" / "sft")
    with pytest.raises(FileNotFoundError, match=r"reference policy.*Restore that checkpoint"):
        train.run(c, str(g))


def test_a_checkpoint_without_a_reference_record_is_resumed_with_a_notice(capsys):
    from gspo_jax import rl

    current = {"source": "pretrained /models/x", "checksum": "0badf00d"}
    rl.check_reference(None, None)  # no KL term: nothing to check
    rl.check_reference(dict(current), current)
    assert capsys.readouterr().err == ""
    rl.check_reference(None, current)  # saved before the record existed
    assert "records no checksum of the reference policy" in capsys.readouterr().err
    with pytest.raises(rl.ReferenceChanged, match=r"model\.pretrained's files changed"):
        rl.check_reference({"source": "pretrained /models/x", "checksum": "12345678"}, current)


def test_non_finite_parameters_stop_the_run():
    c = default_config.get_config("smoke")
    safety.check_health({"params_finite": 1.0, "skipped_in_a_row": 0}, c, "rl step 3")
    with pytest.raises(FloatingPointError, match=r"rl step 3: the parameters are no longer finite"):
        safety.check_health({"params_finite": 0.5, "skipped_in_a_row": 0}, c, "rl step 3")
    with pytest.raises(FloatingPointError, match="max_consecutive_skips=8"):
        safety.check_health({"params_finite": 1.0, "skipped_in_a_row": 9}, c, "rl step 3")


def test_an_update_to_non_finite_parameters_is_reported():
    """A finite loss and gradient, a learning rate that overflows the parameters:
    ``params_finite`` is 0 in the step's metrics (which check_health stops on)."""
    import functools

    import optax

    from gspo_jax import step

    cfg = ModelConfig(vocab_size=24, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = {"prompt_tokens": jnp.ones((2, 3), jnp.int32), "prompt_mask": jnp.ones((2, 3)),
             "tokens": jnp.ones((2, 4), jnp.int32), "mask": jnp.ones((2, 4))}
    for lr, finite in ((1e-3, 1.0), (1e39, 0.0)):
        opt = optax.sgd(lr)
        fn = jax.jit(functools.partial(sft.sft_step, graphdef=graphdef, optimizer=opt,
                                       schedule=optax.constant_schedule(lr)))
        _, m = fn(step.TrainState.create(params, opt.init(params)), batch, jax.random.key(0))
        m = compute_all(m)
        assert np.isfinite(float(m["loss"])) and float(m["params_finite"]) == finite


# --------------------------------------------------------------------------
# Unknown config keys.


def test_an_unknown_config_key_is_one_line_naming_the_closest():
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_jax.train", "--config=configs/default.py:smoke",
         "--config.updates.aux_los_coef=0.1", "--workdir=/nonexistent/never"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "config.updates.aux_los_coef" in lines[0] and "config.updates.aux_loss_coef" in lines[0]


# --------------------------------------------------------------------------
# An embedding padded beyond the tokenizer's vocabulary.


def test_padding_rows_of_the_embedding_are_never_sampled():
    """A checkpoint with 40 embedding rows for a 30-token tokenizer, whose padding rows
    would dominate the logits: with num_valid_tokens = 30 no padding id is ever drawn,
    and the training log-probs are those of the distribution over the 30 tokens."""
    cfg = ModelConfig(vocab_size=40, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      d_ff=32, num_valid_tokens=30)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    model.lm_head[...] = model.lm_head[...].at[:, 30:].set(5.0)  # padding columns: huge logits
    sampler = Sampler.from_model(model)
    ro = sampler([[1, 2, 3], [4, 5]], num_samples=8, max_new_tokens=12, rng=jax.random.key(0),
                 temperature=1.0, eos_id=[0], pad_id=0)
    toks = np.asarray(ro.tokens)[np.asarray(ro.mask) > 0]
    assert toks.size and toks.max() < 30
    x = jnp.asarray([[1, 2, 3, 4]])
    logits, _ = model(x)
    assert float(jnp.max(logits[..., 30:])) == float(np.float32(-1e30))
    lp, ent, _ = model.token_logprobs(x, x)
    ref = jax.nn.log_softmax(logits[..., :30], axis=-1)
    np.testing.assert_allclose(lp, jnp.take_along_axis(ref, x[..., None], -1)[..., 0], rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(ent)))


# --------------------------------------------------------------------------
# Fault injection: kills at random points and a corrupted newest checkpoint.


def _complete_steps(phase_dir):
    if not phase_dir.is_dir():
        return []
    return sorted(int(d) for d in os.listdir(phase_dir)
                  if d.isdigit() and (phase_dir / d / "checksums.json").exists())


def _corrupt(step_dir, rs):
    """Flip 64 bytes in the largest file of the checkpoint's arrays."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir / "state") for f in fs]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        at = rs.randint(0, max(1, len(data) - 64))
        data[at:at + 64] = bytes((b ^ 0xFF) for b in data[at:at + 64])
        f.seek(0)
        f.write(data)
    return path


def test_kills_and_corrupted_checkpoints_resume_to_the_uninterrupted_metrics(data_dir, tmp_path):
    """Five times: start the run, SIGKILL it at a random point after it makes progress,
    and flip 64 bytes in its newest checkpoint. Then let it finish. Every resume skips
    the corrupted checkpoint (set aside as <step>.unusable) for the one before, and the
    RL records equal an uninterrupted run's bit for bit, each step logged once."""
    args = [sys.executable, "-m", "gspo_jax.train", "--config=configs/default.py:smoke",
            f"--config.task.data_dir={data_dir}", "--config.progress_bar=False", "--config.total_rl_steps=6",
            "--config.sft.steps=6", "--config.checkpoint_every=1", "--config.keep_checkpoints=3"]
    env = subprocess_env(1)
    full, cut = tmp_path / "full", tmp_path / "cut"
    out = subprocess.run(args + [f"--workdir={full}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    rs = np.random.RandomState(0)
    corrupted = []
    for _ in range(5):
        phases = {p: cut / "checkpoints" / p for p in ("sft", "rl")}
        before = {p: _complete_steps(d) for p, d in phases.items()}
        proc = subprocess.Popen(args + [f"--workdir={cut}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:  # wait for a new checkpoint ...
            if any(_complete_steps(d) != before[p] for p, d in phases.items()):
                break
            time.sleep(0.05)
        time.sleep(rs.uniform(0.0, 4.0))  # ... then kill at a random point
        proc.kill()
        proc.wait()
        for p in ("rl", "sft"):
            steps = _complete_steps(phases[p])
            if len(steps) >= 2:  # the one before stays to resume from
                corrupted.append((p, steps[-1], _corrupt(phases[p] / str(steps[-1]), rs)))
                break
    out = subprocess.run(args + [f"--workdir={cut}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(corrupted) >= 3, corrupted
    set_aside = [d for p in ("sft", "rl") for d in os.listdir(cut / "checkpoints" / p) if d.endswith(".unusable")]
    assert set_aside, "no corrupted checkpoint was detected and skipped"
    a = {r["step"]: r for r in read_metrics(str(full)) if r["phase"] == "rl"}
    lines = read_metrics(str(cut))
    b = {r["step"]: r for r in lines if r["phase"] == "rl"}
    assert sorted(b) == list(range(7)) and len([r for r in lines if r["phase"] == "rl"]) == 7
    assert [r["step"] for r in lines if r["phase"] == "sft"] == list(range(1, 7))
    timing = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time", "tokens_per_s"}
    for s in range(1, 7):
        assert set(a[s]) - timing == set(b[s]) - timing
        for k in sorted(set(a[s]) - timing):
            np.testing.assert_array_equal(np.asarray(a[s][k]), np.asarray(b[s][k]), err_msg=f"step {s} {k}")


# --------------------------------------------------------------------------
# An error right after a checkpoint save began.


@pytest.mark.parametrize("phase", ["sft", "rl"])
def test_an_error_right_after_a_save_waits_for_that_checkpoint(data_dir, tmp_path, monkeypatch, capsys, phase):
    """Saves are asynchronous. An error in the step after one (here injected; a bad prompt,
    the health check or an out-of-memory error in a run) leaves the phase only once that
    checkpoint is written and renamed to its step, checksums included: the writer is
    slowed down so that, without the wait, the step would still be a temporary
    directory when the error reaches the caller (and be deleted by the next start)."""
    from gspo_jax import checkpoint, sft, train
    from gspo_jax import rl as rl_lib

    write_manifest = checkpoint.write_manifest

    def slow_write(step_dir):
        time.sleep(2.0)
        write_manifest(step_dir)

    monkeypatch.setattr(checkpoint, "write_manifest", slow_write)
    c = _smoke(data_dir, **{"total_rl_steps": 4, "sft.steps": 4})
    if phase == "rl":
        step = rl_lib.RLPhase.step

        def failing(self, s):
            if s == 2:
                raise RuntimeError("injected after the save of RL step 2")
            return step(self, s)

        monkeypatch.setattr(rl_lib.RLPhase, "step", failing)
    else:
        batch = sft.sft_batch

        def failing(t, pos):
            if pos == 2 * c.sft.batch_size:
                raise RuntimeError("injected after the save of SFT step 2")
            return batch(t, pos)

        monkeypatch.setattr(sft, "sft_batch", failing)
    with pytest.raises(RuntimeError, match="injected"):
        train.run(c, str(tmp_path))
    ckpt = tmp_path / "checkpoints" / phase
    assert (ckpt / "2" / "checksums.json").exists(), sorted(os.listdir(ckpt))
    assert not [d for d in os.listdir(ckpt) if "tmp" in d]
    out = capsys.readouterr().out
    assert f"checkpoints/{phase}: stopped by RuntimeError: finishing the checkpoint being written" in out


def test_without_config_json_resume_reads_the_checkpoints_own_config(data_dir, tmp_path):
    """config.json deleted (checkpoints copied to another cluster, a run forked from
    them): the newest checkpoint records the config it was made with, and a resume with
    another is refused, naming the fields and that record; the same config resumes."""
    from gspo_jax import train

    c = _smoke(data_dir, "gspo")
    train.run(c, str(tmp_path))
    os.remove(tmp_path / "config.json")
    other = _smoke(data_dir, "grpo", **{"model.fields.d_model": 64})
    with pytest.raises(config_lib.ConfigError) as e:
        train.run(other, str(tmp_path))
    msg = str(e.value)
    assert "config.objective.name: 'gspo' -> 'grpo'" in msg and "config.model.fields.d_model: 32 -> 64" in msg
    assert os.path.join("checkpoints", "rl", "2", "meta", "metadata") in msg
    more = _smoke(data_dir, "gspo", **{"total_rl_steps": 3})  # may change on resume
    records = train.run(more, str(tmp_path))
    assert [r["step"] for r in records if r["phase"] == "rl"] == [3]
