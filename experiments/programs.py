"""The accelerator programs of gspo_jax at a named model shape: one definition that the
device benchmark (`experiments/bench/bench_accelerator.py`) runs and the compile report
(`experiments/compile_report.py`) compiles for a device it does not have.

Each ``*_program`` returns ``(jitted, args)``: the jitted function and its arguments.
With ``abstract=True`` the arguments are `jax.ShapeDtypeStruct`s placed on the given
mesh (nothing is allocated, so a 30B model's train step can be lowered on a laptop);
otherwise they are device arrays. Either way ``jitted.lower(*args)`` lowers the same
program.

The programs:

* ``train``: `gspo_jax.step.train_step` (GRPO's loss without its KL term, micro-batched,
  AdamW, the state donated) on a mini-batch of rollout-shaped rows.
* ``logprob``: `gspo_jax.passes.logprob_pass` (the old-policy and reference passes) over
  the same mini-batch.
* ``prefill``: the sampler's prompt pass, `Transformer.decode` over [B, P] prompts into
  a fresh KV cache of P + new_tokens - 1 slots, logits of the last position only.
* ``decode``: one decode step, `Transformer.decode` of one token per row against a full
  KV cache (the cache donated, as the sampler's loop carries it).
* ``sampler``: the sampler's whole compiled function (`gspo_jax.rollout`): prefill, the
  on-device decode loop and the routing record, as `Sampler.__call__` runs it.
* ``sampler_refill``: the refilling sampler (`gspo_jax.refill`), as `Sampler.__call__`
  runs it with ``slots``: ``batch`` slots over `REFILL_ROWS_PER_SLOT` x ``batch`` rows.
* ``train_packed``, ``logprob_packed``: the train step and the log-prob pass on packed
  buffers (`gspo_jax.packing`) in their padded twins' micro-batch shape (`packed_shape`).

The sampler-side programs take the parameters as one copy in the compute dtype
(`inference_params`), as a rollout holds them.

With ``Shape.lora`` (a `gspo_jax.lora_training.LoRAConfig` of rank > 0) the train and
log-prob programs are the RL phase's with LoRA, built by the trainer's own functions:
adapters attached after the base (`lora_training.attach`), the base frozen in the compute
dtype and the adapters in f32 (`lora_training.rl_params`), the optimizer's state for the
trainable parameters only (`lora.partition`, as `RunParts.new_state`) and the step's
``StepConfig.trainable`` (`lora_training.trainable`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gspo_jax import lora_training, optim, packing, passes, step
from gspo_jax.models import ModelConfig, lora
from gspo_jax.models.precision import inference_params
from gspo_jax.models.sharding import param_shardings
from gspo_jax.models.transformer import Transformer, init_sharded

# The benchmark model: Qwen3-MoE-shaped (Qwen3-30B-A3B's layer at d_model 2048 with
# Qwen3's vocabulary), randomly initialised. ``layers`` picks 8, 12 or 16 of them.
SIZES = {
    "h200": dict(
        model=dict(
            vocab_size=151936,
            d_model=2048,
            num_layers=12,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            d_ff=6144,
            moe_d_ff=768,
            num_experts=64,
            top_k=8,
            qk_norm=True,
            tie_embeddings=False,
            param_dtype="float32",
            dtype="bfloat16",
            remat_policy="dots_no_scores",
            logits_chunk_size=512,
            # Rows per block of the blocked dispatch: every block gathers its expert's
            # weights, so 512-row blocks copy 8x less than the default 64. The 16-layer
            # train step on an H200: 133.4 GiB at 64, 118.0 at 512 (compile report,
            # experiments/accelerator/compile/).
            moe_block_size=512,
        ),
        rows=32,  # sequences per mini-batch
        prompt_len=128,
        response_len=1920,  # 2,048 tokens per sequence
        micro_batches=4,
        sampler_batches=(64, 256, 1024),
        new_tokens=1024,
    ),
    "tiny": dict(
        model=dict(
            vocab_size=512,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            d_ff=128,
            moe_d_ff=32,
            num_experts=8,
            top_k=2,
            qk_norm=True,
            tie_embeddings=False,
            param_dtype="float32",
            dtype="float32",
            remat_policy="dots_no_scores",
            logits_chunk_size=16,
        ),
        rows=4,
        prompt_len=8,
        response_len=24,
        micro_batches=2,
        sampler_batches=(4, 8),
        new_tokens=8,
    ),
}

PARTS = ("train", "logprob", "prefill", "decode", "sampler", "sampler_refill")
PARTS += ("train_packed", "logprob_packed")
# The arguments of each part's program, by name (the sampler's after its graphdef).
ARG_NAMES = {
    "train": ("state", "batch", "rng"),
    "logprob": ("params", "batch"),
    "prefill": ("params", "tokens", "mask"),
    "decode": ("params", "cache", "tok", "positions"),
    "sampler": ("state", "rng", "prompt_tokens", "prompt_mask", "prompt_ids", "live"),
    "sampler_refill": ("state", "rng", "prompt_tokens", "prompt_mask", "prompt_ids", "n_rows"),
}
ARG_NAMES.update(train_packed=ARG_NAMES["train"], logprob_packed=ARG_NAMES["logprob"])

# configs/qwen3_moe_gsm8k.py at Qwen3-30B-A3B's architecture (its config.json's
# numbers): the per-update mini-batch of 16 prompts x 8 samples in 4 mini-batches.
FLAGSHIP = dict(
    model=dict(
        vocab_size=151936,
        d_model=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        moe_d_ff=768,
        num_experts=128,
        top_k=8,
        qk_norm=True,
        tie_embeddings=False,
        param_dtype="float32",
        dtype="bfloat16",
        remat_policy="full",
        logits_chunk_size=128,
        renormalize_topk=True,
    ),
    rows=32,
    prompt_len=384,
    response_len=1024,
    micro_batches=1,
    logprob_rows=128,  # the old-policy pass runs over the whole rollout
    sampler_batches=(128, 512),  # the rollout; the evaluation's 128 prompts x 4 samples
    new_tokens=1024,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark setting: the model and the batch its programs run on."""

    cfg: ModelConfig
    rows: int
    prompt_len: int
    response_len: int
    micro_batches: int
    new_tokens: int
    sampler_batches: tuple[int, ...]
    logprob_micro_batches: int = 1
    logprob_rows: int = 0  # rows of the log-prob pass (0: a mini-batch's, ``rows``)
    mu_dtype: str = "float32"  # Adam's first moment (`optim.make_optimizer`)
    lora: lora_training.LoRAConfig | None = None  # the RL phase with these adapters

    @property
    def trainable(self) -> str:
        """What the train step updates (`gspo_jax.models.lora.TRAINABLE`)."""
        return lora_training.trainable(self.lora or lora_training.LoRAConfig(), "rl")

    @property
    def seq_len(self) -> int:  # the model reads all but the last token
        return self.prompt_len + self.response_len - 1


