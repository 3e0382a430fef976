"""Per-device memory budget of an RL run, per category, computed from the model config.

    cd /work/main && . .venv/bin/activate
    python -m experiments.memory_budget              # the tables of docs/memory.md
    python -m experiments.memory_budget --validate   # the formulas against XLA (CPU)

Every number is a formula of the ModelConfig (the same fields `from_pretrained` builds
from a checkpoint's config.json), the mesh, the dtypes, the batch and sequence
settings, the remat policy, the attention implementation and the logits chunk; the
formulas are in `Budget` and docs/memory.md.  ``--validate`` compiles the train
step's loss-and-gradient of a small model on CPU and compares the formulas with what
JAX saves for the backward pass (`jax.ad_checkpoint.print_saved_residuals`) and with
XLA's compiled memory analysis.

Three phases of an RL step hold different arrays; the peak of a run is the largest:

* rollout: the resident state and the sampler's KV cache;
* log-prob passes (the old policy, and the reference under KL): forwards over the
  rollout batch in `logprob_micro_batches` pieces, one after another
  (`gspo_jax.passes.logprob_pass`);
* train step: value-and-grad of one micro-batch under the remat policy, then the
  optimizer update.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import re
import sys
from typing import Optional

from gspo_jax.models.config import ModelConfig

GiB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------
# Models: the fields `gspo_jax.models.hf_layout.config_from_hf` reads from each
# checkpoint's config.json (Hugging Face Qwen/<name>/config.json).


def qwen3_30b_a3b(**runtime) -> ModelConfig:
    """Qwen3-30B-A3B: 48 MoE layers, 128 experts top-8 (moe_intermediate 768), hidden
    2048, 32 query / 4 KV heads of 128, vocab 151936, untied embeddings."""
    return ModelConfig(
        vocab_size=151936,
        d_model=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        d_ff=6144,  # intermediate_size: unused, every layer is MoE
        moe_d_ff=768,
        num_experts=128,
        top_k=8,
        renormalize_topk=True,
        rope_theta=1e6,
        **runtime,
    )


def qwen3_8b(**runtime) -> ModelConfig:
    """Qwen3-8B (dense): hidden 4096, 36 layers, 32 / 8 heads of 128, MLP 12288."""
    return ModelConfig(
        vocab_size=151936,
        d_model=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        rope_theta=1e6,
        **runtime,
    )


def qwen3_4b(**runtime) -> ModelConfig:
    """Qwen3-4B (dense): hidden 2560, 36 layers, 32 / 8 heads of 128, MLP 9728, tied
    embeddings."""
    return ModelConfig(
        vocab_size=151936,
        d_model=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        d_ff=9728,
        tie_embeddings=True,
        rope_theta=1e6,
        **runtime,
    )


# --------------------------------------------------------------------------
# Hardware.


@dataclasses.dataclass(frozen=True)
class Hardware:
    """devices: accelerators (JAX devices); hbm: bytes per device; usable: the share
    XLA may allocate (GPUs: set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, the default
    is 0.75)."""

    name: str
    devices: int
    hbm: int
    usable: float = 0.95
    source: str = ""

    @property
    def budget(self) -> float:
        return self.hbm * self.usable


MiB = 2**20
H100_8 = Hardware(
    "8x H100 80GB",
    8,
    81559 * MiB,
    source="H100 SXM 80GB: 81,559 MiB per GPU as nvidia-smi reports it",
)
H200_1 = Hardware(
    "1x H200 141GB", 1, 143771 * MiB, source="H200: 143,771 MiB as nvidia-smi reports it"
)
V5P_8 = Hardware(
    "TPU v5p-8",
    4,
    95 * GiB,
    source="v5p-8 = 2x2x1 topology, 4 chips (8 TensorCores; JAX sees 4 devices), "
    "95 GiB HBM2e per chip (cloud.google.com/tpu/docs/v5p)",
)
V5P_16 = Hardware("TPU v5p-16", 8, 95 * GiB, source="2x2x2 topology, 8 chips, 95 GiB each")


# --------------------------------------------------------------------------
# The run.


@dataclasses.dataclass(frozen=True)
class Run:
    """The experiment-config values the budget depends on (config.<field> names).

    prompt_len is config.rollout.max_prompt_len, the length every prompt is
    left-padded to (384 for GSM8K's chat-formatted prompts).  kl:
    objective.hparams.kl_coef > 0 (a reference copy and a second log-prob pass)."""

    prompts_per_step: int = 64
    group_size: int = 8
    prompt_len: int = 384
    max_new_tokens: int = 1024
    num_minibatches: int = 4
    micro_batches: int = 1
    logprob_micro_batches: int = 1  # config.updates.logprob_micro_batches
    remat_policy: str = "full"
    attention: str = "flash"  # "flash" (cuDNN) or "xla" (einsum scores)
    logits_chunk_size: int = 128  # 0 = the whole sequence
    kl: bool = False
    eval_size: int = 256  # task.eval_size prompts x task.eval_samples, sampled at once
    eval_samples: int = 4

    @property
    def rows(self) -> int:
        """Rollout rows, prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size

    @property
    def seq(self) -> int:
        """Model input length of the train and log-prob passes, P + T - 1
        (`passes.sequence_inputs` drops the last token)."""
        return self.prompt_len + self.max_new_tokens - 1


# Parameters the forward reads in f32 (precision.F32_PARAMS): the router.
def _router_params(cfg: ModelConfig) -> int:
    return cfg.num_moe_layers * cfg.d_model * cfg.num_experts


def _layer_params(cfg: ModelConfig) -> float:
    """Mean parameters of one decoder layer (all but the embedding and the head)."""
    emb = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) + cfg.d_model
    return (cfg.num_params() - emb) / cfg.num_layers


