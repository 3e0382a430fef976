"""The supervised warm start: a policy that is sometimes right before RL begins.

The data set's reference solutions, trained on with the token-mean NLL
(:func:`gspo_jax.step.sft_step`), ``config.sft.steps`` steps. It is a phase of its own,
with its own checkpoints (``checkpoints/sft``); once RL has begun it is never repeated,
and its final parameters are the reference policy of a KL term
(:func:`reference_for_resume`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from gspo_jax import config as config_lib
from gspo_jax import lora_rl, safety, step
from gspo_jax import metrics as metrics_lib
from gspo_jax.checkpoint import PhaseCheckpointer
from gspo_jax.data.encoding import encode_prompt, pad_left, pad_right
from gspo_jax.metrics_log import progress_bar
from gspo_jax.run_config import RunConfig
from gspo_jax.trainer import Trainer


def sft_batch(t: Trainer, position: int) -> tuple[dict[str, np.ndarray], int]:
    """The warm start's batch at data position ``position`` and the number of its
    prompts truncated (`fit_prompts`)."""
    c, tok = t.c, t.tokenizer
    cfg = t.cfg
    examples = t.train_data.batch(position, cfg.sft.batch_size)
    prompts, cut = t.fit_prompts(
        [encode_prompt(tok, ex.prompt, ex.messages) for ex in examples], "a warm-start prompt"
    )
    T = cfg.rollout.max_new_tokens
    responses = []
    for ex in examples:
        if ex.reference is None:
            raise ValueError(
                f"task {c.task.name!r} example {ex.index} has no reference solution for sft"
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
    return step.make_optimizer(
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


def restore_state(t: Trainer):
    """(checkpointer, optimizer, schedule, state, step) of the warm start, resumed
    from its newest checkpoint that restores (step 0: none)."""
    c = t.c
    cfg = t.cfg
    ckpt = PhaseCheckpointer(t.workdir, "sft", every=cfg.checkpoint_every, keep=c.keep_checkpoints)
    optimizer, sched = sft_optimizer(t.cfg)
    state = t.new_state(t.init_params, optimizer, lora_rl.trainable(cfg.lora, "sft"))
    start = 0
    if ckpt.latest_step() is not None:
        state, meta, start = ckpt.restore(state)
        safety.check_sources(meta, t.sources(), f"{ckpt.directory}/{start}")
    return ckpt, optimizer, sched, state, start


def final_params(t: Trainer):
    """The warm start's final parameters from its checkpoint, or None when that
    checkpoint is gone or does not restore (RL, once begun, never repeats it)."""
    ckpt, _, _, state, start = restore_state(t)
    ckpt.close()
    return state.params if start >= t.cfg.sft.steps else None


def run(t: Trainer, open_log, guard: safety.RunGuard | None = None) -> Any:
    """The supervised warm start, resumed from its newest valid checkpoint. Returns
    (its final parameters, the metrics writer it logged to, or None when it had
    nothing left to do). ``open_log(phase, step)`` opens the log cut back to a step."""
    c = t.c
    cfg = t.cfg
    steps = cfg.sft.steps
    ckpt, optimizer, sched, state, start = restore_state(t)
    if start >= steps:
        ckpt.close()
        return state.params, None
    writer = open_log("sft", start)
    fn = t.jit_step(
        step.sft_step,
        state,
        optimizer=optimizer,
        schedule=sched,
        micro_batches=1,
        aux_loss_coef=cfg.sft.aux_loss_coef,
        trainable=lora_rl.trainable(cfg.lora, "sft"),
    )
    with ckpt:  # every way out waits for the save in flight (checkpoint.py)
        bar = progress_bar(c, steps, start, "sft")
        base = jax.random.key(c.seed)
        for i in range(start, steps):
            t0 = time.perf_counter()
            host_batch, cut = sft_batch(t, i * cfg.sft.batch_size)
            state, m = fn(state, t.put_batch(host_batch), jax.random.fold_in(base, i))
            m = metrics_lib.compute_jit(m)  # the numbers, on the devices
            health = {k: m[k] for k in ("params_finite", "skipped_in_a_row")}
            safety.check_health(jax.device_get(health), c, f"sft step {i + 1}")
            if (i + 1) % c.log_every == 0 or i + 1 == steps:
                m = jax.device_get(m)
                dt = time.perf_counter() - t0
                m["step_time"] = dt
                m["tokens_per_s"] = float(np.sum(host_batch["mask"])) / dt
                m["prompts_truncated"] = cut
                writer.write(i + 1, "sft", m)
                bar.set_postfix(nll=f"{m['sft_nll']:.3f}")
            bar.update(1)
            stop = guard is not None and guard.requested
            meta = {"phase": "sft", "step": i + 1, "config": safety.config_record(c), **t.sources()}
            ckpt.save(i + 1, state, meta, force=(i + 1 == steps) or stop)
            if stop:
                ckpt.close()
                writer.close()
                guard.exit(f"sft step {i + 1}")
            if guard is not None:
                guard.heartbeat()
        bar.close()
    return state.params, writer


def reference_for_resume(trainer: Trainer):
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
