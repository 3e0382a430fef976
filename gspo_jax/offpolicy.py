"""Off-policy training: how stale the batch a step trains on is, and where the sampler runs
(docs/offpolicy.md).

    rollout.staleness = k    RL step t trains on the batch that the policy of step t - k
                             sampled: a queue of k scored batches (`RLPhase.queue`),
                             checkpointed with the train state. The first k steps' batches
                             are the warm start's policy's. k = 0 is the on-policy loop.
    rollout.devices = n      the sampler runs on n devices of its own (`split_devices`), the
                             training on the rest; the parameters reach the sampler's
                             devices after each step, device to device, in the compute
                             dtype (`SamplerDevices.publish`).
    rollout.overlap          the next batch is sampled and scored while the current one
                             trains (`gspo_jax.rl.RLPhase.step`).
    updates.trust_region     which policy the objectives' ratio is around: 'decoupled' or
                             'behaviour' (`gspo_jax.rl.RLPhase.prepare`).

A batch of the queue is what `gspo_jax.rl.RLPhase.collect` returns: the device arrays of the
batch layout (`gspo_jax.collect._assemble`; ``policy_version`` int32[N], the RL step whose
parameters sampled each row), the rows' shaped rewards and the host metrics of its
collection. The RNG and the data of batch j are those of step j whatever k is: only the
parameters that sample it differ.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax.config_fields import ConfigError, err, setting
from gspo_jax.models.config import MESH_AXES
from gspo_jax.models.precision import inference_params
from gspo_jax.models.sharding import BATCH_AXES
from gspo_jax.objectives.correction import rollout_correction


@dataclasses.dataclass(frozen=True)
class OffPolicySettings:
    """The off-policy fields of ``config.rollout`` (`gspo_jax.rollout.RolloutConfig`
    extends this), and their rules against each other, the devices and the mesh."""

    staleness: int = setting(
        0,
        low=0,
        doc="k: RL step t trains on the batch the policy of step t - k sampled (the first k "
        "steps' batches: the warm start's policy); 0 is on-policy",
    )
    devices: int = setting(
        0,
        low=0,
        resume=True,
        doc="0: the sampler shares the training devices; n: it runs on n devices of its own "
        "(per process: the last n / processes local devices), training on the rest",
    )
    overlap: bool = setting(
        False,
        resume=True,
        doc="sample the next batch while the current one trains (needs staleness >= 1 and "
        "devices >= 1)",
    )

    def check_run(self, run, ctx) -> None:
        """Overlap needs staleness and devices of its own; the sampler's devices leave
        some for training, divide over the processes, and hold whole copies of the
        training mesh's model shards (`check_sampler_mesh`)."""
        k, n = self.staleness, self.devices
        if self.overlap and k < 1:
            raise err(
                "rollout.overlap",
                "needs rollout.staleness >= 1: the batch sampled while step t trains is step "
                "t + k's, sampled by the parameters step t starts from",
            )
        if self.overlap and n < 1:
            raise err(
                "rollout.overlap",
                "needs rollout.devices >= 1: the sampler runs on devices of its own while the "
                "others train",
            )
        if n >= ctx.num_devices:
            raise err(
                "rollout.devices",
                f"{n} of the {ctx.num_devices} devices leaves none for training",
            )
        procs = jax.process_count()
        if n % procs:
            raise err(
                "rollout.devices",
                f"{n} is not divisible by the {procs} processes (each gives the same number)",
            )
        check_sampler_mesh(run, ctx.mesh_shape)


def check_sampler_mesh(run, shape: dict[str, int]) -> None:
    """The sampler's own mesh, with ``rollout.devices`` (`sampler_mesh`: the training mesh
    ``shape``'s fsdp, expert and tensor sizes, the rest of its devices on data): its
    devices hold whole copies of the model's shards, and the rollout batch, assembled on
    it over its data*fsdp*expert batch shards (`gspo_jax.collect.Collector`), divides over
    them. (The sampler pads the prompts it is given to its shards; the assembled batch
    has exactly prompts_per_step*group_size rows.)"""
    devices = run.rollout.devices
    if not devices:
        return
    copy = shape["fsdp"] * shape["expert"] * shape["tensor"]
    if devices % copy:
        raise err(
            "rollout.devices",
            f"{devices} devices do not hold whole copies of the fsdp*expert*tensor = {copy} "
            f"model shards of the training mesh {shape} (the sampler's mesh keeps those sizes)",
        )
    shards = devices // copy * shape["fsdp"] * shape["expert"]  # BATCH_AXES
    n = run.rollout.prompts_per_step * run.rollout.group_size
    if n % shards:
        raise err(
            "rollout.devices",
            f"{devices} devices give the sampler's mesh data*fsdp*expert = {shards} batch "
            f"shards, which do not divide the rollout batch prompts_per_step*group_size = {n} "
            "it assembles over them; pick rollout.devices so that they do (rollout.devices / "
            "mesh.tensor divides the rollout batch)",
        )


