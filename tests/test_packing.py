"""Packed passes (gspo_jax.packing): the plan's rule, and the packed log-prob pass and
train step equal to the padded ones, for every objective and loss normalisation, under
routing replay (R2, R3), LoRA, the critic and the rollout correction."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gspo_jax import objectives, packing, passes, step
from gspo_jax.metrics import compute_all
from gspo_jax.models import ModelConfig, Transformer, lora

CFG = ModelConfig(vocab_size=24, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  moe_d_ff=16, num_experts=4, top_k=2, value_head=True)
N, P, T = 8, 5, 6
S = P + T - 1
# Buffer rows of 2S slots, two per micro-batch: room for two micro-batches (every
# sequence as long as S, two to a buffer row), several sequences sharing a buffer row.
PACK = packing.Packing.for_batch(N, rows=2, length=2 * S, seq=S)


def _valid(seed, n=N, s=S):
    """A random [n, s] validity mask of contiguous runs (as a left-padded prompt and a
    right-padded response make), lengths 1..s."""
    rs = np.random.RandomState(seed)
    valid = np.zeros((n, s), bool)
    for i in range(n):
        length = rs.randint(1, s + 1)
        start = rs.randint(0, s - length + 1)
        valid[i, start:start + length] = True
    return valid


_plan = jax.jit(packing.plan, static_argnums=1)

# The padded old-policy pass as one program (called eagerly it compiles every primitive
# on its own); only for speed.
_logprob = jax.jit(passes.logprob_pass, static_argnames=("graphdef", "values"))


@pytest.mark.parametrize("seed, length", [(0, 0), (1, 0), (2, 25), (3, 40)])
def test_plan_places_every_real_token_once(seed, length):
    """Every valid position goes to one slot of one used micro-batch, in order within its
    sequence; slots hold one sequence's tokens contiguously, as its segment; nothing else
    is filled; the deal balances the micro-batches and the shards within them. Buffer
    rows of S slots (length 0) or longer."""
    n, s = 24, 10
    valid = _valid(seed, n, s)
    pk = packing.Packing.for_batch(n, rows=4, shards=2, length=length)
    p = jax.device_get(_plan(valid, pk))
    assert 1 <= p.used <= pk.micro and np.all(p.micro < p.used)
    seen = np.zeros((pk.micro, pk.rows, length or s), int)
    for i in range(n):
        cols = p.slot_col[i][valid[i]]
        np.testing.assert_array_equal(cols, cols[0] + np.arange(valid[i].sum()))  # contiguous, in order
        j, b = p.micro[i], p.slot_row[i, 0]
        seen[j, b, cols] += 1
        np.testing.assert_array_equal(p.segment[j, b, cols], i + 1)
        np.testing.assert_array_equal(p.src_row[j, b, cols], i)
        np.testing.assert_array_equal(p.src_pos[j, b, cols], np.flatnonzero(valid[i]))
    assert seen.max() == 1 and seen.sum() == valid.sum()
    np.testing.assert_array_equal(p.segment > 0, seen == 1)
    tokens = (p.segment > 0).sum(axis=(1, 2))  # per micro-batch
    assert tokens.sum() == valid.sum() and np.all(tokens[p.used:] == 0)
    # Fewest micro-batches the buffer rows allow, and balanced: each micro-batch and
    # each shard of one within one sequence's length of the others.
    bins = int(np.sum(np.any(p.segment > 0, axis=2)))
    assert p.used == -(-bins // pk.rows)
    per_shard = (p.segment > 0).reshape(pk.micro, pk.shards, -1).sum(-1)[: p.used]
    assert per_shard.max() - per_shard.min() <= (length or s), per_shard


def test_plan_is_deterministic_and_needs_room():
    """The same mask gives the same plan; a shape with no room for the worst case (every
    sequence a buffer row of its own) is refused, naming the sizes."""
    valid = _valid(0)
    a, b = _plan(valid, PACK), _plan(jnp.asarray(valid), PACK)
    chex.assert_trees_all_equal(a, b)
    with pytest.raises(ValueError, match="3 micro-batches of 2 buffer rows of 10 slots cannot hold 8"):
        packing.plan(valid, packing.Packing(rows=2, micro=3))
    with pytest.raises(ValueError, match="rows a multiple of shards"):
        packing.Packing(rows=3, micro=4, shards=2)
    with pytest.raises(ValueError, match="buffer rows of 9 slots cannot hold a sequence of 10"):
        packing.plan(valid, packing.Packing(rows=2, micro=4, length=9))


def test_packed_attention_is_blind_across_sequences():
    """Two sequences in one buffer row, positions restarting at the second: each token's
    log-prob equals that of its sequence run alone (RoPE and the causal mask per
    segment). Shifting the first sequence's tokens leaves the second's unchanged."""
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))

    @jax.jit  # one program per shape, not one per primitive (only for speed)
    def model(tokens, positions=None, attn_mask=None):
        return nnx.merge(graphdef, params)(tokens, positions=positions, attn_mask=attn_mask)

    rs = np.random.RandomState(1)
    a, b = rs.randint(3, 24, 5), rs.randint(3, 24, 7)
    row = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(7)])[None], jnp.int32)
    seg = jnp.asarray(np.array([1] * 5 + [2] * 7)[None], jnp.int32)
    logits, _ = model(row, positions=pos, attn_mask=seg)
    alone_a, _ = model(jnp.asarray(a[None], jnp.int32))
    alone_b, _ = model(jnp.asarray(b[None], jnp.int32))
    np.testing.assert_allclose(logits[0, :5], alone_a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:], alone_b[0], rtol=1e-5, atol=1e-5)
    other = row.at[0, :5].set((row[0, :5] + 1) % 24)
    shifted, _ = model(other, positions=pos, attn_mask=seg)
    np.testing.assert_allclose(shifted[0, 5:], logits[0, 5:], rtol=1e-6, atol=1e-6)
    assert not np.allclose(shifted[0, :5], logits[0, :5])


def _batch(graphdef, params, seed=0):
    """N rows of left-padded prompts (1..P real tokens) and right-padded responses
    (0..T real tokens, one of each extreme), with pi_old's records, advantages, a
    reference and the critic's targets."""
    rs = np.random.RandomState(seed)
    prompt_len = rs.randint(1, P + 1, N)
    resp_len = rs.randint(0, T + 1, N)
    resp_len[0], resp_len[1], prompt_len[2] = T, 0, P
    prompt_mask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.float32)
    mask = (np.arange(T)[None] < resp_len[:, None]).astype(np.float32)
    batch = {
        "prompt_tokens": jnp.asarray(rs.randint(3, 24, (N, P)), jnp.int32),
        "prompt_mask": jnp.asarray(prompt_mask),
        "tokens": jnp.asarray(rs.randint(3, 24, (N, T)), jnp.int32),
        "mask": jnp.asarray(mask),
    }
    old = _logprob(params, batch, graphdef=graphdef, values=True)
    batch.update(
        old_logp=old["logp"] + jnp.asarray(rs.normal(0, 0.05, (N, T)), jnp.float32),
        old_topk=old["topk_resp"],
        old_free_topk=old["free_topk_resp"],
        old_router_logp=old["router_logp"],
        sampler_topk=old["free_topk_resp"],
        ref_logp=old["logp"] - 0.1,
        advantages=jnp.asarray(rs.normal(size=N), jnp.float32),
        old_values=old["values"],
        returns=old["values"] + jnp.asarray(rs.normal(0, 0.5, (N, T)), jnp.float32),
        rc_weight=jnp.asarray(rs.uniform(0.5, 1.5, (N, T)), jnp.float32),
    )
    return batch, old


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    batch, old = _batch(graphdef, params)
    return graphdef, params, batch, old


