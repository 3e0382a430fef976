"""Forward passes over a batch of prompt+response sequences (no gradient of their own).

The batch layout (`gspo_jax.step`'s module docstring): ``prompt_tokens``/``prompt_mask``
[N, P] left-padded, ``tokens``/``mask`` [N, T] right-padded. Here: the model inputs of
that layout (`sequence_inputs`), the response positions (`response_slice`), one forward
to the response's log-probs and routing records (`forward`, which the losses of
`gspo_jax.step` call too), run on the padded rows or on one micro-batch of packed
buffers (`gspo_jax.packing`) and given back in the padded layout either way (`Forward`),
the old/reference log-prob pass with its routing record (`logprob_pass`), the sampler
against the trainer on the same tokens (`mismatch_metrics`), and the strided micro-batch
split of padded rows (`split_micro`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gspo_jax import packing, routing
from gspo_jax.models.layers import rows_sharded

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


class Forward(NamedTuple):
    """What one forward gives the losses and passes, in the padded layout of its batch
    (N rows, T response positions, S = P + T - 1 input positions; L MoE layers, K
    experts per token), however it ran (padded, or one micro-batch of a packed `Plan`).

    logp, entropy: f32[N,T] of the response tokens under softmax(logits / temperature).
    values: f32[N,T] the critic's V(s_t), or None.
    topk: int32[N,S,L,K] the experts used at every input position (R2's record).
    free_topk: int32[N,T,L,K] the free router's top-K at the response positions.
    router_logp: f32[N,T,L,K] the router's log-softmax at ``at_topk`` (RSPO's router
      log-probs), or at the experts it used there.
    computed: bool[N,T] the response positions this forward computed (a packed micro-
      batch's rows), or None (all of them); elsewhere the arrays above hold 0.
    aux_loss, z_loss: f32[] the router losses over the routed positions;
      replay_mismatch f32[L]; router_tokens f32[] the routed (real) positions.
    """

    logp: jax.Array
    entropy: jax.Array
    values: jax.Array | None
    topk: jax.Array
    free_topk: jax.Array
    router_logp: jax.Array
    computed: jax.Array | None
    aux_loss: jax.Array
    z_loss: jax.Array
    replay_mismatch: jax.Array
    router_tokens: jax.Array


def _run(model, batch: Batch, replay, *, values, temperature, at_topk, packed):
    """The per-token outputs of one forward in the layout it ran in: the padded rows
    [N, S, ...] (but ``router_logp``, [N, T, ...] at the response positions only), or
    micro-batch j of a packed plan [r, S, ...] (``packed`` = (plan, j)). Returns
    (outputs, RouterAux, the attention mask's segment ids)."""
    inputs, targets, positions, attn = sequence_inputs(batch)
    if packed is not None:
        plan, j = packed
        take = functools.partial(packing.pack, plan, j)
        inputs, targets, positions = rows_sharded(
            model.cfg, *map(take, (inputs, targets, positions))
        )
        attn = plan.segment[j]
        replay = None if replay is None else take(replay)
    h, aux = model.hidden(inputs, positions=positions, attn_mask=attn, replay=replay)
    logp, entropy = model.logprobs_from_hidden(h, targets, temperature=temperature)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    if packed is None:  # padded: the router's log-probs at the response positions only
        logits, at = (response_slice(a, p, t) for a in (aux.router_logits, aux.topk_indices))
        at = at if at_topk is None else at_topk
    else:  # packed: at every slot; at_topk [N, T, L, K] to the input positions, packed
        logits, at = aux.router_logits, aux.topk_indices
        if at_topk is not None:
            at = take(jnp.pad(at_topk, ((0, 0), (p - 1, 0), (0, 0), (0, 0))))
    out = {
        "logp": logp,
        "entropy": entropy,
        "topk": aux.topk_indices,
        "free_topk": aux.free_topk_indices,
        "router_logp": routing.topk_router_logp(logits, at),
    }
    if values:
        out["values"] = model.value(h)
    return out, aux, attn


# The outputs read at every input position; the rest at the response's.
FULL_LAYOUT = ("topk",)


def _to_rows(out: dict, to_rows, p: int, t: int) -> dict:
    """Outputs of `_run` as the padded rows' (``to_rows(y, window)``): `FULL_LAYOUT`'s at
    every input position, the others' at the response positions."""
    return {k: to_rows(y, None if k in FULL_LAYOUT else (p - 1, t)) for k, y in out.items()}


def _padded_rows(p: int, t: int):
    """`_to_rows`'s function for a padded `_run`: its response-only outputs as they are."""

    def to_rows(y, window):
        return y if window is None or y.shape[1] != p + t - 1 else response_slice(y, p, t)

    return to_rows


def forward(
    model,
    batch: Batch,
    replay,
    *,
    values: bool = False,
    temperature: float = 1.0,
    at_topk=None,
    packed=None,
) -> Forward:
    """One forward over the batch's sequences (no gradient of its own): `Forward`.

    ``replay`` int32[N,S,L,K] experts to force (R2/R3), or None; ``at_topk``
    int32[N,T,L,K] where to read the router's log-probs (None: at the experts used).
    ``packed`` = (plan, j): run micro-batch j of a `gspo_jax.packing.Plan` of this
    batch, its rows' real tokens end to end in buffer rows, and give its rows' outputs
    back in the padded layout; None: run the padded rows.
    """
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    out, aux, attn = _run(
        model, batch, replay, values=values, temperature=temperature, at_topk=at_topk, packed=packed
    )
    if packed is None:
        rows = _to_rows(out, _padded_rows(p, t), p, t)
        computed = None
    else:
        plan, j = packed
        rows = _to_rows(out, lambda y, w: packing.unpack(plan, j, y, w), p, t)
        computed = packing.computed(plan, j, (p - 1, t))
    return Forward(
        logp=rows["logp"],
        entropy=rows["entropy"],
        values=rows.get("values"),
        topk=rows["topk"],
        free_topk=rows["free_topk"],
        router_logp=rows["router_logp"],
        computed=computed,
        aux_loss=aux.aux_loss,
        z_loss=aux.z_loss,
        replay_mismatch=aux.replay_mismatch,
        router_tokens=jnp.sum((attn > 0).astype(jnp.float32)),
    )


def logprob_pass(
    params,
    batch: Batch,
    *,
    graphdef,
    replay_key: str | None = None,
    values: bool = False,
    temperature: float = 1.0,
    micro_batches: int = 1,
    packing_shape: packing.Packing | None = None,
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
    ``packing_shape``: instead, the rows' real tokens packed (`gspo_jax.packing`) into
    micro-batches of that shape, only the used ones computed (a ``while`` loop), and
    the outputs given back in the padded layout (0 at padding).
    """
    model = nnx.merge(graphdef, params)
    keys = ["prompt_tokens", "prompt_mask", "tokens", "mask"] + ([replay_key] if replay_key else [])
    rows = {k: batch[k] for k in keys}
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]

    def run(rows: Batch, packed=None) -> dict[str, jax.Array]:
        replay = rows[replay_key] if replay_key else None
        kw = dict(values=values, temperature=temperature, at_topk=None, packed=packed)
        return _run(model, rows, replay, **kw)[0]

    n = batch["tokens"].shape[0]
    if packing_shape is not None:
        plan = packing.plan(sequence_inputs(rows)[3], packing_shape)
        if packing_shape.micro == 1:  # one micro-batch: no loop, no buffers
            out = _to_rows(run(rows, (plan, 0)), lambda y, w: packing.unpack(plan, 0, y, w), p, t)
        else:  # each used micro-batch into its slot of [m, r, S, ...] buffers, one gather back
            shapes = jax.eval_shape(run, rows, (plan, 0))
            bufs = jax.tree.map(
                lambda y: jnp.zeros((packing_shape.micro,) + y.shape, y.dtype), shapes
            )
            body = lambda j, b: jax.tree.map(  # noqa: E731
                lambda bj, y: bj.at[j].set(y), b, run(rows, (plan, j))
            )
            bufs = jax.lax.fori_loop(0, plan.used, body, bufs)
            out = _to_rows(bufs, lambda y, w: packing.unpack_all(plan, y, w), p, t)
        out["computed_tokens"] = packing.computed_slots(plan, packing_shape)
    elif micro_batches == 1:
        out = _to_rows(run(rows), _padded_rows(p, t), p, t)
    else:
        if n % micro_batches:
            raise ValueError(
                f"logprob_pass: micro_batches={micro_batches} does not divide {n} rows"
            )
        in_rows = functools.partial(_to_rows, to_rows=_padded_rows(p, t), p=p, t=t)
        out = merge_micro(jax.lax.map(lambda r: in_rows(run(r)), split_micro(rows, micro_batches)))
    out.setdefault("computed_tokens", jnp.asarray(n * (p + t - 1), jnp.float32))
    out["free_topk_resp"] = out.pop("free_topk")
    out["topk_resp"] = response_slice(out["topk"], p, t)
    return out


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
