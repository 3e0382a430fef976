"""Stage 1 of the stability study: drift probes (experiments/stability/README.md).

From each warm start, ``batches`` rollout batches are sampled; from each, the warm
start's parameters take ``updates`` sequential optimizer updates (one mini-batch of
the batch each, as RL with that many updates per rollout does), and after every
update the whole batch is measured against pi_old = the warm start:

* exact KL(pi_old || pi_theta) over the full (character) vocabulary at every response
  token, mean and max; F(tau=2), the share of tokens whose ratio leaves [1/2, 2]; the
  spread of the sampled tokens' log-ratios (std, 99th percentile and max of |log r|);
* the token clip fraction (the share of valid tokens whose gradient the clip removes:
  A > 0 above the upper bound, A < 0 below the lower) under GRPO's token range and,
  for GSPO's sequence ratio, under its paper range, ten times it, and a grid of ranges
  (the calibrated range is read from the grid), overall and by response length;
* on MoE arms: the free router's top-K flips against pi_old's per layer, the share of
  tokens with any flip, and the raw router shift, mean |delta log p_router| at
  pi_old's experts, per layer.

The rollouts of one warm start are sampled once and shared by every objective and
learning rate (a paired design). Each probe's records go to
``<out>/probes/<arm>_<objective>_lr<lr>_s<seed>.jsonl`` (one line per batch and update
index k, k = 0 being pi_old itself); a probe whose file exists is skipped, so the
script resumes after an interrupted chunk.

    python -m experiments.stability.stage1_probes --root runs/stability \
        --only-arms moe2,dense2 --max-minutes 55                      # one chunk
    python -m experiments.stability.stage1_probes --report   # figures, tables
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.stability import common, stage1_report
from experiments.stability.stage1_config import gspo_grid
from gspo_jax import config as config_lib
from gspo_jax import passes, routing

OUT = os.path.join(common.RESULTS, "stage1")


def probe_config(sc, arm: str, seed: int, objective: str, lr: float, root: str):
    """The trainer's config of one probe: constant ``lr`` without warmup (the first
    update moves the policy as much as every later one)."""
    c = common.base_config(arm, seed, smoke=sc.smoke, data_dir=os.path.join(root, "data"))
    eps = sc.grpo_eps if objective == "grpo" else sc.gspo_eps
    config_lib.set_objective(
        c, objective, {"eps_low": float(eps[0]), "eps_high": float(eps[1]), "kl_coef": 0.0}
    )
    c.rollout.prompts_per_step = int(sc.prompts)
    c.rollout.group_size = int(sc.group_size)
    c.updates.num_minibatches = int(sc.updates)
    c.optimizer.lr = float(lr)
    c.optimizer.warmup_steps = 0
    c.optimizer.schedule = "constant"
    return c


@functools.partial(
    jax.jit, static_argnames=("graphdef", "temperature", "grpo_eps", "gspo_ranges", "edges", "moe")
)
def drift_metrics(
    params, batch, old_lp, *, graphdef, temperature, grpo_eps, gspo_ranges, edges, moe
):
    """The drift of ``params`` from pi_old on ``batch`` (the module docstring).

    ``old_lp``: pi_old's full log-probs f32[N, T, V] at the response positions.
    Returns scalars, per-layer vectors f32[L], per-bucket vectors f32[B] and the
    sequence-range grid f32[G] / f32[G, B].
    """
    model = nnx.merge(graphdef, params)
    inputs, _, positions, attn = passes.sequence_inputs(batch)
    h, aux = model.hidden(inputs, positions=positions, attn_mask=attn)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    z = model.logits(passes.response_slice(h, p, t)) / temperature
    lp = jax.nn.log_softmax(z, axis=-1)  # f32[N, T, V]
    m = batch["mask"].astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    tok = batch["tokens"][..., None]
    log_r = jnp.where(
        m > 0,
        jnp.take_along_axis(lp, tok, -1)[..., 0] - jnp.take_along_axis(old_lp, tok, -1)[..., 0],
        0.0,
    )
    p_old = jnp.exp(old_lp)
    kl_tok = jnp.sum(jnp.where(p_old > 0, p_old * (old_lp - lp), 0.0), axis=-1)  # [N, T]
    ent_tok = -jnp.sum(jnp.where(p_old > 0, jnp.exp(lp) * lp, 0.0), axis=-1)
    abs_r = jnp.abs(log_r)
    mean_r = jnp.sum(m * log_r) / n
    out = {
        "kl_exact": jnp.sum(m * kl_tok) / n,
        "kl_exact_max": jnp.max(m * kl_tok),
        "f2": jnp.sum(m * (abs_r > math.log(2.0))) / n,
        "logratio_mean": mean_r,
        "logratio_std": jnp.sqrt(jnp.sum(m * (log_r - mean_r) ** 2) / n),
        "logratio_abs_q99": jnp.nanquantile(jnp.where(m > 0, abs_r, jnp.nan), 0.99),
        "logratio_abs_max": jnp.max(m * abs_r),
        "entropy": jnp.sum(m * ent_tok) / n,
    }

    # Clip fractions. Advantages are per sequence (group) or per token.
    adv = batch["advantages"]
    length = jnp.sum(m, axis=1)  # [N]
    a_tok = adv if adv.ndim == 2 else jnp.broadcast_to(adv[:, None], m.shape)
    a_seq = jnp.sum(m * a_tok, axis=1) / jnp.maximum(length, 1.0)
    ratio = jnp.exp(log_r)
    lo, hi = grpo_eps
    grpo_clipped = m * (((a_tok > 0) & (ratio > 1 + hi)) | ((a_tok < 0) & (ratio < 1 - lo)))
    s = jnp.exp(jnp.sum(m * log_r, axis=1) / jnp.maximum(length, 1.0))  # GSPO's s_i
    lows = jnp.asarray([r[0] for r in gspo_ranges])[:, None]
    highs = jnp.asarray([r[1] for r in gspo_ranges])[:, None]
    a_seq, s = a_seq[None, :], s[None, :]
    seq_clipped = ((a_seq > 0) & (s > 1 + highs)) | ((a_seq < 0) & (s < 1 - lows))  # [G, N]
    seq_tokens = seq_clipped * length[None, :]  # the tokens of clipped sequences
    bucket = jnp.sum(length[:, None] > jnp.asarray(edges)[None, :], axis=1)
    onehot = jax.nn.one_hot(bucket, len(edges) + 1) * (length > 0)[:, None]  # [N, B]
    bucket_tokens = length @ onehot  # [B]
    denom = jnp.maximum(bucket_tokens, 1.0)
    per_bucket = lambda x: x / denom.reshape((1,) * (x.ndim - 1) + (-1,))  # noqa: E731
    out.update(
        clip_grpo=jnp.sum(grpo_clipped) / n,
        clip_grpo_bucket=per_bucket(jnp.sum(grpo_clipped, axis=1) @ onehot),
        clip_gspo=jnp.sum(seq_tokens, axis=1) / n,
        clip_gspo_bucket=per_bucket(seq_tokens @ onehot),
        bucket_tokens=bucket_tokens,
    )
    if moe:
        free = passes.response_slice(aux.free_topk_indices, p, t)
        layer_flips = routing.expert_flip_fraction(batch["old_free_topk"], free, m)
        new_router_lp = routing.topk_router_logp(
            passes.response_slice(aux.router_logits, p, t), batch["old_topk"]
        )
        shift = routing.router_logp_shift(batch["old_router_logp"], new_router_lp)  # [N,T,L]
        layer_shift = jnp.einsum("ntl,nt->l", shift, m) / n
        out.update(
            flip_frac=jnp.mean(layer_flips),
            flip_frac_layer=layer_flips,
            token_flip_rate=routing.token_flip_rate(batch["old_free_topk"], free, m),
            router_shift_raw=jnp.mean(layer_shift),
            router_shift_raw_layer=layer_shift,
        )
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def full_logprobs(params, batch, *, graphdef, temperature):
    """pi's full log-probs f32[N, T, V] at the response positions of ``batch``."""
    model = nnx.merge(graphdef, params)
    inputs, _, positions, attn = passes.sequence_inputs(batch)
    h, _ = model.hidden(inputs, positions=positions, attn_mask=attn)
    p, t = batch["prompt_tokens"].shape[1], batch["tokens"].shape[1]
    return jax.nn.log_softmax(model.logits(passes.response_slice(h, p, t)) / temperature, axis=-1)