def test_packed_logprob_pass_equals_padded(setup):
    """The old pass packed gives every output the padded pass gives, at every real
    position (the response's log-probs, entropies, values, routing records), in one
    micro-batch or several."""
    graphdef, params, batch, old = setup
    valid = np.asarray(passes.sequence_inputs(batch)[3]) > 0
    resp = np.asarray(batch["mask"]) > 0
    for shape in (PACK, packing.Packing.for_batch(N, rows=2), packing.Packing.for_batch(N, rows=N)):
        got = jax.jit(functools.partial(passes.logprob_pass, graphdef=graphdef, values=True,
                                        packing_shape=shape))(params, batch)
        assert set(got) == set(old)
        for key in ("logp", "entropy", "values", "router_logp"):
            np.testing.assert_allclose(np.asarray(got[key])[resp], np.asarray(old[key])[resp],
                                       rtol=1e-5, atol=1e-5, err_msg=key)
        for key, where in (("topk", valid), ("topk_resp", resp), ("free_topk_resp", resp)):
            np.testing.assert_array_equal(np.asarray(got[key])[where], np.asarray(old[key])[where], err_msg=key)


_OPT = optax.sgd(1e-2)  # linear in the gradient: equal parameters are equal gradients


@functools.lru_cache(maxsize=None)
def _step_fn(graphdef, cfg):
    """The jitted step of one setting, built once (R2 and R3 run the same program)."""
    return jax.jit(functools.partial(step.train_step, graphdef=graphdef, optimizer=_OPT,
                                     schedule=optax.constant_schedule(1e-2), cfg=cfg))