def saved_per_token(cfg: ModelConfig, policy: str, seq: int) -> float:
    """Bytes per token that the backward pass keeps of all the decoder layers under
    the remat policy (a sum over layers), seq the key length.

    Per layer: the scan carry x [D] in the compute dtype under every policy; under
    'dots_no_batch' the outputs of the matmuls without batch dims: q [H*hd], k and v
    [KV*hd], the output projection [D], a dense layer's gate and up [F] and down [D],
    an MoE layer's router logits [E] in f32 (the experts' grouped matmuls are not
    dot_generals, and are recomputed); 'dots_no_scores' adds the attention output
    [H*hd]; 'dots' saves that too (as a dot output) and the f32 scores [H*S]."""
    if policy == "none":
        raise ValueError("remat_policy 'none' keeps every intermediate; not modelled")
    if cfg.moe_backend == "dense" and policy != "full":
        raise ValueError("moe_backend 'dense' under a dots policy: not modelled")
    cb = BYTES[cfg.dtype]
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    total = 0.0
    for moe in cfg.layer_kinds:
        b = d * cb  # the carry
        if policy in ("dots_no_batch", "dots_no_scores", "dots"):
            b += (h + 2 * kv) * hd * cb + d * cb
            b += cfg.num_experts * 4 if moe else (2 * cfg.d_ff + d) * cb
            if moe and cfg.moe_backend == "blocked" and policy == "dots":
                b += cfg.top_k * (2 * cfg.moe_d_ff + d) * cb  # batched, saved by 'dots'
        if policy in ("dots_no_scores", "dots"):
            b += h * hd * cb
        if policy == "dots":
            b += h * seq * 4
        total += b
    return total


def top_saved_per_token(cfg: ModelConfig, seq: int) -> float:
    """Bytes per token the backward keeps outside the layers: the RoPE tables cos, sin
    [hd] f32, the attention mask [S] and the token mask (bool), the final RMSNorm's
    f32 input and statistics [D + 2] and its output [D], the logits chunks' inputs
    [D] (a padded copy), the embedding's gather indices and the targets (int32)."""
    cb = BYTES[cfg.dtype]
    d = cfg.d_model
    return 2 * cfg.head_dim * 4 + seq + 1 + (d + 2) * 4 + d * cb + d * cb + 8


