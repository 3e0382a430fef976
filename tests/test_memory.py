"""Memory at the flagship size: the attention through `jax.nn.dot_product_attention`,
the remat policy that saves no attention scores, the reference copy in the compute
dtype, the runtime model fields, and the budget's formulas (experiments/memory_budget.py,
docs/memory.md)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import qwen3_moe_gsm8k
from experiments import memory_budget as mb
from gspo_jax.models import ModelConfig, Transformer, layers
from gspo_jax.models.precision import F32_PARAMS, inference_params

V = 97


def _model(**kw):
    return Transformer(ModelConfig.tiny(**kw), rngs=nnx.Rngs(0))


def _left_padded(b=3, t=12):
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, V, (b, t)), jnp.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, :4] = 0
    mask[-1, :1] = 0
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)  # on the host: no compile
    return tokens, jnp.asarray(mask), jnp.asarray(pos)


# --------------------------------------------------------------------------
# Attention.


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-6), ("bfloat16", 1e-6)])
def test_full_forward_attention_equals_the_einsum_attention(dtype, atol):
    """The full forward (dot_product_attention, XLA on CPU) against a prefill into an
    empty KV cache, which runs the einsum attention the full forward used before:
    the same logits at every real token (measured: 9e-8 in f32, bitwise in bf16)."""
    model = _model(dtype=dtype)
    tokens, mask, pos = _left_padded()
    graphdef, state = nnx.split(model)

    @jax.jit
    def both(state):
        m = nnx.merge(graphdef, state)
        full, _ = m(tokens, positions=pos, attn_mask=mask)
        prefill, _, _ = m.decode(tokens, m.init_cache(3, 12), positions=pos, attn_mask=mask)
        return full, prefill

    full, prefill = both(state)
    real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(full)[real], np.asarray(prefill)[real], atol=atol)


def test_attention_implementation_choice(monkeypatch):
    cfg = ModelConfig.tiny()  # head_dim 16
    choose = layers.attention_implementation
    assert choose(cfg, jnp.bfloat16) == "xla"  # on CPU
    # Forced: cuDNN itself refuses what it cannot run.
    assert choose(cfg.replace(attention_impl="cudnn"), jnp.float32) == "cudnn"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert choose(cfg, jnp.bfloat16) == "cudnn"
    assert choose(cfg, jnp.float16) == "cudnn"
    assert choose(cfg, jnp.float32) == "xla"  # f16 / bf16 only
    assert choose(cfg.replace(head_dim=12), jnp.bfloat16) == "xla"  # not a multiple of 8
    assert choose(cfg.replace(head_dim=256), jnp.bfloat16) == "xla"
    assert choose(cfg.replace(attention_impl="xla"), jnp.bfloat16) == "xla"


@pytest.mark.parametrize("t", [11, 12])
def test_padding_to_an_even_length_changes_nothing(t):
    """What the cuDNN path does at an odd length (the flagship's 256 + 1024 - 1),
    checked with the XLA implementation: the real queries' outputs are unchanged."""
    rs = np.random.RandomState(1)
    b, h, kv, hd = 2, 4, 2, 8
    q = jnp.asarray(rs.randn(b, t, h, hd), jnp.float32)
    k, v = (jnp.asarray(rs.randn(b, t, kv, hd), jnp.float32) for _ in range(2))
    valid = np.ones((b, t), bool)
    valid[0, :3] = False  # left padding

    @jax.jit  # one program instead of one per primitive (speed only)
    def both(q, k, v, valid):
        slots = jnp.arange(t, dtype=jnp.int32)
        mask = layers.attention_mask(slots, slots, valid)[:, None]
        want = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        qp, kp, vp, mp = layers._pad_to_even(q, k, v, mask)
        # Shapes are static: checked while tracing.
        assert qp.shape[1] % 2 == 0 and mp.shape[2:] == (qp.shape[1], qp.shape[1])
        got = jax.nn.dot_product_attention(qp, kp, vp, mask=mp, is_causal=True, implementation="xla")
        return want, got

    want, got = both(q, k, v, jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got[:, :t])[valid], np.asarray(want)[valid], atol=1e-6)


def test_model_config_runtime_fields():
    assert ModelConfig.tiny(logits_chunk_size=0).logits_chunk_size is None  # 0 = off
    assert ModelConfig.tiny(logits_chunk_size=64).logits_chunk_size == 64
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="logits_chunk_size"):
            ModelConfig.tiny(logits_chunk_size=bad)
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig.tiny(attention_impl="flash")
    assert ModelConfig.tiny(remat_policy="dots_no_scores").remat_policy == "dots_no_scores"


# --------------------------------------------------------------------------
# Remat: what the backward pass keeps.

T = 12  # no other dimension of the test model is 12: [.., T, T] is a score array