def _step(setup, cfg, batch=None, params=None):
    graphdef, base_params, base_batch, _ = setup
    params = base_params if params is None else params
    state = step.TrainState.create(params, _OPT.init(params))
    fn = _step_fn(graphdef, cfg)
    state, m = fn(state, base_batch if batch is None else batch, jax.random.key(0))
    return state, compute_all(m)


def _assert_same(setup, cfg, batch=None, params=None, *, micro=1):
    """One update padded (``micro`` micro-batches) and packed: the same loss, gradient,
    parameters and metrics (but for the positions computed, which is the point)."""
    s1, m1 = _step(setup, dataclasses.replace(cfg, micro_batches=micro), batch, params)
    s2, m2 = _step(setup, dataclasses.replace(cfg, packing=PACK), batch, params)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
    assert set(m1) == set(m2)
    for key in sorted(set(m1) - {"computed_tokens", "real_token_share", "aux_loss", "replay_mismatch",
                                  "replay_mismatch_layer"}):
        np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert m2["computed_tokens"] <= m1["computed_tokens"] == N * S
    assert m2["real_token_share"] >= m1["real_token_share"]
    return m1, m2, s1


def _grid():
    """Each objective in two settings of the three switches a packed step must be exact
    under (LoRA, routing replay, staleness), the second the complement of the first, so
    that every objective meets each switch on and off; the first settings run through
    the eight combinations in turn, so that all eight (and every pair of switches) occur."""
    cells = []
    for i, name in enumerate(objectives.names()):
        for bits in (i % 8, 7 - i % 8):
            lora_on, replay, stale = bool(bits & 4), bool(bits & 2), bool(bits & 1)
            cells.append(pytest.param(
                name, lora_on, replay, stale,
                id=f"{name}-{'lora' if lora_on else 'full'}-{'R2R3' if replay else 'noreplay'}-"
                   f"staleness{2 if stale else 0}"))
    return cells


@pytest.fixture(scope="module")
def lora_setup(setup):
    """The setup's model with adapters on every target (zero at the start, so pi_old's
    records are the base model's)."""
    graphdef, params, batch, old = setup
    model = nnx.merge(graphdef, params)
    lora.add_adapters(model, lora.LoRASpec(2, 4.0, tuple(lora.TARGETS)), jax.random.key(3))
    lora_graphdef, lora_params = nnx.split(model)
    return lora_graphdef, lora_params, batch, old


def test_the_grid_covers_every_switch_with_every_objective():
    cells = [p.values for p in _grid()]
    assert {c[0] for c in cells} == set(objectives.names())
    for k in (1, 2, 3):  # each objective with each switch on and off
        assert {(c[0], c[k]) for c in cells} == {(n, v) for n in objectives.names() for v in (False, True)}
    assert len({c[1:] for c in cells}) == 8


