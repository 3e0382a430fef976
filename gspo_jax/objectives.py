r"""Policy objectives: PPO, GRPO, Dr.GRPO, DAPO, GSPO, GSPO-token, CISPO, GMPO, RSPO, SAPO.

Every objective is a pure function of arrays, found by name::

    from gspo_jax import objectives
    fn = objectives.get("gspo")            # objectives.names() lists them all
    loss, metrics = fn(logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4)
    grads = jax.grad(lambda lp: fn(lp, old_logp, advantages, mask)[0])(logp)

Signature of every objective::

    fn(logp, old_logp, advantages, mask, *, ref_logp=None, router_shift=None,
       normalizer=None, **hyperparameters) -> (loss, metrics)

Arrays (``../shared/design/objectives.md`` is the exact specification):

  ``logp``          f32[N,T]  log pi_theta(o_t | q, o_<t) of the sampled token (differentiated).
  ``old_logp``      f32[N,T]  the same under pi_old (treated as a constant).
  ``advantages``    f32[N] (one per sequence) or f32[N,T] (per token; token-level
                    objectives only). f32[N] is broadcast over T explicitly. Ignored
                    where they meet no valid token (empty rows, padding), even NaN.
  ``mask``          f32[N,T]  1 on response tokens that count, 0 elsewhere (or bool).
  ``ref_logp``      f32[N,T]  log pi_ref, required when ``kl_coef > 0``.
  ``router_shift``  f32[N,T]  RSPO's gamma in (0, 1] on valid tokens and >= 0 on
                    padding (`gspo_jax.routing.router_shift` gives [gamma_min, 1]
                    everywhere); required by ``rspo``, ignored by the others.

``loss`` is the scalar that is minimised (L = -J). ``metrics`` is a flat dict of
f32 scalars (see `METRIC_KINDS`). Hyperparameters are keyword-only and static
(Python numbers / strings); each objective accepts only those that apply to it,
with the defaults of objectives.md (``get(name).defaults``). Wrong names, wrong
values or wrong shapes raise ``ValueError`` naming the argument before any array
is touched, so the same checks fire under ``jax.jit`` (shapes are static there).

Conventions common to all objectives (objectives.md, "Inputs"):

  delta_t = clip(logp_t - old_logp_t, -20, 20) (0 where mask = 0),  r_t = exp(delta_t),
  n_i = sum_t mask_{i,t},  mean_delta_i = sum_t mask*delta / max(n_i, 1),  s_i = exp(mean_delta_i).

A sequence with n_i = 0 contributes nothing to any loss or metric; a batch whose
mask is all 0 gives a loss of exactly 0 with finite gradients.

Aggregation (``agg``) of per-token losses l_{i,t}, for token-level objectives:

  ``token-mean``               sum_{i,t} mask*l / sum_{i,t} mask
  ``seq-mean-token-mean``      mean over sequences with n_i > 0 of sum_t mask*l / n_i
  ``seq-mean-token-sum``       sum_{i,t} mask*l / #{i : n_i > 0}
  ``seq-mean-token-sum-norm``  sum_{i,t} mask*l / (#{i : n_i > 0} * norm_len);
                               ``norm_len=None`` means T, the padded response length.

Sequence-level objectives (``gspo``, ``gmpo``, ``rspo``) average one l_i over the
sequences with n_i > 0 and take no ``agg``; their KL term uses
``seq-mean-token-mean``.

Exact gradient accumulation
---------------------------
The only cross-sequence quantities in any loss are the two denominators
sum_{i,t} mask and #{i : n_i > 0}. Compute them once from the whole mini-batch
and pass them to every micro-batch::

    norm = objectives.normalizer(minibatch_mask)          # Normalizer(num_tokens, num_seqs)
    loss = sum(fn(lp_k, old_k, adv_k, mask_k, normalizer=norm)[0] for k in micro_batches)
    # == fn(lp, old, adv, mask)[0] up to float rounding, and so are the gradients,
    # for every objective and every aggregation mode.

(Sequences must not be split across micro-batches: n_i is per sequence.) Without
``normalizer`` the denominators are those of the arrays passed in.

Metrics describe the arrays passed in (the micro-batch), never the normalizer.
``combine_metrics`` merges metrics stacked over micro-batches into exactly the
metrics of the whole mini-batch, using ``num_tokens`` / ``num_seqs`` as weights.

PPO with a critic: `value_loss` (clipped value loss), `token_entropy` and
`entropy_bonus` live beside the objectives; `gspo_jax.advantages.gae` gives the
advantages and returns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]

LOG_RATIO_CLIP = 20.0
"""Token log-ratios are clipped to [-20, 20] before exponentiation."""

AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "k2", "k3")

# How each metric merges across micro-batches (see `combine_metrics`):
#   count: summed;  token: mean weighted by num_tokens;  seq: weighted by num_seqs;
#   max / min: max / min;  std: pooled from the per-part std and mean log-ratio.
METRIC_KINDS: dict[str, str] = {
    "num_tokens": "count",
    "num_seqs": "count",
    "ppo_kl": "token",
    "logratio_std": "std",
    "logratio_abs_max": "max",
    "logratio_seq_var": "seq",
    "frac_ratio_gt_2": "token",
    "clip_frac_low": "token",
    "clip_frac_high": "token",
    "dual_clip_frac": "token",
    "seq_clip_frac": "seq",
    "seq_clip_frac_low": "seq",
    "seq_clip_frac_high": "seq",
    "seq_ratio_mean": "seq",
    "is_weight_mean": "token",
    "is_weight_max": "max",
    "sapo_gate_mean": "token",
    "sapo_gate_min": "min",
    "gamma_mean": "token",
    "gamma_min": "min",
    "kl": "token",
}


# --------------------------------------------------------------------------------------
# Normaliser (exact micro-batch accumulation)
# --------------------------------------------------------------------------------------


class Normalizer(NamedTuple):
    """Denominators of a whole mini-batch (a pytree of two f32 scalars).

    Attributes:
      num_tokens: f32[], sum_{i,t} mask.
      num_seqs: f32[], #{i : n_i > 0}.
    """

    num_tokens: Array
    num_seqs: Array


def normalizer(mask: Array) -> Normalizer:
    """The loss denominators of a mini-batch, for exact gradient accumulation.

    Args:
      mask: f32[N,T] (or bool) mask of the whole mini-batch.

    Returns:
      `Normalizer`; pass it as ``normalizer=`` to every micro-batch's objective call
      so that the micro-batch losses sum to the mini-batch loss.
    """
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be f32[N,T], got shape {mask.shape}")
    m = mask.astype(jnp.float32)
    n = jnp.sum(m, axis=-1)
    return Normalizer(jnp.sum(m), jnp.sum((n > 0).astype(jnp.float32)))


# --------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------


def kl(logp: Array, ref_logp: Array, kind: str) -> Array:
    r"""Per-token estimator of KL(pi_theta || pi_ref) from sampled-token log-probs.

    With d = ref_logp - logp (objectives.md, "KL to a reference policy"):
      k1 = -d,   k2 = d^2 / 2,   k3 = exp(d) - d - 1   (DeepSeekMath's low-variance one).

    Args:
      logp: f32[...] log pi_theta of the sampled tokens.
      ref_logp: f32[...] log pi_ref, same shape.
      kind: "k1", "k2" or "k3".

    Returns:
      f32[...] the estimator per token (unmasked).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {ref_logp.shape} != logp shape {logp.shape}")
    return _kl(ref_logp - logp, kind)


def _kl(d: Array, kind: str) -> Array:
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return jnp.exp(d) - d - 1.0


# --------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------


class _Batch(NamedTuple):
    """Quantities shared by all objectives (all masked: 0 where mask = 0)."""

    m: Array  # f32[N,T] mask as float
    valid: Array  # bool[N,T]
    delta: Array  # f32[N,T] clipped log-ratio, 0 where masked
    n: Array  # f32[N] tokens per sequence
    seq_valid: Array  # f32[N] 1 where n_i > 0
    inv_n: Array  # f32[N] 1 / max(n_i, 1)
    num_tokens: Array  # f32[] local sum of mask
    num_seqs: Array  # f32[] local #{n_i > 0}
    norm: Normalizer  # denominators used by the loss


def _prepare(logp, old_logp, mask, norm: Normalizer | None) -> _Batch:
    m = mask.astype(jnp.float32)
    valid = m > 0
    diff = logp.astype(jnp.float32) - jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    delta = jnp.clip(jnp.where(valid, diff, 0.0), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    n = jnp.sum(m, axis=-1)
    seq_valid = (n > 0).astype(jnp.float32)
    num_tokens, num_seqs = jnp.sum(n), jnp.sum(seq_valid)
    if norm is None:
        norm = Normalizer(num_tokens, num_seqs)
    norm = Normalizer(*(jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)) for x in norm))
    inv_n = 1.0 / jnp.maximum(n, 1.0)
    return _Batch(m, valid, delta, n, seq_valid, inv_n, num_tokens, num_seqs, norm)


