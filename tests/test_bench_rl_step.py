"""`experiments/bench/bench_rl_step.py` with the accelerator config (`configs/bench_rl_h200.py`)
and `experiments/bench/lengths.py`: the full config is valid and has the issue's shape; its
CPU-sized variant runs one whole RL step under imposed lengths and reports every pass's
positions, real shares, stage times and tokens/s per device; the lengths are cut into the
masks as drawn; the real-token shares match a hand-computed case."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import bench_rl_step
from experiments.bench import lengths as lengths_lib
from gspo_jax import config as config_lib
from gspo_jax import packing


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


def test_tiny_variant_runs_a_whole_step(tmp_path, capsys, monkeypatch):
    out_json = tmp_path / "bench.json"
    # Nothing on the synthetic task's path imports TensorFlow (the GPU image has none):
    # every import statement the run executes is seen, whatever other tests imported.
    import builtins

    imported, real_import = [], builtins.__import__

    def spy(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    bench_rl_step.main(
        [
            "--config",
            "configs/bench_rl_h200.py:tiny",
            "--steps",
            "1",
            "--data_dir",
            str(tmp_path),
            "--lengths",
            "flagship",
            "--json",
            str(out_json),
        ]
    )
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert imported and not [m for m in imported if m.split(".")[0] in ("tensorflow", "tensorflow_datasets")]
    out = capsys.readouterr().out
    assert "prompts=8 G=4 max_prompt_len=64 max_new_tokens=16 updates/step=4" in out
    assert "the sampler's decode is the model's own, unchanged" in out
    line = next(x for x in out.splitlines() if x.startswith("tokens/s/device"))
    assert float(line.split("measure): ")[1].split()[0]) > 0
    assert "GFLOP per mini-batch" in out and "objective alone" in out
    s = json.loads(out_json.read_text())["variants"]["as given"]["summary"]
    for key in (
        "sample_time",
        "score_time",
        "prepare_time",
        "update_time",
        "step_time",
        "gen_tokens",
        "tokens_per_s_per_device",
    ):
        assert s[key] > 0, key
    # The lengths imposed are those drawn for batch 1 (the measured step's), clipped to
    # the tiny config's 64 + 16: every row full, so the passes see only real tokens.
    p, r = lengths_lib.sample(
        32, seed=1, max_prompt_len=64, max_new_tokens=16, name="flagship", group_size=4
    )
    assert (s["imposed_prompt"], s["imposed_response"]) == (p.sum(), r.sum())
    real = lengths_lib.valid_mask(p, r, max_prompt_len=64, max_new_tokens=16).sum()
    assert s["train_real"] == pytest.approx(real) and s["logprob_real"] == pytest.approx(real)
    assert s["train_share"] == pytest.approx(1.0) and s["logprob_share"] == pytest.approx(1.0)
    # The sampler: 8 prompts' prefill of 64 positions, decode steps of 32 rows.
    assert s["sampler_tokens"] >= 8 * 64 + 32 and 0 < s["sampler_share"] <= 1
    assert "reference_tokens" not in s  # no KL term: no reference pass


def test_cut_masks_imposes_the_drawn_lengths():
    P, T = 5, 4
    device = {
        "prompt_mask": jnp.ones((3, P), jnp.float32),
        "mask": jnp.zeros((3, T), jnp.float32),
        "tokens": jnp.zeros((3, T), jnp.int32),
    }
    p, r = np.array([2, 5, 1]), np.array([1, 4, 3])
    out = bench_rl_step.cut_masks(device, p, r, overlong_filter=False)
    np.testing.assert_array_equal(
        out["prompt_mask"], [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    )
    np.testing.assert_array_equal(out["mask"], [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    assert out["mask"].dtype == jnp.float32 and out["tokens"] is device["tokens"]
    # Overlong filtering: the response at the cap (row 1) carries no mask.
    filtered = bench_rl_step.cut_masks(device, p, r, overlong_filter=True)
    np.testing.assert_array_equal(filtered["mask"][1], [0, 0, 0, 0])
    assert isinstance(filtered["mask"], jax.Array)


def test_overrides_and_variants():
    c = bench_rl_step.load_config("configs/bench_rl_h200.py:tiny")
    bench_rl_step.apply_overrides(c, ["updates.packing=False", "updates.micro_batch_tokens=0"])
    assert c.updates.packing is False and c.updates.micro_batch_tokens == 0
    with pytest.raises(SystemExit, match="no updates.pakcing"):
        bench_rl_step.apply_overrides(c, ["updates.pakcing=False"])
    assert bench_rl_step.parse_variant(
        "padded:updates.packing=False,updates.micro_batch_tokens=0"
    ) == (
        "padded",
        ["updates.packing=False", "updates.micro_batch_tokens=0"],
    )
    assert bench_rl_step.parse_variant("packed") == ("packed", [])


def test_lengths_are_drawn_clipped_and_grouped():
    kw = dict(seed=3, max_prompt_len=384, max_new_tokens=1024, group_size=8)
    p, r = lengths_lib.sample(4096, **kw)
    p2, r2 = lengths_lib.sample(4096, **kw)
    np.testing.assert_array_equal(p, p2)  # a seed, the same lengths
    assert (p.reshape(-1, 8) == p.reshape(-1, 8)[:, :1]).all()  # a prompt's samples share it
    assert 1 <= p.min() and p.max() <= 384 and 1 <= r.min() and r.max() <= 1024
    # The fits' targets (the module docstring): prompts about 104 tokens, answers 280.
    assert 98 < p.mean() < 110 and 265 < r.mean() < 295
    short = lengths_lib.sample(64, seed=0, max_prompt_len=64, max_new_tokens=16)
    assert (short[0] == 64).all() and lengths_lib.truncated(short[1], 16).all()
    _, thinking = lengths_lib.sample(
        512, seed=0, max_prompt_len=384, max_new_tokens=1024, name="flagship_thinking"
    )
    assert lengths_lib.truncated(thinking, 1024).mean() > 0.95
    with pytest.raises(ValueError, match="no distribution"):
        lengths_lib.sample(8, seed=0, max_prompt_len=8, max_new_tokens=8, name="nope")


def test_shares_match_a_hand_computed_case():
    # P = T = 4, S = 7. Valid input positions (the last response position is none):
    # row 0: 2 prompt + 1 response = 3; row 1: 4 + 3 = 7; row 2: 1 + 2 = 3; row 3: 3 + 3 = 6.
    p, r = np.array([2, 4, 1, 3]), np.array([1, 4, 2, 3])
    valid = lengths_lib.valid_mask(p, r, max_prompt_len=4, max_new_tokens=4)
    np.testing.assert_array_equal(valid.sum(1), [3, 7, 3, 6])
    np.testing.assert_array_equal(valid[0], [0, 0, 1, 1, 1, 0, 0])
    kw = dict(max_prompt_len=4, max_new_tokens=4)
    padded = lengths_lib.shares(p, r, packing=None, **kw)
    assert (padded["real"], padded["padded_slots"]) == (19, 28)
    assert padded["padded_share"] == pytest.approx(19 / 28)
    # First-fit decreasing into rows of 7: [7], [6], [3, 3]: three buffer rows.
    one = lengths_lib.shares(p, r, packing=packing.Packing(rows=1, micro=4), **kw)
    assert (one["micro_batches_used"], one["packed_slots"]) == (3, 21)
    assert one["packed_share"] == pytest.approx(19 / 21)
    # Micro-batches of 2 buffer rows: two used, all 4 x 7 slots computed.
    two = lengths_lib.shares(p, r, packing=packing.Packing(rows=2, micro=2), **kw)
    assert (two["micro_batches_used"], two["packed_share"]) == (2, pytest.approx(19 / 28))
    # A step: the log-prob pass over the batch, the train step over two mini-batches of
    # one-row micro-batches (a mini-batch of 2 rows packs into at most 2 buffer rows).
    shapes = packing.Shapes(
        train=packing.Packing(rows=1, micro=2), logprob=packing.Packing(rows=1, micro=4)
    )
    step = lengths_lib.pass_shares(p, r, shapes=shapes, num_minibatches=2, **kw)
    assert step["logprob"]["packed_share"] == pytest.approx(19 / 21)
    assert step["train"]["real"] == 19 and step["train"]["padded_slots"] == 28
    assert 19 / 28 <= step["train"]["packed_share"] <= 1
    unpacked = lengths_lib.pass_shares(
        p, r, shapes=packing.Shapes(None, None), num_minibatches=2, **kw
    )
    assert unpacked["train"]["packed_share"] == unpacked["train"]["padded_share"]