def model_config(
    size: str, backend: str, layers: int = 0, *, platform: str | None = None, **overrides
) -> ModelConfig:
    """The size's ModelConfig with ``backend`` as the MoE dispatch. ``platform`` is the
    platform the program is compiled for (default: JAX's default backend): on a GPU the
    attention is cuDNN's flash kernel (16-bit inputs only)."""
    m = dict((FLAGSHIP if size == "flagship" else SIZES[size])["model"])
    m["num_layers"] = layers or m["num_layers"]
    m.update(overrides)
    m["param_dtype"], m["dtype"] = jnp.dtype(m["param_dtype"]), jnp.dtype(m["dtype"])
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda") and m["dtype"] == jnp.bfloat16:
        m.setdefault("attention_impl", "cudnn")
    return ModelConfig(moe_backend=backend, **m)


def shape(size: str, backend: str, layers: int = 0, *, platform=None, **overrides) -> Shape:
    """A size of `SIZES` (or "flagship") with its batch; ``overrides`` set Shape fields
    (rows, micro_batches, logprob_micro_batches, ...) or ModelConfig fields."""
    s = FLAGSHIP if size == "flagship" else SIZES[size]
    fields = {f.name for f in dataclasses.fields(Shape)} - {"cfg"}
    batch = {k: s[k] for k in fields if k in s}
    batch["sampler_batches"] = tuple(batch["sampler_batches"])
    batch.update({k: overrides.pop(k) for k in list(overrides) if k in fields})
    return Shape(cfg=model_config(size, backend, layers, platform=platform, **overrides), **batch)


def flagship_shape(*, platform=None, backend="auto", **overrides) -> Shape:
    return shape("flagship", backend, platform=platform, **overrides)


