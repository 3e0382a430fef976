"""Off-policy training (docs/offpolicy.md): rollout.staleness, updates.trust_region,
rollout.devices and rollout.overlap.

* the config's constraints between them, each error naming its field;
* the two trust regions against NumPy references, for one objective of each family
  (token clip: GRPO; sequence ratio: GSPO; capped importance weight: CISPO; geometric
  mean of clipped token ratios: GMPO);
* staleness k: step t trains on what the parameters of step t - k sampled (seen through
  the log-probs the sampler recorded), and the first k steps on the warm start's;
* a run stopped mid-queue and resumed equals the uninterrupted run, bit for bit;
* overlap on 4 + 4 of the 8 fake devices gives the serial schedule's metrics, bit for
  bit, while its training and sampling programs are in flight at the same time.
"""

import functools
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspo_jax import config as config_lib
from gspo_jax import objectives, offpolicy, passes
from gspo_jax.objectives.correction import RolloutCorrection
from configs import default as default_config

# Metrics that measure time, not math.
TIMING = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time", "tokens_per_s",
          "collect_time", "train_wait_time"}


def smoke(data_dir, **overrides):
    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    # A signal whatever the rewards (the smoke model answers nothing right): the entropy
    # bonus moves the parameters every update, so each step's policy differs.
    c.entropy_coef = 0.05
    c.updates.update_without_signal = True
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 0
    fields = overrides.pop("model.fields", None)
    c.update_from_flattened_dict(overrides)  # a misspelt key fails the RunParts's validation
    if fields is not None:
        c.model.fields = fields
    return c


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


# --------------------------------------------------------------------------
# The config.


@pytest.mark.parametrize("overrides, field", [
    ({"rollout.overlap": True, "rollout.devices": 4}, "rollout.overlap"),  # staleness 0
    ({"rollout.overlap": True, "rollout.staleness": 1}, "rollout.overlap"),  # no devices of its own
    ({"rollout.devices": 8}, "rollout.devices"),  # none left for training
    ({"rollout.staleness": -1}, "rollout.staleness"),
    ({"updates.trust_region": "proximal"}, "updates.trust_region"),
    ({"updates.trust_region": "behaviour", "rollout_correction.mode": "token_tis"},
     "rollout_correction.mode"),
])
def test_config_errors_name_the_field(overrides, field):
    c = default_config.get_config("smoke")
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=f"config.{field}"):
        config_lib.validate(c, 8)


def test_the_split_gives_the_sampler_the_last_devices_and_its_own_mesh():
    from gspo_jax.models.sharding import make_mesh

    train, sample = offpolicy.split_devices(4)
    assert train == jax.devices()[:4] and sample == jax.devices()[4:]
    mesh = make_mesh({"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}, train)
    sm = offpolicy.sampler_mesh(mesh, sample)
    assert dict(sm.shape) == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}
    assert set(sm.devices.flat) == set(sample)
    with pytest.raises(config_lib.ConfigError, match="config.rollout.devices"):  # not whole copies
        offpolicy.sampler_mesh(mesh, sample[:3])


# --------------------------------------------------------------------------
# The two trust regions against NumPy.


def _batch(seed=0, n=6, t=7):
    rng = np.random.default_rng(seed)
    mask = (rng.random((n, t)) < 0.8).astype(np.float64)
    mask[0] = 0.0  # an empty row
    mask[1, :] = 1.0
    behaviour = -rng.uniform(0.2, 3.0, (n, t))
    proximal = behaviour + rng.normal(0, 0.4, (n, t))  # the sampler's policy, some steps ago
    proximal[2] += 0.5  # a sequence far off-policy: the sequence mask drops it
    logp = proximal + rng.normal(0, 0.2, (n, t))
    adv = rng.normal(0, 1, n)
    return logp, proximal, behaviour, adv, mask


def _np_grpo(logp, old, adv, mask, w, eps=0.2):
    r = np.exp(np.clip(logp - old, -20, 20))
    a = adv[:, None]
    per_token = -np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps) * a)
    n = mask.sum(1)
    n_seq = (n > 0).sum()
    return sum(np.sum(mask[i] * w[i] * per_token[i]) / (n[i] * n_seq) for i in range(len(n)) if n[i] > 0)


