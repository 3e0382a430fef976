"""Partial rollouts (``rollout.partial_budget``; docs/partial.md): a step decodes each
response for at most a budget of tokens; a response unfinished by then keeps its tokens
and goes on in the next step, under that step's policy.

    step s    the N = prompts x G rows: the groups carried from step s - 1 in their
              slots, fresh prompts (the next data positions) in the vacant ones
      1.      each prompt is prefilled once for its G rows, each live row's response
              so far is fed after it, and the row is decoded for at most
              ``partial_budget`` tokens: the batch program (`gspo_jax.decode`) with its
              prefix stage, ``spec_for``'s spec
      2.      the new tokens and their records are written after each row's old ones
              (`merge`), every token marked with the version that drew it (s)
      3.      a group whose G rows all ended (a stop token, or T tokens) is scored and
              trained on; its slot is vacated. The rest are carried to step s + 1.

What is kept per token is what it was drawn with: its log-prob under the sampler of its
version (the trust region's pi_behaviour and the rollout correction's denominator), its
routing record (what R3 replays, the mismatch metrics), its version (the staleness
metrics). A response's prefix is re-prefilled by the new policy, so its cache is the
new policy's (as in Kimi k1.5's partial rollouts); its recorded log-probs stay the old
policy's. The carried rows are part of an RL checkpoint (`Pool`).

Costs: besides the prompts' prefill, each step feeds every row's response window
[N, T - 1] (masked where it is empty: a fresh row computes it and discards it), and its
cache is T - 1 columns wider; a row whose group is carried but which itself has ended
computes its decode steps and discards them (``live`` is False: it stops the loop early
only when every row has).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.config_fields import ConfigError, err, setting
from gspo_jax.decode import Spec, use_cpu_sampling
from gspo_jax.models.sharding import BATCH_AXES


@dataclasses.dataclass(frozen=True)
class PartialSettings:
    """The partial-rollout field of ``config.rollout`` (`gspo_jax.rollout.RolloutConfig`
    extends this), and its rules against the other ways a step's batch is made."""

    partial_budget: int = setting(
        0,
        low=0,
        doc="partial rollouts: each RL step decodes a response for at most this many "
        "tokens; one unfinished by then goes on in the next step under that step's "
        "policy, and its group trains when all its responses ended (gspo_jax.partial); "
        "0: off",
    )

    def check_run(self, run, ctx) -> None:
        """Below the response length, and not combined with what else fills or places a
        step's batch (dynamic sampling's rounds, refilled slots, the sampler's devices)."""
        b = self.partial_budget
        if not b:
            return
        limit = run.rollout.max_new_tokens
        if b >= limit:
            raise err(
                "rollout.partial_budget",
                f"{b} is not below rollout.max_new_tokens={limit}: every response ends "
                "within its step; use 0 (off)",
            )
        for field, on in (
            ("dapo.dynamic_sampling", run.dapo.dynamic_sampling),
            ("rollout.decode_slots", run.rollout.decode_slots),
            ("rollout.devices", run.rollout.devices),
        ):
            if on:
                raise err(
                    "rollout.partial_budget",
                    f"{b}: partial rollouts are not combined with {field}={on!r}; "
                    f"set one of them to its default",
                )


# ----------------------------------------------------------------------------
# The device programs.


# A pool array's value after a row's last token (the Rollout's: pad, 0, no expert).
FILL = {"logp": 0.0, "experts": -1, "router_logp": 0.0, "version": -1}


