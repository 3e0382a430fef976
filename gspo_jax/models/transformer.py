"""Decoder-only MoE transformer (Flax NNX) with exposed routing and a KV cache.

`Transformer` embeds the tokens, runs the layer segments (`blocks`: a scan over
each segment's stacked repeats), then the final norm and the output head
(`precision.head_logits`); `RouterAux` is its routing record, `KVCache` its
decoding state.

Attention masks work on cache slots: a query at slot q sees key slot s iff
s <= q and slot s holds a real token (attn_mask != 0) of the query's own segment
(attn_mask's value: one per row when padded, several in a packed row).  In the full forward the
slots are 0..T-1; in `decode` they are the KV cache's slots, so left-padded
prompts and one-token steps give the full forward's logits.  Positions (RoPE)
are separate and given by the caller (default arange(T)).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from gspo_jax.models.blocks import CHECKPOINT_POLICIES, Segment, plan_segments
from gspo_jax.models.config import ModelConfig
from gspo_jax.models.layers import RMSNorm, attention_mask, cache_layouts, make_param, rope_tables
from gspo_jax.models.moe import MoEStats
from gspo_jax.models.precision import head_logits
from gspo_jax.models.sharding import param_shardings


@struct.dataclass
class RouterAux:
    """Routing record of one forward, stacked over the L MoE layers.

    Attributes:
      router_logits: f32[B, T, L, E], router logits (before softmax; with the
        router noise added when `decode` was given one).
      topk_indices: int32[B, T, L, K], the experts used (same layout as `replay`:
        pass it back as `replay=` to force the same routing).
      free_topk_indices: int32[B, T, L, K], the top-K the router itself chooses
        (from `router_logits`), whatever `replay` forces; equal to topk_indices
        without replay.
      topk_weights: f32[B, T, L, K], the gates used.
      expert_load: f32[L, E], share of the valid tokens' K assignments per expert,
        counting the free router's choices (free_topk_indices), also under replay.
      aux_loss: f32[], load-balancing loss E * sum_e f_e P_e (f_e: expert_load,
        P_e: mean router probability over valid tokens), averaged over layers; 1
        when balanced.  Under replay f_e still counts the free router's choices:
        the replayed ones are frozen, so the loss would not respond to the router.
      z_loss: f32[], mean over valid tokens and layers of logsumexp(logits)^2.
      replay_mismatch: f32[L], share of replayed choices the free router would
        not have made (0 without replay).
    """

    router_logits: jax.Array
    topk_indices: jax.Array
    free_topk_indices: jax.Array
    topk_weights: jax.Array
    expert_load: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    replay_mismatch: jax.Array

    def loss(self, aux_loss_coef: float, z_loss_coef: float) -> jax.Array:
        """aux_loss_coef * aux_loss + z_loss_coef * z_loss."""
        return aux_loss_coef * self.aux_loss + z_loss_coef * self.z_loss


@struct.dataclass
class KVCache:
    """Decoding state.

    Attributes:
      k: tuple of num_layers arrays [B, KV, hd, S] (keys transposed: the scores
        of a decode step are then a plain [G, hd] x [hd, S] product), or
        [B, S, KV, hd] where attention over the cache runs in a fused kernel
        (`layers.cache_layouts`: cuDNN's, on a GPU).
      v: tuple of num_layers arrays [B, KV, S, hd], or [B, S, KV, hd] with the
        fused kernel.
        Both in the compute dtype unless `init_cache` was given another; one
        buffer per layer.
      valid: bool[B, S], slot holds a real token.
      index: int32[], next slot to write; or int32[B], each row's own (the
        refilling sampler's slots, `gspo_jax.refill`: rows that started at different
        steps write at different slots).

    Static shapes: a carry of lax.while_loop / scan.  One buffer per layer, not
    one stacked [L, ...] array: the layer scan reads layer l's buffer in place
    (`lax.switch` over the layers), where a dynamic slice of a stacked array
    copies the layer every token.  A `decode` call writes the new tokens'
    keys/values with one `dynamic_update_slice` per buffer, which XLA performs in
    place when the cache is a loop carry or a donated argument.
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array