def matmul_params(cfg: ModelConfig, *, active: bool) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not;
    the output head does): all experts, or only the top-K (``active``)."""
    d, hd = cfg.d_model, cfg.head_dim
    n = cfg.vocab_size * d  # output head
    for moe in cfg.layer_kinds:
        n += d * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * d
        if moe:
            experts = cfg.top_k if active else cfg.num_experts
            n += d * cfg.num_experts + experts * 3 * d * cfg.moe_d_ff
        else:
            n += 3 * d * cfg.d_ff
    return n


def adapter_params(cfg: ModelConfig, lc: lora_training.LoRAConfig | None, *, active=False) -> int:
    """The LoRA adapters' parameters (r (in + out) per adapted weight): of every
    expert, or of the top-K only (``active``: those that take part per token)."""
    if not (lc and lc.rank):
        return 0
    d, hd, r = cfg.d_model, cfg.head_dim, lc.rank
    attn = {"q": cfg.num_heads * hd, "k": cfg.num_kv_heads * hd, "v": cfg.num_kv_heads * hd}
    attn["o"] = cfg.num_heads * hd
    n = 0
    for moe in cfg.layer_kinds:
        n += sum(r * (d + attn[t]) for t in attn if t in lc.targets)
        if moe:
            experts = cfg.top_k if active else cfg.num_experts
            mlp = [t for t in ("expert_gate", "expert_up", "expert_down") if t in lc.targets]
            n += experts * len(mlp) * r * (d + cfg.moe_d_ff)
        else:
            n += sum(r * (d + cfg.d_ff) for t in ("gate", "up", "down") if t in lc.targets)
    return n


def on_mesh(sh: Shape, mesh: Mesh) -> Shape:
    """``sh`` as the trainer runs it on ``mesh``: each batch shard dispatches its own
    tokens to the experts (``ModelConfig.moe_groups``, `gspo_jax.run_parts.RunParts`)."""
    groups = math.prod(mesh.shape[a] for a in batch_axes(mesh))
    return dataclasses.replace(sh, cfg=sh.cfg.replace(moe_groups=groups))


def single_device_mesh(device=None) -> Mesh:
    return Mesh(np.asarray([device or jax.devices()[0]]), ("data",))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch's rows are sharded over (the trainer's BATCH_AXES)."""
    return tuple(a for a in ("data", "fsdp", "expert") if a in mesh.axis_names)


def _rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(batch_axes(mesh) or None, *([None] * (ndim - 1))))


