"""The supervised warm start: a policy that is sometimes right before RL begins.

The data set's reference solutions, trained on with the token-mean NLL
(:func:`sft_step`), ``config.sft.steps`` steps. It is a phase of its own,
with its own checkpoints (``checkpoints/sft``); once RL has begun it is never repeated,
and its final parameters are the reference policy of a KL term
(:func:`reference_for_resume`).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gspo_jax import config as config_lib
from gspo_jax import loop, lora_training, optim, safety, step
from gspo_jax import metrics as metrics_lib
from gspo_jax.checkpoint import PhaseCheckpointer
from gspo_jax.data.encoding import encode_prompt, pad_left, pad_right
from gspo_jax.metrics import Mean, Sum
from gspo_jax.passes import forward
from gspo_jax.run_config import RunConfig
from gspo_jax.run_parts import RunParts


def sft_loss(
    params,
    batch: dict[str, jax.Array],
    *,
    graphdef,
    num_tokens,
    micro_batches: int,
    aux_loss_coef: float,
):
    """Token-mean negative log-likelihood of the response given the prompt."""
    model = nnx.merge(graphdef, params)
    f = forward(model, batch, None)
    mask = batch["mask"].astype(jnp.float32)
    nll = -jnp.sum(f.logp * mask) / num_tokens  # this micro-batch's share of the mean
    metrics = {
        "sft_nll": Sum.of(jax.lax.stop_gradient(nll)),
        "entropy": Mean.masked(jax.lax.stop_gradient(f.entropy), mask),
        "aux_loss": Mean.of(f.aux_loss),
    }
    return nll + aux_loss_coef * f.aux_loss / micro_batches, metrics


def sft_step(
    state: step.TrainState,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    *,
    graphdef,
    optimizer,
    schedule,
    micro_batches: int = 1,
    aux_loss_coef: float = 0.0,
    trainable: str = "all",
):
    """One supervised update on prompt+reference-response sequences (of the
    ``trainable`` parameters: all, or with LoRA all but the adapters). Returns (the new
    state, the update's metrics, mergeable as `train_step`'s)."""
    del rng
    num_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
    loss_fn = functools.partial(
        sft_loss,
        graphdef=graphdef,
        num_tokens=num_tokens,
        micro_batches=micro_batches,
        aux_loss_coef=aux_loss_coef,
    )
    loss, metrics, grads = step.accumulate(loss_fn, state.params, batch, micro_batches, trainable)
    new_state, norms = step.apply_update(
        state, grads, loss, optimizer, schedule, trainable=trainable
    )
    return new_state, dict(metrics, loss=Mean.of(loss), **norms)


def sft_batch(t: RunParts, position: int) -> tuple[dict[str, np.ndarray], int]:
    """The warm start's batch at data position ``position`` and the number of its
    prompts truncated (`fit_prompts`)."""
    cfg, tok = t.cfg, t.tokenizer
    examples = t.train_data.batch(position, cfg.sft.batch_size)
    prompts, cut = t.fit_prompts(
        [encode_prompt(tok, ex.prompt, ex.messages) for ex in examples], "a warm-start prompt"
    )
    T = cfg.rollout.max_new_tokens
    responses = []
    for ex in examples:
        if ex.reference is None:
            raise ValueError(
                f"task {cfg.task.name!r} example {ex.index} has no reference solution for sft"
            )
        r = tok.encode(ex.reference) + [tok.eos_id]
        if len(r) > T:
            raise config_lib.ConfigError(
                f"config.rollout.max_new_tokens: {T} is shorter than a reference solution ({len(r)} tokens)"
            )
        responses.append(r)
    pt, pm = pad_left(prompts, t.max_prompt_len, tok.pad_id)
    rt, rm = pad_right(responses, T, tok.pad_id)
    return {"prompt_tokens": pt, "prompt_mask": pm, "tokens": rt, "mask": rm}, cut


def sft_optimizer(cfg: RunConfig):
    """The warm start's AdamW and schedule (a cosine decay), from ``config.sft``."""
    s = cfg.sft
    return optim.make_optimizer(
        lr=s.lr,
        schedule="cosine",
        total_steps=s.steps,
        warmup_steps=s.warmup_steps,
        end_lr_ratio=s.end_lr_ratio,
        weight_decay=s.weight_decay,
        b1=s.b1,
        b2=s.b2,
        grad_clip=s.grad_clip,
    )