def _round(x, digits: int = 6):
    """JSON-ready values, rounded to ``digits`` significant digits (compact files)."""
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    a = np.asarray(x, np.float64)
    if a.ndim == 0:
        v = float(a)
        return v if not math.isfinite(v) or v == 0 else float(f"{v:.{digits}g}")
    return [_round(v, digits) for v in a.tolist()]


TRAIN_METRICS = ("clip_frac", "grad_norm", "update_norm", "no_signal", "loss")


def run_probe(trainer, phase, params0, host_batches, sc, ranges) -> list[dict]:
    """The records of one probe: for each rollout batch, pi_old (k = 0) and the drift
    after each of ``sc.updates`` updates from ``params0``."""
    cfg = trainer.cfg
    graphdef = trainer.graphdef
    kw = dict(
        graphdef=graphdef,
        temperature=cfg.rollout.temperature,
        grpo_eps=tuple(map(float, sc.grpo_eps)),
        gspo_ranges=ranges,
        edges=tuple(int(e) for e in sc.length_edges),
        moe=trainer.model_cfg.num_moe_layers > 0,
    )
    records = []
    for b, host_batch in enumerate(host_batches, start=int(sc.get("batch_offset", 0))):
        phase.state = trainer.new_state(jax.tree.map(jnp.copy, params0), phase.optimizer)
        batch, _ = phase.prepare(host_batch, 0)
        old_lp = full_logprobs(params0, batch, graphdef=graphdef, temperature=kw["temperature"])
        n = batch["tokens"].shape[0]
        mb = n // int(sc.updates)
        perm = np.random.default_rng(1000 * cfg.seed + b).permutation(n)
        per_k = [(drift_metrics(phase.state.params, batch, old_lp, **kw), {})]
        for k in range(int(sc.updates)):
            rows = perm[k * mb : (k + 1) * mb]
            mini = trainer.put_batch({key: v[rows] for key, v in batch.items()})
            phase.state, m = phase.train_fn(phase.state, mini, jax.random.key(k))
            trained = {f"train_{name}": m[name].compute() for name in TRAIN_METRICS if name in m}
            per_k.append((drift_metrics(phase.state.params, batch, old_lp, **kw), trained))
        for k, (drift, trained) in enumerate(jax.device_get(per_k)):
            records.append(dict(batch=b, k=k, **_round(drift), **_round(trained)))
    return records


