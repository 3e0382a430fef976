"""Sampler/trainer routing disagreement under router noise (experiments/router_noise.md).

The sampler (`gspo_jax.rollout.Sampler`, ``router_noise_std=σ``) adds N(0, σ²) to
its router logits; the trainer's forward does not.  For the default config's
model (configs/default.py: d_model 128, 2 MoE layers, 8 experts top-2, the
character tokenizer) on Countdown prompts (3 numbers in 1..9, target 1..30),
at random init and after a short supervised warm start on reference
solutions, this script samples G responses per prompt at temperature 1 for
every σ and compares the record with the trainer's teacher-forced forward over
the same sequences:

* disagreement: share of the sampler's top-K choices (valid response positions,
  per MoE layer and over all) not in the trainer's free top-K of that token and
  layer (`RouterAux.free_topk_indices`, no replay);
* tokens flipped: share of valid response tokens with any such choice;
* mean |Δlogp| and F(2): |log π_trainer − logp| of the sampled tokens and the
  share of tokens whose ratio π_trainer / π_sampler is outside [1/2, 2],
  for the free forward and for R3 (the trainer replays the sampler's record:
  the same experts, gated by the trainer's un-noised router).

Each seed draws its own model init, prompts and sampling key; the table gives
the mean over seeds (± the standard deviation over seeds for the overall
disagreement).  Metrics pool the seed's valid tokens.

    python -m experiments.router_noise                  # 3 seeds
    python -m experiments.router_noise --seeds=1 --sft-steps=0
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import default as default_config
from gspo_jax import rollout
from gspo_jax.answers import ANSWER_CLOSE, ANSWER_OPEN
from gspo_jax.models import ModelConfig, Transformer
from gspo_jax.tasks import countdown, prompts
from gspo_jax.tokenizers import CharTokenizer

SIGMAS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
LN2 = math.log(2.0)


def default_model_config(vocab_size: int) -> ModelConfig:
    """The default config's model (its `model.fields` and runtime settings)."""
    c = default_config.get_config()
    fields = dict(c.model.fields)
    fields.update({k: c.model[k] for k in ("dtype", "param_dtype", "moe_backend", "scan_layers")})
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    return ModelConfig(**fields)