def _abstract(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_params(cfg: ModelConfig, mesh: Mesh):
    """(graphdef, the parameters as ShapeDtypeStructs in their mesh sharding)."""
    gdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shardings = param_shardings(state, mesh, cfg)
    return gdef, jax.tree.map(_abstract, state, shardings)


def model_params(cfg: ModelConfig, mesh: Mesh, *, abstract: bool):
    if abstract:
        return abstract_params(cfg, mesh)
    return nnx.split(init_sharded(cfg, mesh, seed=0))


def policy_params(sh: Shape, mesh: Mesh, *, abstract: bool):
    """(graphdef, the parameters the RL phase trains from): `model_params`, or with
    ``sh.lora`` the model with its adapters attached (`lora_training.attach`, seed 0) and
    the base frozen in the compute dtype (`lora_training.rl_params`), as `gspo_jax.rl` has
    them."""
    cfg, lc = sh.cfg, sh.lora
    if not (lc and lc.rank):
        return model_params(cfg, mesh, abstract=abstract)
    if not abstract:
        model = lora_training.attach(init_sharded(cfg, mesh, seed=0), lc, 0, mesh, cfg)
        graphdef, params = nnx.split(model)
        return graphdef, lora_training.rl_params(params, cfg, sh.trainable)

    def build():
        return lora_training.attach(Transformer(cfg, rngs=nnx.Rngs(0)), lc, 0, mesh, cfg)

    graphdef, params = nnx.split(nnx.eval_shape(build))
    params = jax.tree.map(_abstract, params, param_shardings(params, mesh, cfg))
    rl = jax.eval_shape(
        functools.partial(lora_training.rl_params, model_cfg=cfg, kind=sh.trainable), params
    )
    # Each array keeps its sharding through the cast (as `rl_params` does on devices).
    return graphdef, jax.tree.map(lambda o, p: _abstract(o, p.sharding), rl, params)


def rollout_batch(sh: Shape, mesh: Mesh, *, abstract: bool, seed: int = 0, rows: int = 0) -> dict:
    """A mini-batch in the rollout layout: prompts, responses, masks, advantages."""
    cfg, n = sh.cfg, rows or sh.rows
    spec = {
        "prompt_tokens": ((n, sh.prompt_len), jnp.int32),
        "prompt_mask": ((n, sh.prompt_len), jnp.bool_),
        "tokens": ((n, sh.response_len), jnp.int32),
        "mask": ((n, sh.response_len), jnp.float32),
        "advantages": ((n,), jnp.float32),
    }
    if abstract:
        return {
            k: jax.ShapeDtypeStruct(s, d, sharding=_rows_sharding(mesh, len(s)))
            for k, (s, d) in spec.items()
        }
    rs = np.random.RandomState(seed)
    host = {
        "prompt_tokens": rs.randint(1, cfg.vocab_size, spec["prompt_tokens"][0]),
        "prompt_mask": np.ones(spec["prompt_mask"][0], bool),
        "tokens": rs.randint(1, cfg.vocab_size, spec["tokens"][0]),
        "mask": np.ones(spec["mask"][0], np.float32),
        "advantages": rs.randn(n),
    }
    return {
        k: jax.device_put(np.asarray(host[k], spec[k][1]), _rows_sharding(mesh, len(spec[k][0])))
        for k in spec
    }


def packed_shape(sh: Shape, mesh: Mesh, part: str) -> packing.Packing:
    """The packed twin of ``part``'s (train or logprob) padded micro-batches: buffer rows
    of a padded micro-batch's row count, room for every row (`packing.shapes`)."""
    n, m = (sh.rows, sh.micro_batches)
    if part.startswith("logprob"):
        n, m = sh.logprob_rows or sh.rows, sh.logprob_micro_batches
    return packing.Packing.for_batch(n, n // m, math.prod(mesh.shape[a] for a in batch_axes(mesh)))


def _logprob_fn(sh: Shape, graphdef, packing_shape: packing.Packing | None = None):
    return jax.jit(
        functools.partial(
            passes.logprob_pass,
            graphdef=graphdef,
            values=False,
            temperature=1.0,
            micro_batches=sh.logprob_micro_batches,
            packing_shape=packing_shape,
        )
    )


def logprob_program(
    sh: Shape, mesh: Mesh, *, abstract: bool, graphdef=None, params=None, packed=False
):
    if graphdef is None:
        graphdef, params = policy_params(sh, mesh, abstract=abstract)
    fn = _logprob_fn(sh, graphdef, packed_shape(sh, mesh, "logprob") if packed else None)
    rows = sh.logprob_rows or sh.rows
    return fn, (params, rollout_batch(sh, mesh, abstract=abstract, rows=rows))


def make_optimizer(mu_dtype: str = "float32"):
    return optim.make_optimizer(
        mu_dtype=mu_dtype,
        lr=1e-6,
        schedule="constant",
        total_steps=1000,
        warmup_steps=0,
        end_lr_ratio=1.0,
        weight_decay=0.0,
        b1=0.9,
        b2=0.999,
        grad_clip=1.0,
    )


def train_program(
    sh: Shape, mesh: Mesh, *, abstract: bool, graphdef=None, params=None, old=None, packed=False
):
    """The train step and (state, batch, rng). ``old``: the log-prob pass's outputs on
    the batch (computed here when not given; abstractly, by `jax.eval_shape`)."""
    if graphdef is None:
        graphdef, params = policy_params(sh, mesh, abstract=abstract)
    optimizer, sched = make_optimizer(sh.mu_dtype)
    batch = rollout_batch(sh, mesh, abstract=abstract)
    lp = _logprob_fn(sh, graphdef)
    lp_args = (params, batch)
    # The moments of the trainable parameters only (`RunParts.new_state`).
    trained = lora.partition(params, sh.trainable)[0]
    if abstract:
        opt_state = jax.eval_shape(optimizer.init, trained)
        # The optimizer state takes its parameter's sharding (what `jit(init)` gives).
        opt_shard = jax.jit(optimizer.init).trace(trained).out_info
        opt_state = jax.tree.map(lambda a, i: _abstract(a, i.sharding), opt_state, opt_shard)
        old = old or jax.eval_shape(lp, *lp_args)
        old = {k: _abstract(v, _rows_sharding(mesh, v.ndim)) for k, v in old.items() if v.ndim}
        rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    else:
        opt_state = jax.jit(optimizer.init)(trained)
        old = old or lp(*lp_args)
        rng = jax.random.key(0)
    state = step.TrainState.create(params, opt_state)
    if abstract:
        state = jax.tree.map(
            lambda a: (
                a
                if isinstance(a, jax.ShapeDtypeStruct)
                else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))
            ),
            state,
        )
    batch = dict(
        batch,
        old_logp=old["logp"],
        old_topk=old["topk_resp"],
        old_free_topk=old["free_topk_resp"],
        old_router_logp=old["router_logp"],
    )
    # GRPO without its KL term (no reference pass in a throughput figure).
    scfg = step.step_config(
        objective="grpo",
        hparams=(("kl_coef", 0.0),),
        micro_batches=sh.micro_batches,
        trainable=sh.trainable,
        packing=packed_shape(sh, mesh, "train") if packed else None,
    )
    train = jax.jit(
        functools.partial(
            step.train_step, graphdef=graphdef, optimizer=optimizer, schedule=sched, cfg=scfg
        ),
        donate_argnums=(0,),
    )
    return train, (state, batch, rng)