def _safe_div(x: Array, d: Array) -> Array:
    return x / jnp.maximum(d, 1.0)


def _aggregate(per_token: Array, b: _Batch, agg: str, norm_len: float) -> Array:
    """Aggregates per-token losses l (finite everywhere) into a scalar (module doc)."""
    return jnp.sum(_agg_weight(b, agg, norm_len) * jnp.sum(b.m * per_token, axis=-1))


def _agg_weight(b: _Batch, agg: str, norm_len: float) -> Array:
    """f32[N]: the weight of row i's token sum in the aggregated loss (module doc)."""
    if agg == "token-mean":
        return jnp.broadcast_to(1.0 / jnp.maximum(b.norm.num_tokens, 1.0), b.n.shape)
    inv_seqs = 1.0 / jnp.maximum(b.norm.num_seqs, 1.0)
    if agg == "seq-mean-token-mean":
        return b.inv_n * inv_seqs
    if agg == "seq-mean-token-sum":
        return jnp.broadcast_to(inv_seqs, b.n.shape)
    if agg == "seq-mean-token-sum-norm":
        return jnp.broadcast_to(inv_seqs / norm_len, b.n.shape)
    raise AssertionError(agg)  # validated before


# The loss of every objective is a sum of parts (the policy term, and the KL term when
# kl_coef > 0), each of the form
#
#     sum_i w_i * outer_i( sum_t v_{i,t} ),     (v, g) = terms(logp, old_logp, mask, aux),
#
# with g = dv/dlogp formed by `terms` itself, outer an elementwise function of the row
# sums (identity for token-level terms; exp and the sequence clip for GSPO, GMPO and
# RSPO) and w a constant per row (aggregation weight, advantage). `_fused_loss` is a
# custom JVP whose tangent is sum_{i,t} (sum_parts w_i outer_i' g_{i,t}) dlogp_{i,t}:
# the coefficient is formed beside the value, so reverse mode returns it as the
# gradient (the cotangent 1 of the scalar loss folds away) instead of re-deriving it
# from stored ratios in further passes, and the parts share one gradient pass. On
# XLA:CPU a clipped surrogate compiles to one elementwise pass that writes one [N,T]
# array, its row sum and the gradient pass. Everything in ``aux`` and ``w`` is a
# constant (stop-gradient), as is ``old_logp``. Higher derivatives follow from
# differentiating `terms`' g, which is written with ordinary differentiable operations.


class _Part(NamedTuple):
    terms: Callable  # (logp, old_logp, mask, aux) -> (v, dv/dlogp), f32[N,T] each
    outer: Callable | None  # (row sums f32[N], aux) -> f32[N], elementwise; None: identity
    weight: Array  # f32[N] row weights (constant)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused_loss(fns, logp, old_logp, mask, aux, weights):
    total = 0.0  # per row, summed once (one reduction whatever the number of parts)
    for (terms, outer), w in zip(fns, weights):
        rows = jnp.sum(terms(logp, old_logp, mask, aux)[0], axis=-1)
        total = total + w * (rows if outer is None else outer(rows, aux))
    return jnp.sum(total)


@_fused_loss.defjvp
def _fused_loss_jvp(fns, primals, tangents):
    logp, old_logp, mask, aux, weights = primals
    value, coef_g = 0.0, 0.0
    for (terms, outer), w in zip(fns, weights):
        v, g = terms(logp, old_logp, mask, aux)
        rows = jnp.sum(v, axis=-1)
        if outer is None:
            out, coef = rows, w
        else:
            out, d_out = jax.jvp(lambda x, outer=outer: outer(x, aux), (rows,),
                                 (jnp.ones_like(rows),))
            coef = w * d_out
        value = value + w * out
        coef_g = coef_g + coef[:, None] * g
    return jnp.sum(value), jnp.sum(coef_g * tangents[0])


def _loss(logp, old_logp, b: _Batch, aux: dict, parts: list[_Part]) -> Array:
    """The scalar loss sum of ``parts`` (see above); ``aux`` gains ``inv_n``."""
    fns = tuple((p.terms, p.outer) for p in parts)
    return _fused_loss(fns, _f32(logp), _f32(old_logp), b.m, {**aux, "inv_n": b.inv_n},
                       tuple(p.weight for p in parts))


def _token_part(terms, b: _Batch, agg: str, norm_len: float, adv: Array) -> _Part:
    """Token-level term sum_{i,t} agg-weight * l_t with l_t = -A v_t (A per sequence or token).

    ``terms`` returns (v, dv/dlogp) without the advantage; a per-sequence advantage
    multiplies the row weight, a per-token one is applied inside (``aux["adv"]`` must be
    ``adv``).
    """
    w = _agg_weight(b, agg, norm_len)
    if adv.shape[1] == 1:
        return _Part(terms, None, -adv[:, 0] * w)

    def signed(lp, old, m, x):
        v, g = terms(lp, old, m, x)
        return -x["adv"] * v, -x["adv"] * g

    return _Part(signed, None, w)


def _seq_part(terms, outer, b: _Batch, adv: Array) -> _Part:
    """Sequence-level term: mean over sequences with n_i > 0 of -A_i outer_i(sum_t v)."""
    return _Part(terms, outer, -adv * b.seq_valid / jnp.maximum(b.norm.num_seqs, 1.0))


def _kl_terms(kind: str):
    """v = mask * k(ref - logp), g = dv/dlogp (`kl`; ``aux["ref"]``)."""
    def terms(lp, old, m, aux):
        d = jnp.where(m > 0, aux["ref"] - lp, 0.0)
        if kind == "k1":
            k, dk = -d, jnp.ones_like(d)
        elif kind == "k2":
            k, dk = 0.5 * d * d, -d
        else:
            e = jnp.exp(d)
            k, dk = e - d - 1.0, 1.0 - e
        return m * k, m * dk
    return terms


