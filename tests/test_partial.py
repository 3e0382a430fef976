"""Tests of partial rollouts (gspo_jax.partial, rollout.partial_budget).

* a response decoded over three steps by two different policies: each token's log-prob
  and routing record are those of the policy of its own version (the model's
  teacher-forced forward under those parameters), its version is recorded, and the
  prompt's routing record is the first step's;
* a run with partial rollouts carries unfinished groups from step to step and trains on
  the finished ones, with each token's staleness; stopped mid-way and resumed, it equals
  the uninterrupted run in every metric (the carried responses are in the checkpoint);
* the settings it is not combined with are refused, naming the field.
"""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_offpolicy import TIMING, smoke
from test_rollout import _teacher_forced

from gspo_jax import config as config_lib
from gspo_jax import decode, partial, rollout
from gspo_jax.models import ModelConfig, Transformer

T, P, BUDGET = 12, 12, 5
PROMPTS = [[5, 6, 7], list(range(8, 18)), [20, 21, 22, 23, 24, 25], [30] * 12]
G = 4
STOP = [5, 6, 7, 9, 11]


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(num_layers=3, init_std=0.3), rngs=nnx.Rngs(0))


def _prompts():
    toks = np.zeros((len(PROMPTS), P), np.int32)
    mask = np.zeros(toks.shape, bool)
    for i, p in enumerate(PROMPTS):
        toks[i, P - len(p) :], mask[i, P - len(p) :] = p, True
    return toks, mask


def test_each_token_is_drawn_and_recorded_by_its_own_version(model):
    graphdef, a = nnx.split(model)
    leaves, tree = jax.tree.flatten(a)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    b = jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    versions = [a, b, a]  # the policies of steps 0, 1, 2
    n, mc = len(PROMPTS) * G, model.cfg
    route = (mc.num_moe_layers, mc.top_k)
    pool = {
        "tokens": jnp.zeros((n, T), jnp.int32),
        "logp": jnp.zeros((n, T)),
        "version": jnp.zeros((n, T), jnp.int32),
        "experts": jnp.zeros((n, T) + route, jnp.int32),
        "router_logp": jnp.zeros((n, T) + route),
        "prompt_experts": jnp.zeros((n, P) + route, jnp.int32),
    }
    toks, pmask = _prompts()
    lengths, stopped = np.zeros(n, np.int32), np.zeros(n, bool)
    spec = partial.spec_for(BUDGET, G, 0, None, False, "all")
    live_counts = []
    for step, params in enumerate(versions):
        live = ~(stopped | (lengths >= T))
        live_counts.append(int(live.sum()))
        k = np.where(live, lengths, 0).astype(np.int32)
        new = decode.generate_jit(
            graphdef,
            params,
            jax.random.key(10 + step),
            toks,
            pmask,
            np.arange(len(PROMPTS), dtype=np.int32),
            live,
            jnp.asarray(STOP, jnp.int32),
            jnp.float32(1.0),
            jnp.float32(0.0),
            spec=spec,
            prefix=pool["tokens"],
            prefix_len=k,
        )
        pool, length, stop = partial.merge_jit(pool, new, k, live, np.int32(step), pad_id=0)
        lengths = np.where(live, np.asarray(length), lengths)
        stopped = np.where(live, np.asarray(stop), stopped)
    # Some rows ended in the first step, some went on through all three.
    assert live_counts[0] == n > live_counts[1] >= live_counts[2] > 0
    assert (stopped | (lengths == T)).all() and stopped.any() and (lengths == T).any()

    tokens, version = np.asarray(pool["tokens"]), np.asarray(pool["version"])
    mask = np.arange(T)[None, :] < lengths[:, None]
    # A row's version runs 0, 1, 2 over its tokens, BUDGET each, until it ends.
    expect = np.minimum(np.arange(T) // BUDGET, 2)[None, :].repeat(n, 0)
    np.testing.assert_array_equal(version, np.where(mask, expect, -1))
    # Its tokens end at its first stop token, or at T; padding after.
    for r in range(n):
        hit = np.flatnonzero(np.isin(tokens[r, : lengths[r]], STOP))
        assert (hit.size and hit[0] == lengths[r] - 1 and stopped[r]) or (
            not hit.size and lengths[r] == T and not stopped[r]
        ), (r, tokens[r], lengths[r])
    assert (tokens[~mask] == 0).all() and (np.asarray(pool["logp"])[~mask] == 0).all()

    record = rollout.Rollout(
        tokens=pool["tokens"],
        mask=jnp.asarray(mask, jnp.float32),
        lengths=lengths,
        truncated=~stopped,
        logp=pool["logp"],
        experts=pool["experts"],
        router_logp=pool["router_logp"],
        prompt_tokens=np.repeat(toks, G, 0),
        prompt_mask=np.repeat(pmask, G, 0),
        prompt_experts=pool["prompt_experts"],
    )
    logp, experts = np.asarray(pool["logp"]), np.asarray(pool["experts"])
    forced = {}
    for name, params in (("a", a), ("b", b)):
        sampler = rollout.Sampler(graphdef, params, vocab_size=mc.vocab_size)
        lp_all, topk, ptopk = _teacher_forced(sampler, record)
        lp = np.take_along_axis(lp_all, tokens[..., None], -1)[..., 0]
        forced[name] = (lp, topk, ptopk)
    for v, name in ((0, "a"), (1, "b"), (2, "a")):
        lp, topk, _ = forced[name]
        at = mask & (version == v)
        assert at.sum() > 10
        np.testing.assert_allclose(logp[at], lp[at], atol=1e-5, err_msg=f"version {v}")
        np.testing.assert_array_equal(experts[at], topk[at])
        other = forced["b" if name == "a" else "a"][0]
        assert np.abs(logp[at] - other[at]).max() > 1e-2  # the other policy's would differ
    # The prompt's routing is step 0's (policy a), -1 on its padding.
    np.testing.assert_array_equal(
        np.asarray(pool["prompt_experts"]), np.where(np.repeat(pmask, G, 0)[..., None, None], forced["a"][2], -1)
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout.partial_budget": 16},  # not below max_new_tokens (16 in the smoke config)
        {"rollout.partial_budget": 4, "dapo.dynamic_sampling": True},
        {"rollout.partial_budget": 4, "rollout.decode_slots": 8},
    ],
)
def test_settings_it_is_not_combined_with_are_refused(overrides):
    from configs import default as default_config

    c = default_config.get_config("smoke")
    c.update_from_flattened_dict(overrides)
    with pytest.raises(config_lib.ConfigError, match="rollout.partial_budget"):
        config_lib.load(c, 1)