def inference_copy(cfg: ModelConfig, mesh: Mesh, params, *, abstract: bool):
    """The sampler's one copy of the weights in the compute dtype."""
    if abstract:
        out = jax.eval_shape(functools.partial(inference_params, cfg=cfg), params)
        return jax.tree.map(lambda o, p: _abstract(o, p.sharding), out, params)
    return jax.jit(functools.partial(inference_params, cfg=cfg))(params)


def _sampler_params(sh: Shape, mesh: Mesh, *, abstract: bool):
    graphdef, params = model_params(sh.cfg, mesh, abstract=abstract)
    bf = inference_copy(sh.cfg, mesh, params, abstract=abstract)
    del params  # one copy of the weights, as a rollout holds them
    return graphdef, bf


def prefill_program(sh: Shape, mesh: Mesh, batch: int, *, abstract: bool):
    graphdef, params = _sampler_params(sh, mesh, abstract=abstract)
    max_len = sh.prompt_len + sh.new_tokens - 1

    def prefill(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
        cache = model.init_cache(tokens.shape[0], max_len)
        logits, aux, cache = model.decode(
            tokens, cache, positions=positions, attn_mask=mask, last_only=True, prefill=True
        )
        return logits, aux.topk_indices, cache

    shp = (batch, sh.prompt_len)
    if abstract:
        tokens = jax.ShapeDtypeStruct(shp, jnp.int32, sharding=_rows_sharding(mesh, 2))
        mask = jax.ShapeDtypeStruct(shp, jnp.bool_, sharding=_rows_sharding(mesh, 2))
    else:
        rs = np.random.RandomState(0)
        tokens = jax.device_put(
            rs.randint(1, sh.cfg.vocab_size, shp).astype(np.int32), _rows_sharding(mesh, 2)
        )
        mask = jax.device_put(np.ones(shp, bool), _rows_sharding(mesh, 2))
    return jax.jit(prefill), (params, tokens, mask)


def decode_program(sh: Shape, mesh: Mesh, batch: int, *, abstract: bool):
    """One decode step against a cache of P + new_tokens - 1 slots (its index at the
    middle of the response: what a step costs on average)."""
    graphdef, params = _sampler_params(sh, mesh, abstract=abstract)
    max_len = sh.prompt_len + sh.new_tokens - 1

    def step_fn(params, cache, tok, positions):
        model = nnx.merge(graphdef, params)
        logits, aux, cache = model.decode(tok, cache, positions=positions)
        return logits, aux.topk_indices, cache

    def empty_cache():
        model = nnx.merge(graphdef, params)
        return model.init_cache(batch, max_len)

    cache = jax.eval_shape(empty_cache)
    rows = _rows_sharding(mesh, 2)
    if abstract:
        cache = jax.tree.map(
            lambda a: _abstract(
                a, _rows_sharding(mesh, a.ndim) if a.ndim else NamedSharding(mesh, P())
            ),
            cache,
        )
        tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows)
        pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=rows)
    else:
        cache = jax.jit(empty_cache)()
        cache = cache.replace(index=jnp.asarray(sh.prompt_len + sh.new_tokens // 2, jnp.int32))
        cache = cache.replace(valid=jnp.ones_like(cache.valid))
        tok = jax.device_put(np.ones((batch, 1), np.int32), rows)
        pos = jax.device_put(
            np.full((batch, 1), sh.prompt_len + sh.new_tokens // 2, np.int32), rows
        )
    return jax.jit(step_fn, donate_argnums=(1,)), (params, cache, tok, pos)


# sampler_refill's rows per slot: a step's rollout is twice the slots it decodes in.
REFILL_ROWS_PER_SLOT = 2
# sampler_refill's chunk: a chunk of 32 rows prefilled together (the slots, if fewer).
REFILL_CHUNK = 32


def sampler_program(
    sh: Shape, mesh: Mesh, batch: int, *, abstract: bool, platform=None, refill=False
):
    """The sampler's compiled function for ``batch`` prompts of ``prompt_len`` tokens,
    one sample each, ``new_tokens`` new tokens, temperature 1, no stop token, no
    routing record (what the benchmark times). ``platform``: the sampling formulations
    of that backend (`gspo_jax.decode.use_cpu_sampling`). ``refill``: the refilling
    program instead, in ``batch`` slots over `REFILL_ROWS_PER_SLOT` x ``batch`` prompts,
    chunks of min(`REFILL_CHUNK`, ``batch``) rows, as `Sampler.__call__` calls it: the
    prompts replicated, the real rows' count a scalar, its slots and rows sharded."""
    from gspo_jax import decode, rollout
    from gspo_jax import refill as refilling

    graphdef, params = _sampler_params(sh, mesh, abstract=abstract)
    sampler = rollout.Sampler(
        graphdef, params, vocab_size=sh.cfg.vocab_size, prompt_len=sh.prompt_len
    )
    n = batch * (REFILL_ROWS_PER_SLOT if refill else 1)
    prompts = np.random.RandomState(0).randint(1, sh.cfg.vocab_size, (n, sh.prompt_len))
    args, spec, n_rows = sampler._prepare(
        prompts.tolist(),
        num_samples=1,
        max_new_tokens=sh.new_tokens,
        rng=jax.random.key(0),
        temperature=1.0,
        eos_id=None,
        routing="none",
    )
    platform = platform or jax.default_backend()
    spec = spec._replace(cpu=platform == "cpu")
    if mesh.size > 1:  # rows sharded over the data axes, as a Sampler with a mesh does
        spec = spec._replace(batch_sharding=NamedSharding(mesh, P(batch_axes(mesh))))
    jitted = decode.generate_jit
    if refill:
        args = (*args[:6], jnp.int32(n_rows), *args[7:])
        spec = refilling.RefillSpec(spec, batch, min(REFILL_CHUNK, batch))
        jitted = refilling.generate_refill_jit
    if abstract:
        head, tail = args[:2], args[2:]

        def place(x):  # the batch program's rows sharded; the refilling one's replicated
            x = jnp.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
            if x.ndim and x.shape[0] == batch and not refill:
                return _abstract(x, _rows_sharding(mesh, x.ndim))
            return _abstract(x, NamedSharding(mesh, P()))

        args = head + tuple(jax.tree.map(place, t) for t in tail)
    return _SamplerJit(jitted, spec), args


class _SamplerJit:
    """``jitted.lower(*args)`` for a sampler's jitted function with its static spec bound."""

    def __init__(self, jitted, spec):
        self.jitted, self.spec = jitted, spec

    def lower(self, *args):
        return self.jitted.lower(*args, spec=self.spec)

    def __call__(self, *args):
        return self.jitted(*args, spec=self.spec)


def program(part: str, sh: Shape, mesh: Mesh, *, abstract: bool, batch: int = 0, platform=None):
    """(jitted, args) of one part of `PARTS` (``batch``: the sampler-side batch)."""
    if sh.lora and sh.lora.rank and part.split("_")[0] not in ("train", "logprob"):
        raise ValueError(
            f"part {part!r}: with LoRA only the train and logprob programs are built "
            "(the sampler's would be the merged weights' or the base's with adapters)"
        )
    if part in ("train", "train_packed"):
        return train_program(sh, mesh, abstract=abstract, packed=part == "train_packed")
    if part in ("logprob", "logprob_packed"):
        return logprob_program(sh, mesh, abstract=abstract, packed=part == "logprob_packed")
    if part == "prefill":
        return prefill_program(sh, mesh, batch, abstract=abstract)
    if part == "decode":
        return decode_program(sh, mesh, batch, abstract=abstract)
    if part in ("sampler", "sampler_refill"):
        refill = part == "sampler_refill"
        return sampler_program(sh, mesh, batch, abstract=abstract, platform=platform, refill=refill)
    raise ValueError(f"part: unknown program {part!r}; expected one of {PARTS}")
