"""The optional Weights & Biases writer (config.wandb): offline runs under
``<workdir>/wandb`` with the records of metrics.jsonl and updates.jsonl, a run id
kept per workdir, the "auto" mode, and the message when the package is missing."""

import glob
import os
import sys

import pytest

pytest.importorskip("wandb")

from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax import metrics_log  # noqa: E402
from gspo_jax.metrics_log import MetricsWriter, WandbWriter, open_wandb, wandb_mode  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_wandb(monkeypatch, tmp_path):
    for key, value in {
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB__DISABLE_STATS": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)


def _wandb_cfg(**kw):
    c = config_lib.base_config().wandb
    c.enabled = True
    c.mode = "offline"
    for k, v in kw.items():
        c[k] = v
    return c


def test_writer_logs_records_offline_under_the_workdir(tmp_path):
    workdir = str(tmp_path / "run")
    with open_wandb(_wandb_cfg(), workdir, {"seed": 0}) as wb:
        assert isinstance(wb, WandbWriter)
        assert wb.run.config["seed"] == 0
        w = MetricsWriter(workdir, tensorboard=False, wandb=wb)
        u = MetricsWriter(workdir, tensorboard=False, filename="updates.jsonl",
                          tb_prefix="updates", wandb=wb)
        w.write(0, "rl", {"eval_reward_mean": 0.1})
        for k in range(2):
            u.write(1, "rl", {"k": k, "loss": 0.5 + k, "flips": [1.0, 2.0]}, tb_step=k)
        w.write(1, "rl", {"reward_mean": 0.25, "clip_frac": float("nan")})
        wb.flush()  # rows go to W&B from a thread of their own
        summary = dict(wb.run.summary)
        w.close()
        u.close()
    assert summary["rl/reward_mean"] == 0.25
    assert summary["updates/loss"] == 1.5 and summary["updates/flips/1"] == 2.0
    assert summary["updates/step"] == 1 and summary["updates/rl_step"] == 1
    runs = glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))
    assert len(runs) == 1, os.listdir(os.path.join(workdir, "wandb"))
    run_id = open(os.path.join(workdir, metrics_log.WANDB_ID_FILE)).read().strip()
    assert glob.glob(os.path.join(runs[0], f"run-{run_id}.wandb"))
    # The same workdir keeps its run id: a resumed run continues the same W&B run.
    assert metrics_log.wandb_run_id(workdir) == run_id


def test_disabled_or_not_process_zero_opens_nothing(tmp_path):
    with open_wandb(_wandb_cfg(enabled=False), str(tmp_path), {}) as wb:
        assert wb is None
    with open_wandb(_wandb_cfg(), str(tmp_path), {}, enabled=False) as wb:
        assert wb is None
    assert not os.path.exists(tmp_path / "wandb")


def test_auto_mode(monkeypatch, tmp_path):
    assert wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert wandb_mode("auto") == "offline"  # no credentials
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens
    assert wandb_mode("auto", timeout=1.0) == "offline"


def test_missing_package_names_the_field(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(config_lib.ConfigError) as e:
        with open_wandb(_wandb_cfg(), str(tmp_path), {}):
            pass
    assert str(e.value).startswith("config.wandb.enabled:")
    assert "pip install -e '.[wandb]'" in str(e.value)


def test_config_validation():
    c = default_config.get_config("smoke")
    c.wandb.mode = "sometimes"
    with pytest.raises(config_lib.ConfigError, match=r"^config\.wandb\.mode:"):
        config_lib.validate(c, 8)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def test_smoke_training_run_writes_an_offline_wandb_run(data_dir, tmp_path):
    from gspo_jax import train

    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.progress_bar = False
    c.sft.steps, c.total_rl_steps = 1, 1
    c.wandb.enabled, c.wandb.mode = True, "offline"
    workdir = str(tmp_path / "run")
    train.run(c, workdir)
    runs = glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))
    assert len(runs) == 1
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))
    # Resuming the finished run continues the same W&B run id.
    run_id = metrics_log.wandb_run_id(workdir)
    train.run(c, workdir)
    assert metrics_log.wandb_run_id(workdir) == run_id
    assert all(run_id in p for p in glob.glob(os.path.join(workdir, "wandb", "offline-run-*")))
