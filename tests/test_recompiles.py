"""One shape per run, and no needless host traffic.

* The sampler, the log-prob passes and the train step compile once over an RL phase
  whose prompts vary in length from step to step (and within a batch): every prompt
  is left-padded to ``rollout.max_prompt_len``.
* The rollout stays on the devices: of an RL step only the response token ids (with
  lengths and truncation flags) and scalar metrics come to the host; the R3 routing
  record never does.
* A prompt longer than ``rollout.max_prompt_len`` is refused (an error naming the
  field and the prompt's length) or, with ``rollout.long_prompts="truncate"``, cut to
  its last ``max_prompt_len`` tokens and counted (``prompts_truncated``).
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from gspo_jax import advantages as adv_lib
from gspo_jax import config as config_lib
from gspo_jax import rl as rl_lib
from gspo_jax import sft, run_parts as trainer_lib
from gspo_jax.data.encoding import fit_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402

# The compiled functions of an RL step, by the name compile_counts gives them.
# The sampler, the prepare stage (the old pass, advantages, trust region) and the update.
SAMPLER, PREPARE, TRAIN = "jit(_generate)", "jit(prepare_batch)", "jit(train_step)"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _config(data_dir, **overrides):
    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.sft.steps = 0
    c.update_from_flattened_dict(overrides)  # a misspelt key fails the RunParts's validation
    return c


def _vary_prompt_lengths(trainer, length_of):
    """The train split's batches, with prompt i of the batch at data position ``pos``
    cut or padded (from the left) to ``length_of(pos) + i`` characters: the char
    tokenizer's tokens, plus BOS. The verifier reads the example's metadata, not its
    prompt."""
    source = trainer.train_data
    batch_of = source.batch

    def batch(pos, n):
        length = length_of(pos)
        texts = [(" " * 200 + ex.prompt)[-(length + i) :] for i, ex in enumerate(batch_of(pos, n))]
        return [dataclasses.replace(ex, prompt=t) for ex, t in zip(batch_of(pos, n), texts)]

    source.batch = batch


def test_rl_phase_compiles_once_over_prompts_of_varying_length(data_dir, tmp_path, compile_counts):
    """Four RL steps whose longest prompts differ (about 40, 8, 24 and 100 tokens, the
    last truncated to 64): every prompt is padded to rollout.max_prompt_len, so the
    sampler, the prepare program (the log-prob passes) and the train step compile in
    step 1 and never again."""
    c = _config(data_dir, **{"rollout.long_prompts": "truncate", "dapo.dynamic_sampling": True,
                             "dapo.max_sampling_rounds": 2, "dapo.overlong_filter": True})
    trainer = trainer_lib.RunParts(c, str(tmp_path))
    rl = rl_lib.RLPhase(trainer, trainer.init_params)
    n = int(c.rollout.prompts_per_step)
    lengths = [40, 8, 24, 100, 100]  # per step; + i within the batch, + 1 for BOS
    _vary_prompt_lengths(trainer, lambda pos: lengths[pos // (2 * n)])  # 2 rounds a step at most
    jax.clear_caches()  # step 1 compiles even where an earlier test ran the same sampler
    counts = []
    for s in range(4):
        compile_counts.clear()
        m, _ = rl.step(s)
        counts.append({k: compile_counts[k] for k in (SAMPLER, PREPARE, TRAIN)})
        assert np.isfinite(m["loss"]) and m["sampling_rounds"] in (1, 2)
        assert m["prompts_truncated"] == (n * m["sampling_rounds"] if lengths[s] == 100 else 0)
    assert all(counts[0].values()), counts
    assert counts[1:] == [dict.fromkeys(counts[0], 0)] * 3, (counts, dict(compile_counts))

    # Refuse: the same long prompts stop the step, naming the field and the length.
    rollout = dataclasses.replace(trainer.cfg.rollout, long_prompts="refuse")
    trainer.cfg = dataclasses.replace(trainer.cfg, rollout=rollout)  # the values the phases read
    with pytest.raises(config_lib.ConfigError, match=r"rollout\.max_prompt_len: .* of 101 tokens"):
        rl.step(4)


def _record_host_fetches(monkeypatch) -> list:
    """Every jax.Array value fetched to the host from now on, explicit
    (``jax.device_get``) or implicit (``np.asarray``, ``float``, ...), of an array
    sharded over the mesh: all go through ``ArrayImpl._value``. ``np.asarray`` of a
    single-device array on the CPU reads its buffer directly and is not seen (nor does
    JAX's transfer guard see fetches on the CPU); the batch's arrays are sharded."""
    from jax._src.array import ArrayImpl

    fetched, value = [], ArrayImpl._value

    def recorded(self):
        out = value.fget(self)
        fetched.append(out)
        return out

    monkeypatch.setattr(ArrayImpl, "_value", property(recorded))
    return fetched


def test_routing_record_never_reaches_the_host(data_dir, tmp_path, monkeypatch):
    """Under R3 the batch holds the sampler's whole routing record, on the devices;
    collecting, preparing and updating bring to the host only the response token
    ids, lengths, truncation flags and metrics."""
    c = _config(data_dir, **{"updates.routing_replay": "R3"})
    trainer = trainer_lib.RunParts(c, str(tmp_path))
    rl = rl_lib.RLPhase(trainer, trainer.init_params)
    fetched = _record_host_fetches(monkeypatch)
    queued = rl.collect_batch(0, version=0)
    batch = queued.device
    prepared, _ = rl.prepare(queued, 0)
    rl.step(0)
    rows, T = int(c.rollout.prompts_per_step) * int(c.rollout.group_size), int(c.rollout.max_new_tokens)
    P = int(c.rollout.max_prompt_len)
    L, K = trainer.model_cfg.num_moe_layers, trainer.model_cfg.top_k
    assert isinstance(batch["replay_r3"], jax.Array) and batch["replay_r3"].shape == (rows, P + T - 1, L, K)
    assert isinstance(prepared["replay"], jax.Array)
    assert fetched and max(x.ndim for x in fetched) <= 2
    assert max(x.nbytes for x in fetched) <= rows * T * 4  # the response token ids
    # Two collections and one update phase in all: token ids, lengths, flags and
    # metrics, less than half of one R3 record (4 bytes * 16 * 79 * 2 * 2).
    assert sum(x.nbytes for x in fetched) < rows * (P + T - 1) * L * K * 4 / 2


def test_the_prepare_stage_is_one_program_on_the_devices(
    data_dir, tmp_path, monkeypatch, compile_counts
):
    """Stages 4-6 of a step (the old pass, the advantages, the trust region and the
    diagnostics) are one compiled program, dispatched once per step: the host's rewards
    go to the devices once, sharded over rows, nothing comes back, and a second step
    compiles nothing. RLOO, the estimator no default config uses (the others run in
    every RL test)."""
    import dataclasses

    c = _config(data_dir, advantage="rloo")
    trainer = trainer_lib.RunParts(c, str(tmp_path))
    rl = rl_lib.RLPhase(trainer, trainer.init_params)
    G = int(c.rollout.group_size)
    rewards = np.array([1.0, 0.0, 0.0, 1.0] * (int(c.rollout.prompts_per_step) - 1) + [0.5] * G)
    rewards[:G] = [0.0, 0.25, 0.5, 1.0]
    queued = dataclasses.replace(rl.collect_batch(0, version=0), rewards=rewards)
    fetched = _record_host_fetches(monkeypatch)
    compile_counts.clear()
    out = [rl.prepare(queued, s)[0]["advantages"] for s in range(2)]
    assert fetched == [] and dict(compile_counts) == {"jit(prepare_batch)": 1}
    rows = trainer.put_rows(rewards.astype(np.float32))
    assert out[0].sharding.is_equivalent_to(rows.sharding, 1)
    monkeypatch.undo()
    want = adv_lib.rloo(rewards.reshape(-1, G)).reshape(-1)
    np.testing.assert_allclose(np.asarray(out[0]), want, rtol=1e-6)
    assert (np.asarray(out[0])[-G:] == 0.0).all()  # identical rewards: exactly 0


def test_fit_prompts_refuses_or_truncates():
    prompts = [[1, 2, 3], list(range(10, 20))]
    assert fit_prompts(prompts, 10, "refuse") == (prompts, 0)
    out, cut = fit_prompts(prompts, 4, "truncate")
    assert out == [[1, 2, 3], [16, 17, 18, 19]] and cut == 1  # the last 4 tokens kept
    with pytest.raises(config_lib.ConfigError,
                       match=r"config\.rollout\.max_prompt_len: a prompt of 10 tokens \(number 1 of its batch\)"):
        fit_prompts(prompts, 4, "refuse")


@pytest.mark.parametrize("field, value", [("rollout.max_prompt_len", 0), ("rollout.max_prompt_len", -1),
                                          ("rollout.long_prompts", "drop")])
def test_prompt_length_settings_are_validated(field, value):
    c = default_config.get_config("smoke")
    section, key = field.split(".")
    c[section][key] = value
    with pytest.raises(config_lib.ConfigError, match=f"config.{field}"):
        config_lib.validate(c, jax.device_count())


def test_warm_start_batches_have_one_prompt_length(data_dir, tmp_path):
    c = _config(data_dir, **{"rollout.long_prompts": "truncate"})
    trainer = trainer_lib.RunParts(c, str(tmp_path))
    _vary_prompt_lengths(trainer, lambda pos: [8, 100][pos // 8])
    short, cut0 = sft.sft_batch(trainer, 0)
    long, cut1 = sft.sft_batch(trainer, 8)
    assert short["prompt_tokens"].shape == long["prompt_tokens"].shape == (8, 64)
    assert cut0 == 0 and cut1 == 8 and long["prompt_mask"].all()