def split_devices(n_rollout: int) -> tuple[list, list]:
    """(training devices, sampler devices): each process gives its last
    ``n_rollout / process_count`` local devices to the sampler, so every process holds
    rows of both sides (it scores its own rollout rows; `gspo_jax.multihost`)."""
    train, sample = [], []
    per_process = n_rollout // jax.process_count()
    for p in range(jax.process_count()):
        local = [d for d in jax.devices() if d.process_index == p]
        cut = len(local) - per_process
        train += local[:cut]
        sample += local[cut:]
    return train, sample


def sampler_mesh(train_mesh: Mesh, devices: list) -> Mesh:
    """The sampler's mesh: the training mesh's fsdp, expert and tensor sizes, the rest of
    ``devices`` on the data axis (ConfigError on ``rollout.devices`` if they do not divide)."""
    inner = {a: train_mesh.shape[a] for a in MESH_AXES if a != "data"}
    per_data = int(np.prod(list(inner.values())))
    if len(devices) % per_data:
        raise err(
            "rollout.devices",
            f"{len(devices)} devices do not hold whole copies of the fsdp*expert*tensor = "
            f"{per_data} model shards",
        )
    shape = dict(inner, data=len(devices) // per_data)
    grid = np.asarray(devices).reshape(tuple(shape[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES)


class SamplerDevices:
    """The parameters the sampler reads. Without devices of its own it reads the
    training parameters themselves; with them, a copy in the compute dtype
    (`inference_params`, bitwise the same logits) moved device to device onto its mesh,
    with the training parameters' partition specs."""

    def __init__(self, train_mesh: Mesh, mesh: Mesh, model_cfg):
        self.train_mesh, self.mesh, self.model_cfg = train_mesh, mesh, model_cfg
        self.split = mesh is not train_mesh
        self._cast = jax.jit(lambda p: inference_params(p, model_cfg))

    def on_sampler(self, params) -> bool:
        leaf = jax.tree.leaves(params)[0]
        sh = getattr(leaf, "sharding", None)
        return isinstance(sh, NamedSharding) and sh.mesh == self.mesh

    def publish(self, params):
        """``params`` where the sampler reads them (asynchronous: nothing waits here)."""
        if not self.split or self.on_sampler(params):
            return params
        with jax.set_mesh(self.train_mesh):
            cast = self._cast(params)
        return move(cast, self.mesh)

    def to_training(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A batch assembled on the sampler's mesh, on the training mesh (rows sharded
        over `BATCH_AXES`, as `gspo_jax.run_parts.RunParts.put_batch` places them)."""
        if not self.split:
            return batch
        return move(batch, self.train_mesh)


def move(tree, mesh: Mesh):
    """Every array of ``tree`` onto ``mesh`` with its partition spec, device to device,
    asynchronously.

    In one process that is `jax.device_put`. With several processes JAX moves arrays
    only between shardings over the same devices, so each process moves its own
    blocks: every block a device of ``mesh`` on this process holds is cut from a block of
    the source that a device of this process holds. `split_devices` makes it so (each
    process gives its last devices to the sampler, and both meshes keep the fsdp, expert
    and tensor sizes); a layout where a process would need another process's block is
    refused, naming ``rollout.devices``."""
    dest = jax.tree.map(lambda a: NamedSharding(mesh, a.sharding.spec), tree)
    if jax.process_count() == 1:
        return jax.device_put(tree, dest)
    return jax.tree.map(_move_local_blocks, tree, dest)


def _move_local_blocks(x: jax.Array, dest: NamedSharding) -> jax.Array:
    shards = [(s.index, s.data) for s in x.addressable_shards]

    def block(index):
        for have, data in shards:
            inner = _within(index, have, x.shape)
            if inner is not None:
                return data[inner]
        raise err(
            "rollout.devices",
            f"the sampler's devices of process {jax.process_index()} need rows or "
            f"parameters of an array {x.shape} that only another process holds; give "
            "the sampler as many devices as training has",
        )

    blocks = [
        jax.device_put(block(index), device)
        for device, index in dest.addressable_devices_indices_map(x.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, dest, blocks)


def _within(want, have, shape):
    """The slices that cut block ``want`` out of block ``have`` (tuples of slices over an
    array of ``shape``), or None if ``have`` does not contain it."""
    out = []
    for w, h, n in zip(want, have, shape):
        w0, w1, _ = w.indices(n)
        h0, h1, _ = h.indices(n)
        if w0 < h0 or w1 > h1:
            return None
        out.append(slice(w0 - h0, w1 - h0))
    return tuple(out)


class BatchQueue(collections.deque):
    """The scored batches waiting to be trained on (`QueuedBatch`, oldest first): RL step
    s trains on the batch step s - k sampled and collects batch s + k, k =
    ``rollout.staleness`` (0: the on-policy loop, an empty queue)."""

    def __init__(self, cfg):
        """An empty queue for the run whose loaded config is ``cfg``."""
        super().__init__()
        self.staleness = cfg.rollout.staleness

    def collected_at(self, s: int) -> int:
        """The batch (its data and RNG: step j's) that RL step ``s`` collects."""
        return s + self.staleness

    def fill(self, s: int, collect) -> None:
        """Before step s: batches s ... s + k - 1 in the queue, each ``collect(j,
        version=s)``. Only at a fresh start is anything sampled here (by the parameters
        RL starts from); a resume restores the queue from its checkpoint."""
        while len(self) < self.staleness:
            self.append(collect(s + len(self), version=s))


@dataclasses.dataclass
class QueuedBatch:
    """One scored batch waiting to be trained on."""

    device: dict[str, jax.Array]  # the batch layout, on the training mesh
    rewards: np.ndarray  # f32[N], shaped
    info: dict[str, Any]  # host metrics of its collection (rewards, lengths, times)
    step: int  # the RL step it was sampled for (its data and RNG)
    version: int  # the RL step whose parameters sampled it

    def meta(self) -> dict[str, Any]:
        """The host part, as JSON (floats round-trip exactly)."""
        info = {
            k: (float(v) if isinstance(v, (float, np.floating)) else int(v))
            for k, v in self.info.items()
        }
        return {
            "rewards": [float(x) for x in np.asarray(self.rewards, np.float32)],
            "info": info,
            "step": self.step,
            "version": self.version,
        }

    @classmethod
    def from_checkpoint(cls, device, meta: dict[str, Any]) -> "QueuedBatch":
        return cls(
            device=dict(device),
            rewards=np.asarray(meta["rewards"], np.float32),
            info=dict(meta["info"]),
            step=int(meta["step"]),
            version=int(meta["version"]),
        )


def batch_template(
    *,
    rows: int,
    prompt_len: int,
    resp_len: int,
    route: tuple[int, int] | None,
    replay_r3: bool,
    sharding,
    per_token_version: bool = False,
) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and shardings of a queued batch's device arrays (the restore
    target of a checkpointed queue). ``route``: (MoE layers, experts per token) when
    the batch holds the sampler's routing record (its experts and its router's
    log-probs there). ``per_token_version``: ``policy_version`` is [rows, resp_len]
    (partial rollouts), not [rows]."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    f32, i32 = jnp.float32, jnp.int32
    out = {
        "prompt_tokens": spec((rows, prompt_len), i32),
        "prompt_mask": spec((rows, prompt_len), f32),
        "tokens": spec((rows, resp_len), i32),
        "mask": spec((rows, resp_len), f32),
        "rollout_logp": spec((rows, resp_len), f32),
        "policy_version": spec((rows, resp_len) if per_token_version else (rows,), i32),
    }
    if route is not None:
        out["sampler_topk"] = spec((rows, resp_len) + route, i32)
        out["sampler_router_logp"] = spec((rows, resp_len) + route, f32)
        if replay_r3:
            out["replay_r3"] = spec((rows, prompt_len + resp_len - 1) + route, i32)
    return out


def staleness_metrics(version: jax.Array, mask: jax.Array, step: int) -> dict[str, jax.Array]:
    """``staleness_mean`` / ``staleness_max`` over the valid tokens: RL step ``step``
    minus the version of the parameters that sampled each token. ``version``: int32[N]
    (a row's tokens all drawn by one policy) or int32[N, T] (partial rollouts: each
    token its own; `gspo_jax.partial`)."""
    valid = mask > 0
    if version.ndim == 1:
        version = version[:, None]
    age = jnp.broadcast_to((step - version).astype(jnp.float32), valid.shape)
    n = jnp.maximum(jnp.sum(valid), 1)
    return {
        "staleness_mean": jnp.sum(jnp.where(valid, age, 0.0)) / n,
        "staleness_max": jnp.max(jnp.where(valid, age, 0.0)),
    }


def routing_record(cfg, model_cfg) -> str:
    """The routing record the training rollouts keep (`gspo_jax.rollout.ROUTING`): R3
    replays all of it; an MoE model's mismatch metrics (and the 'behaviour' trust
    region's routing references) need the response tokens'."""
    if cfg.updates.routing_replay == "R3":
        return "all"
    return "response" if model_cfg.num_moe_layers > 0 else "none"


def queue_target(trainer):
    """The restore target of a checkpointed queue (`gspo_jax.rl.checkpoint_target`), as a
    function of the checkpoint's record: ``rollout.staleness`` batch templates, shaped
    with the ``rollout.max_prompt_len`` they were sampled with (a field a resume may
    change; `fit_queue` brings them to this run's); none at staleness 0."""
    cfg, mc = trainer.cfg, trainer.model_cfg
    record = routing_record(cfg, mc)
    route = (mc.num_moe_layers, mc.top_k) if record != "none" else None

    def target(meta: dict[str, Any]) -> list[dict[str, jax.ShapeDtypeStruct]]:
        saved = meta.get("config", {}).get("rollout", {}).get("max_prompt_len")
        template = batch_template(
            rows=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            prompt_len=int(saved or trainer.max_prompt_len),
            resp_len=cfg.rollout.max_new_tokens,
            route=route,
            replay_r3=record == "all",
            sharding=NamedSharding(trainer.mesh, P(BATCH_AXES)),
            per_token_version=bool(cfg.rollout.partial_budget),
        )
        return [template] * cfg.rollout.staleness

    return target


PROMPT_AXIS = {"prompt_tokens": 1, "prompt_mask": 1, "replay_r3": 1}  # left-padded prompts
PROMPT_PAD = {"prompt_mask": 0, "replay_r3": -1}  # prompt_tokens: the tokenizer's pad id


def fit_queue(device: dict[str, jax.Array], prompt_len: int, pad_id: int) -> dict[str, jax.Array]:
    """A queued batch sampled with another ``rollout.max_prompt_len``, with its
    prompts left-padded to ``prompt_len`` as a batch sampled now would be (pad tokens,
    mask 0, no routing at the pads). Raises a ConfigError when a queued prompt is
    longer than ``prompt_len``."""
    width = device["prompt_tokens"].shape[1]
    if width == prompt_len:
        return device
    longest = int(jnp.max(jnp.sum(device["prompt_mask"], axis=1)))
    if longest > prompt_len:
        raise ConfigError(
            f"config.rollout.max_prompt_len={prompt_len}: the checkpoint's queue "
            f"(rollout.staleness) holds prompts of up to {longest} tokens, sampled with "
            f"max_prompt_len={width}; resume with max_prompt_len >= {longest}"
        )
    out = dict(device)
    for key, axis in PROMPT_AXIS.items():
        if key not in device:
            continue
        x = device[key]
        if prompt_len < width:  # the cut columns are pads in every row
            x = jax.lax.slice_in_dim(x, width - prompt_len, x.shape[axis], axis=axis)
        else:
            pad = [(0, 0)] * x.ndim
            pad[axis] = (prompt_len - width, 0)
            x = jnp.pad(x, pad, constant_values=PROMPT_PAD.get(key, pad_id))
        out[key] = jax.device_put(x, device[key].sharding)
    return out


def trust_region_inputs(trust_region: str, behaviour_logp, proximal_logp, mask, rc):
    """What the objectives take as pi_old, and the rollout correction's weight, under
    ``updates.trust_region`` (docs/offpolicy.md):

        decoupled   pi_old = pi_proximal (the old pass at the step's parameters);
                    weight = rollout_correction(pi_proximal / pi_behaviour) (None: off)
        behaviour   pi_old = pi_behaviour (the sampler's log-probs); weight None

    Args: f32[N,T] log-probs of the sampled tokens under the sampler
    (``behaviour_logp``) and the old pass (``proximal_logp``, unused under
    'behaviour', may be None there), the response mask, and ``rc`` (a
    `RolloutCorrection`). Returns (old_logp, weight or None, the correction's mergeable
    metrics or {})."""
    if trust_region == "behaviour":
        return behaviour_logp, None, {}
    if rc.mode == "none":
        return proximal_logp, None, {}
    weight, metrics = rollout_correction(proximal_logp, behaviour_logp, mask, rc)
    return proximal_logp, weight, metrics