@pytest.mark.parametrize("objective, use_lora, replay, stale", _grid())
def test_packed_step_equals_padded(setup, lora_setup, objective, use_lora, replay, stale):
    """Every registered objective at its defaults, with the router z-loss (and, for PPO,
    the critic's clipped value loss): packed equals padded, the loss, the parameters and
    every metric. The switches, as the step sees them:

    * LoRA: adapters trained, the base frozen (``trainable='lora'``).
    * Routing replay: R2 (the old pass's experts) and R3 (other experts, as a sampler's
      record is), the experts moving with their tokens; one program serves both.
    * Staleness 0 is a rollout's first update (pi_old is the policy: ratio 1, no
      rollout correction); staleness 2 a later one on samples two versions old (pi_old
      apart from the policy, the rollout correction's weights on every token).

    And each objective trains: a finite loss and gradient, parameters moved, none
    skipped, and the objective's own metrics out of the step.
    """
    graphdef, params, batch, old = lora_setup if use_lora else setup
    settings = dict(z_loss_coef=0.01)
    if objective == "ppo":
        settings["value_coef"] = 0.5
    if use_lora:
        settings["trainable"] = "lora"
    cfg = step.step_config(objective, **settings)
    if not stale:
        batch = {k: v for k, v in batch.items() if k != "rc_weight"} | {"old_logp": old["logp"]}
    records = {"R2": old["topk"], "R3": (old["topk"] + 1) % CFG.num_experts} if replay else {"none": None}
    for mode, record in records.items():
        m1, m2, s1 = _assert_same((graphdef, params, None, None), cfg,
                                  batch if record is None else dict(batch, replay=record))
        if record is not None:
            assert (m1["replay_mismatch"] > 0) == (mode == "R3"), mode
        # pi_old is the policy (to the passes' rounding), or 0.05 nats a token apart
        assert m1["kl_k3"] > 1e-4 if stale else m1["kl_k3"] < 1e-5
    assert np.isfinite(m1["loss"]) and m1["grad_norm"] > 0 and m1["update_norm"] > 0
    assert int(s1.skipped) == 0
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(params))]
    assert any(moved)
    expected = {"ppo_kl", "logratio_std", "frac_ratio_gt_2"}
    expected |= {"value_loss"} if objective == "ppo" else set()
    expected |= {"gamma_mean"} if objective == "rspo" else set()
    expected |= {"sapo_gate_mean"} if objective == "sapo" else set()
    expected |= {"is_weight_mean"} if objective == "cispo" else set()
    assert expected <= set(m1), expected - set(m1)


def test_packed_step_equals_padded_under_every_normalisation(setup):
    """Every loss normalisation: three are objectives' defaults (token-mean: PPO, DAPO,
    CISPO; seq-mean-token-mean: GRPO, GSPO-token, SAPO; Dr.GRPO's constant,
    seq-mean-token-sum-norm), checked above; the fourth here, GRPO with
    seq-mean-token-sum, against the padded step in two micro-batches."""
    defaults = {objectives.get(n).defaults.get("agg") for n in objectives.names()}
    assert set(objectives.AGG_MODES) - defaults == {"seq-mean-token-sum"}
    _assert_same(setup, step.step_config("grpo", {"agg": "seq-mean-token-sum"}), micro=2)


