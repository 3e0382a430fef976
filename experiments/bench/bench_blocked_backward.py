"""The blocked MoE dispatch's weight-gather backward on this machine: autodiff's
scatter-add against `dispatch.take_expert_blocks`'s one-hot matmul, interleaved in one
process (jit(grad) of one layer, medians of 15 calls each).

    python -m experiments.bench.bench_blocked_backward
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax.models import dispatch

# (tokens, d_model, expert width, experts, top-k)
SHAPES = [(1024, 512, 1024, 8, 2), (1024, 512, 256, 64, 2), (2048, 128, 256, 8, 2)]


def layer_grad(weight_grad, x, idx, gates, ws):
    """jit(grad) of one blocked layer with the weight gather's backward ``weight_grad``."""

    def loss(x, ws):
        y = dispatch.dispatch_blocked(x, idx, gates, *ws, max_block=64, weight_grad=weight_grad)
        return jnp.sum(y**2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main():
    for n, d, f, e, k in SHAPES:
        rs = np.random.RandomState(0)
        x = jnp.asarray(rs.randn(n, d), jnp.float32)
        idx = jnp.asarray(np.stack([rs.permutation(e)[:k] for _ in range(n)]), jnp.int32)
        gates = jnp.asarray(rs.rand(n, k), jnp.float32)
        ws = [
            jnp.asarray(rs.randn(*s) * 0.05, jnp.float32) for s in [(e, d, f), (e, d, f), (e, f, d)]
        ]
        fa = layer_grad("matmul", x, idx, gates, ws)
        fb = layer_grad("scatter", x, idx, gates, ws)
        times = {"matmul": [], "scatter": []}
        for fn in (fa, fb):
            jax.block_until_ready(fn(x, ws))
        for _ in range(15):
            for name, fn in (("matmul", fa), ("scatter", fb)):
                t = time.perf_counter()
                jax.block_until_ready(fn(x, ws))
                times[name].append(time.perf_counter() - t)
        a, b = np.median(times["matmul"]), np.median(times["scatter"])
        print(
            f"tokens {n}, d {d}, width {f}, {e} experts top-{k}: matmul backward {1e3 * a:.1f} ms, "
            f"scatter-add {1e3 * b:.1f} ms, ratio {a / b:.2f}"
        )


if __name__ == "__main__":
    main()
