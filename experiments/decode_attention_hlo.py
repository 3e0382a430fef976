"""How a decode step's attention over the KV cache is computed in the optimised program
of a compile-only accelerator (no device needed).

    JAX_PLATFORMS=cpu python -m experiments.decode_attention_hlo \\
        --target h200 --size h200 --layers 2 --batch 64

It compiles `experiments/programs.py`'s ``decode`` program (one token per row against a
cache of prompt_len + new_tokens - 1 slots) for the target and lists

* the custom calls (cuDNN's fused attention is ``__cudnn$fmha...``);
* every instruction whose result has the cache's slot count S as a dimension, other than
  the cache buffers themselves (parameters, their in-place updates and bitcasts), by op
  and array type: an attention that forms scores over the whole cache shows an
  f32[B, KV, G, 1, S(+1)] (or [B, H, 1, S]) array here, fused or not.

The exit status is 1 when ``--expect-fused`` is given and the program has no fused
attention call or has an f32 array of B x H x S elements (the scores).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from experiments import hlo, programs, targets  # noqa: E402
from experiments.compile_report import mesh_for  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h200")
    ap.add_argument("--size", default="h200")
    ap.add_argument("--layers", type=int, default=0, help="0: the size's")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--backend", default="auto", help="MoE dispatch (ModelConfig.moe_backend)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--expect-fused", action="store_true")
    args = ap.parse_args(argv)

    target = targets.compile_devices(args.target)
    mesh = mesh_for(target, None)
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        overrides[k] = int(v) if v.isdigit() else v
    sh = programs.shape(args.size, args.backend, args.layers, platform=target.platform, **overrides)
    sh = programs.on_mesh(sh, mesh)
    cfg = sh.cfg
    slots = sh.prompt_len + sh.new_tokens - 1
    jitted, fargs = programs.decode_program(sh, mesh, args.batch, abstract=True)
    with jax.set_mesh(mesh):
        text = jitted.lower(*fargs).compile().as_text()
    comps = hlo.parse_module(text)

    custom = collections.Counter()
    with_s = collections.Counter()
    scores = []
    b, h = args.batch // mesh.size, cfg.num_heads
    for comp in comps.values():
        for ins in comp.instrs:
            if ins.opcode == "custom-call":
                target_name = ins.attrs.split('custom_call_target="', 1)[-1].split('"', 1)[0]
                custom[target_name] += 1
            if ins.opcode in ("parameter", "bitcast", "dynamic-update-slice", "tuple"):
                continue
            for arr in ins.arrays:
                if not any(d in (slots, slots + 1) for d in arr.dims):
                    continue
                with_s[f"{ins.opcode} {arr.dtype}{list(arr.dims)}"] += 1
                if arr.dtype == "f32" and math.prod(arr.dims) >= b * h * slots:
                    scores.append(f"{ins.opcode} {arr.dtype}{list(arr.dims)} in {comp.name}")

    print(
        f"# decode step, {target.kind} ({args.target}), jax {jax.__version__}, "
        f"{cfg.num_layers} layers, batch {args.batch}, {slots} cache slots, "
        f"attention_impl {cfg.attention_impl}, dtype {jax.numpy.dtype(cfg.dtype).name}"
    )
    print("custom calls:", dict(custom) or "none")
    print("instructions with an S-sized dimension (cache buffers and their updates left out):")
    for k, n in sorted(with_s.items()):
        print(f"  {n:4d} x {k}")
    print(f"f32 arrays of >= B*H*S = {b * h * slots:,} elements (scores):", len(scores))
    for s in scores[:10]:
        print("  ", s)
    fused = any("fmha" in k or "cudnn" in k.lower() for k in custom)
    if args.expect_fused and (not fused or scores):
        print("expected a fused attention call and no f32 scores over the cache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
