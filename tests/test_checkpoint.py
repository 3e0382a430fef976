"""PhaseCheckpointer: checksums, falling back past unusable checkpoints, finite checks."""
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gspo_jax import checkpoint
from gspo_jax.checkpoint import CheckpointError, PhaseCheckpointer, check_finite


@flax.struct.dataclass
class State:
    """TrainState-like: parameters, optimizer state, an integer counter."""

    step: jax.Array
    params: dict
    opt_state: object


OPT = optax.adam(1e-3)


def make_state(value: float, step: int = 0) -> State:
    params = {
        "embed": jnp.full((64, 32), value, jnp.float32),
        "layers": {"w": jnp.arange(4 * 16 * 16, dtype=jnp.float32).reshape(4, 16, 16) * value,
                   "b": jnp.full((16,), value, jnp.bfloat16)},
    }
    return State(step=jnp.int32(step), params=params, opt_state=OPT.init(params))


def ckpt(tmp_path, **kw) -> PhaseCheckpointer:
    kw.setdefault("every", 1)
    kw.setdefault("keep", 5)
    return PhaseCheckpointer(str(tmp_path), "rl", **kw)


def save_steps(tmp_path, steps, **kw) -> str:
    c = ckpt(tmp_path, **kw)
    for s in steps:
        assert c.save(s, make_state(float(s), s), {"phase": "rl", "step": s})
    c.close()
    return c.directory


def data_file(step_dir: str) -> str:
    """The largest array data file of a checkpoint."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs]
    return max(files, key=os.path.getsize)


def restored_value(state) -> float:
    return float(np.asarray(state.params["embed"])[0, 0])


def test_round_trip_writes_checksums(tmp_path):
    d = save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        manifest = json.load(open(os.path.join(d, str(s), checkpoint.MANIFEST)))
        assert any(k.startswith("state/") for k in manifest["files"])
        assert any(k.startswith("meta/") for k in manifest["files"])
        assert checkpoint.verify_manifest(os.path.join(d, str(s))) is None
    c = ckpt(tmp_path)
    assert c.latest_step() == 2
    state, meta, step = c.restore(make_state(0.0))
    assert step == 2 and meta == {"phase": "rl", "step": 2} and restored_value(state) == 2.0
    assert int(state.step) == 2 and state.params["layers"]["b"].dtype == jnp.bfloat16
    c.close()


def test_back_to_back_async_saves_then_close(tmp_path):
    """Saves issued with no wait in between, then close: each finished, each checksummed."""
    c = ckpt(tmp_path, keep=3)
    for s in range(1, 7):
        c.save(s, make_state(float(s), s), {"step": s}, force=True)
    c.close()
    names = sorted(os.listdir(c.directory))
    assert names == ["4", "5", "6"], names
    for s in (4, 5, 6):
        assert checkpoint.verify_manifest(os.path.join(c.directory, str(s))) is None


def test_sync_saves_are_checksummed_too(tmp_path):
    d = save_steps(tmp_path, [1], async_save=False)
    assert checkpoint.verify_manifest(os.path.join(d, "1")) is None


def test_flipped_bytes_fall_back_to_previous_step(tmp_path, capsys):
    d = save_steps(tmp_path, [1, 2])
    target = data_file(os.path.join(d, "2"))
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        f.write(bytes(64))  # 64 bytes zeroed in the middle of the newest data file
    rel = os.path.relpath(target, os.path.join(d, "2"))
    c = ckpt(tmp_path)
    assert c.latest_step() == 2  # a directory exists; restore decides whether it is usable
    state, meta, step = c.restore(make_state(0.0))
    assert step == 1 and meta["step"] == 1 and restored_value(state) == 1.0
    out = capsys.readouterr().out
    assert f"skipping step 2: checksum mismatch in {rel}" in out
    assert "moved step 2 aside to 2.unusable" in out
    # The resumed run saves step 2 again.
    assert c.save(2, make_state(2.0, 2), {"step": 2})
    c.close()
    assert sorted(os.listdir(d)) == ["1", "2", "2.unusable"]
    assert restored_value(ckpt(tmp_path).restore(make_state(0.0))[0]) == 2.0


def test_truncated_file_falls_back(tmp_path, capsys):
    d = save_steps(tmp_path, [1, 2, 3])
    target = data_file(os.path.join(d, "3"))
    os.truncate(target, os.path.getsize(target) // 3)
    _, _, step = ckpt(tmp_path).restore(make_state(0.0))
    assert step == 2
    out = capsys.readouterr().out
    assert "skipping step 3: incomplete:" in out and "truncated" in out


def test_missing_file_falls_back(tmp_path, capsys):
    d = save_steps(tmp_path, [1, 2])
    target = data_file(os.path.join(d, "2"))
    os.remove(target)
    _, _, step = ckpt(tmp_path).restore(make_state(0.0))
    assert step == 1
    rel = os.path.relpath(target, os.path.join(d, "2"))
    assert f"skipping step 2: incomplete: {rel} is missing" in capsys.readouterr().out


def test_empty_and_temporary_directories_are_not_steps(tmp_path, capsys):
    d = save_steps(tmp_path, [1, 2])
    os.makedirs(os.path.join(d, "7"))
    os.makedirs(os.path.join(d, "9.orbax-checkpoint-tmp", "state"))
    open(os.path.join(d, "9.orbax-checkpoint-tmp", "state", "junk"), "wb").write(b"x" * 100)
    c = ckpt(tmp_path)
    assert c.latest_step() == 2
    os.makedirs(os.path.join(d, "8"))  # appearing after the checkpointer started
    assert c.latest_step() == 2
    _, _, step = c.restore(make_state(0.0))
    assert step == 2
    out = capsys.readouterr().out
    assert "removed the empty directory 7" in out and "removed the empty directory 8" in out
    assert "skipping" not in out
    # Steps 3..7 save normally: orbax does not take "7" for an existing checkpoint.
    for s in range(3, 8):
        assert c.save(s, make_state(float(s), s), {"step": s})
    c.close()
    assert not os.path.exists(os.path.join(d, "9.orbax-checkpoint-tmp"))
    assert ckpt(tmp_path).restore(make_state(0.0))[2] == 7


def test_non_finite_checkpoint_is_skipped(tmp_path, capsys):
    c = ckpt(tmp_path)
    c.save(1, make_state(1.0, 1), {"step": 1})
    bad = make_state(2.0, 2)
    bad = bad.replace(params={**bad.params, "layers": {**bad.params["layers"],
                                                       "w": bad.params["layers"]["w"].at[1, 2, 3].set(jnp.nan)}})
    c.save(2, bad, {"step": 2})
    c.close()
    _, _, step = ckpt(tmp_path).restore(make_state(0.0))
    assert step == 1
    assert "skipping step 2: non-finite value in params/layers/w" in capsys.readouterr().out


def test_restore_error_is_summarised_and_skipped(tmp_path, capsys):
    """No checksums to catch it (an older save): orbax's own error, in one line."""
    d = save_steps(tmp_path, [1, 2])
    os.remove(os.path.join(d, "2", checkpoint.MANIFEST))
    for r, _, fs in os.walk(os.path.join(d, "2", "state")):
        for f in fs:
            os.truncate(os.path.join(r, f), 0)
    _, _, step = ckpt(tmp_path).restore(make_state(0.0))
    assert step == 1
    line = [l for l in capsys.readouterr().out.splitlines() if "skipping step 2" in l]
    assert len(line) == 1 and "restore failed:" in line[0] and len(line[0]) < 400