def countdown_examples(n: int, seed: int) -> list[tuple[str, str]]:
    """n (prompt, reference completion) texts of the 'small' Countdown task."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = countdown.generate_problem(
            rng, num_numbers=3, min_number=1, max_number=9, min_target=1, max_target=30
        )
        out.append((countdown.prompt(p.numbers, p.target), prompts.answer_span(p.solution)))
    return out


def sft(model: Transformer, tok: CharTokenizer, *, steps: int, batch: int, lr: float, seed: int):
    """A supervised warm start on reference solutions, shorter than the default
    config's (its learning rate, Adam, 20 warm-up steps, gradient clipping at 1,
    aux / z-loss coefficients 0.01 / 0.001): (model, last step's NLL)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, 20), optax.constant_schedule(lr)], [20]
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask, loss_mask):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            lp, _, aux = m.token_logprobs(tokens, jnp.roll(tokens, -1, axis=1), attn_mask=mask)
            nll = -jnp.sum(lp * loss_mask) / jnp.sum(loss_mask)
            return nll + 0.01 * aux.aux_loss + 0.001 * aux.z_loss, nll

        (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, nll

    examples = countdown_examples(steps * batch, seed=10_000 + seed)
    length = 64
    nll = float("nan")
    for i in range(steps):
        tokens = np.full((batch, length), tok.pad_id, np.int32)
        loss_mask = np.zeros((batch, length), np.float32)
        for j, (prompt, ref) in enumerate(examples[i * batch : (i + 1) * batch]):
            p = [tok.bos_id] + tok.encode(prompt)
            seq = p + tok.encode(ref) + [tok.eos_id]
            if len(seq) > length:
                raise ValueError(f"an SFT sequence of {len(seq)} tokens exceeds {length}")
            tokens[j, : len(seq)] = seq
            loss_mask[j, len(p) - 1 : len(seq) - 1] = 1.0  # positions predicting the reference
        params, opt_state, nll = step(params, opt_state, tokens, tokens != tok.pad_id, loss_mask)
    return nnx.merge(graphdef, params, rest), float(nll)


@functools.partial(jax.jit, static_argnums=0)
def trainer_forward(graphdef, state, tokens, positions, mask, replay):
    """The trainer's teacher-forced log-probs of the next tokens, free top-K and
    routing margin (K-th minus (K+1)-th largest router logit, f32[B, T, L])."""
    lp, _, aux = nnx.merge(graphdef, state).token_logprobs(
        tokens, jnp.roll(tokens, -1, axis=1), positions=positions, attn_mask=mask, replay=replay
    )
    k = aux.free_topk_indices.shape[-1]
    top = jax.lax.top_k(aux.router_logits, k + 1)[0]
    return lp, aux.free_topk_indices, top[..., k - 1] - top[..., k]


def measure(sampler: rollout.Sampler, prompt_ids, *, sigma, rng, num_samples, max_new_tokens, tok):
    """One rollout at router noise σ against the trainer: a dict of metrics."""
    r = sampler(
        prompt_ids,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        rng=rng,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        router_noise_std=sigma,
    )
    tokens = jnp.concatenate([r.prompt_tokens, r.tokens], axis=1)
    mask = jnp.concatenate([r.prompt_mask, r.mask > 0], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    P, T = r.prompt_tokens.shape[1], r.tokens.shape[1]
    resp = slice(P - 1, P - 1 + T)  # the positions that predict response tokens
    args = (sampler.graphdef, sampler.state, tokens, positions, mask)
    lp_free, topk, margin = (np.asarray(a[:, resp]) for a in trainer_forward(*args, None))
    lp_r3 = trainer_forward(*args, r.replay())[0]
    valid = np.asarray(r.mask) > 0
    rec, ref = np.asarray(r.experts)[valid], topk[valid]  # [M, L, K]
    missed = ~np.any(rec[..., :, None] == ref[..., None, :], axis=-1)  # [M, L, K]
    d_free = np.abs(lp_free - np.asarray(r.logp))[valid]
    d_r3 = np.abs(np.asarray(lp_r3[:, resp]) - np.asarray(r.logp))[valid]
    return dict(
        layers=missed.mean(axis=(0, 2)),
        overall=missed.mean(),
        tokens_flipped=missed.any(axis=(1, 2)).mean(),
        dlogp=d_free.mean(),
        f2=(d_free > LN2).mean(),
        dlogp_r3=d_r3.mean(),
        f2_r3=(d_r3 > LN2).mean(),
        n_tokens=int(valid.sum()),
        margin=np.median(margin[valid]),
    )


def table(results: dict[float, list[dict]], num_layers: int) -> str:
    layer_cols = " | ".join(f"layer {i}" for i in range(num_layers))
    head = (
        f"| σ | {layer_cols} | overall | tokens flipped | mean \\|Δlogp\\| | F(2) "
        "| R3 mean \\|Δlogp\\| | R3 F(2) |"
    )
    lines = [head, "|" + "---|" * (num_layers + 7)]
    for sigma, runs in results.items():
        mean = lambda k: np.mean([run[k] for run in runs], axis=0)
        layers = " | ".join(f"{x:.3f}" for x in mean("layers"))
        std = np.std([run["overall"] for run in runs])
        lines.append(
            f"| {sigma:g} | {layers} | {mean('overall'):.3f} ± {std:.3f} "
            f"| {mean('tokens_flipped'):.3f} | {mean('dlogp'):.4f} | {mean('f2'):.4f} "
            f"| {mean('dlogp_r3'):.4f} | {mean('f2_r3'):.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per seed")
    parser.add_argument("--num-samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--sft-steps", type=int, default=80, help="0: random init only")
    parser.add_argument("--sft-batch", type=int, default=32)
    args = parser.parse_args()

    start = time.time()
    c = default_config.get_config()
    tok = CharTokenizer(words=(ANSWER_OPEN, ANSWER_CLOSE))
    cfg = default_model_config(tok.vocab_size)
    phases = ["random init"]
    if args.sft_steps:
        phases.append(f"after {args.sft_steps} SFT steps of {args.sft_batch} sequences")
    results = {phase: {s: [] for s in SIGMAS} for phase in phases}
    sft_nll = []
    for seed in range(args.seeds):
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        prompt_ids = [
            [tok.bos_id] + tok.encode(p) for p, _ in countdown_examples(args.prompts, seed)
        ]
        for phase in phases:
            if phase != "random init":
                model, nll = sft(
                    model,
                    tok,
                    steps=args.sft_steps,
                    batch=args.sft_batch,
                    lr=float(c.sft.lr),
                    seed=seed,
                )
                sft_nll.append(nll)
            sampler = rollout.Sampler.from_model(model)
            for sigma in SIGMAS:
                results[phase][sigma].append(
                    measure(
                        sampler,
                        prompt_ids,
                        sigma=sigma,
                        rng=jax.random.key(seed),
                        num_samples=args.num_samples,
                        max_new_tokens=args.max_new_tokens,
                        tok=tok,
                    )
                )
    print(
        f"# Router noise: sampler vs trainer ({datetime.date.today()}, {jax.default_backend()}, "
        f"{time.time() - start:.0f} s)\n"
    )
    print(
        f"Model: d_model {cfg.d_model}, {cfg.num_layers} layers ({cfg.num_moe_layers} MoE), "
        f"{cfg.num_experts} experts top-{cfg.top_k}, vocab {cfg.vocab_size}; {args.seeds} seeds x "
        f"{args.prompts} prompts x {args.num_samples} samples, <= {args.max_new_tokens} new "
        "tokens, temperature 1."
    )
    if sft_nll:
        print(f"SFT last-step NLL per seed: {', '.join(f'{x:.3f}' for x in sft_nll)}.")
    for phase in phases:
        runs = results[phase][SIGMAS[0]]
        n_tok = np.mean([run["n_tokens"] for run in runs])
        margin = np.mean([run["margin"] for run in runs])
        print(
            f"\n## {phase}\n\nAbout {n_tok:.0f} valid response tokens per seed; median routing "
            f"margin (K-th minus (K+1)-th router logit, trainer, σ = 0) {margin:.3f}.\n"
        )
        print(table(results[phase], cfg.num_moe_layers))


if __name__ == "__main__":
    main()