def merge(pool, new, k, live, version, *, pad_id: int):
    """The pool's rows with ``new`` (the batch program's outputs) written after their first
    ``k[r]`` tokens, for the ``live`` rows; the others as they were.

    A live row's columns [0, k) keep its old tokens and records, [k, k + n) take the new
    ones (n of them: at most T - k, as a response ends at T tokens), and the columns
    after hold the fill values (`FILL`); the new tokens' ``version`` is ``version``.
    ``pool``: ``tokens``, ``logp``, ``version`` [N, T]; ``experts``, ``router_logp``
    [N, T, L, K] where the routing record is kept; ``prompt_experts`` [N, P, L, K] where
    all of it is (a row that starts, k = 0, takes the new prompt prefill's). Returns (the pool after the step, the
    live rows' lengths int32[N] and whether they stopped, bool[N]: a stop token within
    their T tokens)."""
    t = pool["tokens"].shape[1]
    n = jnp.minimum(new["lengths"], t - k)
    length = k + n
    stopped = ~new["truncated"] & (new["lengths"] <= t - k)
    col = jnp.arange(t)[None, :]
    src = jnp.clip(col - k[:, None], 0, new["tokens"].shape[1] - 1)
    old, fresh = col < k[:, None], col < length[:, None]

    def put(name, x, empty):
        wide = lambda a: a.reshape(a.shape + (1,) * (x.ndim - a.ndim))
        idx = jnp.broadcast_to(wide(src), (x.shape[0], t) + x.shape[2:])
        out = jnp.where(wide(old), pool[name], jnp.where(wide(fresh), x_at(x, idx), empty))
        return jnp.where(wide(live[:, None]), out, pool[name])

    x_at = lambda x, idx: jnp.take_along_axis(x, idx, axis=1)
    out = {
        "tokens": put("tokens", new["tokens"], pad_id),
        "logp": put("logp", new["logp"], FILL["logp"]),
        "version": put("version", jnp.full(new["tokens"].shape, version, jnp.int32), -1),
    }
    if "experts" in pool:
        out["experts"] = put("experts", new["experts"], FILL["experts"])
        out["router_logp"] = put("router_logp", new["router_logp"], FILL["router_logp"])
    if "prompt_experts" in pool:
        starts = (live & (k == 0))[:, None, None, None]
        out["prompt_experts"] = jnp.where(starts, new["prompt_experts"], pool["prompt_experts"])
    return out, length, stopped


merge_jit = jax.jit(merge, static_argnames=("pad_id",))


# ----------------------------------------------------------------------------
# The carried rows, between steps and in a checkpoint.