def write_slots(buf: jax.Array, new: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """``buf`` [B, ...] with ``new`` written at slots [index, index + T) of ``axis``: one
    ``index`` for every row (int32[], a `dynamic_update_slice`), or one per row (int32[B],
    a row-wise one, which XLA lowers to a scatter); in place where ``buf`` is a loop carry
    or donated."""
    if index.ndim == 0:
        return jax.lax.dynamic_update_slice(
            buf, new, tuple(index if a == axis else 0 for a in range(buf.ndim))
        )
    row = lambda b, n, i: jax.lax.dynamic_update_slice(
        b, n, tuple(i if a == axis - 1 else 0 for a in range(b.ndim))
    )
    return jax.vmap(row)(buf, new, index)


def _check_temperature(temperature) -> float:
    """A log-prob temperature: a static number > 0 (it decides the graph), as a float."""
    ok = isinstance(temperature, (int, float, np.integer, np.floating)) and not isinstance(
        temperature, (bool, np.bool_)
    )
    if not (ok and np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: must be a Python float > 0, got {temperature!r}")
    return float(temperature)


class Transformer(nnx.Module):
    """The policy model.  See the package docstring for the public API."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = cfg.jnp_param_dtype
        self.embed = make_param(
            rngs, (), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd, std=cfg.init_std
        )
        self.plan = tuple(plan_segments(cfg.layer_kinds))
        self.segments = nnx.List([Segment(cfg, u, r, rngs=rngs) for u, r in self.plan])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
        if not cfg.tie_embeddings:
            self.lm_head = make_param(
                rngs, (), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pd, std=cfg.init_std
            )
        if cfg.value_head:
            self.value_w = make_param(rngs, (), (cfg.d_model,), ("embed",), pd, std=cfg.init_std)
            self.value_b = make_param(None, (), (), (), pd, "zeros")

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, tokens, positions, attn_mask, replay, router_noise=None):
        cfg = self.cfg
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens: expected int[B, T], got {tokens.dtype}{list(tokens.shape)}")
        b, t = tokens.shape
        if positions is not None and tuple(positions.shape) != (b, t):
            raise ValueError(f"positions: expected shape {(b, t)}, got {tuple(positions.shape)}")
        if attn_mask is not None and tuple(attn_mask.shape) != (b, t):
            raise ValueError(f"attn_mask: expected shape {(b, t)}, got {tuple(attn_mask.shape)}")
        if replay is not None:
            want = (b, t, cfg.num_moe_layers, cfg.top_k)
            if tuple(replay.shape) != want:
                raise ValueError(
                    f"replay: expected int32[B, T, L, K] = {want}, got {tuple(replay.shape)}"
                )
            if not isinstance(replay, jax.core.Tracer):
                r = np.asarray(replay)
                if r.size and (r.min() < -1 or r.max() >= cfg.num_experts):
                    raise ValueError(
                        f"replay: entries must be -1 or in [0, {cfg.num_experts}), "
                        f"got range [{r.min()}, {r.max()}]"
                    )
        if router_noise is not None:
            want = (b, t, cfg.num_moe_layers, cfg.num_experts)
            if tuple(router_noise.shape) != want:
                raise ValueError(
                    f"router_noise: expected f32[B, T, L, E] = {want}, "
                    f"got {tuple(router_noise.shape)}"
                )

    # ------------------------------------------------------------------ core
    def _run(
        self,
        tokens,
        positions,
        attn_mask,
        replay,
        cache: Optional[KVCache],
        router_noise=None,
        prefill: bool = False,
    ):
        cfg = self.cfg
        self._check_inputs(tokens, positions, attn_mask, replay, router_noise)
        b, t = tokens.shape
        dt = cfg.jnp_dtype
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        token_mask = jnp.ones((b, t), bool) if attn_mask is None else attn_mask.astype(bool)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        slots = jnp.arange(t, dtype=jnp.int32)
        mask = attention_mask(slots, slots, token_mask)  # [B, T, T] among the T tokens
        if attn_mask is not None:  # a real token sees its own segment only (packed rows)
            seg = attn_mask.astype(jnp.int32)
            mask = mask & ((seg[:, :, None] == seg[:, None, :]) | (seg[:, :, None] == 0))
        if cache is None:
            kc = vc = cache_mask = None
        else:
            # Every cached slot is earlier than every new token: it is visible iff
            # it holds a real token.  The new tokens' keys go to [index, index + T).
            kc, vc = tuple(cache.k), tuple(cache.v)
            cache_mask = jnp.broadcast_to(cache.valid[:, None, :], (b, t, cache.valid.shape[1]))
            if prefill:  # an empty cache: nothing to attend to but the new tokens
                cache_mask = None
            valid = write_slots(cache.valid, token_mask, cache.index, 1)
        # Per-MoE-layer inputs, leading L: (replay [L, B, T, K], noise [L, B, T, E]).
        per_layer = lambda a, dtype: None if a is None else jnp.moveaxis(a.astype(dtype), 2, 0)
        moe_in = (per_layer(replay, jnp.int32), per_layer(router_noise, jnp.float32))

        all_stats, new_kv, layer0, moe0 = [], [], 0, 0
        for seg in self.segments:
            u, n = len(seg.unit), seg.repeats
            m = sum(seg.unit)
            # This segment's MoE layers' inputs, [n, m, B, T, ...] (scanned over n).
            moe_seg = (None, None)
            if m:
                moe_seg = jax.tree.map(
                    lambda a: a[moe0 : moe0 + n * m].reshape((n, m) + a.shape[1:]), moe_in
                )
            gdef, state = nnx.split(seg.blocks)

            def body(x, xs, gdef=gdef, layer0=layer0, u=u):
                st, i, (rep, noise) = xs
                blocks = nnx.merge(gdef, st)
                stats, kvs, jm = [], [], 0
                for j, blk in enumerate(blocks):
                    c = None
                    if kc is not None:  # all layers' caches (read only) and this layer's index
                        c = (kc, vc, layer0 + i * u + j, cache_mask)
                    r = z = None
                    if blk.is_moe:
                        r = None if rep is None else rep[jm]
                        z = None if noise is None else noise[jm]
                    x, s, kv = blk(x, cos, sin, mask, token_mask, r, c, z)
                    kvs.append(kv)
                    if s is not None:
                        stats.append(s)
                        jm += 1
                stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs) if xs else None
                return x, (stack(stats), stack(kvs) if kc is not None else None)

            if cfg.remat_policy != "none":
                body = jax.checkpoint(
                    body, policy=CHECKPOINT_POLICIES[cfg.remat_policy], prevent_cse=False
                )
            steps = jnp.arange(n, dtype=jnp.int32)
            if cfg.scan_layers:
                x, (stats, kvs) = jax.lax.scan(body, x, (state, steps, moe_seg))
            else:
                outs = []
                for i in range(n):
                    st, seg_i = jax.tree.map(lambda a: a[i], (state, moe_seg))
                    x, o = body(x, (st, i, seg_i))  # a Python int i: static layer indices
                    outs.append(o)
                stats, kvs = jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs else (None, None)
            flat = lambda a, k: a.reshape((n * k,) + a.shape[2:])  # [n, k, ...] -> [n * k, ...]
            if m:
                all_stats.append(jax.tree.map(lambda a: flat(a, m), stats))
            if kc is not None:
                new_kv.append(jax.tree.map(lambda a: flat(a, u), kvs))
            layer0 += n * u
            moe0 += n * m

        h = self.final_norm(x)
        aux = self._router_aux(all_stats, b, t)
        new_cache = None
        if cache is not None:
            # Each layer's new keys / values (in the cache's layouts, T slots) go to
            # slots [index, index + T) of its buffers, in place.
            k_new, v_new = (jnp.concatenate(a, axis=0) for a in zip(*new_kv))  # leading L
            write = lambda bufs, new, layout: tuple(
                write_slots(buf, new[j], cache.index, layout.index("s"))
                for j, buf in enumerate(bufs)
            )
            k_layout, v_layout = cache_layouts(cfg)
            new_cache = KVCache(
                k=write(kc, k_new, k_layout),
                v=write(vc, v_new, v_layout),
                valid=valid,
                index=cache.index + t,
            )
        return h, aux, new_cache

    def _router_aux(self, all_stats, b, t) -> RouterAux:
        cfg = self.cfg
        if not all_stats:
            e, k = cfg.num_experts, cfg.top_k
            z = jnp.zeros((), jnp.float32)
            return RouterAux(
                router_logits=jnp.zeros((b, t, 0, e), jnp.float32),
                topk_indices=jnp.zeros((b, t, 0, k), jnp.int32),
                free_topk_indices=jnp.zeros((b, t, 0, k), jnp.int32),
                topk_weights=jnp.zeros((b, t, 0, k), jnp.float32),
                expert_load=jnp.zeros((0, e), jnp.float32),
                aux_loss=z,
                z_loss=z,
                replay_mismatch=jnp.zeros((0,), jnp.float32),
            )
        s = MoEStats(*[jnp.concatenate(f, axis=0) for f in zip(*all_stats)])  # leading L
        per_tok = lambda a: jnp.moveaxis(a, 0, 2)  # [L, B, T, X] -> [B, T, L, X]
        return RouterAux(
            router_logits=per_tok(s.router_logits),
            topk_indices=per_tok(s.topk_indices),
            free_topk_indices=per_tok(s.free_topk_indices),
            topk_weights=per_tok(s.topk_weights),
            expert_load=s.expert_load,
            aux_loss=jnp.mean(s.aux_loss),
            z_loss=jnp.mean(s.z_loss),
            replay_mismatch=s.mismatch,
        )

    # ------------------------------------------------------------------ head
    def _head_weight(self):
        """[D, V] output projection (embedding transposed when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def _project(self, h, w):
        """f32 logits [..., V] = h [..., D] @ w [D, V] in h's dtype, f32 accumulation
        (`head_logits`, whose backward runs in h's dtype too);
        -1e30 at the embedding's padding ids (`ModelConfig.num_valid_tokens`): finite, so
        that softmax gives them exactly 0 and the entropy's 0 * z stays 0."""
        z = head_logits(h, w)
        n = self.cfg.num_valid_tokens
        if 0 < n < z.shape[-1]:
            z = jnp.where(jnp.arange(z.shape[-1]) < n, z, -1e30)
        return z

    def logits(self, h: jax.Array) -> jax.Array:
        """f32[B, T, V] from final-normed hidden states [B, T, D]."""
        return self._project(h, self._head_weight())

    # ------------------------------------------------------------------ public
    def __call__(self, tokens, *, positions=None, attn_mask=None, replay=None):
        """Full forward.

        Args:
          tokens: int32[B, T].
          positions: int32[B, T] RoPE positions (default arange(T) per row).
          attn_mask: [B, T] segment ids: 0 = padding (never attended to; excluded
            from router losses and load), and a real token attends to the earlier
            tokens of its own segment only. A padded row's 0/1 mask is one segment;
            a packed row (`gspo_jax.packing`) holds several.
          replay: int32[B, T, L, K] experts to force, -1 = free (a row is replayed
            iff all its K entries are >= 0).

        Returns: (logits f32[B, T, V], RouterAux).
        """
        h, aux = self.hidden(tokens, positions=positions, attn_mask=attn_mask, replay=replay)
        return self.logits(h), aux

    def hidden(self, tokens, *, positions=None, attn_mask=None, replay=None):
        """(final-normed hidden states [B, T, D] in compute dtype, RouterAux)."""
        h, aux, _ = self._run(tokens, positions, attn_mask, replay, None)
        return h, aux

    def token_logprobs(
        self,
        tokens,
        targets,
        *,
        positions=None,
        attn_mask=None,
        replay=None,
        chunk_size=None,
        temperature: float = 1.0,
    ):
        """Log-probabilities and entropies of next tokens, chunked over T.

        logp[b, t] = log pi(targets[b, t] | tokens[b, :t+1]) = z[targets] - logsumexp(z)
        entropy[b, t] = logsumexp(z) - sum_v softmax(z)_v z_v
        with z = logits[b, t] / temperature (the same f32 logits as `__call__`;
        temperature a Python float > 0, the sampler's: at 1.0 no division is
        made).  The sequence is processed in chunks of `chunk_size` (default
        cfg.logits_chunk_size, else T) under `jax.checkpoint`, so at most one
        chunk's [B, c, V] logits exist at a time, in the forward and the backward
        pass.

        Returns: (logp f32[B, T], entropy f32[B, T], RouterAux).
        """
        if tuple(targets.shape) != tuple(tokens.shape):
            raise ValueError(
                f"targets: expected shape {tuple(tokens.shape)}, got {tuple(targets.shape)}"
            )
        if not isinstance(targets, jax.core.Tracer):
            tg = np.asarray(targets)
            if tg.size and (tg.min() < 0 or tg.max() >= self.cfg.vocab_size):
                raise ValueError(
                    f"targets: entries must be in [0, {self.cfg.vocab_size}), "
                    f"got range [{tg.min()}, {tg.max()}]"
                )
        _check_temperature(temperature)
        h, aux = self.hidden(tokens, positions=positions, attn_mask=attn_mask, replay=replay)
        lp, ent = self.logprobs_from_hidden(
            h, targets, chunk_size=chunk_size, temperature=temperature
        )
        return lp, ent, aux

    def logprobs_from_hidden(self, h, targets, *, chunk_size=None, temperature: float = 1.0):
        """`token_logprobs` from final hidden states h [B, T, D] (for callers that
        also need h, e.g. the value head): (logp f32[B, T], entropy f32[B, T]) of
        softmax(logits / temperature)."""
        temperature = _check_temperature(temperature)
        b, t, d = h.shape
        c = chunk_size or self.cfg.logits_chunk_size or t
        if c <= 0:
            raise ValueError(f"chunk_size: must be > 0, got {c}")
        c = min(c, t)
        nc = -(-t // c)
        pad = nc * c - t
        hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, d).swapaxes(0, 1)
        tp = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
        w = self._head_weight()
        project = self._project

        @jax.checkpoint
        def chunk(hc, tc):
            z = project(hc, w)  # [B, c, V] f32
            if temperature != 1.0:
                z = z / temperature
            lse = jax.nn.logsumexp(z, axis=-1)
            zt = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
            p = jnp.exp(z - lse[..., None])
            ent = lse - jnp.sum(p * z, axis=-1)
            return zt - lse, ent

        _, (lp, ent) = jax.lax.scan(lambda _, xs: (None, chunk(*xs)), None, (hp, tp))
        lp = lp.swapaxes(0, 1).reshape(b, nc * c)[:, :t]
        ent = ent.swapaxes(0, 1).reshape(b, nc * c)[:, :t]
        return lp, ent

    def value(self, h: jax.Array) -> jax.Array:
        """Value head: f32[B, T] = h @ w + b (requires cfg.value_head)."""
        if not self.cfg.value_head:
            raise ValueError("value: ModelConfig.value_head is False; the model has no value head")
        return jnp.einsum(
            "btd,d->bt", h.astype(jnp.float32), self.value_w[...].astype(jnp.float32)
        ) + self.value_b[...].astype(jnp.float32)

    def _cache_shapes(self, batch_size: int, max_len: int):
        """One layer's (keys, values) shapes in `layers.cache_layouts`."""
        cfg = self.cfg
        size = dict(b=batch_size, k=cfg.num_kv_heads, h=cfg.head_dim, s=max_len)
        return tuple(tuple(size[a] for a in layout) for layout in cache_layouts(cfg))

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """Empty KV cache for `batch_size` sequences of up to `max_len` slots."""
        cfg = self.cfg
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(
                f"init_cache: batch_size and max_len must be > 0, got {batch_size}, {max_len}"
            )
        k_shape, v_shape = self._cache_shapes(batch_size, max_len)
        dt = jnp.dtype(dtype) if dtype is not None else cfg.jnp_dtype
        zeros = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
        return KVCache(
            k=zeros(k_shape),
            v=zeros(v_shape),
            valid=jnp.zeros((batch_size, max_len), bool),
            index=jnp.zeros((), jnp.int32),
        )

    def decode(
        self,
        tokens,
        cache: KVCache,
        *,
        positions,
        attn_mask=None,
        replay=None,
        last_only: bool = False,
        router_noise=None,
        prefill: bool = False,
    ):
        """Write tokens [B, T'] at cache slots [index, index + T') and attend causally
        to all valid slots.  T' = prompt length for prefill, 1 for a step.

        Args:
          tokens: int32[B, T'].
          cache: KVCache of batch B (from `init_cache`).
          positions: int32[B, T'] RoPE positions.
          attn_mask: [B, T'], 1 = real token (default all 1).
          replay: int32[B, T', L, K] experts to force (see `__call__`).
          router_noise: f32[B, T', L, E] added to every MoE layer's router logits
            before top-K and the gates (the sampler's controllable mismatch with
            the trainer, `gspo_jax.rollout`), or None (no noise).  RouterAux then
            records the noisy logits and choices.
          last_only: return the logits of the last position only (what a sampler
            needs after a prefill): the [B, T', V] projection is skipped.
          prefill: the cache is empty (fresh from `init_cache`): the tokens attend
            among themselves only, not to its S empty slots as well. The same outputs
            at every real token, bitwise; the scores are [T', T'] instead of
            [T', S + T'] (the H200 benchmark's 12-layer prefill of 1024 prompts of 128
            tokens into 1,279 slots: 71.0 -> 63.2 GiB by the compile report). A cache
            that holds tokens is refused where its index is known; under jit the caller
            vouches for it.

        The caller keeps index + T' <= max_len (not checkable under jit:
        `dynamic_update_slice` would clamp the write).

        Returns: (logits f32[B, T', V] (f32[B, 1, V] with last_only), RouterAux
        over all T' tokens, updated KVCache).
        """
        b, t = tokens.shape
        if tuple(cache.valid.shape[:1]) != (b,):
            raise ValueError(f"cache: batch {cache.valid.shape[0]} != tokens batch {b}")
        names = dict(b="B", k="KV", h="hd", s="S")
        layouts = {
            name: ("[" + ", ".join(names[a] for a in layout) + "]", want)
            for name, layout, want in zip(
                ("k", "v"), cache_layouts(self.cfg), self._cache_shapes(b, cache.valid.shape[1])
            )
        }
        for name, (layout, want) in layouts.items():
            bufs = getattr(cache, name)
            got = (
                [tuple(a.shape) for a in bufs]
                if isinstance(bufs, (tuple, list))
                else tuple(bufs.shape)
            )
            if got != [want] * self.cfg.num_layers:
                raise ValueError(
                    f"cache.{name}: expected {self.cfg.num_layers} arrays {layout} = "
                    f"{want}, got shapes {got}"
                )
        if t > cache.valid.shape[1]:
            raise ValueError(
                f"tokens: length {t} exceeds the cache's max_len {cache.valid.shape[1]}"
            )
        known = not isinstance(cache.index, jax.core.Tracer)
        if known and int(np.max(cache.index)) + t > cache.valid.shape[1]:
            raise ValueError(
                f"cache: index {int(np.max(cache.index))} + {t} tokens exceeds max_len "
                f"{cache.valid.shape[1]}"
            )
        if jnp.ndim(cache.index) not in (0, 1) or (
            jnp.ndim(cache.index) == 1 and (cache.index.shape != (b,) or t != 1)
        ):
            raise ValueError(
                f"cache.index: int32[] or, for one token per row, int32[{b}]; got shape "
                f"{jnp.shape(cache.index)} with {t} tokens"
            )
        if positions is None:
            raise ValueError("positions: decode needs explicit positions int32[B, T']")
        if prefill and known and int(np.max(cache.index)) != 0:
            raise ValueError(
                f"prefill: the cache already holds {int(np.max(cache.index))} tokens; prefill=True "
                "is for an empty cache"
            )
        h, aux, cache = self._run(
            tokens, positions, attn_mask, replay, cache, router_noise, prefill=prefill
        )
        if last_only:
            h = h[:, -1:]
        return self.logits(h), aux, cache


def init_sharded(cfg: ModelConfig, mesh: jax.sharding.Mesh, *, seed: int = 0):
    """A Transformer whose parameters are created directly in their sharding
    (`jax.jit(init, out_shardings=...)`; no full replica is ever materialised)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    gdef, abs_state = nnx.split(abstract)
    shardings = param_shardings(abs_state, mesh, cfg)

    @jax.jit
    def init():
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(gdef, state)