def probe_path(out: str, arm: str, objective: str, lr: float, seed: int) -> str:
    return os.path.join(out, "probes", f"{arm}_{objective}_lr{lr:g}_s{seed}.jsonl")


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every probe of the grid not yet in ``out``, warm start by warm start, until the
    chunk's budget expires. Returns the number of probes run."""
    from gspo_jax import sft
    from gspo_jax.rl import RLPhase
    from gspo_jax.run_parts import RunParts

    ranges = gspo_grid(sc)
    done = 0
    for seed in sc.seeds:
        for arm in sc.arms:
            todo = [
                (obj, lr)
                for obj in sc.objectives
                for lr in sc.lrs
                if not os.path.exists(probe_path(out, arm, obj, lr, seed))
            ]
            if not todo:
                continue
            if budget.expired():
                return done
            warm = common.ensure_warm_start(root, arm, int(seed), smoke=sc.smoke)
            host_batches = None
            for obj, lr in todo:
                if budget.expired():
                    return done
                c = probe_config(sc, arm, int(seed), obj, lr, root)
                trainer = RunParts(c, warm)
                params0 = sft.final_params(trainer)
                if params0 is None:
                    raise RuntimeError(
                        f"{warm}: the warm start's final checkpoint does not restore"
                    )
                phase = RLPhase(trainer, params0)
                if host_batches is None:  # one set of rollouts per warm start, shared
                    first = int(sc.get("batch_offset", 0))  # stage 5 skips stage 1's
                    host_batches = [
                        phase.queued(
                            *phase.collect(params0, b, jax.random.fold_in(jax.random.key(seed), b)),
                            step=b,
                            version=0,
                        )
                        for b in range(first, first + int(sc.batches))
                    ]
                records = run_probe(trainer, phase, params0, host_batches, sc, ranges)
                meta = dict(arm=arm, objective=obj, lr=float(lr), seed=int(seed))
                common.write_jsonl(
                    probe_path(out, arm, obj, lr, seed), [dict(meta, **r) for r in records]
                )
                last = records[-1]
                log(
                    f"probe {arm} {obj} lr={lr:g} seed={seed}: after {last['k']} updates "
                    f"kl={last['kl_exact']:.4g} f2={last['f2']:.4g} "
                    f"flip={last.get('flip_frac', float('nan')):.4g}"
                )
                done += 1
    return done


def main(argv=None) -> None:
    only = ("arms", "seeds")
    args = common.stage_parser(__doc__, OUT, "stage1_config.py", only).parse_args(argv)
    sc = common.stage_config(args, only)
    if args.report:
        stage1_report.report(args.out, sc)
        return
    n = run_all(sc, args.root, args.out, common.Budget(args.max_minutes))
    print(f"stage 1: {n} probes run into {args.out}")


if __name__ == "__main__":
    main()
