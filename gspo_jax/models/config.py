"""The model's frozen configuration.

`ModelConfig` describes a decoder-only transformer whose feed-forward blocks are
either dense SwiGLU MLPs or Mixture-of-Experts layers.  It is data: hashable,
immutable, validated on construction, and kept apart from experiment configs.

Which layers are MoE (0-based layer index i; mirrors Qwen3-MoE's rules):

    is_moe(i) = num_experts > 0
                and i >= first_dense_layers
                and i not in dense_layers             # HF `mlp_only_layers`
                and (i + 1) % moe_every == 0          # HF `decoder_sparse_step`

so "every layer" is the default, "every k-th" is ``moe_every=k`` and "the first
k dense" is ``first_dense_layers=k``.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Optional

import jax.numpy as jnp

from gspo_jax.config_fields import err, from_dataclass_error, is_int, problem, setting

MOE_BACKENDS = ("auto", "blocked", "ragged", "dense")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_no_scores")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
# Logical names used by the parameters: vocab, embed, heads, kv_heads, head_dim,
# mlp, expert, norm, layers.  `batch` is the activations' leading axis.
DEFAULT_AXIS_RULES = (
    # Rows over every axis but 'tensor': with an 'expert' axis, each of its devices
    # has rows of its own and exchanges them with the experts' devices (expert
    # parallelism, gspo_jax/models/expert_parallel.py), as MaxText lays it out.
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("norm", None),
    ("layers", None),
)


def _layer_list(v) -> str | None:
    if isinstance(v, (list, tuple)) and all(is_int(i) for i in v):
        return None
    return f"must be a list of ints, got {v!r}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of the transformer.

    Attributes:
      vocab_size: V.
      d_model: D, the residual stream width.
      num_layers: number of decoder layers.
      num_heads: H query heads.
      num_kv_heads: KV heads (grouped-query attention; H % KV == 0).
      head_dim: per-head width, independent of D / H (as in Qwen3).
      d_ff: hidden width of the dense SwiGLU MLP layers.
      moe_d_ff: hidden width of each expert's SwiGLU MLP.
      num_experts: E (0 = a dense model).
      top_k: K experts per token.
      moe_every: layer i is MoE only if (i + 1) % moe_every == 0.
      first_dense_layers: the first k layers are dense.
      dense_layers: explicit dense layer indices (HF ``mlp_only_layers``).
      renormalize_topk: divide the K gate weights by their sum (HF
        ``norm_topk_prob``).
      qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
      qkv_bias: biases on the q, k and v projections (Qwen2).
      tie_embeddings: the output projection is the embedding matrix transposed.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      param_dtype: storage dtype of parameters.
      dtype: compute dtype (matmul inputs, residual stream).  Router, softmax,
        norms' statistics and the returned logits are always f32.
      scan_layers: ``lax.scan`` over repeated identical layer groups (one compiled
        body) instead of unrolling.  The parameter layout is the same either way.
      remat_policy: 'none' | 'full' (save nothing) | 'dots' (save every matmul
        output, the attention scores [B, H, T, S] and the experts' batched
        products included) | 'dots_no_batch' (save the matmuls without batch dims:
        the q/k/v/o projections, dense MLPs and the router) | 'dots_no_scores'
        ('dots_no_batch' plus the attention output [B, T, H, hd] before the output
        projection, so the backward pass recomputes only the scores; no
        [B, H, T, S] array is saved, see blocks.CHECKPOINT_POLICIES).  Applied per
        scanned layer group.
      attention_impl: the full forward's attention (`jax.nn.dot_product_attention`):
        'xla' (einsum scores; every backend), 'cudnn' (the cuDNN flash kernel:
        NVIDIA GPU, bf16/f16, head_dim a multiple of 8 <= 128; an odd length is
        padded by one) or 'auto' (cudnn where all of that holds, else xla).  The KV-cache decode
        path is the same einsum attention whatever this says.
      moe_backend: 'blocked' (sort-based, dropless, expert-blocked batched matmul;
        fast on CPU), 'ragged' (sort-based, dropless grouped matmul reading the
        experts in place, expert parallel over the mesh's expert axis; for GPU and
        TPU), 'dense' (every expert on every token, masked; the reference) or
        'auto' (blocked on CPU, ragged on GPU and TPU; docs/moe.md).
      moe_block_size: rows per block of the 'blocked' backend (an upper bound;
        shrunk for small token counts).
      moe_groups: the 'blocked' and 'ragged' dispatches sort and compute the tokens
        of this many equal blocks of batch rows separately (gcd with the rows of a
        call): the trainer sets it to the mesh's batch shards (data x fsdp x expert), so that
        each device dispatches its own rows. Changes no value. Under a mesh set
        with `jax.set_mesh`, 'ragged' takes its groups from the mesh instead
        (`gspo_jax.models.expert_parallel`).
      aux_loss_coef: a Hugging Face checkpoint's weight of RouterAux.aux_loss (its
        ``router_aux_loss_coef`` x top_k), kept so that an export writes it back; a run's
        weights are config.updates.aux_loss_coef and config.sft.aux_loss_coef.
      z_loss_coef: likewise for RouterAux.z_loss (a run's: config.updates.z_loss_coef).
      value_head: add a scalar value head (PPO critic; the trainer sets it for
        config.advantage 'gae').
      logits_chunk_size: default chunk over T in `token_logprobs` (None = whole T;
        0 is taken as None, the experiment config's "off").
      num_valid_tokens: token ids >= this are padding rows of the embedding (a real
        checkpoint pads its vocabulary beyond the tokenizer's); their logits are set
        to -1e30 in every forward, so they are never sampled and carry no probability
        mass in any log-prob (0 = every id is a token).
      init_std: stddev of the normal initialiser of matrices (HF
        ``initializer_range``).
      axis_rules: logical axis name -> mesh axis rules, see DEFAULT_AXIS_RULES.
    """

    vocab_size: int = setting(low=0, doc="V (in config.model.fields, 0 = the tokenizer's)")
    d_model: int = setting(low=1, doc="D, the residual stream width")
    num_layers: int = setting(low=1, doc="decoder layers")
    num_heads: int = setting(low=1, doc="query heads")
    num_kv_heads: int = setting(low=1, doc="KV heads; divides num_heads")
    head_dim: int = setting(low=1, doc="per-head width; even (rotary embedding)")
    d_ff: int = setting(low=1, doc="hidden width of the dense SwiGLU MLPs")
    moe_d_ff: int = setting(0, low=0, doc="hidden width of each expert; >= 1 with experts")
    num_experts: int = setting(0, low=0, doc="E (0 = a dense model)")
    top_k: int = setting(0, low=0, doc="experts per token, in [1, num_experts] with experts")
    moe_every: int = setting(1, low=1, doc="layer i is MoE only if (i + 1) % moe_every == 0")
    first_dense_layers: int = setting(0, low=0, doc="the first k layers are dense")
    dense_layers: tuple[int, ...] = setting(
        (), check=_layer_list, doc="dense layer indices in [0, num_layers)"
    )
    renormalize_topk: bool = setting(True, doc="divide the K gate weights by their sum")
    qk_norm: bool = setting(True, doc="RMSNorm on queries and keys before RoPE")
    qkv_bias: bool = setting(False, doc="biases on the q, k and v projections")
    tie_embeddings: bool = setting(False, doc="the output projection is the embedding's")
    rope_theta: float = setting(10_000.0, low=0, low_open=True, doc="RoPE base")
    norm_eps: float = setting(1e-6, low=0, low_open=True, doc="RMSNorm epsilon")
    param_dtype: str = "float32"
    dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "none"
    attention_impl: str = "auto"
    moe_backend: str = "blocked"
    moe_block_size: int = 64
    moe_groups: int = 1
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    value_head: bool = False
    logits_chunk_size: Optional[int] = None
    num_valid_tokens: int = 0
    init_std: float = setting(0.02, low=0, low_open=True, doc="stddev of the initialiser")
    axis_rules: tuple[tuple[str, object], ...] = DEFAULT_AXIS_RULES

    def __post_init__(self):
        def need(cond, field, msg):
            if not cond:
                raise ValueError(f"ModelConfig.{field}: {msg} (got {getattr(self, field)!r})")

        for f in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "d_ff",
            "moe_every",
            "moe_block_size",
            "moe_groups",
        ):
            need(
                isinstance(getattr(self, f), int) and getattr(self, f) > 0,
                f,
                "must be a positive int",
            )
        need(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads={self.num_heads}",
        )
        need(self.head_dim % 2 == 0, "head_dim", "must be even (rotary embedding)")
        need(self.num_experts >= 0, "num_experts", "must be >= 0")
        if self.num_experts > 0:
            need(
                1 <= self.top_k <= self.num_experts,
                "top_k",
                f"must be in [1, num_experts={self.num_experts}]",
            )
            need(self.moe_d_ff > 0, "moe_d_ff", "must be > 0 when num_experts > 0")
        need(self.first_dense_layers >= 0, "first_dense_layers", "must be >= 0")
        need(
            all(0 <= i < self.num_layers for i in self.dense_layers),
            "dense_layers",
            f"indices must be in [0, num_layers={self.num_layers})",
        )
        need(self.param_dtype in DTYPES, "param_dtype", f"must be one of {DTYPES}")
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        need(
            self.remat_policy in REMAT_POLICIES, "remat_policy", f"must be one of {REMAT_POLICIES}"
        )
        need(
            self.attention_impl in ATTENTION_IMPLS,
            "attention_impl",
            f"must be one of {ATTENTION_IMPLS}",
        )
        need(self.moe_backend in MOE_BACKENDS, "moe_backend", f"must be one of {MOE_BACKENDS}")
        if self.logits_chunk_size == 0 and not isinstance(self.logits_chunk_size, bool):
            object.__setattr__(self, "logits_chunk_size", None)  # the config's 0 = off
        need(
            self.logits_chunk_size is None
            or (
                isinstance(self.logits_chunk_size, int)
                and not isinstance(self.logits_chunk_size, bool)
                and self.logits_chunk_size > 0
            ),
            "logits_chunk_size",
            "must be None, 0 (off) or an int > 0",
        )
        need(
            0 <= self.num_valid_tokens <= self.vocab_size,
            "num_valid_tokens",
            f"must be in [0, vocab_size={self.vocab_size}]",
        )
        need(self.rope_theta > 0, "rope_theta", "must be > 0")
        need(self.norm_eps > 0, "norm_eps", "must be > 0")
        for rule in self.axis_rules:
            ok = isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)
            targets = rule[1] if ok and isinstance(rule[1], tuple) else (rule[1],) if ok else ()
            ok = ok and all(t is None or t in MESH_AXES for t in targets)
            need(
                ok,
                "axis_rules",
                f"each rule must be (logical_name, mesh axis in "
                f"{MESH_AXES} | tuple of them | None); bad rule {rule!r}",
            )

    # ---------------------------------------------------------------- derived
    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has an MoE feed-forward."""
        return (
            self.num_experts > 0
            and layer >= self.first_dense_layers
            and layer not in self.dense_layers
            and (layer + 1) % self.moe_every == 0
        )

    @property
    def layer_kinds(self) -> tuple[bool, ...]:
        """is_moe for every layer, in order."""
        return tuple(self.is_moe(i) for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        """L, the number of MoE layers (the L axis of RouterAux and replay)."""
        return sum(self.layer_kinds)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (active=True: only K of E experts per MoE layer)."""
        d, h, kv, hd = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * hd * (h + 2 * kv) + h * hd * d + 2 * d
        attn += 2 * hd if self.qk_norm else 0
        attn += hd * (h + 2 * kv) if self.qkv_bias else 0
        total = 0
        for moe in self.layer_kinds:
            if moe:
                e = self.top_k if active else self.num_experts
                total += attn + self.num_experts * d + e * 3 * d * self.moe_d_ff
            else:
                total += attn + 3 * d * self.d_ff
        total += self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        total += d + 1 if self.value_head else 0
        return total

    # ---------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides) -> "ModelConfig":
        """A few-thousand-parameter MoE model for tests: 4 layers (first dense,
        then MoE / dense alternating ... see `first_dense_layers` / `moe_every`
        overrides), 8 experts top-2, vocab 97."""
        base = dict(
            vocab_size=97,
            d_model=32,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            d_ff=64,
            moe_d_ff=24,
            num_experts=8,
            top_k=2,
            first_dense_layers=1,
            renormalize_topk=True,
            qk_norm=True,
            rope_theta=10_000.0,
            moe_block_size=8,
        )
        base.update(overrides)
        return cls(**base)


