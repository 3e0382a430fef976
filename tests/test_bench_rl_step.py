"""`experiments/bench/bench_rl_step.py` with the accelerator config (`configs/bench_rl_h200.py`):
the full config is valid and has the issue's shape; its CPU-sized variant runs one whole
RL step and reports tokens/s per device."""

import pytest

from experiments.bench import bench_rl_step
from gspo_jax import config as config_lib


def test_full_config_is_valid_and_realistic():
    c = bench_rl_step.load_config("configs/bench_rl_h200.py")
    config_lib.validate(c, num_devices=1)
    assert (c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens) == (
        64,
        8,
        1024,
    )
    assert c.updates.num_minibatches == 4 and c.model.fields["vocab_size"] == 151_936
    assert (
        bench_rl_step.load_config("configs/bench_rl_h200.py:layers=16").model.fields["num_layers"]
        == 16
    )
    with pytest.raises(SystemExit, match="no file"):
        bench_rl_step.load_config("configs/missing.py")


def test_tiny_variant_runs_a_whole_step(tmp_path, capsys):
    bench_rl_step.main(
        ["--config", "configs/bench_rl_h200.py:tiny", "--steps", "1", "--data_dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert "prompts=8 G=4 max_new_tokens=16 updates/step=4" in out
    line = next(x for x in out.splitlines() if x.startswith("tokens/s/device"))
    assert float(line.split("measure): ")[1].split()[0]) > 0