def restore_state(t: RunParts):
    """(checkpointer, optimizer, schedule, state, step) of the warm start, resumed
    from its newest checkpoint that restores (step 0: none)."""
    cfg = t.cfg
    ckpt = PhaseCheckpointer(
        t.workdir, "sft", every=cfg.checkpoint_every, keep=cfg.keep_checkpoints
    )
    optimizer, sched = sft_optimizer(t.cfg)
    state = t.new_state(t.init_params, optimizer, lora_training.trainable(cfg.lora, "sft"))
    start = 0
    if ckpt.latest_step() is not None:
        state, meta, start = ckpt.restore(state)
        safety.check_sources(meta, t.sources(), f"{ckpt.directory}/{start}")
    return ckpt, optimizer, sched, state, start


def final_params(t: RunParts):
    """The warm start's final parameters from its checkpoint, or None when that
    checkpoint is gone or does not restore (RL, once begun, never repeats it)."""
    ckpt, _, _, state, start = restore_state(t)
    ckpt.close()
    return state.params if start >= t.cfg.sft.steps else None


class WarmStart:
    """The warm start as a phase of the run's loop (`gspo_jax.loop.Phase`), resumed
    from its newest valid checkpoint (`restore_state`)."""

    name = "sft"

    def __init__(self, t: RunParts):
        cfg = t.cfg
        self.t, self.cfg, self.steps = t, cfg, cfg.sft.steps
        self.ckpt, optimizer, sched, self.state, self.start = restore_state(t)
        self.key = jax.random.key(cfg.seed)
        self.fn = None
        if self.start < self.steps:
            self.fn = t.jit_step(
                sft_step,
                self.state,
                optimizer=optimizer,
                schedule=sched,
                micro_batches=1,
                aux_loss_coef=cfg.sft.aux_loss_coef,
                trainable=lora_training.trainable(cfg.lora, "sft"),
            )

    def run_step(self, s: int):
        """One step on the batch at data position s * batch_size; its metrics stay on
        the devices but for the health check's two scalars."""
        self._t0 = time.perf_counter()
        host_batch, self._cut = sft_batch(self.t, s * self.t.cfg.sft.batch_size)
        self._tokens = float(np.sum(host_batch["mask"]))
        self.state, m = self.fn(
            self.state, self.t.put_batch(host_batch), jax.random.fold_in(self.key, s)
        )
        m = metrics_lib.compute_jit(m)  # the numbers, on the devices
        return m, jax.device_get({k: m[k] for k in ("params_finite", "skipped_in_a_row")})

    def finish_step(self, s: int, m) -> dict[str, Any] | None:
        """Every ``log_every`` steps and the last: the metrics, its time and tokens/s."""
        if (s + 1) % self.cfg.log_every and s + 1 != self.steps:
            return None
        m = jax.device_get(m)
        dt = time.perf_counter() - self._t0
        m["step_time"] = dt
        m["tokens_per_s"] = self._tokens / dt
        m["prompts_truncated"] = self._cut
        return m

    def postfix(self, m, record) -> dict[str, str]:
        return {} if record is None else {"nll": f"{record['sft_nll']:.3f}"}

    def checkpoint_items(self) -> tuple[Any, dict[str, Any]]:
        return self.state, {}

    def close(self) -> None:
        pass


def run(t: RunParts, open_log, guard: safety.RunGuard | None = None) -> Any:
    """The supervised warm start, resumed from its newest valid checkpoint (the run's
    loop, `gspo_jax.loop.run`). Returns (its final parameters, the metrics writer it
    logged to, or None when it had nothing left to do). ``open_log(phase, step)`` opens
    the log cut back to a step."""
    phase = WarmStart(t)
    if phase.start >= phase.steps:
        phase.ckpt.close()
        return phase.state.params, None
    writer = open_log("sft", phase.start)
    with phase.ckpt:  # every way out waits for the save in flight (checkpoint.py)
        loop.run(phase, t, phase.ckpt, writer, guard)
    return phase.state.params, writer


def reference_for_resume(trainer: RunParts):
    """RL resumes and its KL term needs pi_ref (or LoRA its frozen base), the warm
    start's final parameters: from the warm start's last checkpoint. The warm start is
    never repeated once RL has begun; if that checkpoint is gone (or does not restore),
    the run stops and says so, naming what needs it.
    """
    params = final_params(trainer)
    if params is None:
        path = os.path.join(trainer.workdir, "checkpoints", "sft", str(trainer.cfg.sft.steps))
        needs = []
        if trainer.kl_coef:
            needs.append(f"the KL term (kl_coef={trainer.kl_coef}) needs the reference policy")
        if trainer.cfg.lora.rank:
            needs.append(f"LoRA (lora.rank={trainer.cfg.lora.rank}) needs its frozen base")
        raise FileNotFoundError(
            f"RL resumes from its checkpoint, but the warm start's last checkpoint ({path}) "
            f"is gone or does not restore, and {' and '.join(needs)} it holds. Restore that "
            "checkpoint to resume (a warm start is never repeated once RL has begun)."
        )
    return params
