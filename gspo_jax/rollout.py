"""Rollout: a jit-compiled batched sampler with a KV cache that records what RL needs.

A `Sampler` (built once, called every RL step and at every evaluation) turns a
list of prompts into ``len(prompts) * num_samples`` responses, prompt-major (row
``r = i * num_samples + g`` is sample g of prompt i), and returns a `Rollout`
that holds, per response token:

* ``logp``, the log-prob of the token under the distribution that drew it,
  softmax(logits / temperature) (0 for greedy decoding).  The trainer keeps it as
  the batch's ``rollout_logp``: the sampler's side of the train-inference
  mismatch metrics and of the rollout correction.  The objectives' old log-probs
  π_old are not these: the trainer recomputes them with its own forward at the
  same temperature (the old-log-prob pass, `gspo_jax.passes.logprob_pass`);
* the MoE routing record (R3): the top-K experts every MoE layer chose at the
  forward position that produced the token, and those of the prompt prefill
  (`replay_r3` aligns them with the trainer's forward);
* with the routing record, ``router_logp``: the sampler's router log-softmax at
  those experts, the behaviour policy's side of RSPO's router shift and of the
  routing diagnostics when the trust region is around the sampler itself.

How it runs
-----------
1. Host side (once per call): prompts are left-padded to one length P (the
   sampler's ``prompt_len``; without one, the call's longest prompt), the prompt
   list is padded to a *batch bucket* b (a power of two, or a multiple of one, so
   that the B = b * G rows divide over the data-parallel shards), and every array
   is placed on the device (sharded over the mesh's data axes when a mesh is
   given).  The trainer passes ``prompt_len=rollout.max_prompt_len`` and a fixed
   prompt count per call site, so it compiles one program per call site for the
   whole run.
2. Device side, one ``jax.jit``-compiled function per (B, P, max_new_tokens, G,
   greedy or not, routing record): one prefill of the [b, P] prompts into a KV
   cache, then a ``lax.while_loop`` that samples token t from the last logits,
   records it and feeds it back through ``Transformer.decode`` (one token per row),
   until every row has stopped or ``max_new_tokens`` tokens are out.  Nothing
   returns to the host between tokens.

The prefill runs once per prompt, on [b, P], and its KV cache is copied to the
prompt's G rows; it projects only the last prompt position to logits
(``decode(..., last_only=True)``).  The decode step's cost is the model's
(`Transformer.decode`); see experiments/rollout.md.

Sampling (per row, per step, logits ℓ ∈ R^V):

* greedy (``temperature == 0``): o_t = argmax ℓ; ``logp`` = 0 (log 1).
* otherwise o_t is drawn from softmax(ℓ / temperature) by inverse-CDF sampling
  with one uniform u_{r,t}.  How the cumulative sum and argmax are computed
  depends on the backend, in one place: `gspo_jax.decode.use_cpu_sampling`.

RL trains on the log-probs of the distribution that sampled, so the sampler
offers no truncation of it (top-k, top-p): the trainer would not compute the
truncated distribution's log-probs, and the gradient would be biased.

Randomness: row r = (prompt i, sample g) uses the key
``fold_in(fold_in(rng, prompt_ids[i]), g)`` and draws all its uniforms from it,
so a row's sample does not depend on the other rows of the batch, on the
padding, or on the prompt's position in the list (pass the same ``prompt_ids``
to reproduce a prompt's samples in another batch).

Router noise (``router_noise_std`` σ > 0): a controllable sampler/trainer
mismatch.  The sampler adds N(0, σ²) noise to the router logits of every MoE
layer at every token it feeds (prefill and decode steps), before top-K and the
gates; the trainer's forwards never do.  The noise of row r at the token of
RoPE position p is σ · normal(fold_in(k_r, p)) of shape [L, E], with
``k_r = fold_in(fold_in(fold_in(rng, NOISE_STREAM), prompt_ids[i]), g)``
(`gspo_jax.decode.NOISE_STREAM` = 2**31, outside the prompt ids' range, so the
uniforms' keys are untouched); the prompt's prefill, shared by its G rows, uses
sample 0's key.
So it is independent per token, layer and expert, and, like the uniforms, a
row's noise does not depend on the batch or the padding.  Everything recorded
is the noisy forward's: ``experts`` holds the experts actually used,
``router_logp`` the noisy router's log-softmax at them, ``logp`` the log-prob of
the distribution that drew the token.  σ is a traced value
(changing it does not recompile); σ = 0 (the default) runs the noise-free
program, bit for bit.

Stopping: a row stops after emitting any ``eos_id`` token, inside the response
only; the stop token belongs to the response (mask 1).  A row that emits
``max_new_tokens`` tokens without stopping is ``truncated``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional, Sequence, Union

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gspo_jax.config_fields import err, setting
from gspo_jax.decode import Spec, generate_jit, use_cpu_sampling
from gspo_jax.offpolicy import OffPolicySettings
from gspo_jax.partial import PartialSettings
from gspo_jax.refill import RefillSpec, SlotSettings, generate_refill_jit

__all__ = ["ROUTING", "Rollout", "Sampler", "replay_r3"]

# What of the routing record a rollout keeps (`Sampler.__call__`'s ``routing``):
# everything (R3 replays it), the response tokens' only (``experts`` and
# ``router_logp``: the sampler/trainer routing mismatch, the router shift against
# the sampler), or nothing.
ROUTING = ("all", "response", "none")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(OffPolicySettings, SlotSettings, PartialSettings):
    """``config.rollout``: what the sampler draws each RL step, in how many decode slots
    (`gspo_jax.refill.SlotSettings`), and which policy drew the batch a step trains on,
    where and when (`gspo_jax.offpolicy.OffPolicySettings`)."""

    prompts_per_step: int = setting(64, low=1, doc="prompts sampled per RL step")
    group_size: int = setting(
        8, low=1, doc="samples per prompt (>= 2 for group advantages and dynamic sampling)"
    )
    max_new_tokens: int = setting(24, low=1, doc="response length limit, in tokens")
    temperature: float = setting(
        1.0,
        low=0,
        low_open=True,
        why=" (RL samples, and trains on softmax(logits / temperature))",
        doc="RL trains on the log-probs of softmax(logits / temperature)",
    )
    router_noise_std: float = setting(
        0.0,
        low=0,
        doc="std of Gaussian noise on the sampler's router logits, never the trainer's: a "
        "controlled train-inference routing mismatch (experiments/router_noise.md); 0 for "
        "a dense model",
    )
    # The sampler's own precision (gspo_jax.models.precision.SamplerPrecision): an
    # inference engine computing in bf16, or reading int8 weights, while the trainer
    # computes in f32 -- a train-inference mismatch that comes from numerics.
    sampler_dtype: str = setting(
        "",
        choices=("", "float32", "bfloat16"),
        doc="the sampler's compute dtype ('' = model.dtype, the trainer's); evaluation "
        "samples with it too",
    )
    sampler_quantization: str = setting(
        "none",
        choices=("none", "int8", "int4"),
        doc="the sampler reads the linear weights quantized (QLoRA's schemes), "
        "re-quantized from the policy at every step",
    )
    # One prompt shape for the sampler, the log-prob passes and the train step (and
    # SFT) over the whole run, so no batch recompiles them. 64 fits Countdown's and
    # arithmetic's compact prompts (at most 52 characters with BOS, at every
    # difficulty). A truncated prompt keeps its end (the question's end, the answer
    # format and the chat template's assistant turn) and is counted in the RL step's
    # ``prompts_truncated`` (``eval_prompts_truncated``, SFT's too).
    max_prompt_len: int = setting(
        64,
        low=1,
        resume=True,
        doc="every prompt is left-padded to this many tokens; a longer one is refused or "
        "truncated (long_prompts)",
    )
    long_prompts: str = setting(
        "refuse",
        choices=("refuse", "truncate"),
        resume=True,
        doc="a prompt over max_prompt_len: refused (an error naming it) or cut to its last "
        "max_prompt_len tokens",
    )

    def check_run(self, run, ctx) -> None:
        """The off-policy settings (`OffPolicySettings.check_run`); router noise and a
        quantized sampler against the model and LoRA; the decode slots."""
        OffPolicySettings.check_run(self, run, ctx)
        SlotSettings.check_run(self, run, ctx)
        PartialSettings.check_run(self, run, ctx)
        if run.model.dense and self.router_noise_std > 0:
            raise err(
                "rollout.router_noise_std",
                f"{self.router_noise_std} needs MoE layers; "
                "model.fields.num_experts=0 is a dense model",
            )
        if self.sampler_quantization != "none" and run.lora.base_quantization != "none":
            raise err(
                "rollout.sampler_quantization",
                f"{self.sampler_quantization!r}: the frozen base is already quantized "
                f"(lora.base_quantization={run.lora.base_quantization!r}) and the sampler "
                "reads it as it is; use 'none'",
            )


def replay_r3(prompt_experts: jax.Array, experts: jax.Array) -> jax.Array:
    """int32[N, P+T-1, L, K]: the R3 replay array of a rollout's routing record, for
    the forward whose logits at positions P-1 ... P+T-2 give the response log-probs
    (the input ``concat(prompt_tokens, tokens)`` without its last token).

    Position j < P routes prompt token j (``prompt_experts[:, j]``); position P + t
    routes response token t, whose routing the sampler recorded when it fed o_t to
    produce o_{t+1} (``experts[:, t+1]``).  ``experts[:, 0]`` is the last prompt
    position's, which ``prompt_experts[:, P-1]`` already holds.
    """
    return jnp.concatenate([prompt_experts, experts[:, 1:]], axis=1)


@flax.struct.dataclass
class Rollout:
    """Sampled responses and the record RL needs, N = len(prompts) * num_samples
    rows in prompt-major order (row i * num_samples + g is sample g of prompt i).

    T = max_new_tokens, P = the padded prompt length (left padding included),
    L = number of MoE layers, K = experts per token.

    Attributes:
      tokens: int32[N, T], the response; ``pad_id`` after the row stopped.
      mask: f32[N, T], 1.0 on the response tokens (the stop token included),
        0.0 after.  ``mask[r, t] = t < lengths[r]``.
      lengths: int32[N], number of response tokens (= mask.sum(-1)).
      truncated: bool[N], reached T tokens without emitting a stop token.
      logp: f32[N, T], the log-prob of o_t under the distribution that drew it,
        log softmax(logits / temperature)[o_t] (0 for greedy decoding, which
        draws with probability 1).  The trainer's ``rollout_logp``; the
        objectives' old log-probs come from the trainer's own forward (module
        docstring).  0 where mask is 0.
      experts: int32[N, T, L, K], the R3 routing record: experts[r, t] is the
        top-K chosen by every MoE layer at the forward position whose output
        produced o_t, i.e. the input position (P - 1 + t) of the padded sequence
        ``concat(prompt_tokens, tokens)`` (the last prompt token for t = 0).  It
        is aligned with logp[r, t].  -1 where mask is 0.  With router noise, the
        experts actually used (the noisy router's top-K); logp is then that of
        the noisy forward too.  None when the sampler was asked for no routing
        record (``routing="none"``).
      router_logp: f32[N, T, L, K], the sampler's router log-softmax over the E
        experts evaluated at ``experts`` (`gspo_jax.routing.topk_router_logp`,
        the formula of the trainer's ``router_logp``), per MoE layer, at the same
        positions; 0 where mask is 0.  It is the router the sampler actually
        routed with: with router noise, the log-softmax of the noisy logits.
        f32 (the router computes its logits in f32 from hidden states of the
        model's compute dtype).
        None exactly when ``experts`` is.
      prompt_tokens: int32[N, P], the prompts, left-padded with ``pad_id``.
      prompt_mask: bool[N, P], True on real prompt tokens.
      prompt_experts: int32[N, P, L, K], the prefill's top-K at every prompt
        position; -1 on padding.  ``prompt_experts[:, P-1] == experts[:, 0]``.
        None unless the sampler was asked for the whole record (``routing="all"``).
      decode_steps: int32[], the decode steps the sampler ran after its prefill: the
        longest row's length less one for the batch program, fewer with refilled slots
        (`gspo_jax.refill`). Each step computes every row (slot) of the program.
    """

    tokens: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    logp: jax.Array
    experts: jax.Array
    router_logp: jax.Array
    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    prompt_experts: jax.Array
    decode_steps: jax.Array = None

    def replay(self) -> jax.Array:
        """int32[N, P+T, L, K]: the R3 replay array (`replay_r3`) for a forward over
        the full sequence ``concat(prompt_tokens, tokens)``.  The last response
        token is never fed during sampling, so its position holds -1 (free
        routing); no response log-prob depends on it.  Needs the whole record
        (``routing="all"``)."""
        if self.prompt_experts is None or self.experts is None:
            raise ValueError(
                "Rollout.replay: the rollout has no prompt routing record; sample with "
                "routing='all'"
            )
        tail = jnp.full_like(self.experts[:, :1], -1)
        return jnp.concatenate([replay_r3(self.prompt_experts, self.experts), tail], axis=1)


# ----------------------------------------------------------------------------
# Host side: validation, padding, placement.


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _token_list(seq, name: str, vocab_size: int) -> list[int]:
    """A non-empty sequence of token ids in [0, vocab_size), or ValueError."""
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
        raise ValueError(f"{name}: expected a sequence of token ids, got {type(seq).__name__}")
    arr = np.asarray(seq)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{name}: expected a non-empty 1-D sequence of token ids, got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise ValueError(
            f"{name}: token id {int(arr[bad][0])} outside [0, vocab_size={vocab_size})"
        )
    return arr.astype(np.int32).tolist()


class Sampler:
    """A batched sampler bound to one model structure; split the model once, call
    it every RL step (passing the latest parameters as ``state=``).

    Compiled functions are cached per (batch bucket, prompt length P,
    max_new_tokens, number of stop tokens, sampling mode): temperature and
    router_noise_std are traced values, so changing them does not recompile;
    greedy-vs-sampling, whether router noise is on (router_noise_std > 0) and
    the routing record kept (``routing``) are static.

    Args:
      graphdef, state: ``nnx.split(model)`` of a model with the
        ``init_cache`` / ``decode`` API of `gspo_jax.models.Transformer`.
      vocab_size: V, for input validation.
      mesh: optional device mesh; the batch is sharded over ``data_axes`` and the
        parameters keep whatever sharding ``state`` has.
      data_axes: mesh axes the batch is sharded over (default: those of
        ("data", "fsdp", "expert") that the mesh has: the trainer's batch axes).
      prompt_len: every prompt is left-padded to this many tokens (a longer one
        raises ValueError), so every call compiles the same program; None: to
        the longest prompt of each call.
      slots: decode at most this many rows at once, refilling a slot with the next
        row as its row finishes (`gspo_jax.refill`); 0, or a call of no more rows:
        every row at once (`gspo_jax.decode`). A multiple of the data shards.
      refill_chunk: rows prefilled together when slots free (1 <= it <= slots).
    """

    def __init__(
        self,
        graphdef,
        state,
        *,
        vocab_size: int,
        mesh: Optional[Mesh] = None,
        data_axes: Optional[Sequence[str]] = None,
        prompt_len: Optional[int] = None,
        slots: int = 0,
        refill_chunk: int = 1,
    ):
        if not (_is_int(vocab_size) and vocab_size > 0):
            raise ValueError(f"vocab_size: must be a positive int, got {vocab_size!r}")
        if prompt_len is not None and not (_is_int(prompt_len) and prompt_len > 0):
            raise ValueError(f"prompt_len: must be a positive int or None, got {prompt_len!r}")
        self.graphdef = graphdef
        self.state = state
        self.vocab_size = int(vocab_size)
        self.prompt_len = None if prompt_len is None else int(prompt_len)
        self.mesh = mesh
        if mesh is None:
            if data_axes is not None:
                raise ValueError("data_axes: given without a mesh")
            self.data_axes, self.data_shards = (), 1
            self._sharding = None
        else:
            if data_axes is None:
                data_axes = tuple(a for a in ("data", "fsdp", "expert") if a in mesh.axis_names)
            data_axes = tuple(data_axes)
            for a in data_axes:
                if a not in mesh.axis_names:
                    raise ValueError(
                        f"data_axes: {a!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
                    )
            self.data_axes = data_axes
            self.data_shards = math.prod(mesh.shape[a] for a in data_axes)
            self._sharding = NamedSharding(mesh, PartitionSpec(data_axes or None))
        if not (_is_int(slots) and slots >= 0 and slots % self.data_shards == 0):
            raise ValueError(
                f"slots: must be an int >= 0 and a multiple of the {self.data_shards} data "
                f"shards, got {slots!r}"
            )
        if slots and not (_is_int(refill_chunk) and 1 <= refill_chunk <= slots):
            raise ValueError(
                f"refill_chunk: must be an int in [1, slots={slots}], got {refill_chunk!r}"
            )
        self.slots, self.refill_chunk = int(slots), int(refill_chunk)

    @classmethod
    def from_model(cls, model: nnx.Module, **kwargs) -> "Sampler":
        """Splits ``model`` once; kwargs as for the constructor."""
        graphdef, state = nnx.split(model)
        return cls(graphdef, state, vocab_size=model.cfg.vocab_size, **kwargs)

    def padded_prompt_len(self, length: int) -> int:
        """The padded prompt length P used for a longest prompt of ``length``."""
        if self.prompt_len is None:
            return length
        if length > self.prompt_len:
            raise ValueError(
                f"prompts: a prompt of {length} tokens is longer than the sampler's "
                f"prompt_len={self.prompt_len}"
            )
        return self.prompt_len

    def batch_bucket(self, num_prompts: int, num_samples: int) -> int:
        """The padded prompt count b (rows B = b * num_samples): the smallest
        multiple of next_pow2(num_prompts) that makes B a multiple of the data
        shard count."""
        step = _next_pow2(num_prompts)
        b = step
        while (b * num_samples) % self.data_shards:
            b += step
        return b

    def decode_rows(self, num_prompts: int, num_samples: int) -> int:
        """The rows a decode step of a call computes: its slots where they refill
        (`gspo_jax.refill`), else every row of its batch bucket."""
        n = num_prompts * num_samples
        if self.slots and n > self.slots:
            return self.slots
        return self.batch_bucket(num_prompts, num_samples) * num_samples

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 1.0,
        eos_id: Union[None, int, Sequence[int]] = None,
        pad_id: int = 0,
        prompt_ids: Optional[Sequence[int]] = None,
        state=None,
        router_noise_std: float = 0.0,
        routing: str = "all",
    ) -> Rollout:
        """Samples ``num_samples`` responses for every prompt.

        Args:
          prompts: list of token-id lists (each non-empty, ids in [0, V)).
          num_samples: G, responses per prompt.
          max_new_tokens: T, the response length bound (and the output width).
          rng: a JAX PRNG key (typed or raw uint32[2]).
          temperature: τ >= 0; 0 = greedy.
          eos_id: a token id or a list of them; emitting one stops the row.
          pad_id: the token written at padding (prompt and response).
          prompt_ids: distinct ints, one per prompt, folded into the row keys
            (default 0 .. len(prompts) - 1).  The same prompt with the same
            prompt id and rng gives the same samples in any batch.
          state: parameters to use instead of ``self.state`` (same structure).
          router_noise_std: σ >= 0 of the Gaussian noise added to the sampler's
            router logits (every MoE layer, every token fed; module docstring):
            a controllable sampler/trainer routing mismatch.  0 = none.
          routing: the routing record to keep (static: each value is a program
            of its own): "all" (``experts``, ``router_logp`` and
            ``prompt_experts``, what R3 replays), "response" (``experts`` and
            ``router_logp``; ``prompt_experts`` is None) or "none" (all None: no
            [N, T, L, K] record in the decode loop).  A kept record is two
            [B, T, L, K] buffers in the loop: int32 ``experts``, f32 ``router_logp``.

        Returns:
          a `Rollout` with N = len(prompts) * num_samples rows (device arrays).
        """
        args, spec, n_rows = self._prepare(
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            rng=rng,
            temperature=temperature,
            eos_id=eos_id,
            pad_id=pad_id,
            prompt_ids=prompt_ids,
            state=state,
            router_noise_std=router_noise_std,
            routing=routing,
        )
        # Traced on the mesh, as the trainer's programs are: the ragged MoE dispatch
        # takes its per-device row groups (and expert parallelism) from it.
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            if self.slots and n_rows > self.slots:
                replicated = lambda a: (
                    a
                    if self.mesh is None
                    else jax.device_put(a, NamedSharding(self.mesh, PartitionSpec()))
                )
                args = (*args[:3], *map(replicated, args[3:6]), jnp.int32(n_rows), *args[7:])
                spec = RefillSpec(spec, self.slots, self.refill_chunk)
                out = generate_refill_jit(*args, spec=spec)
            else:
                out = generate_jit(*args, spec=spec)
        if n_rows < out["tokens"].shape[0]:
            out = {k: v if v is None or v.ndim == 0 else v[:n_rows] for k, v in out.items()}
        return Rollout(**out)

    def _prepare(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 1.0,
        eos_id: Union[None, int, Sequence[int]] = None,
        pad_id: int = 0,
        prompt_ids: Optional[Sequence[int]] = None,
        state=None,
        router_noise_std: float = 0.0,
        routing: str = "all",
    ):
        """Validates the arguments of `__call__` and builds the compiled
        function's arguments: (positional args, spec, number of real rows)."""
        V = self.vocab_size
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
            raise ValueError("prompts: expected a non-empty list of token-id lists")
        plist = [_token_list(p, f"prompts[{i}]", V) for i, p in enumerate(prompts)]
        for name, val in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens)):
            if not (_is_int(val) and val >= 1):
                raise ValueError(f"{name}: must be an int >= 1, got {val!r}")
        if not (
            isinstance(temperature, (int, float, np.integer, np.floating))
            and math.isfinite(temperature)
            and temperature >= 0
        ):
            raise ValueError(f"temperature: must be a finite float >= 0, got {temperature!r}")
        if not (
            isinstance(router_noise_std, (int, float, np.integer, np.floating))
            and not isinstance(router_noise_std, (bool, np.bool_))
            and math.isfinite(router_noise_std)
            and router_noise_std >= 0
        ):
            raise ValueError(
                f"router_noise_std: must be a finite float >= 0, got {router_noise_std!r}"
            )
        if routing not in ROUTING:
            raise ValueError(f"routing: must be one of {ROUTING}, got {routing!r}")
        if not (_is_int(pad_id) and 0 <= pad_id < V):
            raise ValueError(f"pad_id: must be a token id in [0, {V}), got {pad_id!r}")
        if eos_id is None:
            eos = []
        elif _is_int(eos_id):
            eos = _token_list([eos_id], "eos_id", V)
        else:
            eos = _token_list(eos_id, "eos_id", V)
        n, G = len(plist), int(num_samples)
        if prompt_ids is None:
            pids = np.arange(n, dtype=np.int64)
        else:
            pids = np.asarray(prompt_ids)
            if pids.shape != (n,) or not np.issubdtype(pids.dtype, np.integer):
                raise ValueError(
                    f"prompt_ids: expected {n} ints (one per prompt), got {pids.shape} {pids.dtype}"
                )
            if len(set(pids.tolist())) != n:
                raise ValueError("prompt_ids: must be distinct (equal ids give equal samples)")
            if pids.min() < 0 or pids.max() >= 2**31:
                raise ValueError("prompt_ids: must be in [0, 2**31)")
        rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            if rng.shape != (2,) or rng.dtype != jnp.uint32:
                raise ValueError(f"rng: expected a PRNG key, got {rng.dtype}{list(rng.shape)}")
            rng = jax.random.wrap_key_data(rng)
        if rng.shape != ():
            raise ValueError(f"rng: expected a single key, got shape {rng.shape}")

        # Padded, left-aligned host arrays.
        N = n * G
        P = self.padded_prompt_len(max(len(p) for p in plist))
        nb = self.batch_bucket(n, G)
        B = nb * G
        toks = np.full((nb, P), pad_id, np.int32)
        pmask = np.zeros((nb, P), bool)
        for i, p in enumerate(plist):
            toks[i, P - len(p) :] = p
            pmask[i, P - len(p) :] = True
        pmask[n:, -1] = True  # padding prompts: one pad token, discarded
        pid = np.zeros((nb,), np.int32)
        pid[:n] = pids
        live = np.arange(B) < N

        spec = Spec(
            max_new_tokens=int(max_new_tokens),
            num_samples=G,
            greedy=temperature == 0,
            cpu=use_cpu_sampling(),
            pad_id=int(pad_id),
            batch_sharding=self._sharding,
            router_noise=bool(router_noise_std > 0),
            routing=routing,
        )
        if self._sharding is None:
            put = put_prompts = jnp.asarray
        else:
            put = functools.partial(jax.device_put, device=self._sharding)
            # The prefill batch is sharded too where it divides evenly.
            put_prompts = (
                put
                if nb % self.data_shards == 0
                else functools.partial(
                    jax.device_put, device=NamedSharding(self.mesh, PartitionSpec())
                )
            )
        args = (
            self.graphdef,
            self.state if state is None else state,
            rng,
            put_prompts(toks),
            put_prompts(pmask),
            put_prompts(pid),
            put(live),
            jnp.asarray(np.asarray(eos, np.int32)),
            jnp.float32(temperature if temperature > 0 else 1.0),
            jnp.float32(router_noise_std),
        )
        return args, spec, N