def _np_gspo(logp, old, adv, mask, w, eps_low=0.02, eps_high=0.03):
    n = mask.sum(1)
    d = np.where(mask > 0, np.clip(logp - old, -20, 20), 0.0)
    s = np.exp(d.sum(1) / np.maximum(n, 1))
    per_seq = -np.minimum(s * adv, np.clip(s, 1 - eps_low, 1 + eps_high) * adv)
    w_bar = (mask * w).sum(1) / np.maximum(n, 1)
    return np.sum(np.where(n > 0, w_bar * per_seq, 0.0)) / max((n > 0).sum(), 1)


def _np_cispo(logp, old, adv, mask, w, eps_high=0.28):
    capped = np.minimum(np.exp(np.clip(logp - old, -20, 20)), 1 + eps_high)  # sg(clip(r))
    return np.sum(mask * w * -capped * adv[:, None] * logp) / mask.sum()


def _np_gmpo(logp, old, adv, mask, w, eps=0.4):
    n = mask.sum(1)
    d = np.where(mask > 0, np.clip(logp - old, -20, 20), 0.0)
    d = np.where(adv[:, None] >= 0, np.minimum(d, eps), np.maximum(d, -eps))
    g = np.exp((mask * d).sum(1) / np.maximum(n, 1))
    w_bar = (mask * w).sum(1) / np.maximum(n, 1)
    return np.sum(np.where(n > 0, w_bar * -adv * g, 0.0)) / max((n > 0).sum(), 1)