def _kl_parts(hp, b: _Batch, agg: str, norm_len: float) -> list[_Part]:
    """kl_coef * agg(k) as a loss part, or none when kl_coef = 0 (a static choice)."""
    if hp["kl_coef"] == 0:
        return []
    return [_Part(_kl_terms(hp["kl_estimator"]), None,
                  hp["kl_coef"] * _agg_weight(b, agg, norm_len))]


def _loss_aux(adv: Array, ref_logp, hp, **more) -> dict:
    """aux for `_loss`: advantages as [N,1] / [N,T], ref_logp when the KL term is on."""
    aux = {"adv": adv, **more}
    if hp["kl_coef"] != 0:
        aux["ref"] = jax.lax.stop_gradient(_f32(ref_logp))
    return aux


def _log_ratio(lp, old, m):
    """(delta, inside): the masked log-ratio clipped to +-LOG_RATIO_CLIP, and where its
    derivative is 1 (valid and strictly inside the clip)."""
    diff = lp - old
    valid = m > 0
    delta = jnp.clip(jnp.where(valid, diff, 0.0), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return delta, valid & (jnp.abs(diff) < LOG_RATIO_CLIP)


def _tok_mean(x: Array, b: _Batch) -> Array:
    """Masked token mean over the arrays passed in (metrics)."""
    return _safe_div(jnp.sum(b.m * x), b.num_tokens)


# On CPU, metrics are computed in one pass over blocks of rows (`lax.map`), so that
# the intermediates of all of them stay in cache: XLA:CPU neither fuses sibling
# reductions nor keeps a shared producer live between them, and separate full-size
# reductions cost several times the loss itself at N x T = 512 x 2048. GPU and TPU
# compilers fuse sibling reductions into one kernel over the whole array, where a
# sequential loop of small blocks would only add launches: there, one block (on an
# H100 the metrics' row pass then joins the loss's own kernel; experiments/objectives.md).
_BLOCK_ELEMENTS = 16384
_BLOCKED_BACKENDS = ("cpu",)
_LN2 = math.log(2.0)

# A token statistic: (reduction, per-token f32 values, value used where mask = 0).
#   "mean": masked token mean (sum of mask * x over the tokens, / num_tokens);
#   "max" / "min": over valid tokens; the neutral value stands in for masked ones.
TokenStats = dict[str, tuple[str, Array, float]]


def _block_rows(n: int, t: int, backend: str = "cpu") -> int:
    """Rows per metrics block: on a backend in _BLOCKED_BACKENDS, the largest divisor
    of n whose block holds <= _BLOCK_ELEMENTS elements; elsewhere all n rows."""
    if backend not in _BLOCKED_BACKENDS:
        return n
    best = 1
    for rows in range(1, n + 1):
        if n % rows == 0 and rows * t <= _BLOCK_ELEMENTS:
            best = rows
    return best


def _token_metrics(b: _Batch, logp, old_logp, mask, inputs: dict,
                   stats_fn: Callable[..., TokenStats],
                   seq_rows: Mapping[str, Array] | None = None,
                   token_rows: Mapping[str, Array] | None = None) -> Metrics:
    """Log-ratio diagnostics plus the objective's own token statistics, masked.

    Args:
      b: the prepared batch (for the counts).
      logp, old_logp, mask: f32[N,T] (gradient stopped here).
      inputs: further arrays with leading dim N (advantages, router shift, ...).
      stats_fn: (delta, logp, valid, inputs) of one block of rows -> TokenStats.
      seq_rows: name -> f32[N] per sequence; the metric is its mean over sequences with
        a valid token.
      token_rows: name -> f32[N] per-sequence token sums; the metric is their total over
        the batch's valid tokens.

    Returns:
      the common metrics (objectives.md, "Diagnostics"), those of stats_fn, and the
      seq_rows and token_rows metrics.

    Two levels: one pass over [N,T] gives each statistic per row (f32[N]); then one
    variadic reduction takes all sums over rows (with the token and sequence counts)
    and all maxima (minima negated), and one elementwise pass makes the metrics. On an
    accelerator they so cost a few kernels whatever their number (there the row pass
    joins the loss's own). The row results pass an optimization barrier: without it
    XLA folds each sum of row sums into its own full reduction, each with its own
    second-stage kernel.
    """
    sg = jax.lax.stop_gradient
    n, t = logp.shape
    rows = _block_rows(n, t, jax.default_backend())

    def block(xs):
        lp, old, m, extra = xs
        valid = m > 0
        d = jnp.clip(jnp.where(valid, lp - old, 0.0), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        ad = jnp.abs(d)
        stats = {"_s1": ("mean", d, 0.0), "_s2": ("mean", d * d, 0.0),
                 # F(tau=2): max(r, 1/r) > 2  <=>  |delta| > log 2.
                 "frac_ratio_gt_2": ("mean", (ad > _LN2).astype(jnp.float32), 0.0),
                 "logratio_abs_max": ("max", ad, 0.0)}
        stats.update(stats_fn(d, lp, valid, extra))
        kinds.update({key: v[0] for key, v in stats.items()})
        out = {}
        for key, (kind, x, neutral) in stats.items():
            if kind == "mean":
                out[key] = jnp.sum(m * x, axis=-1)
            elif kind == "max":
                out[key] = jnp.max(jnp.where(valid, x, neutral), axis=-1)
            else:
                out[key] = jnp.min(jnp.where(valid, x, neutral), axis=-1)
        return out

    def split(x):
        return x.reshape(n // rows, rows, *x.shape[1:])

    xs = (sg(_f32(logp)), sg(_f32(old_logp)), _f32(mask),
          {k: sg(_f32(v)) for k, v in inputs.items()})
    kinds: dict[str, str] = {}  # filled while `block` is traced
    if rows == n:  # one block: no loop (and no re-tracing of a scan body when not jitted)
        per_row = jax.lax.optimization_barrier(block(xs))
    else:
        per_row = jax.lax.map(block, jax.tree.map(split, xs))
        per_row = {k: v.reshape(n) for k, v in per_row.items()}

    # Second level. Token sums (/ num_tokens), then sequence values (/ num_seqs).
    s1, s2 = per_row.pop("_s1"), per_row.pop("_s2")
    tok = {"_mean": s1, "_sq_mean": s2}
    seq_mean, seq_sq = s1 * b.inv_n, s2 * b.inv_n
    seq = {"logratio_seq_var": jnp.maximum(seq_sq - seq_mean * seq_mean, 0.0)}
    if "_clipped" in per_row:  # see _clip_stats: low side where A < 0, high side elsewhere
        neg = inputs["adv"][:, 0] < 0
        clipped = per_row.pop("_clipped")
        tok["clip_frac_low"] = jnp.where(neg, clipped, 0.0)
        tok["clip_frac_high"] = jnp.where(neg, 0.0, clipped)
    extreme = {}  # max over rows; a "min" statistic enters negated
    for key, x in per_row.items():
        kind = kinds[key]
        if kind == "mean":
            tok[key] = x
        else:
            extreme[key] = x if kind == "max" else -x
    tok.update({k: _f32(v) for k, v in (token_rows or {}).items()})
    seq.update({k: _f32(v) for k, v in (seq_rows or {}).items()})

    # One reduction for all sums and maxima: a variadic reduce over a stacked f32[K,N]
    # of row sums (the last two rows are the token and sequence counts, the
    # denominators) and one of row maxima (a "min" statistic went in negated); the
    # shorter is padded to the other's height with rows that are never read.
    sum_rows = [*tok.values(), *(b.seq_valid * v for v in seq.values()), b.n, b.seq_valid]
    k_tok, k = len(tok), len(tok) + len(seq)
    max_rows = list(extreme.values())
    size = max(len(sum_rows), len(max_rows))
    sum_rows += [jnp.zeros_like(b.n)] * (size - len(sum_rows))
    max_rows += [jnp.zeros_like(b.n)] * (size - len(max_rows))
    sums, tops = jax.lax.reduce(
        (jnp.stack(sum_rows), jnp.stack(max_rows)), (jnp.float32(0), jnp.float32(-jnp.inf)),
        lambda x, y: (x[0] + y[0], jnp.maximum(x[1], y[1])), (1,))
    # Every metric comes out of one elementwise pass over [sums, maxima]: a metric that
    # is a bare element of a reduction's output would cost its own copy kernel.
    allv = jnp.concatenate([sums[:k + 2], tops[:len(extreme)]])
    i = jnp.arange(allv.shape[0])
    denom = jnp.where(i < k_tok, sums[k], jnp.where(i < k, sums[k + 1], 1.0))
    sign = jnp.asarray([1.0] * (k + 2) + [1.0 if kinds[key] == "max" else -1.0
                                          for key in extreme], jnp.float32)
    final = sign * _safe_div(allv, denom)
    out = dict(zip([*tok, *seq, "num_tokens", "num_seqs", *extreme], final))
    mean, sq_mean = out.pop("_mean"), out.pop("_sq_mean")
    return {
        "ppo_kl": -mean,
        "logratio_std": jnp.sqrt(jnp.maximum(sq_mean - mean * mean, 0.0)),
        **out,
    }


def _clip_stats(hi: Array, lo: Array, adv: Array) -> TokenStats:
    """Token clip fractions. With one advantage per row (adv [rows,1]) only one side can
    clip in a row, so one reduction serves both; `_token_metrics` splits it by sign."""
    if adv.shape[-1] == 1:
        return {"_clipped": ("mean", _f32(hi | lo), 0.0)}
    return {"clip_frac_low": ("mean", _f32(lo), 0.0), "clip_frac_high": ("mean", _f32(hi), 0.0)}


def _adv1d(advantages: Array, b: _Batch) -> Array:
    """Stop-gradient f32[N] advantages, 0 on rows with no valid token.

    A row with n_i = 0 contributes nothing, whatever its advantage: zeroing it here
    keeps a NaN or inf there (padding rows) out of the loss, where 0 * NaN is NaN.
    """
    return jnp.where(b.seq_valid > 0, jax.lax.stop_gradient(_f32(advantages)), 0.0)


def _adv2d(advantages: Array, b: _Batch) -> Array:
    """Stop-gradient f32 advantages as [N,1] (from [N]) or [N,T] (equal rank with [N,T]),
    0 where they meet no valid token (`_adv1d`; per token: where mask = 0)."""
    if jnp.ndim(advantages) == 1:
        return _adv1d(advantages, b)[:, None]
    return jnp.where(b.valid, jax.lax.stop_gradient(_f32(advantages)), 0.0)


def _kl_values(logp, ref_logp, valid, kind: str) -> Array:
    d = jnp.where(valid, jax.lax.stop_gradient(_f32(ref_logp)) - _f32(logp), 0.0)
    return _kl(d, kind)


def _with_kl(stats_fn, hp):
    """Adds the token-mean of the KL estimator ("kl") to a block statistics function."""
    if hp["kl_coef"] == 0:
        return stats_fn

    def fn(d, lp, valid, x):
        out = stats_fn(d, lp, valid, x)
        out["kl"] = ("mean", _kl_values(lp, x["ref"], valid, hp["kl_estimator"]), 0.0)
        return out

    return fn


def _metric_inputs(advantages, ref_logp, hp, **more) -> dict:
    out = {"adv": advantages if advantages.ndim == 2 else advantages[:, None]}
    if hp["kl_coef"] != 0:
        out["ref"] = ref_logp
    out.update(more)
    return out


def _ratio_clip(ratio: Array, adv: Array, eps_low, eps_high, dual_clip):
    """PPO's clipped ratio with an exactly-zero gradient where the clip binds.

    max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) == -A * r_eff with
      r_eff = 1+eps_high   if A > 0 and r > 1+eps_high          (clip binds: no gradient)
              1-eps_low    if A < 0 and r < 1-eps_low           (clip binds: no gradient)
              c            if A < 0 and r > c (dual clip)      (no gradient)
              r            otherwise                            (gradient -A r grad log p)
    Returns (r_eff, clipped_high, clipped_low, dual_clipped) (masks are bool).
    """
    hi = (adv > 0) & (ratio > 1.0 + eps_high)
    lo = (adv < 0) & (ratio < 1.0 - eps_low)
    r_eff = jnp.where(hi, 1.0 + eps_high, jnp.where(lo, 1.0 - eps_low, ratio))
    if dual_clip is None:
        dual = jnp.zeros_like(hi)
    else:
        dual = (adv < 0) & (ratio > dual_clip)
        r_eff = jnp.where(dual, float(dual_clip), r_eff)
    return r_eff, hi, lo, dual


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


# --------------------------------------------------------------------------------------
# The objectives (validated hyperparameters arrive as the dict `hp`)
# --------------------------------------------------------------------------------------


def _clip_terms(hp, seq_ratio: bool):
    """(v, g) of the clipped surrogate, v = mask * r_eff (module doc of `_ratio_clip`).

    The ratio is r_t = exp(delta_t), or for GSPO-token s_hat_{i,t} (value s_i,
    derivative s_i: ``aux["s"]`` holds sg(s_i) as [N,1]). g = mask * dr/dlogp where the
    clip does not bind, 0 where it does. Both come from one array q = mask * (r where
    the token keeps its gradient, -r_eff where it does not): v = |q|, g = max(q, 0)
    (r > 0), so XLA keeps a single [N,T] intermediate between the value's row sum and
    the gradient.
    """
    sg = jax.lax.stop_gradient

    def terms(lp, old, m, aux):
        a = aux["adv"]
        delta, inside = _log_ratio(lp, old, m)
        if seq_ratio:
            # s_hat = exp(sg(mean_delta_i) + delta_t - sg(delta_t)), evaluated as
            # sg(s_i) * (1 + delta_t - sg(delta_t)): the same value and first derivative
            # without a per-token exp.
            ratio = aux["s"] * (1.0 + (delta - sg(delta)))
        else:
            ratio = jnp.exp(delta)
        r_eff, hi, lo, dual = _ratio_clip(ratio, a, hp["eps_low"], hp["eps_high"],
                                          hp["dual_clip"])
        q = m * jnp.where(inside & ~(hi | lo | dual), ratio, -r_eff)
        return jnp.abs(q), jnp.maximum(q, 0.0)

    return terms


def _clipped_surrogate(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """ppo / grpo / dr_grpo / dapo: l_t = max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high))."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv2d(advantages, b)
    norm_len = hp["norm_len"] or b.delta.shape[1]
    loss = _loss(logp, old_logp, b, _loss_aux(adv, ref_logp, hp),
                 [_token_part(_clip_terms(hp, seq_ratio=False), b, hp["agg"], norm_len, adv),
                  *_kl_parts(hp, b, hp["agg"], norm_len)])

    def stats(d, lp, valid, x):
        # The clip conditions in log space (no exp in the metrics pass); they can differ
        # from the loss's r > 1 + eps only within an ulp of the bound.
        a = x["adv"]
        hi = (a > 0) & (d > math.log1p(hp["eps_high"]))
        lo = (a < 0) & (d < math.log1p(-hp["eps_low"]))
        out = _clip_stats(hi, lo, a)
        if hp["dual_clip"] is not None:
            out["dual_clip_frac"] = ("mean", _f32((a < 0) & (d > math.log(hp["dual_clip"]))), 0.0)
        return out

    # Without a dual clip its fraction is 0, a mean of zero rows (so it comes out of the
    # metrics' last pass, not a copy of a constant).
    none = {"dual_clip_frac": jnp.zeros_like(b.n)} if hp["dual_clip"] is None else None
    metrics = _token_metrics(b, logp, old_logp, mask, _metric_inputs(adv, ref_logp, hp),
                             _with_kl(stats, hp), token_rows=none)
    return loss, metrics


def _seq_mean_delta(b: _Batch) -> Array:
    """f32[N] mean_delta_i = sum_t mask * delta / max(n_i, 1)."""
    return jnp.sum(b.m * b.delta, axis=-1) * b.inv_n


def _delta_terms(lp, old, m, aux):
    """v = mask * delta, g = mask where delta's clip does not bind (GSPO's row sums)."""
    delta, inside = _log_ratio(lp, old, m)
    return m * delta, jnp.where(inside, m, 0.0)


def _gspo_outer(hp):
    """Row sum of mask * delta -> GSPO's clipped s_i (elementwise over rows)."""
    def outer(rows, aux):
        s = jnp.exp(rows * aux["inv_n"])
        return _ratio_clip(s, aux["adv"][:, 0], hp["eps_low"], hp["eps_high"], None)[0]
    return outer


def _gspo(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """GSPO: l_i = max(-A_i s_i, -A_i clip(s_i, 1-eps_low, 1+eps_high)), mean over sequences."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv1d(advantages, b)
    loss = _loss(logp, old_logp, b, _loss_aux(adv[:, None], ref_logp, hp),
                 [_seq_part(_delta_terms, _gspo_outer(hp), b, adv),
                  *_kl_parts(hp, b, "seq-mean-token-mean", 1.0)])
    s = jax.lax.stop_gradient(jnp.exp(_seq_mean_delta(b)))  # f32[N], for the metrics
    _, hi, lo, _ = _ratio_clip(s, adv, hp["eps_low"], hp["eps_high"], None)
    hi, lo = _f32(hi), _f32(lo)  # f32[N], per sequence
    metrics = _token_metrics(
        b, logp, old_logp, mask, _metric_inputs(adv, ref_logp, hp), _with_kl(lambda *a: {}, hp),
        seq_rows={"seq_clip_frac_low": lo, "seq_clip_frac_high": hi, "seq_clip_frac": hi + lo,
                  "seq_ratio_mean": s},
        # Share of tokens whose gradient the sequence clip removed.
        token_rows={"clip_frac_low": lo * b.n, "clip_frac_high": hi * b.n})
    return loss, metrics


def _gspo_token(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """GSPO-token: log s_hat_{i,t} = sg(mean_delta_i) + delta_t - sg(delta_t), token clip."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv2d(advantages, b)
    # s_hat has value s_i at every token and d s_hat / d logp_t = s_i (through delta_t,
    # which carries the same [-20, 20] clip as GSPO's mean_delta, so the two gradients
    # agree exactly); see `_clip_terms`.
    s = jax.lax.stop_gradient(jnp.exp(_seq_mean_delta(b)))  # f32[N]
    norm_len = hp["norm_len"] or b.delta.shape[1]
    terms = _clip_terms({**hp, "dual_clip": None}, seq_ratio=True)
    loss = _loss(logp, old_logp, b, _loss_aux(adv, ref_logp, hp, s=s[:, None]),
                 [_token_part(terms, b, hp["agg"], norm_len, adv),
                  *_kl_parts(hp, b, hp["agg"], norm_len)])

    def stats(d, lp, valid, x):
        a, s = x["adv"], x["s"]
        hi = (a > 0) & (s > 1.0 + hp["eps_high"])
        lo = (a < 0) & (s < 1.0 - hp["eps_low"])
        return _clip_stats(hi, lo, a)

    metrics = _token_metrics(b, logp, old_logp, mask,
                             _metric_inputs(adv, ref_logp, hp, s=s[:, None]),
                             _with_kl(stats, hp), seq_rows={"seq_ratio_mean": s})
    return loss, metrics


def _cispo_weight(ratio: Array, hp) -> tuple[Array, Array, Array]:
    """clip(r, 1-eps_low, 1+eps_high) (no lower bound for eps_low=None), hi, lo."""
    hi = ratio > 1.0 + hp["eps_high"]
    weight = jnp.minimum(ratio, 1.0 + hp["eps_high"])
    if hp["eps_low"] is None:
        return weight, hi, jnp.zeros_like(hi)
    return jnp.maximum(weight, 1.0 - hp["eps_low"]), hi, ratio < 1.0 - hp["eps_low"]


def _cispo_terms(hp):
    """v = mask * sg(clip(r)) * logp, g = mask * sg(clip(r)): every valid token keeps a
    gradient, weighted by the clipped IS ratio (a constant at every order)."""
    def terms(lp, old, m, aux):
        delta, _ = _log_ratio(lp, old, m)
        w = jnp.where(m > 0, m * _cispo_weight(jnp.exp(delta), hp)[0], 0.0)
        w = jax.lax.stop_gradient(w)
        return w * jnp.where(m > 0, lp, 0.0), w
    return terms


def _cispo(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """CISPO: l_t = -sg(clip(r_t, 1-eps_low, 1+eps_high)) A_t logp_t; every token keeps a gradient."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv2d(advantages, b)
    norm_len = hp["norm_len"] or b.delta.shape[1]
    loss = _loss(logp, old_logp, b, _loss_aux(adv, ref_logp, hp),
                 [_token_part(_cispo_terms(hp), b, hp["agg"], norm_len, adv),
                  *_kl_parts(hp, b, hp["agg"], norm_len)])

    def stats(d, lp, valid, x):
        w, hi, lo = _cispo_weight(jnp.exp(d), hp)
        return {"clip_frac_low": ("mean", _f32(lo), 0.0),
                "clip_frac_high": ("mean", _f32(hi), 0.0),
                "is_weight_mean": ("mean", w, 0.0),
                "is_weight_max": ("max", w, 0.0)}

    metrics = _token_metrics(b, logp, old_logp, mask, _metric_inputs(adv, ref_logp, hp),
                             _with_kl(stats, hp))
    return loss, metrics


def _geo_clip(delta: Array, adv: Array, eps_low, eps_high):
    """GMPO's sign-dependent log-space clip: (delta*, clipped_high, clipped_low).

    delta*_t = min(delta_t, eps_high) if A >= 0, max(delta_t, -eps_low) if A < 0, written
    with `where` so the clipped tokens have an exactly-zero gradient.
    """
    hi = (adv >= 0) & (delta > eps_high)
    lo = (adv < 0) & (delta < -eps_low)
    return jnp.where(hi, eps_high, jnp.where(lo, -eps_low, delta)), hi, lo


def _geo_stats(hp):
    def stats(d, lp, valid, x):
        _, hi, lo = _geo_clip(d, x["adv"], hp["eps_low"], hp["eps_high"])
        out = _clip_stats(hi, lo, x["adv"])
        if "gamma" in x:
            out["gamma_mean"] = ("mean", x["gamma"], 0.0)
            out["gamma_min"] = ("min", x["gamma"], 1.0)
        return out
    return _with_kl(stats, hp)


def _geo_terms(hp):
    """v = mask * delta*_t (+ log gamma_t for RSPO, no gradient), g = mask where the
    log-space clip does not bind."""
    def terms(lp, old, m, aux):
        delta, inside = _log_ratio(lp, old, m)
        d_star, hi, lo = _geo_clip(delta, aux["adv"], hp["eps_low"], hp["eps_high"])
        v = m * d_star
        if "gamma" in aux:
            # mask * log gamma, with gamma + (1 - mask) = 1 off the mask so that padding
            # needs only gamma >= 0 there (mask is 0/1). Written without a select, XLA:CPU
            # evaluates the log inside the row sum instead of storing an [N,T] array.
            v = v + m * jnp.log(aux["gamma"] + (1.0 - m))
        return v, jnp.where(inside & ~(hi | lo), m, 0.0)
    return terms


def _geo_outer(rows, aux):
    """Row sum -> exp(row sum / n_i): GMPO's g_i, RSPO's S_i."""
    return jnp.exp(rows * aux["inv_n"])


def _geo_seq_ratio(hp, logp, old_logp, b: _Batch, aux: dict) -> Array:
    """f32[N] GMPO's g_i / RSPO's S_i (the same row sums as the loss's, which XLA
    computes once)."""
    v, _ = _geo_terms(hp)(jax.lax.stop_gradient(_f32(logp)), _f32(old_logp), b.m, aux)
    return _geo_outer(jnp.sum(v, axis=-1), {"inv_n": b.inv_n})


def _gmpo(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """GMPO: l_i = -A_i exp(mean_t delta*_t), mean over sequences."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv1d(advantages, b)
    loss = _loss(logp, old_logp, b, _loss_aux(adv[:, None], ref_logp, hp),
                 [_seq_part(_geo_terms(hp), _geo_outer, b, adv),
                  *_kl_parts(hp, b, "seq-mean-token-mean", 1.0)])
    seq_ratio = _geo_seq_ratio(hp, logp, old_logp, b, {"adv": adv[:, None]})
    metrics = _token_metrics(b, logp, old_logp, mask, _metric_inputs(adv, ref_logp, hp),
                             _geo_stats(hp), seq_rows={"seq_ratio_mean": seq_ratio})
    return loss, metrics


def _rspo(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """RSPO: l_i = -A_i exp(mean_t delta*_t) exp(mean_t log gamma_t), mean over sequences."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv1d(advantages, b)
    gamma = jax.lax.stop_gradient(_f32(router_shift))
    loss = _loss(logp, old_logp, b, _loss_aux(adv[:, None], ref_logp, hp, gamma=gamma),
                 [_seq_part(_geo_terms(hp), _geo_outer, b, adv),
                  *_kl_parts(hp, b, "seq-mean-token-mean", 1.0)])
    seq_ratio = _geo_seq_ratio(hp, logp, old_logp, b, {"adv": adv[:, None], "gamma": gamma})
    metrics = _token_metrics(b, logp, old_logp, mask,
                             _metric_inputs(adv, ref_logp, hp, gamma=gamma),
                             _geo_stats(hp), seq_rows={"seq_ratio_mean": seq_ratio})
    return loss, metrics


def _sapo_gate(ratio: Array, adv: Array, hp):
    """(tau, p) with tau = tau_pos where A > 0 else tau_neg, p = sigmoid(tau (r - 1))."""
    tau = jnp.where(adv > 0, hp["tau_pos"], hp["tau_neg"])
    return tau, jax.nn.sigmoid(tau * (ratio - 1.0))


def _sapo_terms(hp, per_token: bool):
    """v = mask * p, g = mask * tau p (1 - p) r (dp/dlogp), p = sigmoid(tau (r - 1)).

    With per-token advantages the 4/tau factor is applied here; with one advantage per
    sequence it is a row weight (see `_sapo`).
    """
    def terms(lp, old, m, aux):
        delta, inside = _log_ratio(lp, old, m)
        r = jnp.exp(delta)
        tau = jnp.where(aux["adv"] > 0, hp["tau_pos"], hp["tau_neg"])
        # sigmoid(tau (r - 1)) as 1 / (1 + e^{tau (1 - r)}): r in [e^-20, e^20], so the
        # exponent can only overflow to +inf (p = 0, the limit) and p(1 - p) stays exact
        # at both ends; on XLA:CPU this costs ~7% less per call than jax.nn.sigmoid.
        p = 1.0 / (1.0 + jnp.exp(tau * (1.0 - r)))
        v, g = m * p, jnp.where(inside, m * (tau * p * (1.0 - p) * r), 0.0)
        if per_token:
            v, g = (4.0 / tau) * v, (4.0 / tau) * g
        return v, g
    return terms


def _sapo(logp, old_logp, advantages, mask, ref_logp, router_shift, norm, hp):
    """SAPO: l_t = -A_t (4/tau) sigmoid(tau (r_t - 1)), tau = tau_pos if A > 0 else tau_neg."""
    b = _prepare(logp, old_logp, mask, norm)
    adv = _adv2d(advantages, b)
    norm_len = hp["norm_len"] or b.delta.shape[1]
    per_token = adv.shape[1] != 1
    if per_token:
        weighted_adv = adv
    else:  # 4/tau is one number per sequence: it joins the advantage in the row weight
        weighted_adv = adv * (4.0 / jnp.where(adv > 0, hp["tau_pos"], hp["tau_neg"]))
    # (4/tau > 0 keeps the sign of A, which picks tau inside the terms.)
    loss = _loss(logp, old_logp, b, _loss_aux(weighted_adv, ref_logp, hp),
                 [_token_part(_sapo_terms(hp, per_token), b, hp["agg"], norm_len, weighted_adv),
                  *_kl_parts(hp, b, hp["agg"], norm_len)])

    def stats(d, lp, valid, x):
        _, q = _sapo_gate(jnp.exp(d), x["adv"], hp)
        gate = 4.0 * q * (1.0 - q)  # gradient weight relative to -A r grad logp
        return {"sapo_gate_mean": ("mean", gate, 0.0), "sapo_gate_min": ("min", gate, 1.0)}

    metrics = _token_metrics(b, logp, old_logp, mask, _metric_inputs(adv, ref_logp, hp),
                             _with_kl(stats, hp))
    return loss, metrics


# --------------------------------------------------------------------------------------
# Registry, validation
# --------------------------------------------------------------------------------------

_KL_DEFAULTS = {"kl_coef": 0.0, "kl_estimator": "k3"}


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered objective: validates its inputs, then calls the pure implementation.

    Attributes:
      name: registry name.
      defaults: accepted hyperparameters and their defaults.
      sequence_level: one loss per sequence (advantages must be f32[N]).
      log_space_eps: eps_low / eps_high bound the log-ratio (GMPO, RSPO), not the ratio.
      needs_router_shift: RSPO.
      impl: the pure function.
    """

    name: str
    defaults: Mapping[str, Any]
    impl: Callable[..., tuple[Array, Metrics]]
    sequence_level: bool = False
    log_space_eps: bool = False
    needs_router_shift: bool = False
    doc: str = ""

    def __call__(self, logp, old_logp, advantages, mask, *, ref_logp=None,
                 router_shift=None, normalizer: Normalizer | None = None, **hyperparameters):
        hp = self.validate_hyperparameters(hyperparameters)
        arrays = self._validate_arrays(logp, old_logp, advantages, mask, ref_logp,
                                       router_shift, normalizer, hp)
        return self.impl(*arrays, normalizer, hp)

    # -- hyperparameters --------------------------------------------------------------
    def validate_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
        """Returns defaults updated by ``hyperparameters``; ValueError on anything wrong."""
        unknown = sorted(set(hyperparameters) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown hyperparameter(s) {unknown}; accepted: {sorted(self.defaults)}")
        hp = {**self.defaults, **hyperparameters}
        for key, value in hp.items():
            _check_hp(self, key, value)
        return hp

    # -- arrays -----------------------------------------------------------------------
    def _validate_arrays(self, logp, old_logp, advantages, mask, ref_logp, router_shift,
                         norm, hp):
        name = self.name
        logp = _as_array(logp, "logp", name)
        if logp.ndim != 2:
            raise ValueError(f"{name}: logp must be f32[N,T], got shape {logp.shape}")
        shape = logp.shape
        old_logp = _as_array(old_logp, "old_logp", name)
        mask = _as_array(mask, "mask", name, floating=False)
        advantages = _as_array(advantages, "advantages", name)
        for arg, x in (("old_logp", old_logp), ("mask", mask)):
            if x.shape != shape:
                raise ValueError(f"{name}: {arg} shape {x.shape} != logp shape {shape}")
        if self.sequence_level:
            if advantages.shape != shape[:1]:
                raise ValueError(f"{name}: advantages must be f32[N] = {shape[:1]} for a "
                                 f"sequence-level objective, got shape {advantages.shape}")
        elif advantages.shape not in (shape[:1], shape):
            raise ValueError(f"{name}: advantages must be f32[N] or f32[N,T] with "
                             f"(N, T) = {shape}, got shape {advantages.shape}")
        if ref_logp is not None:
            ref_logp = _as_array(ref_logp, "ref_logp", name)
            if ref_logp.shape != shape:
                raise ValueError(f"{name}: ref_logp shape {ref_logp.shape} != logp shape {shape}")
        elif hp.get("kl_coef", 0) > 0:
            raise ValueError(f"{name}: kl_coef={hp['kl_coef']} > 0 needs ref_logp "
                             "(pass ref_logp, or kl_coef=0.0)")
        if router_shift is not None:
            router_shift = _as_array(router_shift, "router_shift", name)
            if router_shift.shape != shape:
                raise ValueError(f"{name}: router_shift shape {router_shift.shape} != logp "
                                 f"shape {shape}")
        elif self.needs_router_shift:
            raise ValueError(f"{name}: router_shift (f32[N,T], gspo_jax.routing.router_shift) "
                             "is required")
        if norm is not None:
            if not isinstance(norm, Normalizer):
                raise ValueError(f"{name}: normalizer must be objectives.Normalizer, got "
                                 f"{type(norm).__name__}")
            for field, x in zip(norm._fields, norm):
                if jnp.shape(x) != ():
                    raise ValueError(f"{name}: normalizer.{field} must be a scalar, got "
                                     f"shape {jnp.shape(x)}")
        return logp, old_logp, advantages, mask, ref_logp, router_shift


def _as_array(x, arg: str, name: str, floating: bool = True) -> Array:
    try:
        x = jnp.asarray(x)
    except TypeError as e:
        raise ValueError(f"{name}: {arg} is not an array: {e}") from None
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: {arg} must be floating point, got dtype {x.dtype}")
    return x


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_hp(obj: Objective, key: str, v) -> None:
    name = obj.name

    def need(cond, what):
        if not cond:
            raise ValueError(f"{name}: {key} {what}, got {v!r}")

    if key in ("eps_low", "eps_high", "dual_clip", "kl_coef", "tau_pos", "tau_neg"):
        if v is None and (key == "dual_clip" or (key == "eps_low" and name == "cispo")):
            return
        need(_is_number(v) and math.isfinite(v), "must be a static finite Python number")
    if key in ("eps_low", "eps_high"):
        need(v >= 0, "must be >= 0")
        if key == "eps_low" and not obj.log_space_eps:
            need(v < 1, "must be < 1 (the ratio's lower bound 1 - eps_low must stay positive)")
    elif key == "dual_clip":
        need(v > 1, "must be None or > 1")
    elif key == "kl_coef":
        need(v >= 0, "must be >= 0")
    elif key in ("tau_pos", "tau_neg"):
        need(v > 0, "must be > 0")
    elif key == "kl_estimator":
        need(v in KL_KINDS, f"must be one of {KL_KINDS}")
    elif key == "agg":
        need(v in AGG_MODES, f"must be one of {AGG_MODES}")
    elif key == "norm_len":
        if v is not None:
            need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0,
                 "must be None or a positive int")
    else:  # pragma: no cover - every default key is handled above
        raise AssertionError(key)


_REGISTRY: dict[str, Objective] = {}


def _register(name, impl, defaults, **flags):
    _REGISTRY[name] = Objective(name=name, defaults=dict(defaults), impl=impl,
                                doc=impl.__doc__ or "", **flags)


_TOKEN = {"agg": "seq-mean-token-mean", "norm_len": None}
_register("ppo", _clipped_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
                                      **_KL_DEFAULTS, **_TOKEN, "agg": "token-mean"})
_register("grpo", _clipped_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
                                       "kl_coef": 0.04, "kl_estimator": "k3", **_TOKEN})
_register("dr_grpo", _clipped_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
                                          **_KL_DEFAULTS, **_TOKEN,
                                          "agg": "seq-mean-token-sum-norm"})
_register("dapo", _clipped_surrogate, {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": None,
                                       **_KL_DEFAULTS, **_TOKEN, "agg": "token-mean"})
_register("gspo", _gspo, {"eps_low": 3e-4, "eps_high": 4e-4, **_KL_DEFAULTS},
          sequence_level=True)
_register("gspo_token", _gspo_token, {"eps_low": 3e-4, "eps_high": 4e-4, **_KL_DEFAULTS,
                                      **_TOKEN})
# eps_high for CISPO is not fixed by the seeds; 0.28 (DAPO's clip-higher bound) is our choice.
_register("cispo", _cispo, {"eps_low": None, "eps_high": 0.28, **_KL_DEFAULTS, **_TOKEN,
                            "agg": "token-mean"})
_register("gmpo", _gmpo, {"eps_low": 0.4, "eps_high": 0.4, **_KL_DEFAULTS},
          sequence_level=True, log_space_eps=True)
_register("rspo", _rspo, {"eps_low": 0.4, "eps_high": 0.4, **_KL_DEFAULTS},
          sequence_level=True, log_space_eps=True, needs_router_shift=True)
_register("sapo", _sapo, {"tau_pos": 1.0, "tau_neg": 1.05, **_KL_DEFAULTS, **_TOKEN})

_DOCS = {
    "ppo": "PPO clipped surrogate (token-mean), optional dual clip c > 1 for A < 0.",
    "grpo": "GRPO (DeepSeekMath): clipped surrogate, seq-mean-token-mean, k3 KL with beta 0.04.",
    "dr_grpo": "Dr.GRPO: clipped surrogate, seq-mean-token-sum-norm (no 1/|o| factor), no KL.",
    "dapo": "DAPO: clipped surrogate with clip-higher (0.2, 0.28), token-mean, no KL.",
    "gspo": "GSPO: sequence-level ratio s_i = exp(mean_t delta), clipped per sequence.",
    "gspo_token": "GSPO-token: s_i with a per-token gradient path, for per-token advantages.",
    "cispo": "CISPO (MiniMax-M1): REINFORCE with a stop-gradient clipped IS weight.",
    "gmpo": "GMPO: geometric mean of one-sided log-space-clipped token ratios.",
    "rspo": ("RSPO: GMPO times the geometric mean of the router shift gamma. gamma multiplies "
             "outside the sgn(A) power (objectives.md), so routing drift damps the update "
             "for either sign of A."),
    "sapo": "SAPO: soft sigmoid gate with temperatures tau_pos / tau_neg.",
}


def get(name: str) -> Objective:
    """Returns the objective registered as ``name`` (see `names`)."""
    if name not in _REGISTRY:
        raise ValueError(f"name: unknown objective {name!r}; registered: {names()}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Every registered objective name."""
    return tuple(_REGISTRY)


def describe(name: str) -> str:
    """One line on what the objective is."""
    get(name)
    return _DOCS[name]


# --------------------------------------------------------------------------------------
# Metrics across micro-batches
# --------------------------------------------------------------------------------------


def combine_metrics(stacked: Mapping[str, Array]) -> Metrics:
    """Merges per-micro-batch metrics into those of the whole mini-batch, exactly.

    Args:
      stacked: an objective's metrics with a leading micro-batch axis on every value
        (e.g. the ys of a `lax.scan` over micro-batches), f32[K] each.

    Returns:
      dict of f32 scalars equal to the metrics of the concatenated micro-batches.
    """
    unknown = sorted(set(stacked) - set(METRIC_KINDS))
    if unknown:
        raise ValueError(f"stacked: unknown metric(s) {unknown}")
    for key in ("num_tokens", "num_seqs"):
        if key not in stacked:
            raise ValueError(f"stacked: missing {key!r}, needed as the weight")
    nt, ns = stacked["num_tokens"], stacked["num_seqs"]
    wt, ws = nt / jnp.maximum(jnp.sum(nt), 1.0), ns / jnp.maximum(jnp.sum(ns), 1.0)
    out = {}
    for key, x in stacked.items():
        kind = METRIC_KINDS[key]
        if kind == "count":
            out[key] = jnp.sum(x)
        elif kind == "token":
            out[key] = jnp.sum(wt * x)
        elif kind == "seq":
            out[key] = jnp.sum(ws * x)
        elif kind == "max":
            out[key] = jnp.max(x)
        elif kind == "min":
            out[key] = jnp.min(x)
        else:  # std of delta, pooled: E[delta^2] = std^2 + mean^2, mean = -ppo_kl
            mean_k = -stacked["ppo_kl"]
            mean = jnp.sum(wt * mean_k)
            sq = jnp.sum(wt * (x * x + mean_k * mean_k))
            out[key] = jnp.sqrt(jnp.maximum(sq - mean * mean, 0.0))
    return out


# --------------------------------------------------------------------------------------
# PPO with a critic
# --------------------------------------------------------------------------------------


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               clip_eps: float | None = 0.2, agg: str = "token-mean",
               norm_len: int | None = None,
               normalizer: Normalizer | None = None) -> tuple[Array, Metrics]:
    r"""PPO's clipped value loss.

    l_t = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2), aggregated
    like the policy loss (``clip_eps=None``: the unclipped 1/2 (V - R)^2).

    Args:
      values: f32[N,T] V_phi(s_t) (differentiated).
      old_values: f32[N,T] the critic's values when the batch was collected.
      returns: f32[N,T] regression targets (`gspo_jax.advantages.gae`).
      mask: f32[N,T].
      clip_eps: eps_v >= 0, or None.
      agg, norm_len, normalizer: as for the objectives.

    Returns:
      (loss, metrics) with metrics ``value_clip_frac`` (share of tokens where the clipped
      term is the larger) and ``value_error`` (masked mean of (V - R)^2).
    """
    values = jnp.asarray(values)
    for arg, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if jnp.shape(x) != values.shape or values.ndim != 2:
            raise ValueError(f"value_loss: {arg} shape {jnp.shape(x)} != values shape "
                             f"{values.shape} (both f32[N,T])")
    if clip_eps is not None and not (_is_number(clip_eps) and clip_eps >= 0):
        raise ValueError(f"value_loss: clip_eps must be None or >= 0, got {clip_eps!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"value_loss: agg must be one of {AGG_MODES}, got {agg!r}")
    b = _prepare(jnp.zeros_like(values), jnp.zeros_like(values), jnp.asarray(mask), normalizer)
    v = jnp.where(b.valid, values.astype(jnp.float32), 0.0)
    v_old = jax.lax.stop_gradient(jnp.where(b.valid, jnp.asarray(old_values, jnp.float32), 0.0))
    ret = jax.lax.stop_gradient(jnp.where(b.valid, jnp.asarray(returns, jnp.float32), 0.0))
    err = (v - ret) ** 2
    if clip_eps is None:
        per_tok, clipped = 0.5 * err, jnp.zeros_like(b.valid)
    else:
        v_clip = v_old + jnp.clip(v - v_old, -clip_eps, clip_eps)
        err_clip = (v_clip - ret) ** 2
        per_tok, clipped = 0.5 * jnp.maximum(err, err_clip), err_clip > err
    loss = _aggregate(per_tok, b, agg, norm_len or values.shape[1])
    metrics = {"value_clip_frac": _tok_mean(_f32(clipped), b),
               "value_error": _tok_mean(jax.lax.stop_gradient(err), b)}
    return loss, metrics


def token_entropy(logits: Array) -> Array:
    """Entropy of the next-token distribution, f32[..., V] logits -> f32[...]."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def entropy_bonus(entropy: Array, mask: Array, *, coef: float = 0.01,
                  agg: str = "token-mean", norm_len: int | None = None,
                  normalizer: Normalizer | None = None) -> tuple[Array, Metrics]:
    """Entropy bonus as a loss term: -coef * agg(H_t).

    Args:
      entropy: f32[N,T] per-token entropy (`token_entropy`), differentiated.
      mask: f32[N,T].
      coef: >= 0.
      agg, norm_len, normalizer: as for the objectives.

    Returns:
      (loss, {"entropy": masked token mean of H}).
    """
    entropy = jnp.asarray(entropy)
    if entropy.ndim != 2 or jnp.shape(mask) != entropy.shape:
        raise ValueError(f"entropy_bonus: entropy {entropy.shape} and mask {jnp.shape(mask)} "
                         "must both be f32[N,T]")
    if not (_is_number(coef) and coef >= 0):
        raise ValueError(f"entropy_bonus: coef must be a number >= 0, got {coef!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"entropy_bonus: agg must be one of {AGG_MODES}, got {agg!r}")
    b = _prepare(jnp.zeros_like(entropy), jnp.zeros_like(entropy), jnp.asarray(mask), normalizer)
    h = jnp.where(b.valid, entropy.astype(jnp.float32), 0.0)
    loss = -coef * _aggregate(h, b, agg, norm_len or entropy.shape[1])
    return loss, {"entropy": _tok_mean(jax.lax.stop_gradient(h), b)}