def layer_transient_per_token(cfg: ModelConfig, run: Run, backward: bool) -> float:
    """Bytes per token of the one layer being recomputed and differentiated (or, with
    backward=False, run forward): what no policy saves, one layer at a time.

    Attention: 'xla' materialises arrays of the f32 scores' size H*S*4 bytes: 3 at
    once in a forward, 8 in a backward (XLA:CPU's compiled peak grows by 3.0 and 7.4
    such arrays per unit of B*H*T*S; `validate`); the cuDNN flash kernel keeps only
    its softmax statistics [H] f32.  q, k, v and the output [(2H + 2KV) hd].  The FFN:
    an MoE layer's K gathered copies of the token [D], its gate, up and gated hidden
    [3F] and its expert outputs [D] (x2 with their gradients); a dense one [3F + D]."""
    cb = BYTES[cfg.dtype]
    d, h, kv, hd, s = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, run.seq
    grad = 2 if backward else 1
    attn = (2 * h + 2 * kv) * hd * cb * grad
    if run.attention == "xla":
        attn += h * s * 4 * (8 if backward else 3)
    else:
        attn += h * 4
    if cfg.num_experts:
        ffn = cfg.top_k * (2 * d + 3 * cfg.moe_d_ff) * cb * grad
    else:
        ffn = (3 * cfg.d_ff + d) * cb * grad
    return attn + ffn