FAMILIES = {
    "grpo": (_np_grpo, dict(kl_coef=0.0)),
    "gspo": (_np_gspo, dict(eps_low=0.02, eps_high=0.03)),
    "cispo": (_np_cispo, {}),
    "gmpo": (_np_gmpo, {}),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("trust_region, rc_mode", [
    ("behaviour", "none"), ("decoupled", "none"), ("decoupled", "token_tis"), ("decoupled", "seq_mask"),
])
def test_trust_regions_match_numpy(name, trust_region, rc_mode):
    """'behaviour': pi_old is the sampler's log-probs and nothing weighs the loss;
    'decoupled': pi_old is the proximal policy's, and the rollout correction weighs the
    loss by pi_proximal / pi_behaviour (truncated at C, or a sequence's geometric ratio
    masked outside [1/c_low, c_high])."""
    ref, hp = FAMILIES[name]
    logp, prox, behav, adv, mask = _batch()
    rc = RolloutCorrection(mode=rc_mode, cap=1.3, c_low=1.2, c_high=1.2)
    with jax.enable_x64(True):
        old, weight, _ = offpolicy.trust_region_inputs(
            trust_region, jnp.asarray(behav), jnp.asarray(prox), jnp.asarray(mask), rc)
        loss, _ = objectives.get(name)(jnp.asarray(logp), old, jnp.asarray(adv), jnp.asarray(mask),
                                       weight=weight, **hp)
        loss = float(loss)
    lam = np.where(mask > 0, prox - behav, 0.0)
    if trust_region == "behaviour":
        expect_old, w = behav, np.ones_like(mask)
    elif rc_mode == "none":
        expect_old, w = prox, np.ones_like(mask)
    elif rc_mode == "token_tis":
        expect_old, w = prox, np.minimum(np.exp(lam), 1.3) * mask
    else:
        geo = lam.sum(1) / np.maximum(mask.sum(1), 1)
        keep = (geo >= -np.log(1.2)) & (geo <= np.log(1.2))
        expect_old, w = prox, keep[:, None] * mask
        assert 0 < keep[mask.sum(1) > 0].sum() < (mask.sum(1) > 0).sum()  # the mask bites
    np.testing.assert_allclose(loss, ref(logp, expect_old, adv, mask, w), rtol=1e-9, atol=1e-12)
    # The other trust region's answer differs: the test can tell them apart.
    other = prox if trust_region == "behaviour" else behav
    assert abs(loss - ref(logp, other, adv, mask, np.ones_like(mask))) > 1e-4


# --------------------------------------------------------------------------
# Staleness in the RL loop.


@pytest.mark.parametrize("k", [0, 2])
def test_step_t_trains_on_what_the_policy_of_step_t_minus_k_sampled(data_dir, tmp_path, k):
    """k = 0 is the on-policy loop: each step trains on what its own parameters sampled."""
    from gspo_jax import passes
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    steps = 4
    c = smoke(data_dir, **{"rollout.staleness": k, "updates.trust_region": "behaviour"})
    trainer = RunParts(c, str(tmp_path))
    rl = RLPhase(trainer, trainer.init_params)
    trained = {}
    prepare = rl.prepare
    rl.prepare = lambda queued, s: (trained.__setitem__(s, queued), prepare(queued, s))[1]
    params = []
    for s in range(steps):
        params.append(jax.tree.map(jnp.copy, rl.state.params))  # the policy of step s
        m, _ = rl.step(s)
        assert m["staleness_mean"] == m["staleness_max"] == min(s, k)

    # One compiled program for the log-prob pass (called eagerly it compiles op by op).
    logprob_pass = jax.jit(functools.partial(passes.logprob_pass, graphdef=trainer.graphdef))

    def logp(p, batch):
        return np.asarray(logprob_pass(p, batch)["logp"])

    for s in range(steps):
        q = trained[s]
        assert q.step == s and q.version == max(s - k, 0)
        np.testing.assert_array_equal(np.asarray(q.device["policy_version"]), max(s - k, 0))
        batch = jax.device_get(q.device)
        m = batch["mask"] > 0
        sampled = batch["rollout_logp"][m]
        by_version = logp(params[max(s - k, 0)], q.device)[m]
        np.testing.assert_allclose(sampled, by_version, atol=2e-4)  # sampler vs trainer numerics
        if s >= 1:  # the parameters of another step differ: the batch is not theirs
            other = params[s] if k else params[s - 1]
            assert np.max(np.abs(logp(other, q.device)[m] - sampled)) > 1e-2


def _records(workdir, name="metrics.jsonl"):
    return [json.loads(line) for line in open(os.path.join(workdir, name))]


def _assert_same_records(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        keys = set(ra) - TIMING
        assert keys == set(rb) - TIMING, set(ra) ^ set(rb)
        for key in keys:
            assert ra[key] == rb[key], (ra.get("phase"), ra.get("step"), key, ra[key], rb[key])


def test_a_run_stopped_mid_queue_resumes_to_the_uninterrupted_run(data_dir, tmp_path, monkeypatch):
    """SIGTERM after RL step 2 of 5 with k = 2: the checkpoint holds batches 2 and 3 (sampled
    by the policies of steps 0 and 1); the resumed run trains on them and equals the
    uninterrupted run in every metric and every update's record."""
    from gspo_jax import rl as rl_lib
    from gspo_jax import train

    c = smoke(data_dir, **{"rollout.staleness": 2, "total_rl_steps": 5, "checkpoint_every": 10})
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train.run(c, full)

    step = rl_lib.RLPhase.step

    def step_then_stop(self, s):
        out = step(self, s)
        if s == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the run saves after this step and stops
        return out

    monkeypatch.setattr(rl_lib.RLPhase, "step", step_then_stop)
    with pytest.raises(SystemExit):
        train.run(c, cut)
    monkeypatch.setattr(rl_lib.RLPhase, "step", step)
    saved = [d for d in os.listdir(os.path.join(cut, "checkpoints", "rl")) if d.isdigit()]
    assert max(map(int, saved)) == 2
    meta = json.load(open(os.path.join(cut, "checkpoints", "rl", "2", "meta", "metadata")))
    assert [(q["step"], q["version"]) for q in meta["queue"]] == [(2, 0), (3, 1)]
    train.run(c, cut)
    _assert_same_records(_records(full), _records(cut))
    _assert_same_records(_records(full, "updates.jsonl"), _records(cut, "updates.jsonl"))

    # rollout.max_prompt_len may change on resume (the remedy for a prompt too long for
    # it): the queued batches, sampled at the old length, are re-padded to the new one.
    longer = c.rollout.max_prompt_len + 16
    c.rollout.max_prompt_len, c.total_rl_steps = longer, 6
    train.run(c, cut)
    assert [r["step"] for r in _records(cut) if r["phase"] == "rl"][-1] == 6
    meta = json.load(open(os.path.join(cut, "checkpoints", "rl", "6", "meta", "metadata")))
    assert meta["config"]["rollout"]["max_prompt_len"] == longer


# --------------------------------------------------------------------------
# The sampler on devices of its own, overlapped with training.


def _timeline(monkeypatch):
    """Record, at each dispatch of a step's updates, whether the last training rollout's
    outputs were ready (the sampler had finished), and at each dispatch of a training
    rollout, whether the last updates' state was ready (training had finished)."""
    from gspo_jax import rl as rl_lib
    from gspo_jax import run_parts as trainer_lib

    events, last = [], {}
    ready = lambda tree: all(x.is_ready() for x in jax.tree.leaves(tree))  # noqa: E731
    updates, rollout = rl_lib.RLPhase.updates, trainer_lib.RunParts.rollout

    def timed_updates(self, batch, rng):
        events.append(("updates", ready(last["sample"]) if "sample" in last else None))
        out = updates(self, batch, rng)
        last["train"] = self.state
        return out

    def timed_rollout(self, params, examples, rng, **kw):
        out = rollout(self, params, examples, rng, **kw)
        if kw.get("router_noise"):  # the training rollouts (evaluation has none)
            events.append(("sample", ready(last["train"]) if "train" in last else None))
            last["sample"] = out[0].tokens
        return out

    monkeypatch.setattr(rl_lib.RLPhase, "updates", timed_updates)
    monkeypatch.setattr(trainer_lib.RunParts, "rollout", timed_rollout)
    return events


def test_overlap_runs_both_sides_at_once_and_changes_no_number(data_dir, tmp_path, monkeypatch):
    """4 + 4 of the 8 fake devices, k = 1: serially each step samples, then trains (the
    sampler's outputs are ready when the updates are dispatched); overlapped, the sampler
    is dispatched while the updates are still running (their state not ready yet). The
    numbers are the same."""
    from gspo_jax import train

    base = {"rollout.staleness": 1, "rollout.devices": 4, "total_rl_steps": 3,
            "updates.num_epochs": 4, "rollout.prompts_per_step": 8}
    runs = {}
    for overlap in (False, True):
        c = smoke(data_dir, **base, **{"rollout.overlap": overlap})
        events = _timeline(monkeypatch)
        workdir = str(tmp_path / f"overlap_{overlap}")
        train.run(c, workdir)
        monkeypatch.undo()
        runs[overlap] = (workdir, events)
    _assert_same_records(_records(runs[False][0]), _records(runs[True][0]))
    _assert_same_records(_records(runs[False][0], "updates.jsonl"), _records(runs[True][0], "updates.jsonl"))

    serial, overlapped = runs[False][1], runs[True][1]
    # batch 0 fills the queue, then each step: sample, updates (serial) or updates, sample.
    assert [e[0] for e in serial] == ["sample"] + ["sample", "updates"] * 3
    assert [e[0] for e in overlapped] == ["sample"] + ["updates", "sample"] * 3
    assert all(ready for side, ready in serial[2::2])  # the sampler had finished
    assert not any(ready for side, ready in overlapped[2::2])  # training was still running
    records = [r for r in _records(runs[True][0]) if r["phase"] == "rl" and r["step"] > 0]
    assert all(r["collect_time"] >= 0 and r["train_wait_time"] >= 0 for r in records)


@pytest.mark.parametrize("replay", ["none", "R2", "R3"])
def test_what_each_trust_region_replays_and_compares_against(data_dir, tmp_path, replay):
    """Under 'behaviour' pi_old is the sampler's log-probs and its routing references are
    the sampler's (the experts it used, its router's log-probs there: RSPO's router shift);
    the old pass runs only for R2, whose replay is that pass's routing (pi_proximal's). R3
    replays the sampler's routing under both trust regions. Under 'decoupled' every
    reference is the old pass's."""
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    got = {}
    for region in ("decoupled", "behaviour"):
        # Padded rows: the old pass run on its own then computes bit for bit what it
        # computes inside the prepare program (packed, XLA fuses its gathers differently
        # in the two programs: the last bit of a log-prob moves; tests/test_packing.py).
        c = smoke(data_dir, **{"updates.trust_region": region, "updates.routing_replay": replay,
                               "rollout.staleness": 1, "updates.packing": False})
        c.objective.name, c.objective.hparams_of = "rspo", "rspo"
        c.objective.hparams = dict(objectives.get("rspo").defaults)
        trainer = RunParts(c, str(tmp_path / region))
        rl = RLPhase(trainer, trainer.init_params)
        calls = []  # the log-prob passes the prepare program traces (no KL term: pi_old's)
        logprob_pass = passes.logprob_pass
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(passes, "logprob_pass", lambda *a, **k: calls.append(k) or logprob_pass(*a, **k))
            queued = rl.collect_batch(0, version=0)
            batch, _ = rl.prepare(queued, 1)
        dev, old = jax.device_get(queued.device), None
        if calls:  # pi_old's pass as the prepare program runs it, on its own
            old_pass = jax.jit(functools.partial(logprob_pass, **calls[0]))
            old = jax.device_get(old_pass(rl.state.params, queued.device))
        got[region] = (jax.device_get(batch), dev, old, len(calls))
        rl.updates(batch, jax.random.key(0))  # every objective input is there and well-formed

    batch, dev, old, calls = got["behaviour"]
    assert calls == (1 if replay == "R2" else 0)
    np.testing.assert_array_equal(batch["old_logp"], dev["rollout_logp"])
    np.testing.assert_array_equal(batch["old_topk"], dev["sampler_topk"])
    np.testing.assert_array_equal(batch["old_free_topk"], dev["sampler_topk"])
    np.testing.assert_array_equal(batch["old_router_logp"], dev["sampler_router_logp"])
    if replay == "R2":
        np.testing.assert_array_equal(batch["replay"], old["topk"])
    batch, dev, old, calls = got["decoupled"]
    assert calls == 1
    np.testing.assert_array_equal(batch["old_logp"], old["logp"])
    np.testing.assert_array_equal(batch["old_router_logp"], old["router_logp"])
    np.testing.assert_array_equal(batch["old_topk"], old["topk_resp"])
    if replay == "R2":
        np.testing.assert_array_equal(batch["replay"], old["topk"])
    for region in ("decoupled", "behaviour"):
        if replay == "R3":
            np.testing.assert_array_equal(got[region][0]["replay"], got[region][1]["replay_r3"])
        if replay == "none":
            assert "replay" not in got[region][0]


@pytest.mark.parametrize("replay, experts", [("none", 0), ("none", 4), ("R3", 4)])
def test_the_checkpointed_queue_has_the_shapes_of_a_collected_batch(data_dir, tmp_path, replay, experts):
    """The restore target of a queued batch (no routing record, the response's, R3's whole
    sequence) is what `collect_batch` makes: the same arrays, shapes, dtypes and sharding."""
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    c = smoke(data_dir, **{"rollout.staleness": 1, "updates.routing_replay": replay,
                           "model.fields": dict(default_config.get_config("smoke").model.fields,
                                                num_experts=experts, top_k=2 if experts else 0)})
    trainer = RunParts(c, str(tmp_path))
    rl = RLPhase(trainer, trainer.init_params)
    queued = rl.collect_batch(0, version=0)
    from gspo_jax.rl import CHECKPOINT_LAYOUT

    template = rl.checkpoint_target()({"layout": CHECKPOINT_LAYOUT})["queue"][0]
    assert sorted(template) == sorted(queued.device)
    for key, spec in template.items():
        x = queued.device[key]
        assert (x.shape, x.dtype) == (spec.shape, spec.dtype), key
        assert x.sharding.is_equivalent_to(spec.sharding, x.ndim), key

    # A checkpoint saved with another rollout.max_prompt_len restores at that length
    # (its record says which), and `fit_queue` re-pads it as a batch sampled now.
    width, pad_id = c.rollout.max_prompt_len, trainer.tokenizer.pad_id
    saved = {"layout": CHECKPOINT_LAYOUT, "config": {"rollout": {"max_prompt_len": width + 5}}}
    assert rl.checkpoint_target()(saved)["queue"][0]["prompt_tokens"].shape[1] == width + 5
    grown = offpolicy.fit_queue(queued.device, width + 5, pad_id)
    got, want = jax.device_get(grown), jax.device_get(queued.device)
    for key, x in got.items():
        if key in offpolicy.PROMPT_AXIS:  # five pad columns on the left, the rest as sampled
            assert x.shape[1] == want[key].shape[1] + 5, key
            np.testing.assert_array_equal(x[:, 5:], want[key])
            np.testing.assert_array_equal(x[:, :5], offpolicy.PROMPT_PAD.get(key, pad_id))
        else:
            np.testing.assert_array_equal(x, want[key])
        assert grown[key].sharding.is_equivalent_to(queued.device[key].sharding, x.ndim), key
    back = jax.device_get(offpolicy.fit_queue(grown, width, pad_id))
    for key in want:
        np.testing.assert_array_equal(back[key], want[key])
    longest = int(want["prompt_mask"].sum(1).max())
    with pytest.raises(config_lib.ConfigError, match=rf"config\.rollout\.max_prompt_len={longest - 1}: "
                       rf".*prompts of up to {longest} tokens"):
        offpolicy.fit_queue(queued.device, longest - 1, pad_id)


def test_one_checkpoint_layout_and_the_one_before_it_restore(data_dir, tmp_path):
    """An RL checkpoint is {"train", "queue"} whatever the features (an empty queue at
    staleness 0), built and read by gspo_jax.rl alone, for a resume and for the
    evaluation; a checkpoint written before (the bare state at staleness 0, a record
    without "layout") still restores, in both."""
    from gspo_jax import evaluate, safety
    from gspo_jax.checkpoint import PhaseCheckpointer
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    c = smoke(data_dir)
    trainer = RunParts(c, str(tmp_path))
    rl = RLPhase(trainer, trainer.init_params)
    rl.state = rl.state.replace(params=jax.tree.map(lambda x: x + 1, rl.state.params))
    want = jax.device_get(rl.state.params)
    tree, meta = rl.checkpoint_items()
    assert sorted(tree) == ["queue", "train"] and tree["queue"] == []
    assert meta == {"layout": 2, "queue": []}
    record = {"phase": "rl", "config": safety.config_record(c)}
    with PhaseCheckpointer(str(tmp_path), "rl", every=1, keep=5) as ckpt:
        ckpt.save(1, tree, {**record, "step": 1, **meta}, force=True)
        ckpt.save(2, rl.state, {**record, "step": 2}, force=True)  # the layout before
    for step in (2, 1):
        rl = RLPhase(trainer, trainer.init_params)
        with PhaseCheckpointer(str(tmp_path), "rl", every=1, keep=5) as ckpt:
            rl.load_checkpoint(*ckpt.restore(rl.checkpoint_target(), step)[:2])
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(rl.state.params), want)
        assert not rl.queue
    params, restored = evaluate.restore_params(trainer)  # the newest: the layout before
    assert restored == "rl/2"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), want)