class Slots:
    """The host side of partial rollouts: N = groups x G rows in group slots, each slot's
    data position (-1: vacant), each row's length and whether it stopped, and the next
    data position a fresh prompt takes. Fresh prompts are read in order from position 0,
    one per vacated slot: a run reads each prompt once, in the order a run without
    partial rollouts reads them. A step is `begin`, the device programs on the rows
    `begin` returns, `end` with their lengths, then `vacate` of the groups trained on."""

    def __init__(self, groups: int, group_size: int, max_new_tokens: int):
        self.groups, self.g, self.steps = groups, group_size, max_new_tokens
        self.n = groups * group_size
        self.positions = np.full(groups, -1, np.int64)
        self.lengths = np.zeros(self.n, np.int32)
        self.stopped = np.zeros(self.n, bool)
        self.next_pos = 0

    def finished(self) -> np.ndarray:
        """bool[N]: the rows whose response ended (a stop token, or T tokens)."""
        return self.stopped | (self.lengths >= self.steps)

    def begin(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Fresh prompts into the vacant slots. Returns (bool[groups]: the slots that
        took one, int32[N] ``k``: each live row's tokens so far, bool[N] ``live``: the
        rows to decode)."""
        vacant = self.positions < 0
        self.positions[vacant] = self.next_pos + np.arange(int(vacant.sum()))
        self.next_pos += int(vacant.sum())
        starts = np.repeat(vacant, self.g)
        self.lengths[starts], self.stopped[starts] = 0, False
        live = ~self.finished()
        return vacant, np.where(live, self.lengths, 0).astype(np.int32), live

    def end(self, live, length, stopped) -> np.ndarray:
        """The live rows' new lengths and stop flags (`merge`'s). Returns bool[groups]:
        the groups whose rows have all ended."""
        self.lengths = np.where(live, length, self.lengths).astype(np.int32)
        self.stopped = np.where(live, stopped, self.stopped)
        return self.finished().reshape(-1, self.g).all(axis=1)

    def vacate(self, done) -> None:
        """The groups ``done`` (bool[groups]) leave their slots."""
        rows = np.repeat(done, self.g)
        self.positions[done] = -1
        self.lengths[rows], self.stopped[rows] = 0, False


class Pool(Slots):
    """A run's partial responses between RL steps (`Slots`), with, on the devices, the
    per-token arrays of `merge`; all of it in an RL checkpoint."""

    def __init__(self, trainer, routing: str, *, allocate: bool = True):
        cfg, mc = trainer.cfg, trainer.model_cfg
        super().__init__(
            cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens
        )
        self.t, self.routing = trainer, routing
        self.route = (mc.num_moe_layers, mc.top_k) if routing != "none" else None
        self.device = None  # ``allocate=False``: only a checkpoint's restore target
        if allocate:
            self.device = jax.tree.map(
                lambda s: trainer.put_rows(np.zeros(s.shape, s.dtype)),
                self.template(trainer.max_prompt_len, sharding=None),
            )

    def template(self, prompt_len: int, sharding) -> dict[str, jax.ShapeDtypeStruct]:
        """The device arrays' shapes (a checkpoint's restore target, with ``sharding``)."""
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        rows, t = (self.n, self.steps), self.steps
        out = {
            "tokens": spec(rows, jnp.int32),
            "logp": spec(rows, jnp.float32),
            "version": spec(rows, jnp.int32),
        }
        if self.route is not None:
            out["experts"] = spec((self.n, t) + self.route, jnp.int32)
            out["router_logp"] = spec((self.n, t) + self.route, jnp.float32)
        if self.routing == "all":
            out["prompt_experts"] = spec((self.n, prompt_len) + self.route, jnp.int32)
        return out

    def meta(self) -> dict[str, Any]:
        """The host part, as JSON."""
        return {
            "positions": [int(x) for x in self.positions],
            "lengths": [int(x) for x in self.lengths],
            "stopped": [bool(x) for x in self.stopped],
            "next_pos": int(self.next_pos),
        }

    def target(self, meta: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
        """The restore target of the device arrays an RL checkpoint with record ``meta``
        holds (its prompt length: the config it was saved with)."""
        saved = meta.get("config", {}).get("rollout", {}).get("max_prompt_len")
        sharding = NamedSharding(self.t.mesh, P(BATCH_AXES))
        return self.template(int(saved or self.t.max_prompt_len), sharding)

    def load(self, device: dict[str, jax.Array], meta: dict[str, Any]) -> None:
        """Restore what `meta` and the checkpoint's arrays hold."""
        width = device.get("prompt_experts")
        if width is not None and width.shape[1] != self.t.max_prompt_len:
            raise ConfigError(
                f"config.rollout.max_prompt_len={self.t.max_prompt_len}: the checkpoint's "
                f"partial responses (rollout.partial_budget) were sampled with "
                f"max_prompt_len={width.shape[1]}, whose routing record R3 replays; "
                "resume with that length"
            )
        self.device = dict(device)
        self.positions = np.asarray(meta["positions"], np.int64)
        self.lengths = np.asarray(meta["lengths"], np.int32)
        self.stopped = np.asarray(meta["stopped"], bool)
        self.next_pos = int(meta["next_pos"])


def replicated(mesh):
    """Places a host array on every device of ``mesh`` (per-prompt arrays whose count
    the batch shards do not divide, as the sampler places them)."""
    return functools.partial(jax.device_put, device=NamedSharding(mesh, P()))


@functools.lru_cache(maxsize=None)
def spec_for(
    budget: int, group: int, pad_id: int, sharding, router_noise: bool, routing: str
) -> Spec:
    """The batch program's static configuration for a partial step: at most ``budget``
    new tokens per row, after its prefix (`gspo_jax.decode.generate_jit`'s ``prefix``)."""
    return Spec(
        max_new_tokens=budget,
        num_samples=group,
        greedy=False,
        cpu=use_cpu_sampling(),
        pad_id=pad_id,
        batch_sharding=sharding,
        router_noise=router_noise,
        routing=routing,
        prefix=True,
    )