# --------------------------------------------------------------------------
# config.model: the model of an experiment.


def _tiny_moe() -> dict:
    """config.model.fields' default: a tiny MoE for CPU runs, and every other field the
    config sets (each declared with a `setting`: docs/config.md's table) at ModelConfig's
    default. Each must be present to be set on the command line: the trainer locks the
    config before ``--config.model.fields.<key>=`` is applied, and a locked group takes
    no new key. (A workdir saved when fewer were present compares at these defaults:
    `gspo_jax.safety.config_differences`.)"""
    tiny = dict(
        vocab_size=0,
        d_model=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        d_ff=256,
        moe_d_ff=128,
        num_experts=8,
        top_k=2,
    )
    return {
        f.name: tiny.get(f.name, f.default)
        for f in dataclasses.fields(ModelConfig)
        if "doc" in f.metadata and (f.name in tiny or f.default is not dataclasses.MISSING)
    }


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """``config.model``: a checkpoint to load, or the architecture to initialise
    (``fields``), and the runtime settings of either."""

    pretrained: str = setting("", doc='a Hugging Face checkpoint directory ("" = initialise)')
    dtype: str = setting("float32", choices=DTYPES, doc="compute dtype")
    param_dtype: str = setting("float32", choices=DTYPES, doc="storage dtype of parameters")
    moe_backend: str = setting(
        "auto",
        choices=MOE_BACKENDS,
        resume=True,
        doc="auto: blocked on CPU, ragged on GPU/TPU (docs/moe.md)",
    )
    # Each block gathers its expert's weights, so larger blocks copy less.
    moe_block_size: int = setting(
        64,
        low=1,
        resume=True,
        doc="rows per block of the 'blocked' dispatch (an upper bound; 512 on a GPU or TPU: "
        "docs/memory.md)",
    )
    scan_layers: bool = setting(True, doc="lax.scan over repeated layer groups")
    remat_policy: str = setting(
        "none",
        choices=REMAT_POLICIES,
        resume=True,
        doc="rematerialisation of each layer group's activations (docs/memory.md)",
    )
    attention_impl: str = setting(
        "auto",
        choices=ATTENTION_IMPLS,
        resume=True,
        doc="auto: cuDNN flash on an NVIDIA GPU where it applies, else XLA; cudnn needs a "
        "bf16/f16 dtype (a kernel changes rounding only)",
    )
    logits_chunk_size: int = setting(
        0,
        low=0,
        why=" (0 = off)",
        resume=True,
        doc="token log-probs take the f32 logits this many positions at a time (0 = all at "
        "once): a 152k vocabulary needs it (docs/memory.md); changes no number",
    )
    fields: dict = setting(
        factory=_tiny_moe,
        open_group=True,
        domain="ModelConfig's fields and checks (vocab_size 0 = the tokenizer's)",
        doc="the architecture of an initialised model",
    )

    @classmethod
    def check_node(cls, node) -> None:
        """Every ModelConfig field present in ``config.model.fields``, on its own (its
        declaration in ModelConfig); an initialised model's required ones present."""
        f = node.fields
        known = {x.name: x for x in dataclasses.fields(ModelConfig)}
        for key in f.keys():
            path = f"model.fields.{key}"
            if key in RUNTIME_FIELDS:
                raise err(path, f"a runtime setting: set config.model.{key} (this one is ignored)")
            if key in DERIVED_FIELDS:
                raise err(path, f"{DERIVED_FIELDS[key]}; leave it out")
            if key not in known:
                near = difflib.get_close_matches(key, list(known), n=1)
                hint = f"; did you mean config.model.fields.{near[0]}?" if near else ""
                raise err(path, f"not a ModelConfig field{hint}")
        if not node.pretrained:
            for key, x in known.items():
                if x.default is dataclasses.MISSING and key not in f:
                    raise err(f"model.fields.{key}", "missing (an initialised model needs it)")
        for key in f.keys():
            msg = field_problem(key, f[key])
            if msg:
                raise err(f"model.fields.{key}", msg)
        if node.attention_impl == "cudnn" and node.dtype == "float32":
            raise err(
                "model.attention_impl",
                "'cudnn' (flash attention) needs model.dtype bfloat16 or float16, got float32; "
                "use 'auto' or 'xla'",
            )

    def check_run(self, run, ctx) -> None:
        """A pretrained model's tokenizer; an initialised one against the tokenizer
        (``ctx.tokenizer_vocab_size``, where known), then ModelConfig's own checks across
        its fields (every error names config.model.fields.<x>)."""
        if self.pretrained:
            if run.tokenizer == "char":
                raise err(
                    "tokenizer",
                    "a pretrained model needs its own tokenizer: set it to the checkpoint "
                    "directory",
                )
            return
        vocab, tokenizer_vocab = int(self.fields["vocab_size"]), ctx.tokenizer_vocab_size
        if tokenizer_vocab is not None and vocab and vocab < tokenizer_vocab:
            raise err(
                "model.fields.vocab_size",
                f"{vocab} is smaller than the tokenizer's vocabulary of {tokenizer_vocab} "
                "(set it to 0 to take the tokenizer's)",
            )
        try:
            self.model_config(tokenizer_vocab or vocab or 1, run.advantage == "gae")
        except (TypeError, ValueError) as e:
            moved = {k: f"model.{k}" for k in RUNTIME_FIELDS}
            raise from_dataclass_error(
                e, "ModelConfig", "model.fields", self.fields, moved
            ) from None

    @property
    def dense(self) -> bool:
        """An initialised model without experts (a pretrained one is known once loaded)."""
        return not self.pretrained and int(self.fields.get("num_experts", 0)) == 0

    def model_config(self, tokenizer_vocab_size: int, value_head: bool = False) -> ModelConfig:
        """The ModelConfig of an initialised policy: ``fields`` with this section's
        runtime settings; vocab_size 0 takes the tokenizer's, and a larger one marks the
        rows past the tokenizer's as padding (never sampled). ``value_head``: PPO's
        critic (config.advantage 'gae')."""
        f = {k: tuple(v) if isinstance(v, list) else v for k, v in self.fields.items()}
        f.update({k: getattr(self, k) for k in RUNTIME_FIELDS})
        if value_head:
            f["value_head"] = True
        if not f.get("vocab_size"):
            f["vocab_size"] = tokenizer_vocab_size
        elif f["vocab_size"] > tokenizer_vocab_size:
            f["num_valid_tokens"] = tokenizer_vocab_size
        return ModelConfig(**f)


# Set on config.model, not config.model.fields (`model_config` copies them over).
RUNTIME_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelSection) if f.name not in ("pretrained", "fields")
)
# ModelConfig fields the trainer sets, and from what.
DERIVED_FIELDS = {
    "num_valid_tokens": "derived from the tokenizer's vocabulary",
    "moe_groups": "set by the trainer to the mesh's batch shards",
    "value_head": "set by the trainer for config.advantage='gae' (PPO's critic)",
    "aux_loss_coef": "not read by training (a Hugging Face checkpoint's router loss weight, "
    "kept for its export): set config.updates.aux_loss_coef (RL) and "
    "config.sft.aux_loss_coef (the warm start)",
    "z_loss_coef": "not read by training (a Hugging Face checkpoint's, kept for its "
    "export): set config.updates.z_loss_coef (RL)",
}


def field_problem(key: str, value) -> str | None:
    """What is wrong with ``value`` of ModelConfig field ``key`` on its own (its
    declared type and range), or None; the cross-field checks are ModelConfig's."""
    f = {f.name: f for f in dataclasses.fields(ModelConfig)}[key]
    if "doc" not in f.metadata:
        return None
    return problem(value, typing.get_type_hints(ModelConfig)[key], f.metadata)