@dataclasses.dataclass
class Budget:
    """Bytes per device, per category and per phase (see the module docstring)."""

    cfg: ModelConfig
    hw: Hardware
    run: Run
    param_shards: Optional[int] = None  # default: every device (mesh fsdp = -1)
    data_shards: Optional[int] = None  # default: every device

    def __post_init__(self):
        self.param_shards = self.param_shards or self.hw.devices
        self.data_shards = self.data_shards or self.hw.devices
        run = self.run
        n_rows = run.rows // run.num_minibatches // run.micro_batches
        if n_rows * run.num_minibatches * run.micro_batches != run.rows:
            raise ValueError("num_minibatches * micro_batches must divide the rollout rows")
        if n_rows % self.data_shards or run.rows % (self.data_shards * run.logprob_micro_batches):
            raise ValueError(
                f"the batch does not split over {self.data_shards} data shards (train "
                f"micro-batches of {n_rows} rows, {run.logprob_micro_batches} log-prob pieces)"
            )

    # ------------------------------------------------------------ categories
    @property
    def n_params(self) -> int:
        return self.cfg.num_params()

    def _over_params(self, nbytes: float) -> float:
        return nbytes / self.param_shards

    def parameters(self) -> float:
        """N * bytes(param_dtype) / param shards."""
        return self._over_params(self.n_params * BYTES[self.cfg.param_dtype])

    def optimizer_state(self) -> float:
        """AdamW's two moments, in the parameter dtype (optax.adamw's mu_dtype=None):
        2 N * bytes(param_dtype) / param shards."""
        return 2 * self.parameters()

    def gradients(self) -> float:
        """N * bytes(param_dtype) / param shards; twice with micro_batches > 1 (the
        micro-batch scan's accumulator and the current micro-batch's gradient,
        `step.accumulate`)."""
        return self.parameters() * (2 if self.run.micro_batches > 1 else 1)

    def reference(self) -> float:
        """With KL: the reference copy in the compute dtype, the router in f32
        (`precision.inference_params`)."""
        if not self.run.kl:
            return 0.0
        r = _router_params(self.cfg)
        return self._over_params((self.n_params - r) * BYTES[self.cfg.dtype] + r * 4)

    def fsdp_gather(self, backward: bool = True) -> float:
        """One layer's weights gathered in the compute dtype (x2: the next layer's
        prefetch) and, in the train step, one layer's gradient in the parameter dtype
        before its reduce-scatter: L_params * (2 cb + pb), 0 on one device."""
        if self.param_shards == 1:
            return 0.0
        cb, pb = BYTES[self.cfg.dtype], BYTES[self.cfg.param_dtype]
        return _layer_params(self.cfg) * (2 * cb + (pb if backward else 0))

    def train_rows(self) -> int:
        """Rows of one micro-batch per device: rows / minibatches / micro / data shards."""
        r = self.run
        return r.rows // r.num_minibatches // r.micro_batches // self.data_shards

    def pass_rows(self) -> int:
        """Rows per device of a log-prob pass: the rollout batch, logprob_micro_batches
        pieces one after another."""
        return self.run.rows // self.run.logprob_micro_batches // self.data_shards

    def activations(self) -> float:
        """Train step: tokens * (saved_per_token + top_saved_per_token), tokens =
        train_rows * S."""
        tokens = self.train_rows() * self.run.seq
        cfg = self.cfg
        return tokens * (
            saved_per_token(cfg, self.run.remat_policy, self.run.seq)
            + top_saved_per_token(cfg, self.run.seq)
        )

    def layer_transient(self) -> float:
        """Train step: one layer's recomputation and backward (layer_transient_per_token)."""
        return (
            self.train_rows() * self.run.seq * layer_transient_per_token(self.cfg, self.run, True)
        )

    def _chunk(self) -> int:
        c = self.run.logits_chunk_size
        return min(c, self.run.seq) if c else self.run.seq

    def logits_train(self, rows: Optional[int] = None) -> float:
        """rows * c * V * 4 bytes * 3 (the chunk's f32 logits, its softmax and, in the
        backward, their gradient) + the gathered head [D, V] in the compute dtype."""
        cfg = self.cfg
        rows = self.train_rows() if rows is None else rows
        head = cfg.d_model * cfg.vocab_size * BYTES[cfg.dtype] if self.param_shards > 1 else 0
        return rows * self._chunk() * cfg.vocab_size * 4 * 3 + head

    def logits_pass(self) -> float:
        """rows * c * V * 4 * 2 (logits and softmax, forward only) + the gathered head."""
        cfg = self.cfg
        head = cfg.d_model * cfg.vocab_size * BYTES[cfg.dtype] if self.param_shards > 1 else 0
        return self.pass_rows() * self._chunk() * cfg.vocab_size * 4 * 2 + head

    def pass_activations(self) -> float:
        """Log-prob pass over pass_rows * S tokens: the residual stream, its norm and the
        layer output [3 D] in the compute dtype, one layer run forward
        (layer_transient_per_token), and the routing record it returns: router logits
        [L_moe * E] f32 and top-K indices, free top-K and weights [3 L_moe K] x 4 B."""
        cfg = self.cfg
        tokens = self.pass_rows() * self.run.seq
        per = 3 * cfg.d_model * BYTES[cfg.dtype] + layer_transient_per_token(cfg, self.run, False)
        per += cfg.num_moe_layers * (cfg.num_experts * 4 + 3 * cfg.top_k * 4)
        return tokens * per

    def kv_cache(self, evaluation: bool = False) -> float:
        """Rollout rows per device * L * 2 (k, v) * KV * hd * (P + T - 1) slots * cb;
        with evaluation, the held-out rollout's eval_size * eval_samples rows."""
        cfg = self.cfg
        slots = self.run.prompt_len + self.run.max_new_tokens - 1
        per_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * slots
        return self._rollout_rows(evaluation) * per_row * BYTES[cfg.dtype]

    def _rollout_rows(self, evaluation: bool) -> int:
        r = self.run
        rows = r.eval_size * r.eval_samples if evaluation else r.rows
        return -(-rows // self.data_shards)

    def rollout_transient(self, evaluation: bool = False) -> float:
        """The sampler's other arrays: each step's logits [rows, V] f32 (x3: logits,
        probabilities, a sort or cumsum), the routing record [rows, T, L_moe, K] (the
        experts, int32, and the router's log-probs there, f32) and the prompt-level
        prefill's scores [prompts, H, P, S + P] f32 (x2)."""
        cfg, run = self.cfg, self.run
        rows = self._rollout_rows(evaluation)
        n_prompts = run.eval_size if evaluation else run.prompts_per_step
        prompts = -(-n_prompts // self.data_shards)
        slots = run.prompt_len + run.max_new_tokens - 1
        out = rows * cfg.vocab_size * 4 * 3
        out += rows * run.max_new_tokens * cfg.num_moe_layers * cfg.top_k * (4 + 4)
        out += prompts * cfg.num_heads * run.prompt_len * (slots + run.prompt_len) * 4 * 2
        return out

    # ------------------------------------------------------------ phases
    def resident(self) -> float:
        return self.parameters() + self.optimizer_state() + self.reference()

    def phases(self) -> dict[str, float]:
        return {
            "rollout": self.resident()
            + self.fsdp_gather(backward=False)
            + self.kv_cache()
            + self.rollout_transient(),
            "eval rollout": self.resident()
            + self.fsdp_gather(backward=False)
            + self.kv_cache(evaluation=True)
            + self.rollout_transient(evaluation=True),
            "log-prob pass": self.resident()
            + self.fsdp_gather(backward=False)
            + self.pass_activations()
            + self.logits_pass(),
            "train step": self.resident()
            + self.gradients()
            + self.fsdp_gather()
            + self.activations()
            + self.layer_transient()
            + self.logits_train(),
        }

    def max_train_rows(self, policy: str) -> int:
        """The most micro-batch rows per device whose train step stays within 90% of
        the device budget under `policy` (the train step's peak is linear in them)."""
        one = dataclasses.replace(self, run=dataclasses.replace(self.run, remat_policy=policy))
        rows = one.train_rows()
        fixed = one.resident() + one.gradients() + one.fsdp_gather() + one.logits_train(0)
        per_row = (
            one.activations() + one.layer_transient() + one.logits_train() - one.logits_train(0)
        ) / rows
        return max(0, math.floor((0.9 * self.hw.budget - fixed) / per_row))

    def table(self) -> str:
        """Markdown: categories, then the phases' peaks against the device budget."""
        g = lambda b: f"{b / GiB:8.2f}"
        rows = [
            ("parameters", self.parameters(), "N * pb / shards"),
            ("optimizer state (Adam m, v)", self.optimizer_state(), "2 N * pb / shards"),
            ("gradients", self.gradients(), "N * pb / shards (x2 with micro_batches > 1)"),
            ("reference policy", self.reference(), "KL only: N * cb / shards"),
            ("FSDP gathers (one layer)", self.fsdp_gather(), "L_params * (2 cb + pb)"),
            (
                f"activations ({self.run.remat_policy})",
                self.activations(),
                "train tokens * saved bytes/token",
            ),
            ("one layer's recompute + backward", self.layer_transient(), "train tokens * ..."),
            (
                f"logits chunk (train, c={self._chunk()})",
                self.logits_train(),
                "rows * c * V * 4 * 3",
            ),
            (
                f"logits chunk (log-prob pass, c={self._chunk()})",
                self.logits_pass(),
                "rows * c * V * 4 * 2",
            ),
            ("log-prob pass activations", self.pass_activations(), "pass tokens * ..."),
            ("KV cache (rollout)", self.kv_cache(), "rows * L * 2 KV hd * slots * cb"),
            ("rollout other", self.rollout_transient(), "step logits, routes, prefill"),
            (
                f"KV cache (eval: {self.run.eval_size} x {self.run.eval_samples})",
                self.kv_cache(evaluation=True),
                "eval rows * L * 2 KV hd * slots * cb",
            ),
        ]
        lines = ["| category | GiB / device | formula |", "|---|---:|---|"]
        lines += [f"| {name} | {g(b).strip()} | {f} |" for name, b, f in rows]
        lines += ["", "| phase | peak GiB / device | of budget |", "|---|---:|---:|"]
        for name, b in self.phases().items():
            lines.append(f"| {name} | {g(b).strip()} | {b / self.hw.budget:.0%} |")
        peak = max(self.phases().values())
        verdict = "fits" if peak <= 0.9 * self.hw.budget else "does NOT fit (> 90% of budget)"
        fit = ", ".join(
            f"{p} <= {self.max_train_rows(p)}" for p in ("full", "dots_no_scores", "dots")
        )
        lines.append(f"\ntrain rows per device that fit (90% of the budget): {fit}")
        lines.append(
            f"budget {self.hw.budget / GiB:.1f} GiB per device "
            f"({self.hw.usable:.0%} of {self.hw.hbm / GiB:.1f} GiB); peak {peak / GiB:.1f} GiB: "
            f"{verdict}"
        )
        return "\n".join(lines)

    def header(self) -> str:
        cfg, run = self.cfg, self.run
        return (
            f"{self.hw.name}: {self.hw.devices} devices, params over {self.param_shards}, "
            f"batch over {self.data_shards}; N = {self.n_params / 1e9:.2f}B "
            f"({cfg.num_params(active=True) / 1e9:.2f}B active); param_dtype "
            f"{cfg.param_dtype}, dtype {cfg.dtype}; rows {run.rows} "
            f"({run.prompts_per_step} x {run.group_size}), S = {run.seq}, minibatches "
            f"{run.num_minibatches}, micro {run.micro_batches} -> {self.train_rows()} train "
            f"rows / device, {self.pass_rows()} pass rows / device; remat {run.remat_policy}, "
            f"attention {run.attention}, logits chunk {run.logits_chunk_size}, "
            f"KL {'on' if run.kl else 'off'}"
        )


# --------------------------------------------------------------------------
# The documented setups.


def setups() -> list[tuple[str, Budget]]:
    """The setups of docs/memory.md: (title, Budget)."""
    moe = dict(dtype="bfloat16", param_dtype="float32", moe_backend="ragged")
    dense = dict(dtype="bfloat16", param_dtype="float32")
    # configs/qwen3_moe_gsm8k.py: 16 prompts x 8 samples, 4 mini-batches, no
    # accumulation, remat 'full', cuDNN attention, logits in chunks of 128, 128
    # held-out prompts x 4 samples.
    flagship = Run(prompts_per_step=16, logits_chunk_size=128, eval_size=128)
    tpu = dataclasses.replace(flagship, attention="xla")
    replace = dataclasses.replace
    return [
        (
            "(a) Qwen3-30B-A3B, 8x H100 80GB: configs/qwen3_moe_gsm8k.py",
            Budget(qwen3_30b_a3b(**moe), H100_8, flagship),
        ),
        (
            "(a') the config before this change (64 prompts, remat 'dots', micro_batches 4, "
            "no logits chunk, XLA attention), for comparison",
            Budget(
                qwen3_30b_a3b(**moe),
                H100_8,
                Run(remat_policy="dots", micro_batches=4, logits_chunk_size=0, attention="xla"),
            ),
        ),
        (
            "(a'') (a) with a KL term (GRPO's kl_coef 0.04): the bf16 reference copy",
            Budget(qwen3_30b_a3b(**moe), H100_8, replace(flagship, kl=True)),
        ),
        (
            "(b) Qwen3-30B-A3B, TPU v5p-8, f32 parameters and moments",
            Budget(qwen3_30b_a3b(**moe), V5P_8, tpu),
        ),
        (
            "(b') Qwen3-30B-A3B, TPU v5p-8, bf16 parameters and moments: fits, does not "
            "train at lr 1e-6",
            Budget(
                qwen3_30b_a3b(dtype="bfloat16", param_dtype="bfloat16", moe_backend="ragged"),
                V5P_8,
                dataclasses.replace(tpu, prompts_per_step=8),
            ),
        ),
        (
            "(b'') Qwen3-30B-A3B, TPU v5p-16, f32 parameters and moments: the flagship "
            "config as it is",
            Budget(qwen3_30b_a3b(**moe), V5P_16, tpu),
        ),
        (
            "(c) Qwen3-4B, one H200",
            Budget(
                qwen3_4b(**dense),
                H200_1,
                replace(flagship, prompts_per_step=32, logits_chunk_size=64, eval_size=64),
            ),
        ),
        (
            "(c') Qwen3-8B, one H200",
            Budget(qwen3_8b(**dense), H200_1, replace(flagship, prompts_per_step=4, eval_size=16)),
        ),
    ]


# --------------------------------------------------------------------------
# Validation on CPU: the formulas against what JAX and XLA do on a small model.


def _saved_bytes(fn, *args) -> tuple[float, float]:
    """(bytes of the floating-point residuals inside the layer scan, bytes of all the
    other residuals) that jax keeps for fn's backward, arguments excluded."""
    import jax

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    layers = other = 0.0
    for line in buf.getvalue().splitlines():
        m = re.match(r"^(\w+)\[([\d,]*)\]\s+(.*)$", line.strip())
        if not m or "from the argument" in m.group(3):
            continue
        dtype, dims = m.group(1), [int(x) for x in m.group(2).split(",") if x]
        size = math.prod(dims) * {"bool": 1}.get(dtype, int(re.sub(r"\D", "", dtype) or 8) // 8)
        if "output of scan" in m.group(3) and dtype.startswith(("float", "bfloat")):
            layers += size
        else:
            other += size
    return layers, other


def validate(quick: bool = False) -> str:
    """Compile the train path's value-and-grad (token_logprobs, as `passes.forward`) of a
    small MoE model on CPU; compare (1) the saved residuals with saved_per_token and
    top_saved_per_token, (2) the compiled temp memory's differences between policies
    with the formula's, (3) the argument bytes with N * pb."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gspo_jax.models import Transformer

    b, t = (2, 128) if quick else (4, 256)
    out = [
        f"small model: 4 layers (1 dense + 3 MoE), D=64, 8 heads / 2 KV of 16, E=8 top-2, "
        f"V=512; batch {b} x {t}; logits chunk 64; f32 and bf16 compute; ragged MoE; "
        "XLA attention",
        "",
        "| dtype | policy | saved (JAX) | saved (formula) | ratio | temp (XLA) | "
        "temp (formula) | ratio | temp - temp(full) | formula - formula(full) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype in ("float32", "bfloat16"):
        temps, forms = {}, {}
        for policy in ("full", "dots_no_batch", "dots_no_scores", "dots"):
            cfg = ModelConfig(
                vocab_size=512,
                d_model=64,
                num_layers=4,
                num_heads=8,
                num_kv_heads=2,
                head_dim=16,
                d_ff=128,
                moe_d_ff=32,
                num_experts=8,
                top_k=2,
                first_dense_layers=1,
                remat_policy=policy,
                moe_backend="ragged",
                attention_impl="xla",
                dtype=dtype,
                logits_chunk_size=64,
            )
            gd, st = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
            tokens = jnp.zeros((b, t), jnp.int32)

            def loss(st, tokens):
                lp, _, aux = nnx.merge(gd, st).token_logprobs(tokens, tokens)
                return jnp.sum(lp) + aux.z_loss

            layers, other = _saved_bytes(lambda s: loss(s, tokens), st)
            f_layers = b * t * saved_per_token(cfg, policy, t)
            f_top = b * t * top_saved_per_token(cfg, t)
            comp = jax.jit(jax.grad(loss)).lower(st, tokens).compile()
            ma = comp.memory_analysis()
            n_bytes = cfg.num_params() * BYTES[cfg.param_dtype]
            assert ma.argument_size_in_bytes >= n_bytes
            temps[policy], forms[policy] = ma.temp_size_in_bytes, f_layers + f_top
            saved, formula = layers + other, f_layers + f_top
            # The train step's temporaries by the formulas: the saved residuals, one
            # layer's recompute and backward, the logits chunk (3 x [B, c, V] f32).
            run = Run(attention="xla", max_new_tokens=t, prompt_len=1)
            temp_f = formula + b * t * layer_transient_per_token(cfg, run, True)
            temp_f += b * 64 * cfg.vocab_size * 4 * 3
            out.append(
                f"| {dtype} | {policy} | {saved / 1e6:.3f} MB | {formula / 1e6:.3f} MB | "
                f"{formula / saved:.3f} | {ma.temp_size_in_bytes / 1e6:.2f} MB | "
                f"{temp_f / 1e6:.2f} MB | {temp_f / ma.temp_size_in_bytes:.2f} | "
                f"{(temps[policy] - temps['full']) / 1e6:+.2f} MB | "
                f"{(forms[policy] - forms['full']) / 1e6:+.2f} MB |"
            )
        out.append(
            f"| {dtype} | arguments | {ma.argument_size_in_bytes} B | N * pb + tokens = "
            f"{n_bytes + b * t * 4} B | | | | | | |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="formulas vs XLA on CPU")
    ap.add_argument("--quick", action="store_true", help="a smaller validation model")
    args = ap.parse_args(argv)
    if args.validate:
        print(validate(args.quick))
        return 0
    for title, budget in setups():
        print(f"### {title}\n\n{budget.header()}\n\n{budget.table()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
