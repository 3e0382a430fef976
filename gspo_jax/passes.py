"""Forward passes over a batch of prompt+response sequences (no gradient of their own).

The batch layout (`gspo_jax.step`'s module docstring): ``prompt_tokens``/``prompt_mask``
[N, P] left-padded, ``tokens``/``mask`` [N, T] right-padded. Here: the model inputs of
that layout (`sequence_inputs`), the response positions (`response_slice`), one forward
to the response's log-probs (`forward`, which the losses of `gspo_jax.step` call too),
the old/reference log-prob pass with its routing record (`logprob_pass`), the sampler
against the trainer on the same tokens (`mismatch_metrics`), and the strided
micro-batch split both the pass and the train step use (`split_micro`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import routing

Batch = dict[str, jax.Array]


def split_micro(tree, m: int):
    """[n, ...] -> [m, n/m, ...] on every leaf, micro-batch j holding rows j, j + m,
    j + 2m, ...: strided, so that a batch sharded over devices in contiguous blocks
    puts n/m/devices rows of every micro-batch on every device. (Contiguous micro-
    batches, rows j n/m ..., would each sit on a few devices, and XLA all-gathers the
    whole mini-batch to every device, which then computes every micro-batch: seen in
    the compiled train step on 4 CPU devices, tests/test_step.py.)"""
    return jax.tree.map(
        lambda x: x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1), tree
    )


def merge_micro(tree):
    """The inverse of `split_micro`: [m, n/m, ...] -> [n, ...] in row order."""
    return jax.tree.map(
        lambda x: x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tree
    )


def sequence_inputs(batch: Batch):
    """Model inputs for the prompt+response layout (see the module docstring).

    Returns inputs, targets int32[N,P+T-1], positions int32[N,P+T-1] (counted
    over real tokens, so left padding does not shift them) and attn_mask.
    """
    seq = jnp.concatenate([batch["prompt_tokens"], batch["tokens"]], axis=1)
    valid = jnp.concatenate([batch["prompt_mask"], batch["mask"]], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return seq[:, :-1], seq[:, 1:], positions[:, :-1], valid[:, :-1]


def response_slice(x: jax.Array, prompt_len: int, resp_len: int) -> jax.Array:
    """The positions that predict the response tokens: [:, P-1 : P-1+T]."""
    return jax.lax.slice_in_dim(x, prompt_len - 1, prompt_len - 1 + resp_len, axis=1)


def forward(model, batch: Batch, replay, *, values: bool = False, temperature: float = 1.0):
    """Response log-probs under softmax(logits / temperature), their entropies (and
    critic values V(s_t)) of one forward.

    Returns (logp, entropy, values or None, aux); per-token arrays f32[N,T].
    """
    inputs, targets, positions, attn = sequence_inputs(batch)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    if values:
        h, aux = model.hidden(inputs, positions=positions, attn_mask=attn, replay=replay)
        logp, entropy = model.logprobs_from_hidden(h, targets, temperature=temperature)
        v = response_slice(model.value(h), p, t)
    else:
        logp, entropy, aux = model.token_logprobs(
            inputs,
            targets,
            positions=positions,
            attn_mask=attn,
            replay=replay,
            temperature=temperature,
        )
        v = None
    return response_slice(logp, p, t), response_slice(entropy, p, t), v, aux


def logprob_pass(
    params,
    batch: Batch,
    *,
    graphdef,
    replay_key: str | None = None,
    values: bool = False,
    temperature: float = 1.0,
    micro_batches: int = 1,
):
    """Per-token log-probs of the response under ``params`` (no gradient).

    Used for the old policy (recomputed by the training model) and for the
    reference policy (always routed freely). Also returns the routing record of
    this forward: ``topk`` int32[N,P+T-1,L,K], the experts used at every input
    position (the R2 replay); at the response positions those experts
    (``topk_resp``), the router log-softmax there (RSPO's old router log-probs) and
    the free router's top-K (``free_topk_resp``, what it chooses whatever replay
    forced); with ``values``, the critic's V(s_t) too.

    ``micro_batches``: the rows run in that many strided pieces, one after another
    (``lax.map``), so that the pass holds the activations and logits of N /
    micro_batches rows at a time; every row's outputs are its own either way.
    """
    model = nnx.merge(graphdef, params)
    keys = ["prompt_tokens", "prompt_mask", "tokens", "mask"] + ([replay_key] if replay_key else [])

    def one(rows: Batch) -> dict[str, jax.Array]:
        replay = rows[replay_key] if replay_key else None
        logp, entropy, v, aux = forward(model, rows, replay, values=values, temperature=temperature)
        p, t = rows["prompt_tokens"].shape[1], rows["tokens"].shape[1]
        topk_resp = response_slice(aux.topk_indices, p, t)
        router_lp = routing.topk_router_logp(response_slice(aux.router_logits, p, t), topk_resp)
        out = {
            "logp": logp,
            "entropy": entropy,
            "topk": aux.topk_indices,
            "topk_resp": topk_resp,
            "free_topk_resp": response_slice(aux.free_topk_indices, p, t),
            "router_logp": router_lp,
        }
        if values:
            out["values"] = v
        return out

    rows = {k: batch[k] for k in keys}
    if micro_batches == 1:
        return one(rows)
    n = batch["tokens"].shape[0]
    if n % micro_batches:
        raise ValueError(f"logprob_pass: micro_batches={micro_batches} does not divide {n} rows")
    return merge_micro(jax.lax.map(one, split_micro(rows, micro_batches)))


def mismatch_metrics(sampler_logp, old_logp, mask, sampler_topk=None, old_free_topk=None):
    """Train-inference mismatch: the sampler against the old-policy pass on the same
    tokens (docs/objectives.md, "Stability diagnostics").

    With r_t = pi_old(o_t) / pi_sampler(o_t) over valid tokens: ``mismatch_kl`` the k3
    estimate of KL(pi_sampler || pi_old), mean (r - 1) - log r (tokens are the
    sampler's); ``mismatch_f2`` the share with r outside [1/2, 2] (R3's F(tau), tau=2);
    ``mismatch_logp_abs`` mean |log r|. With the routing records, the share of the
    sampler's top-K choices the old pass's free router would not make, per layer and
    overall, and the share of tokens with any such choice.
    """
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    log_r = jnp.where(m > 0, old_logp - sampler_logp, 0.0)
    out = {
        "mismatch_kl": jnp.sum(m * (jnp.expm1(log_r) - log_r)) / n,
        "mismatch_f2": jnp.sum(m * (jnp.abs(log_r) > math.log(2.0))) / n,
        "mismatch_logp_abs": jnp.sum(m * jnp.abs(log_r)) / n,
    }
    if sampler_topk is not None:
        layer = routing.expert_flip_fraction(sampler_topk, old_free_topk, m)
        out["mismatch_route_layer"] = layer
        out["mismatch_route"] = jnp.mean(layer) if layer.size else jnp.zeros(())
        out["mismatch_route_token"] = routing.token_flip_rate(sampler_topk, old_free_topk, m)
    return out