def _records(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def test_a_run_carries_groups_and_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    """Responses end at a frequent character too (a digit or an operator), so that groups end at different
    steps: some steps train on groups begun steps before, beside fresh ones carried on.
    SIGTERM after step 2 of 5: the checkpoint holds the carried responses, and the resumed
    run equals the uninterrupted one in every metric."""
    from gspo_jax import rl as rl_lib
    from gspo_jax import train
    from gspo_jax.tokenizers import CharTokenizer

    init = CharTokenizer.__init__

    def stop_at_digits(self, *a, **kw):
        init(self, *a, **kw)
        self.stop_ids = (self.eos_id, *self.encode("0123456789+-*()="))

    monkeypatch.setattr(CharTokenizer, "__init__", stop_at_digits)
    c = smoke(
        str(tmp_path / "tfds"),
        **{
            "rollout.partial_budget": 4,
            "total_rl_steps": 5,
            "checkpoint_every": 10,
            "updates.routing_replay": "R3",
        },
    )
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train.run(c, full)
    rl = [r for r in _records(full) if r.get("phase") == "rl" and "partial_groups_done" in r]
    assert len(rl) == 5
    groups = c.rollout.prompts_per_step
    assert all(r["partial_groups_done"] + r["partial_groups_carried"] == groups for r in rl)
    assert sum(r["partial_groups_done"] for r in rl) >= groups  # some trained
    # A step that trains on some groups and carries others, and one whose tokens were
    # drawn by more than one policy (staleness counted per token).
    assert any(0 < r["partial_groups_done"] < groups for r in rl)
    assert any(r["staleness_max"] >= 1 and 0 < r["staleness_mean"] < r["staleness_max"] for r in rl)

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
    meta = json.load(open(os.path.join(cut, "checkpoints", "rl", "2", "meta", "metadata")))
    assert meta["partial"]["next_pos"] >= groups and any(
        p >= 0 for p in meta["partial"]["positions"]
    )  # groups carried over the stop
    train.run(c, cut)
    a, b = _records(full), _records(cut)
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert set(ra) - TIMING == set(rb) - TIMING
        for key in set(ra) - TIMING:
            assert ra[key] == rb[key], (ra.get("step"), key, ra[key], rb[key])