def test_the_seeded_report_applies_the_rule_written_before_the_runs(tmp_path):
    """experiments/offpolicy/report.py: paired differences by seed, and each verdict."""
    from experiments.offpolicy import report

    def write(workdir, reward):
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"phase": "rl", "step": 0, "eval_reward_mean": 0.2}) + "\n")
            f.write(json.dumps({"phase": "rl", "step": 60, "eval_reward_mean": reward}) + "\n")

    root, seeds, tis = (str(tmp_path / d) for d in ("one", "seeds", "tis"))
    fresh = {0: 0.40, 1: 0.42, 2: 0.38}
    stale = {"behaviour": {0: 0.30, 1: 0.35, 2: 0.37},  # all below, mean -0.06: degrades
             "decoupled": {0: 0.41, 1: 0.38, 2: 0.37}}  # mean -0.013, one below -0.02: holds
    for s in (0, 1, 2):
        for region in ("decoupled", "behaviour"):
            base = root if s == 0 else seeds
            prefix = "" if s == 0 else f"seed={s}__"
            write(os.path.join(base, prefix + report.point(0, region)), fresh[s])
            write(os.path.join(base, prefix + report.point(4, region)), stale[region][s])
        write(os.path.join(tis, f"seed={s}__mode=token_tis"), {0: 0.36, 1: 0.30, 2: 0.40}[s])  # mixed signs
    verdicts, table = report.seeded(root, seeds, tis)
    assert verdicts["behaviour"]["verdict"] == "degrades"
    assert verdicts["decoupled"]["verdict"] == "holds"
    assert verdicts["decoupled + token_tis"]["verdict"] == "not resolved at this scale"
    np.testing.assert_allclose(verdicts["behaviour"]["d"], [-0.10, -0.07, -0.01])
    assert table.count("\n") == 5