def test_shapes_of_a_token_budget():
    """A run's token budget makes micro-batches of budget // L buffer rows (the worst
    case's count of them), or budget // S padded rows in the padded twin; without one,
    the row counts' micro-batches. Buffer rows shorter than S, and a budget whose padded
    micro-batches do not divide the mini-batch, are refused, naming the field."""
    from configs import default as default_config
    from gspo_jax import config as config_lib

    c = default_config.get_config()  # 256-row mini-batches of 87-token rows
    c.updates.micro_batch_tokens, c.updates.pack_length = 32 * 87, 0
    run = config_lib.load(c, 1)
    sh = packing.shapes(run.updates, run, 1)
    assert sh.train == packing.Packing(rows=32, micro=8) and sh.logprob == packing.Packing(rows=32, micro=16)
    longer = dataclasses.replace(run.updates, pack_length=4 * 87)
    assert packing.shapes(longer, run, 1).train == packing.Packing(rows=8, micro=8, length=4 * 87)
    padded = dataclasses.replace(longer, packing=False)  # the twin: 32 padded rows
    assert packing.shapes(padded, run, 1) == packing.Shapes(None, None, 8, 16)
    assert packing.shapes(dataclasses.replace(padded, micro_batch_tokens=0), run, 1) == packing.Shapes(None, None, 1, 1)
    with pytest.raises(config_lib.ConfigError, match="^config.updates.micro_batch_tokens: .*do not divide"):
        packing.shapes(dataclasses.replace(padded, micro_batch_tokens=24 * 87), run, 1)
    with pytest.raises(config_lib.ConfigError, match="^config.updates.pack_length: 80 is shorter"):
        packing.shapes(dataclasses.replace(longer, pack_length=80), run, 1)
    with pytest.raises(config_lib.ConfigError, match="^config.updates.micro_batch_tokens: 300 is smaller than one buffer row"):
        packing.shapes(dataclasses.replace(longer, micro_batch_tokens=300), run, 1)


@pytest.mark.parametrize("staleness", [0, 2])
def test_packed_run_equals_its_padded_twin(tmp_path, staleness):
    """Whole smoke runs with R3 replay under a token budget of 8 rows per micro-batch
    (16-row mini-batches on the 8 fake devices), on-policy and at staleness 2 (the
    decoupled trust region, the rollout correction): every reward and length equal, every
    loss and metric equal to float rounding, packed with the sampler's 32 rows in 16
    refilled slots (`gspo_jax.refill`) or as the padded twin sampling them all at once."""
    from configs import default as default_config
    from gspo_jax import train

    def run(packed):
        c = default_config.get_config("smoke")
        c.task.data_dir = str(tmp_path / "data")
        c.rollout.prompts_per_step, c.rollout.group_size = 8, 4
        c.rollout.staleness = staleness
        c.rollout_correction.mode = "token_tis" if staleness else "none"
        c.updates.routing_replay = "R3"
        c.updates.micro_batch_tokens = 8 * (c.rollout.max_prompt_len + c.rollout.max_new_tokens - 1)
        c.updates.packing = packed
        c.rollout.decode_slots = 16 if packed else 0  # and the sampler's refilled slots
        c.sft.steps = 1
        return [r for r in train.run(c, str(tmp_path / f"packed{packed}")) if r["phase"] == "rl"]

    packed, padded = run(True), run(False)
    assert len(packed) == len(padded) == 3
    timing = {"step_time", "rollout_time", "old_logp_time", "update_time", "sample_time", "tokens_per_s",
              "score_time"}
    layout = {"computed_tokens", "real_token_share", "logprob_computed_tokens", "logprob_real_token_share",
              "decode_steps", "decode_row_use"}
    for a, b in zip(packed, padded):
        assert set(a) == set(b)
        for key in sorted(set(a) - timing - layout):
            if isinstance(a[key], str):
                assert a[key] == b[key], key
            elif key.startswith(("reward", "gen_", "response_len", "eval_")):
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            else:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)
    # What each computed: a prompt takes 44-45 of a row's 79 slots, so no two sequences
    # share a buffer row here, and packed computes what its padded twin does (what packing
    # saves is measured in test_packed_logprob_pass_equals_padded and experiments/packing.md).
    for a, b in zip(packed[1:], padded[1:]):
        assert a["computed_tokens"] <= b["computed_tokens"]
        assert a["logprob_computed_tokens"] <= b["logprob_computed_tokens"]
        assert 0 < a["real_token_share"] <= 1 and 0 < a["logprob_real_token_share"] <= 1
    for a, b in zip(packed[1:], padded[1:]):  # 32 rows through 16 slots take more steps
        assert a["decode_steps"] > b["decode_steps"] and 0 < a["decode_row_use"] <= 1
