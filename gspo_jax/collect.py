"""Stages 1-3 of an RL step: sample, score, shape and filter, and the batch assembled on
the sampler's devices (`Collector`). `gspo_jax.rl` drives it; the batch it returns is what
`gspo_jax.offpolicy.QueuedBatch` holds until a step trains on it.

Host traffic: of a rollout only the response token ids, lengths and truncation flags come
to the host (to decode and score them, and for the step's metrics); the batch is
assembled on the devices from row indices (dynamic sampling's selection, the fill).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import multihost, partial, shaping
from gspo_jax.data.encoding import encode_prompt
from gspo_jax.decode import generate_jit
from gspo_jax.models.sharding import BATCH_AXES
from gspo_jax.rollout import Rollout, replay_r3
from gspo_jax.run_config import RunConfig
from gspo_jax.run_parts import RunParts


@dataclasses.dataclass
class _Round:
    """One sampling round of :meth:`Collector.collect`."""

    rollout: Any  # the Rollout, on the devices
    host: dict[str, np.ndarray]  # lengths and truncation flags of every row (RunParts.score)
    rewards: np.ndarray  # [n * G], shaped (RunParts.shape_and_filter)
    components: dict[str, np.ndarray]  # the reward's components (rewards.score)
    fails: dict[str, int]  # verifier failure counts
    rows: np.ndarray  # int[kept * G]: the rollout rows of the kept groups
    groups_kept: int
    prompts_truncated: int
    sample_time: float
    version: Any = None  # int32[N, T]: each token's policy version (partial rollouts)


# The Rollout's arrays the training batch is assembled from (`_assemble`); the
# routing record only where the sampler kept it.
_BATCH_FIELDS = ("prompt_tokens", "prompt_mask", "tokens", "mask", "truncated", "logp")
_ROUTING_FIELDS = {
    "all": ("experts", "router_logp", "prompt_experts"),
    "response": ("experts", "router_logp"),
    "none": (),
}


def _assemble(parts, src_round, src_row, valid, *, overlong_filter: bool):
    """The training batch, on the devices, from the rollouts of a step's sampling
    rounds: row i is row ``src_row[i]`` of round ``src_round[i]``; ``valid`` 0 marks
    padding rows (their mask is 0: dynamic sampling fell short).

    ``parts``: per round, a dict of the Rollout's arrays (`_BATCH_FIELDS`, plus
    ``experts`` and ``prompt_experts`` where the sampler kept them); a fixed number of
    them (`Collector.fill_batch` repeats round 0 for rounds not sampled), so that one
    program serves every step. Returns the batch layout of :mod:`gspo_jax.step`:
    ``prompt_tokens``, ``prompt_mask`` (f32), ``tokens``, ``mask`` (overlong
    filtering applied), ``rollout_logp`` (the sampler's log-probs of the
    distribution that drew the tokens), ``sampler_topk`` (the sampler's routing at
    the response positions) and ``replay_r3`` (R3: the sampler's routing at every
    input position [0, P+T-1)), the last two where the record is there.
    """

    def take(key):
        out = jnp.take(parts[0][key], src_row, axis=0)
        for r in range(1, len(parts)):
            sel = (src_round == r).reshape((-1,) + (1,) * (out.ndim - 1))
            out = jnp.where(sel, jnp.take(parts[r][key], src_row, axis=0), out)
        return out

    mask = take("mask").astype(jnp.float32)
    if overlong_filter:
        mask = shaping.overlong_mask(take("truncated"), mask)
    batch = {
        "prompt_tokens": take("prompt_tokens"),
        "prompt_mask": take("prompt_mask").astype(jnp.float32),
        "tokens": take("tokens"),
        "mask": mask * valid[:, None],
        "rollout_logp": take("logp"),
    }
    if "version" in parts[0]:  # per token (partial rollouts); else the queue's, per row
        batch["policy_version"] = take("version")
    if "experts" in parts[0]:
        # The sampler's routing of the position that produced each response token.
        batch["sampler_topk"] = take("experts")
        # ... and its router's log-probs at those experts (the behaviour policy's router).
        batch["sampler_router_logp"] = take("router_logp")
    if "prompt_experts" in parts[0]:
        batch["replay_r3"] = replay_r3(take("prompt_experts"), batch["sampler_topk"])
    return batch


def shape_and_filter(
    cfg: RunConfig, host, r: np.ndarray, correct: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Stage 3, shape and filter (DAPO, ``config.dapo``), on one round (``host``: the row lengths
    `score` returns): the soft overlong punishment added to the rewards ``r``; dynamic
    sampling keeps only the groups whose correctness differs (``correct``, the
    verifier's 0/1 per response: DAPO filters on accuracy, not on the shaped
    reward, so a length penalty or a format reward cannot keep a group whose
    answers are all right or all wrong). Overlong filtering (the mask of truncated
    responses zeroed) happens on the devices, in `_assemble`. Returns (the shaped
    rewards of every response, the rows of the kept groups, the number of groups
    kept)."""
    g, T = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    if cfg.dapo.soft_overlong:
        length = np.asarray(host["lengths"], np.float32)
        r = r + shaping.soft_overlong_penalty(
            length, max_len=T, cache_len=cfg.dapo.overlong_cache_len
        )
    keep = (
        shaping.dynamic_sampling_keep(np.asarray(correct).reshape(-1, g))
        if cfg.dapo.dynamic_sampling
        else np.ones(len(r) // g, bool)
    )
    rows = np.flatnonzero(np.repeat(keep, g))
    return r, rows, int(keep.sum())


class Collector:
    """Stages 1-3 of the RL steps of a run: ``trainer``'s sampler and verifier, keeping the
    routing record ``routing`` (`gspo_jax.offpolicy.routing_record`)."""

    def __init__(self, trainer: RunParts, routing: str):
        self.t, self.cfg, self.routing = trainer, trainer.cfg, routing
        self.assemble_fn = jax.jit(
            functools.partial(_assemble, overlong_filter=trainer.cfg.dapo.overlong_filter),
            # on the sampler's devices; `gspo_jax.rl.RLPhase.queued` moves it to training's
            out_shardings=NamedSharding(trainer.sampler_mesh, P(BATCH_AXES)),
        )
        # Partial rollouts (rollout.partial_budget): the responses carried between steps.
        budget = trainer.cfg.rollout.partial_budget
        self.pool = partial.Pool(trainer, routing) if budget else None

    def collect(
        self, params, step_idx: int, rng, version: int | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Stages 1-3: rollouts, rewards and DAPO's filters for one RL step.

        Rounds of sample -> score -> shape and filter, until the kept groups fill
        the batch (one round without dynamic sampling); then the batch is filled
        and given its advantages. Returns the batch (without old log-probs), on the
        devices, and host metrics. Of the rollouts only the response token ids,
        lengths and truncation flags came to the host (`score`). With partial rollouts,
        `collect_partial`; ``version``: the RL step whose parameters ``params`` are
        (default ``step_idx``), each new token's version.
        """
        if self.pool is not None:
            return self.collect_partial(params, rng, step_idx if version is None else version)
        cfg = self.cfg
        n_prompts = cfg.rollout.prompts_per_step
        max_rounds = cfg.dapo.max_sampling_rounds if cfg.dapo.dynamic_sampling else 1
        rounds: list[_Round] = []
        for rnd in range(max_rounds):
            # Round r of step s reads prompts at position (s * max_rounds + r) * n_prompts,
            # a pure function of the step: resume needs no extra data state.
            pos = (step_idx * max_rounds + rnd) * n_prompts
            examples, ro, cut, seconds = self.sample(params, pos, jax.random.fold_in(rng, rnd))
            r, components, fails, host = self.t.score(examples, ro)
            shaped, rows, groups_kept = shape_and_filter(self.cfg, host, r, components["correct"])
            rounds.append(
                _Round(ro, host, shaped, components, fails, rows, groups_kept, cut, seconds)
            )
            if sum(r.groups_kept for r in rounds) >= n_prompts:
                break
        return self.fill_batch(rounds), self._collect_metrics(rounds)

    def sample(self, params, pos: int, rng):
        """Stage 1, sample: the ``prompts_per_step`` prompts at data position ``pos``
        and ``group_size`` responses to each. Returns (examples, the rollout on the
        devices, the number of prompts truncated, seconds spent sampling)."""
        n = self.cfg.rollout.prompts_per_step
        examples = self.t.train_data.batch(pos, n)
        t0 = time.perf_counter()
        # Keyed by data stream id, not split index: a batch across an epoch boundary
        # may hold one example twice, and the sampler needs distinct ids.
        ro, cut = self.t.rollout(
            params,
            examples,
            rng,
            prompt_ids=self.t.train_data.stream_ids(pos, n).tolist(),
            router_noise=True,
            routing=self.routing,
        )
        jax.block_until_ready(ro)
        return examples, ro, cut, time.perf_counter() - t0

    def fill_batch(self, rounds: list[_Round]) -> dict[str, Any]:
        """Stage 3, the batch: exactly ``prompts_per_step`` groups from the rounds'
        kept rows, assembled on the devices (`_assemble`; only row indices go there
        from the host). If dynamic sampling fell short, the missing groups are copies
        of the first kept one (of row 0 if none was kept) whose mask is 0 (they add
        nothing). ``rewards`` (host, shaped) are the batch rows' rewards, for
        `advantages`."""
        cfg = self.cfg
        n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        src_round = np.concatenate([np.full(len(r.rows), i) for i, r in enumerate(rounds)])
        src_row = np.concatenate([r.rows for r in rounds])
        reward = np.concatenate([r.rewards[r.rows] for r in rounds])
        src_round, src_row, reward = src_round[:n_rows], src_row[:n_rows], reward[:n_rows]
        valid = (np.arange(n_rows) < len(src_row)).astype(np.float32)
        if not len(src_row):  # nothing kept: the padding copies row 0 of round 0
            src_round, src_row, reward = np.zeros(1, int), np.zeros(1, int), rounds[0].rewards[:1]
        short = n_rows - len(src_row)
        src_round = np.concatenate([src_round, np.repeat(src_round[:1], short)])
        src_row = np.concatenate([src_row, np.repeat(src_row[:1], short)])
        reward = np.concatenate([reward, np.repeat(reward[:1], short)])
        # Every round's arrays, the same number of rounds each step (round 0 repeated
        # for the rounds not sampled): one program for every step.
        max_rounds = cfg.dapo.max_sampling_rounds if cfg.dapo.dynamic_sampling else 1
        fields = _BATCH_FIELDS + _ROUTING_FIELDS[self.routing]
        parts = [{k: getattr(r.rollout, k) for k in fields} for r in rounds]
        if rounds[0].version is not None:
            parts = [dict(p, version=r.version) for p, r in zip(parts, rounds)]
        parts += [parts[0]] * (max_rounds - len(parts))
        batch = self.assemble_fn(
            tuple(parts), src_round.astype(np.int32), src_row.astype(np.int32), valid
        )
        batch["rewards"] = reward
        return batch

    def collect_partial(self, params, rng, version: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Stages 1-3 with partial rollouts (`gspo_jax.partial`): the carried groups go on
        and fresh prompts take the vacant slots; every live row is decoded for at most
        ``rollout.partial_budget`` tokens by ``params`` (RL step ``version``'s); the
        groups whose responses all ended are scored and make the batch (the others'
        rows have mask 0, as dynamic sampling's missing groups do), and vacate their
        slots. The host sees what `collect` does (the token ids, lengths and stop flags
        of the rows, to verify them) and gives the devices the rows' prefix lengths."""
        cfg, t, pool = self.cfg, self.t, self.pool
        g, plen, tok = cfg.rollout.group_size, t.max_prompt_len, t.tokenizer
        vacant, k, live = pool.begin()
        fresh = int(vacant.sum())
        examples = [t.train_data.batch(int(pos), 1)[0] for pos in pool.positions]
        encoded = [encode_prompt(tok, ex.prompt, ex.messages) for ex in examples]
        ids, _ = t.fit_prompts(encoded)
        cut = t.fit_prompts([e for e, v in zip(encoded, vacant) if v])[1] if fresh else 0
        toks = np.full((pool.groups, plen), tok.pad_id, np.int32)
        pmask = np.zeros((pool.groups, plen), bool)
        for i, p in enumerate(ids):
            toks[i, plen - len(p) :], pmask[i, plen - len(p) :] = p, True
        # Each row keyed as the batch program keys it: its prompt's stream id, its sample.
        sid = np.concatenate([t.train_data.stream_ids(int(pos), 1) for pos in pool.positions])
        if sid.max() >= 2**31:  # the sampler's keys are int32
            raise ValueError(f"a prompt's data stream id {int(sid.max())} is past 2**31")
        sampler, put = t.sampler, t.put_rows
        spec = partial.spec_for(
            cfg.rollout.partial_budget,
            g,
            tok.pad_id,
            sampler._sharding,
            bool(cfg.rollout.router_noise_std > 0),
            self.routing,
        )
        shards = np.prod([t.mesh.shape[a] for a in BATCH_AXES])
        per_prompt = put if pool.groups % shards == 0 else partial.replicated(t.mesh)
        state = t.sampler_devices.publish(t.sampler_precision.view(params))
        t0 = time.perf_counter()
        with jax.set_mesh(sampler.mesh):
            new = generate_jit(
                sampler.graphdef,
                state,
                rng,
                per_prompt(toks),
                per_prompt(pmask),
                per_prompt(sid.astype(np.int32)),
                put(live),
                jnp.asarray(np.asarray(list(tok.stop_ids), np.int32)),
                jnp.float32(cfg.rollout.temperature),
                jnp.float32(cfg.rollout.router_noise_std),
                spec=spec,
                prefix=pool.device["tokens"],
                prefix_len=put(k),
            )
            merged, length, stopped = partial.merge_jit(
                pool.device, new, put(k), put(live), np.int32(version), pad_id=tok.pad_id
            )
        _, host = multihost.local_rows({"lengths": length, "stopped": stopped})
        length, stopped = (multihost.gather_rows(host[x], length) for x in ("lengths", "stopped"))
        seconds = time.perf_counter() - t0
        new_tokens = np.where(live, length - k, 0)
        done = pool.end(live, length, stopped)
        done_rows = np.repeat(done, g)
        steps_t = cfg.rollout.max_new_tokens
        ro = Rollout(
            tokens=merged["tokens"],
            mask=put((np.arange(steps_t)[None, :] < pool.lengths[:, None]).astype(np.float32)),
            lengths=put(pool.lengths),
            truncated=put(~pool.stopped & (pool.lengths >= steps_t)),
            logp=merged["logp"],
            experts=merged.get("experts"),
            router_logp=merged.get("router_logp"),
            prompt_tokens=new["prompt_tokens"],
            prompt_mask=new["prompt_mask"],
            prompt_experts=merged.get("prompt_experts"),
            decode_steps=new["decode_steps"],
        )
        r, components, fails, host = t.score(examples, ro, select=done_rows)
        shaped, _, _ = shape_and_filter(cfg, host, r, components["correct"])
        rows = np.flatnonzero(done_rows)
        rnd = _Round(ro, host, shaped, components, fails, rows, int(done.sum()), cut, seconds)
        batch = self.fill_batch([dataclasses.replace(rnd, version=merged["version"])])
        info = {}
        if len(rows):  # the rewards and lengths of the responses trained on
            view = dataclasses.replace(
                rnd,
                rewards=shaped[rows],
                components={x: v[rows] for x, v in components.items()},
                host={x: np.asarray(v)[rows] for x, v in host.items()},
            )
            info = self._collect_metrics([view])
        steps = int(new["decode_steps"])
        info.update(
            sample_time=seconds,
            prompts_truncated=cut,
            gen_tokens=int(new_tokens.sum()),
            decode_steps=steps,
            sampling_rounds=1,
            dynamic_sampling_bound_hit=0.0,
            # the first new token of a row comes from the prefill, each other one from
            # a decode step
            decode_row_use=float(np.maximum(new_tokens - 1, 0).sum()) / max(1, steps * pool.n),
            partial_groups_done=int(done.sum()),
            partial_groups_carried=int((~done).sum()),
            partial_tokens_carried=int(pool.lengths[~done_rows].sum()),
        )
        pool.vacate(done)  # the trained groups leave their slots
        pool.device = merged
        return batch, info

    def _collect_metrics(self, rounds: list[_Round]) -> dict[str, Any]:
        """Host metrics of one step's rounds (every sampled response, kept or not)."""
        cfg = self.cfg
        n_prompts, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        r_all = np.concatenate([r.rewards for r in rounds])
        rg_all = r_all.reshape(-1, g)
        lengths = [np.asarray(r.host["lengths"], np.float32) for r in rounds]
        length = np.concatenate(lengths)
        fail_counts: dict[str, int] = {}
        for r in rounds:
            for k, v in r.fails.items():
                fail_counts[k] = fail_counts.get(k, 0) + v
        info = {
            "reward_mean": float(r_all.mean()),
            "reward_std": float(r_all.std()),
            "reward_correct": float(
                np.concatenate([r.components["correct"] for r in rounds]).mean()
            ),
            "reward_format": float(np.concatenate([r.components["format"] for r in rounds]).mean()),
            "zero_std_group_frac": float(np.mean(rg_all.std(axis=1) == 0)),
            "response_len": float(length.mean()),
            "truncation_rate": float(
                np.concatenate([np.asarray(r.host["truncated"]) for r in rounds]).mean()
            ),
            "prompts_truncated": sum(r.prompts_truncated for r in rounds),
            "sampling_rounds": len(rounds),
            "dynamic_sampling_bound_hit": float(
                cfg.dapo.dynamic_sampling and sum(r.groups_kept for r in rounds) < n_prompts
            ),
            "sample_time": sum(r.sample_time for r in rounds),
            "gen_tokens": sum(int(x.sum()) for x in lengths),
        }
        # The decode steps, and the share of their rows (slots) that fed a live row's
        # token: every response token but the last is fed once (`gspo_jax.refill`).
        steps = sum(int(r.rollout.decode_steps) for r in rounds)
        rows = self.t.sampler.decode_rows(n_prompts, g)
        info["decode_steps"] = steps
        info["decode_row_use"] = sum(float(np.maximum(x - 1, 0).sum()) for x in lengths) / max(
            1, steps * rows
        )
        info.update({f"verifier_{k}": v for k, v in fail_counts.items()})
        return info