def _saved(policy, **kw):
    """[(dtype, shape)] of the residuals JAX keeps for the backward pass of the train
    path's loss (token_logprobs), arguments excluded."""
    model = _model(remat_policy=policy, attention_impl="xla", **kw)
    graphdef, state = nnx.split(model)
    tokens, mask, pos = _left_padded(2, T)

    def loss(state):
        m = nnx.merge(graphdef, state)
        lp, _, aux = m.token_logprobs(
            tokens, jnp.roll(tokens, -1, 1), positions=pos, attn_mask=mask
        )
        return jnp.sum(lp * mask) + aux.z_loss

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(loss, state)
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"^(\w+)\[([\d,]*)\]\s+(.*)$", line.strip())
        if m and "from the argument" not in m.group(3):
            out.append((m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)))
    return out


def _score_arrays(saved):
    """Floating-point residuals with the sequence length twice: [.., T, .., S]."""
    return [(d, s) for d, s in saved if d != "bool" and not d.startswith("i") and s.count(T) >= 2]


@pytest.mark.parametrize("backend", ["blocked", "ragged"])
def test_dots_no_scores_saves_no_attention_scores(backend):
    dots = _saved("dots", moe_backend=backend)
    assert _score_arrays(dots), "the detector must see the scores 'dots' saves"
    for policy in ("dots_no_scores", "dots_no_batch", "full"):
        assert _score_arrays(_saved(policy, moe_backend=backend)) == [], policy
    # dots_no_scores = dots_no_batch + the attention output [n, B, T, H, hd] per segment.
    ctx = lambda saved: [s for d, s in saved if s[1:] == (2, T, 4, 16)]
    no_batch, no_scores = (
        _saved("dots_no_batch", moe_backend=backend),
        _saved("dots_no_scores", moe_backend=backend),
    )
    plan = _model().plan
    assert len(ctx(no_scores)) == len(ctx(no_batch)) + len(plan)
    assert (
        sum(s[0] for s in ctx(no_scores)) - sum(s[0] for s in ctx(no_batch))
        == ModelConfig.tiny().num_layers
    )