def test_checkpoint_without_checksums_restores_with_a_note(tmp_path, capsys):
    d = save_steps(tmp_path, [1])
    os.remove(os.path.join(d, "1", checkpoint.MANIFEST))
    state, _, step = ckpt(tmp_path).restore(make_state(0.0))
    assert step == 1 and restored_value(state) == 1.0
    assert f"step 1 has no {checkpoint.MANIFEST}" in capsys.readouterr().out


def test_all_bad_raises_naming_each(tmp_path):
    d = save_steps(tmp_path, [1, 2, 3])
    with open(data_file(os.path.join(d, "3")), "r+b") as f:
        f.write(b"\xff" * 64)
    os.truncate(data_file(os.path.join(d, "2")), 10)
    os.remove(os.path.join(d, "1", "meta", "metadata"))
    os.makedirs(os.path.join(d, "4", "junk"))
    c = ckpt(tmp_path)
    with pytest.raises(CheckpointError) as e:
        c.restore(make_state(0.0))
    msg = str(e.value)
    assert "no usable 'rl' checkpoint" in msg
    assert "step 4: incomplete: no state/ or meta/ directory" in msg
    assert "step 3: checksum mismatch in state/" in msg
    assert "step 2: incomplete: state/" in msg and "truncated" in msg
    assert "step 1: incomplete: meta/metadata is missing" in msg
    # Nothing was moved: the directories are as they were.
    assert sorted(os.listdir(d)) == ["1", "2", "3", "4"]


def test_explicit_step(tmp_path):
    save_steps(tmp_path, [1, 2])
    c = ckpt(tmp_path)
    assert c.restore(make_state(0.0), step=1)[2] == 1
    with pytest.raises(FileNotFoundError, match="checkpoint 5"):
        c.restore(make_state(0.0), step=5)


def test_no_checkpoint(tmp_path):
    c = ckpt(tmp_path)
    assert c.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no 'rl' checkpoint"):
        c.restore(make_state(0.0))


def test_check_finite():
    s = make_state(1.0)
    assert check_finite(s) is None
    assert check_finite({"i": jnp.arange(3)}) is None  # integer leaves are not checked
    t = s.replace(params={**s.params, "embed": s.params["embed"].at[3, 4].set(jnp.inf)})
    assert check_finite(t) == "params/embed"
    u = s.replace(opt_state=jax.tree.map(lambda x: x * jnp.nan if x.ndim else x, s.opt_state))
    assert check_finite(u).startswith("opt_state/")
    assert check_finite(np.array([1.0, np.nan])) == ""