def test_remat_policies_give_the_same_gradients():
    tokens, mask, pos = _left_padded(2, T)

    def grads(policy):
        graphdef, state = nnx.split(_model(remat_policy=policy))

        def loss(state):
            m = nnx.merge(graphdef, state)
            lp, _, aux = m.token_logprobs(
                tokens, jnp.roll(tokens, -1, 1), positions=pos, attn_mask=mask
            )
            return jnp.sum(lp * mask) + aux.z_loss

        return jax.jit(jax.value_and_grad(loss))(state)

    (l0, g0), (l1, g1) = grads("none"), grads("dots_no_scores")
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):  # f32 reassociation only
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# The reference policy in the compute dtype.


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inference_params_give_the_same_log_probs(dtype):
    model = _model(dtype=dtype, value_head=True)
    graphdef, params = nnx.split(model)
    ref = inference_params(params, model.cfg)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref)):
        kept = any(str(getattr(k, "key", "")) in F32_PARAMS for k in path)
        assert b.dtype == (jnp.float32 if kept else jnp.dtype(dtype)), jax.tree_util.keystr(path)
        assert b is not a
    tokens, mask, pos = _left_padded()

    @jax.jit
    def logp(state):
        m = nnx.merge(graphdef, state)
        lp, ent, aux = m.token_logprobs(
            tokens, jnp.roll(tokens, -1, 1), positions=pos, attn_mask=mask
        )
        return lp, ent, aux.topk_indices

    want = jax.block_until_ready(logp(params))
    for leaf in jax.tree.leaves(params):
        leaf.delete()  # the trainer donates the policy's parameters: the copy stands alone
    for a, b in zip(want, logp(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise


# --------------------------------------------------------------------------
# The budget's formulas.


def test_saved_residual_formula_matches_jax():
    """saved_per_token + top_saved_per_token against what JAX keeps: within 0.2% under
    'full' (the formula leaves out a few [D]-sized constants); the dots policies count
    the first layer's input once too often (< 5%)."""
    b, t = 2, 64
    for dtype in ("float32", "bfloat16"):
        for policy in ("full", "dots_no_batch", "dots_no_scores", "dots"):
            cfg = ModelConfig(
                vocab_size=128,
                d_model=32,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                d_ff=48,
                moe_d_ff=24,
                num_experts=8,
                top_k=2,
                first_dense_layers=1,
                remat_policy=policy,
                moe_backend="ragged",
                attention_impl="xla",
                dtype=dtype,
                logits_chunk_size=16,
            )
            graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
            tokens = jnp.zeros((b, t), jnp.int32)

            def loss(s):
                lp, _, aux = nnx.merge(graphdef, s).token_logprobs(tokens, tokens)
                return jnp.sum(lp) + aux.z_loss

            layers_b, other_b = mb._saved_bytes(loss, state)
            formula = b * t * (mb.saved_per_token(cfg, policy, t) + mb.top_saved_per_token(cfg, t))
            ratio = formula / (layers_b + other_b)
            if policy == "full":
                # all but a few per-model constants ([D] norm scale, scalars)
                assert ratio == pytest.approx(1.0, abs=2e-3), (dtype, policy, ratio)
            else:
                assert 0.998 <= ratio < 1.05, (dtype, policy, ratio)


def test_budget_categories():
    cfg = mb.qwen3_30b_a3b(dtype="bfloat16", param_dtype="float32", moe_backend="ragged")
    assert cfg.num_params() == pytest.approx(30.53e9, rel=1e-3)  # Qwen3-30B-A3B
    assert cfg.num_params(active=True) == pytest.approx(3.35e9, rel=1e-2)
    run = mb.Run(prompts_per_step=16)
    budget = mb.Budget(cfg, mb.H100_8, run)
    n = cfg.num_params()
    assert budget.parameters() == n * 4 / 8
    assert budget.optimizer_state() == 2 * n * 4 / 8
    assert budget.gradients() == n * 4 / 8
    accumulating = mb.Budget(cfg, mb.H100_8, mb.Run(micro_batches=4))
    assert accumulating.gradients() == 2 * n * 4 / 8
    # KV cache: rows / device * L * 2 * KV * hd * (P + T - 1) * 2 bytes.
    assert budget.kv_cache() == 16 * 48 * 2 * 4 * 128 * (384 + 1024 - 1) * 2
    assert budget.train_rows() == 4 and budget.pass_rows() == 16
    pieces = mb.Budget(cfg, mb.H100_8, mb.Run(prompts_per_step=16, logprob_micro_batches=4))
    assert pieces.pass_rows() == 4 and pieces.train_rows() == 4
    assert pieces.phases()["log-prob pass"] < budget.phases()["log-prob pass"]
    assert pieces.phases()["train step"] == budget.phases()["train step"]
    with pytest.raises(ValueError, match="does not split over 8 data shards"):
        mb.Budget(cfg, mb.H100_8, mb.Run(prompts_per_step=16, logprob_micro_batches=32))
    # Logits: 4 rows * 128 positions * V * f32 * 3, and the gathered head.
    assert budget.logits_train() == 4 * 128 * 151936 * 4 * 3 + 2048 * 151936 * 2
    kl = mb.Budget(cfg, mb.H100_8, mb.Run(prompts_per_step=16, kl=True))
    router = 48 * 2048 * 128
    assert kl.reference() == ((n - router) * 2 + router * 4) / 8


def test_flagship_config_is_the_budgeted_one_and_fits():
    c = qwen3_moe_gsm8k.get_config("ckpt=/ckpt")
    title, budget = mb.setups()[0]
    run = budget.run
    assert "configs/qwen3_moe_gsm8k.py" in title
    assert (c.rollout.prompts_per_step, c.rollout.group_size) == (
        run.prompts_per_step,
        run.group_size,
    )
    assert c.rollout.max_new_tokens == run.max_new_tokens
    assert c.rollout.max_prompt_len == run.prompt_len
    assert (c.updates.num_minibatches, c.updates.micro_batches) == (
        run.num_minibatches,
        run.micro_batches,
    )
    assert c.updates.logprob_micro_batches == run.logprob_micro_batches
    assert c.model.remat_policy == run.remat_policy
    assert c.model.logits_chunk_size == run.logits_chunk_size
    assert (c.model.dtype, c.model.param_dtype) == (budget.cfg.dtype, budget.cfg.param_dtype)
    assert c.model.attention_impl == "auto" and run.attention == "flash"  # cuDNN on the GPUs
    assert c.task.eval_size == run.eval_size and c.task.eval_samples == run.eval_samples
    assert c.objective.hparams.kl_coef == 0 and not run.kl
    assert max(budget.phases().values()) <= 0.9 * budget.hw.budget


def test_flagship_config_is_the_compiled_one_and_fits():
    """configs/qwen3_moe_gsm8k.py is the program `experiments/compile_report.py --size
    flagship` compiles, and its committed report for one 8x H100 node (the config's
    dispatch, block size and first-moment dtype) is within 90% of what XLA may use."""
    import json
    import os

    from experiments import programs

    c = qwen3_moe_gsm8k.get_config("ckpt=/ckpt")
    sh = programs.FLAGSHIP
    m = sh["model"]
    assert (c.model.remat_policy, c.model.logits_chunk_size) == (
        m["remat_policy"],
        m["logits_chunk_size"],
    )
    assert (c.model.dtype, c.model.param_dtype) == (m["dtype"], m["param_dtype"])
    rows = c.rollout.prompts_per_step * c.rollout.group_size
    assert sh["rows"] == rows // c.updates.num_minibatches and sh["logprob_rows"] == rows
    assert c.updates.micro_batches == sh["micro_batches"] == 1
    assert (sh["prompt_len"], sh["response_len"]) == (
        c.rollout.max_prompt_len,
        c.rollout.max_new_tokens,
    )
    assert (c.model.moe_backend, c.model.moe_block_size, c.optimizer.mu_dtype) == (
        "blocked",
        512,
        "bfloat16",
    )
    path = os.path.join(
        os.path.dirname(__file__),
        "..",
        "experiments/accelerator/compile/flagship_h100x8_blocked512_mubf16.json",
    )
    (train,) = json.load(open(path))["rows"]
    assert train["part"] == "train" and train["devices"] == 8 and train["moe_backend"] == "blocked"
    assert train["memory"]["fraction_of_usable"] <= 0.9
