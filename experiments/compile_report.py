"""What a GPU or TPU program of gspo_jax holds, from a machine without that device.

    python -m experiments.compile_report --target h200 --layers 16 \\
        --parts train,logprob,prefill,decode,sampler --batches 64,256,1024
    python -m experiments.compile_report --target h200 --parts sampler,sampler_refill
    python -m experiments.compile_report --target v5p:2x2x1 --size flagship --parts train
    python -m experiments.compile_report --target h200 --size flagship --parts train \\
        --lora 16,q,k,v,o,expert_gate,expert_up,expert_down

It compiles the programs of `experiments/programs.py` (the ones
`experiments/bench/bench_accelerator.py` runs on a device) for a compile-only target
(`experiments/targets`: h100, h200, b200 from XLA's GPU specs, optionally ``xN``
devices; TPU slices through libtpu) and prints for each program:

* peak memory by XLA's own accounting, arguments + outputs + temporaries - aliases
  (donated buffers), against the device's usable memory (``--mem-fraction`` of it,
  what ``XLA_PYTHON_CLIENT_MEM_FRACTION`` gives JAX);
* the largest buffers of that peak, each labelled (parameter, optimizer state,
  gradient, KV cache, logits, dispatch copy of expert weights, activation): the
  arguments, and the slots of XLA's heap (``*-memory-usage-report.txt``: one slot holds
  several values at different times; it is labelled by its largest);
* an op inventory: gathers and scatters that move expert-weight-shaped arrays (bytes
  per call of the program), dense expansions of ``ragged_dot``, f32 matmuls with a
  vocabulary-sized dimension, custom calls, collectives;
* matmul FLOPs of the optimised program (every dot, cuBLAS GEMM, grouped-matmul kernel
  call and, on a TPU, convolution, through loop trip counts) against the model's: 2 x
  active matmul parameters per token forward, 6 x for a train step (attention's
  products run in cuDNN's custom calls and are not in either figure); beside it the
  ratio expected with the recompute the design implies (`recompute_flops`).

``sampler_refill``: the refilling sampler in ``batch`` slots over twice as many rows
(`programs.sampler_program`); its decode steps depend on when rows finish, so it has no
model FLOPs to compare with (reported as not applicable).

``train_packed``, ``logprob_packed``: the passes on packed buffers in the padded ones'
micro-batch shape (`programs.packed_shape`), whose loop runs the micro-batches a plan
uses (a count XLA cannot read): their FLOPs are one micro-batch's, the loop's body. With
them, a table gives for one batch at lengths from `experiments.bench.lengths.sample`
the micro-batches each pass computes (`gspo_jax.packing.plan`, run here), the real
tokens' share of the positions computed and the matmul FLOPs per real token.

``--lora rank[,target,...]``: the train and log-prob programs of the RL phase with LoRA
(`experiments/programs.py`: the base frozen in the compute dtype, adapters and their
optimizer state in f32); the model's FLOPs are then those of a frozen base (no weight
gradient: 4 x its active parameters per token) and trained adapters (6 x theirs).

No timings: the compiler does not run the program. On a GPU target, the CUDA plugin
must be installed (``pip install -e '.[compile]'``); without it the report says so
and exits with status 2. ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import tempfile
import time

# The compile-only targets need no device: keep JAX on the CPU whatever is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from experiments import compile_tables, hlo, programs, targets  # noqa: E402
from gspo_jax import config_fields, packing, passes  # noqa: E402
from gspo_jax.lora_training import LoRAConfig  # noqa: E402
from gspo_jax.models import dispatch  # noqa: E402
from gspo_jax.models.layers import cache_layouts  # noqa: E402

GIB = 2**30
SAMPLER_SIDE = ("prefill", "decode", "sampler", "sampler_refill")  # parts run at --batches


def cpu_target() -> targets.Target:
    """This machine's CPU as a target (``--target cpu``: the tests' fast programs)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return targets.Target("cpu", "cpu", (jax.devices("cpu")[0],), mem)


def mesh_for(target: targets.Target, mesh_shape: dict[str, int] | None) -> Mesh:
    """A mesh over the target's devices: ``mesh_shape`` (axis -> size, -1 = the rest),
    or all devices on 'fsdp' (parameters and batch sharded over every device)."""
    devs = list(target.devices)
    shape = dict(mesh_shape or {"data": 1, "fsdp": -1, "expert": 1, "tensor": 1})
    known = math.prod(v for v in shape.values() if v != -1)
    shape = {k: (len(devs) // known if v == -1 else v) for k, v in shape.items()}
    if math.prod(shape.values()) != len(devs):
        raise ValueError(f"mesh: {shape} does not cover the target's {len(devs)} devices")
    return Mesh(np.asarray(devs).reshape(tuple(shape.values())), tuple(shape))


def model_flops(sh: programs.Shape, part: str, batch: int) -> float | None:
    """The model's matmul FLOPs for one call of ``part`` (module docstring); None for the
    refilling sampler, whose decode steps depend on when its rows finish."""
    active = programs.matmul_params(sh.cfg, active=True)
    adapters = programs.adapter_params(sh.cfg, sh.lora, active=True)
    head = sh.cfg.vocab_size * sh.cfg.d_model
    if part == "train" and sh.trainable == "all":
        return 6.0 * active * sh.rows * sh.seq_len
    if part == "train":  # the base's products forward and into x; the adapters' all three
        return (4.0 * active + 6.0 * adapters) * sh.rows * sh.seq_len
    if part == "logprob":
        return 2.0 * (active + adapters) * (sh.logprob_rows or sh.rows) * sh.seq_len
    if part == "prefill":  # the head on the last position only
        return 2.0 * (active - head) * batch * sh.prompt_len + 2.0 * head * batch
    if part == "decode":
        return 2.0 * active * batch
    if part == "sampler":  # prefill + new_tokens - 1 decode steps
        return model_flops(sh, "prefill", batch) + (sh.new_tokens - 1) * 2.0 * active * batch
    if part == "sampler_refill":
        return None
    raise ValueError(part)


def recompute_flops(sh: programs.Shape, part: str, platform: str) -> float:
    """The matmul FLOPs a train step recomputes by design, beyond `model_flops`:

    * the output head's forward, once per chunk of the loss (`Transformer.
      logprobs_from_hidden` runs each chunk under `jax.checkpoint`, so that no
      [rows, T, V] f32 logits are kept);
    * what the layers' remat policy does not keep: with 'full', the layers' whole
      forward; with the dot-saving policies, the MoE dispatch's expert products
      where they are not a saved dot (the grouped-matmul kernel's, and the blocked
      dispatch's batched einsums, which only 'dots' saves); none with 'none'.
    """
    if part != "train":
        return 0.0
    cfg = sh.cfg
    tokens = sh.rows * sh.seq_len
    head = cfg.vocab_size * cfg.d_model
    n = 2.0 * head * tokens
    policy = cfg.remat_policy
    backend = dispatch.backend_for(cfg.moe_backend, platform)
    experts = sum(cfg.top_k * 3 * cfg.d_model * cfg.moe_d_ff for moe in cfg.layer_kinds if moe)
    if policy == "full":
        n += 2.0 * (programs.matmul_params(cfg, active=True) - head) * tokens
    elif (
        policy != "none" and backend != "dense" and not (backend == "blocked" and policy == "dots")
    ):
        n += 2.0 * experts * tokens
    return n


def micro_batch_flops(comps, unknown: list[str]) -> tuple[float | None, list[str]]:
    """(matmul FLOPs of one iteration, the loop's name) of a packed program's micro-batch
    loop: the while loop of unknown trip count (``unknown``, `hlo.execution_counts`') whose
    body holds matmuls; (None, []) unless exactly one does and its own loops are known."""
    found = []
    for ins in (i for c in comps.values() for i in c.instrs if i.name in set(unknown)):
        body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
        if ins.opcode != "while" or not body:
            continue
        sub = {k: dataclasses.replace(c, entry=k == body.group(1)) for k, c in comps.items()}
        counts, inner = hlo.execution_counts(sub)
        flops = sum(x.flops * x.count for x in hlo.matmuls(sub, counts))
        if flops:
            found.append((flops, inner, ins.name))
    if len(found) != 1 or found[0][1] or math.isnan(found[0][0]):
        return None, []
    return found[0][0], [found[0][2]]


class Labeller:
    """What a live buffer is, from its name (entry parameters are named after the
    argument path) or its shape."""

    def __init__(self, sh: programs.Shape, param_shapes, cache_shapes):
        cfg = sh.cfg
        d, f = cfg.d_model, cfg.moe_d_ff
        self.expert_shapes = [(d, f), (f, d), (d, 2 * f), (2 * f, d)]
        self.num_experts = cfg.num_experts
        self.vocab = cfg.vocab_size
        self.param_shapes = set(param_shapes)
        self.cache_shapes = set(cache_shapes)
        self.paths: list[str] = []  # each HLO parameter's argument path (report_one sets it)

    def __call__(self, name: str | None, arr, is_argument: bool) -> str:
        if is_argument:
            m = re.fullmatch(r"parameter (\d+)", name or "")
            if m and int(m.group(1)) < len(self.paths):  # an unnamed parameter: its path
                name = self.paths[int(m.group(1))]
            name = re.sub(r"[^a-z_]+", "_", name.lower()).strip("_")
            if name.startswith(("state_opt_state", "opt_state")):
                return "optimizer state"
            if "_lora_a" in name or "_lora_b" in name:
                return "adapter"
            if name.startswith(("state_params", "params", "state__")):
                return "parameter"
            if name.startswith("cache"):
                return "KV cache"
            return "input"
        if tuple(arr.dims) in self.cache_shapes:
            return "KV cache"
        if tuple(arr.dims) in self.param_shapes:
            return "gradient" if arr.dtype == "f32" else "weights in compute dtype"
        if hlo._weight_like(arr, self.expert_shapes, self.num_experts):
            return "dispatch copy of expert weights"
        if self.vocab in arr.dims:
            return "logits"
        return "activation / other"


def _argument_paths(part: str, args) -> list[str]:
    """The argument path of each HLO parameter, in parameter order (``state.params...``,
    as JAX names the parameters it can): JAX passes the flattened arguments in this
    order."""
    names = programs.ARG_NAMES[part]
    if part.startswith("sampler"):
        args = args[1:]  # the graphdef is static
    out = []
    for name, arg in zip(names, args):
        for p, x in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if hasattr(x, "shape"):
                out.append(name + jax.tree_util.keystr(p))
    return out


def _abstract_shapes(tree) -> list[tuple[int, ...]]:
    """Each array's shape on one device (its shard), as the per-device program holds it."""
    out = []
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape"):
            sharding = getattr(x, "sharding", None)
            out.append(tuple(sharding.shard_shape(x.shape) if sharding else x.shape))
    return out


def report_one(
    part: str,
    sh: programs.Shape,
    target: targets.Target,
    mesh: Mesh,
    *,
    batch: int,
    mem_fraction: float,
    top: int,
) -> dict:
    t0 = time.perf_counter()
    base = part.removesuffix("_packed")
    fn, args = programs.program(
        part, sh, mesh, abstract=True, batch=batch, platform=target.platform
    )
    # A program for a compile-only device cannot be loaded from a persistent compilation
    # cache (and one that is writes no dump): compile it, with the cache off.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with tempfile.TemporaryDirectory() as dump:
            options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
            if target.platform == "cuda":
                # Nothing runs the machine code: what the report reads (the optimised HLO,
                # the buffer assignment) is fixed before the PTX is assembled, so it is
                # assembled unoptimised (ptxas -O0: the tiny train step's compile took
                # 12-20% less CPU time, its HLO and memory unchanged).
                options["xla_gpu_disable_gpuasm_optimizations"] = True
            # On the mesh, as the trainer traces its programs; for the target's kernels.
            with jax.set_mesh(mesh), targets.compiling_for(target):
                compiled = fn.lower(*args).compile(options)
            compile_s = time.perf_counter() - t0
            text = compiled.as_text()
            usage = ""
            for f in sorted(os.listdir(dump)):
                if f.endswith("after_optimizations-memory-usage-report.txt"):
                    usage = open(os.path.join(dump, f)).read()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
        compilation_cache.reset_cache()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    peak -= m.alias_size_in_bytes
    usable = target.device_bytes * mem_fraction
    comps = hlo.parse_module(text)
    counts, unknown = hlo.execution_counts(comps)
    mm = hlo.matmuls(comps, counts)
    unread = sum(1 for x in mm if math.isnan(x.flops))
    if target.platform == "tpu":
        # XLA:TPU's convolutions are read right on a plain dot in a loop (the tests), but
        # the v5p flagship's log-prob pass came to 3,166x the model's FLOPs: not trusted.
        unread = max(unread, 1)
    hlo_flops = sum(x.flops * x.count for x in mm if not math.isnan(x.flops))
    flops_model = model_flops(sh, base, batch)
    flops_model = flops_model and flops_model / mesh.size  # per device (None: not applicable)
    flops_recompute = recompute_flops(sh, base, target.platform) / mesh.size
    pk, micro_flops = None, hlo_flops
    if base != part:  # one micro-batch: the model's over its slots, the program's loop body
        pk = programs.packed_shape(sh, mesh, part)
        flops_model, flops_recompute = flops_model / pk.micro, flops_recompute / pk.micro
        if pk.micro > 1:
            micro_flops, loops = micro_batch_flops(comps, unknown)
            unknown = [u for u in unknown if u not in loops]
    ratio = micro_flops / flops_model if flops_model and micro_flops else None
    n_lp = sh.logprob_rows or sh.rows
    labeller = Labeller(
        sh,
        _abstract_shapes(args[0]) if base != "train" else _abstract_shapes(args[0].params),
        _abstract_shapes(args[1]) if part == "decode" else [],
    )
    rows = programs.REFILL_ROWS_PER_SLOT * batch  # sampler_refill: its slots, rows, chunk
    refill = part == "sampler_refill" and dict(slots=batch, rows=rows, chunk=fn.spec.chunk)
    if part in ("prefill", "sampler", "sampler_refill"):  # the refill's: slots and a chunk
        kv = dict(k=sh.cfg.num_kv_heads, s=sh.prompt_len + sh.new_tokens - 1, h=sh.cfg.head_dim)
        for b in {batch // max(1, mesh.size), refill and refill["chunk"]} - {0}:
            for layout in cache_layouts(sh.cfg):  # the model's (keys, values) axis orders
                labeller.cache_shapes.add(tuple(dict(kv, b=b)[a] for a in layout))
    labeller.paths = _argument_paths(part, args)
    buffers = hlo.peak_buffers(comps, usage, labeller)
    by_what: dict[str, float] = {}
    for b in buffers:
        by_what[b["what"]] = by_what.get(b["what"], 0) + b["bytes"]
    inv = hlo.inventory(
        comps,
        counts,
        vocab_size=sh.cfg.vocab_size,
        expert_shapes=labeller.expert_shapes,
        num_experts=sh.cfg.num_experts,
    )
    return dict(
        part=part,
        target=target.name,
        device=target.kind,
        devices=mesh.size,
        mesh=dict(mesh.shape),
        layers=sh.cfg.num_layers,
        moe_backend=sh.cfg.moe_backend,
        moe_block_size=sh.cfg.moe_block_size,
        mu_dtype=sh.mu_dtype,
        lora=_lora_row(sh),
        batch=batch if part in SAMPLER_SIDE else sh.rows if base != "logprob" else n_lp,
        refill=refill or None,
        compile_s=round(compile_s, 1),
        memory=dict(
            arguments_gib=m.argument_size_in_bytes / GIB,
            outputs_gib=m.output_size_in_bytes / GIB,
            temporaries_gib=m.temp_size_in_bytes / GIB,
            aliased_gib=m.alias_size_in_bytes / GIB,
            peak_gib=peak / GIB,
            usable_gib=usable / GIB,
            fraction_of_usable=peak / usable,
        ),
        peak_by_kind_gib={k: v / GIB for k, v in sorted(by_what.items(), key=lambda kv: -kv[1])},
        largest_buffers=buffers[:top],
        inventory=inv,
        matmul_tflop_hlo=hlo_flops / 1e12,
        matmul_tflop_model=flops_model and flops_model / 1e12,
        packing=dataclasses.asdict(pk) if pk else None,
        micro_tflop_hlo=micro_flops / 1e12 if micro_flops else None,
        hlo_over_model=ratio if ratio and not unknown and not unread else None,
        expected_over_model=(flops_model + flops_recompute) / flops_model if flops_model else None,
        unknown_trip_counts=len(unknown),
        unread_matmuls=unread,
    )


def lengths_batch(sh: programs.Shape, sample, seed: int, source: str) -> dict:
    """The rollout batch (``logprob_rows``, or a mini-batch's rows) at lengths drawn by
    ``sample`` (`experiments.bench.lengths.sample`'s signature): its valid input
    positions bool[n, S] (`gspo_jax.passes.sequence_inputs`), rows in a random order
    (mini-batches are a permutation's slices, as in `gspo_jax.rl`), and a summary."""
    n, p, t = sh.logprob_rows or sh.rows, sh.prompt_len, sh.response_len
    if n % sh.rows:
        raise ValueError(f"lengths: {n} log-prob rows are not mini-batches of {sh.rows}")
    pl, rl = (np.asarray(x) for x in sample(n, seed=seed, max_prompt_len=p, max_new_tokens=t))
    rows = dict(prompt_tokens=np.zeros((n, p), np.int32), tokens=np.zeros((n, t), np.int32))
    rows.update(prompt_mask=np.arange(p) >= p - pl[:, None], mask=np.arange(t) < rl[:, None])
    valid = np.asarray(passes.sequence_inputs(rows)[3], bool)
    valid = valid[np.random.default_rng(seed).permutation(n)]
    means = dict(prompt_mean=pl.mean(), response_mean=rl.mean(), response_at_max=np.mean(rl >= t))
    summary = dict(source=source, seed=seed, rows=n, real_tokens=int(valid.sum()))
    return dict(valid=valid, summary=dict(summary, **{k: float(v) for k, v in means.items()}))


def token_figures(r: dict, sh: programs.Shape, mesh: Mesh, valid: np.ndarray) -> dict:
    """What a train (per mini-batch) or log-prob row computes for the batch ``valid``
    (`lengths_batch`); program FLOPs over all devices, a packed program's as counted (its
    micro-batch loop, from the first micro-batch, once) plus the loop body's for each
    further micro-batch used."""
    base = r["part"].removesuffix("_packed")
    calls = valid.shape[0] // r["batch"] if base == "train" else 1
    seq, real = valid.shape[1], int(valid.sum())
    flops = lambda x: x * 1e12 * mesh.size if x is not None else None  # noqa: E731
    once, micro = flops(r["matmul_tflop_hlo"]), flops(r["micro_tflop_hlo"])
    pk = r["packing"] and packing.Packing(**r["packing"])
    if pk:
        plan = jax.jit(packing.plan, static_argnums=1)
        used = [int(plan(v, pk).used) for v in np.split(valid, calls)]
        shape, slots = [pk.rows, seq], sum(used) * pk.rows * seq
        total = once if pk.micro == 1 else sum(once + (u - 1) * (micro or math.nan) for u in used)
    else:
        m = sh.micro_batches if base == "train" else sh.logprob_micro_batches
        used, shape, slots = [m] * calls, [r["batch"] // m, seq], valid.size
        total, micro = once * calls, once / m
    read = not r["unread_matmuls"] and not r["unknown_trip_counts"] and not math.isnan(total)
    # The model's FLOPs are one micro-batch's (packed) or the whole program's (padded).
    per_slot = flops(r["matmul_tflop_model"]) / ((shape[0] if pk else r["batch"]) * seq)
    out = dict(micro_batch=shape, micro_batches_used=used, real_tokens=real, computed_slots=slots)
    out.update(real_share=real / slots, gflop_per_real_token_model=per_slot * slots / real / 1e9)
    out.update(tflop_per_micro_batch=micro / 1e12 if micro and read else None)
    out.update(gflop_per_real_token=total / real / 1e9 if read else None)
    return out


def _lora_row(sh: programs.Shape) -> dict | None:
    if not (sh.lora and sh.lora.rank):
        return None
    return dict(rank=sh.lora.rank, targets=list(sh.lora.targets), trainable=sh.trainable)


def parse_lora(text: str):
    """``--lora rank[,target,...]`` as a `LoRAConfig` (the targets default to its own),
    checked as the run's config is (unknown targets, a negative rank: named)."""
    rank, *names = [x.strip() for x in text.split(",") if x.strip()]
    node = config_fields.defaults(LoRAConfig)
    node.rank = int(rank)
    if names:
        node.targets = tuple(names)
    config_fields.check(LoRAConfig, node, "--lora ")
    return config_fields.build(LoRAConfig, node)


def render(r: dict) -> str:
    mem = r["memory"]
    lo, rf = r.get("lora"), r.get("refill")
    lines = [
        f"## {r['part']} — {r['device']} x{r['devices']} ({r['target']}), "
        f"{r['layers']} layers, {r['moe_backend']}, batch {r['batch']}"
        + (f" slots over {rf['rows']} rows, chunks of {rf['chunk']}" if rf else "")
        + (f", LoRA rank {lo['rank']} on {','.join(lo['targets'])}" if lo else "")
        + f"  (compiled in {r['compile_s']} s)",
        f"peak {mem['peak_gib']:.2f} GiB = arguments {mem['arguments_gib']:.2f} + outputs "
        f"{mem['outputs_gib']:.2f} + temporaries {mem['temporaries_gib']:.2f} - aliased "
        f"{mem['aliased_gib']:.2f}; usable {mem['usable_gib']:.1f} GiB: "
        f"{100 * mem['fraction_of_usable']:.1f}%"
        + ("  ** DOES NOT FIT **" if mem["fraction_of_usable"] > 1 else ""),
        "the peak by kind (arguments, and heap slots by their largest array): "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["peak_by_kind_gib"].items()),
        "largest buffers at the peak:",
    ]
    for b in r["largest_buffers"]:
        lines.append(
            f"  {b['bytes'] / GIB:8.3f} GiB  {b['shape']:<28} {b['what']:<32} {b['name'][:60]}"
        )
    inv = r["inventory"]
    lines.append(
        f"expert-weight gathers/scatters: {len(inv['expert_weight_copies'])} ops, "
        f"{inv['expert_weight_copy_gib']:.2f} GiB moved per call"
    )
    copies = sorted(inv["expert_weight_copies"], key=lambda w: -w["bytes_per_call"] * w["count"])
    for w in copies[:6]:
        lines.append(
            f"  {w['opcode']:<8} {w['shape']:<24} x{w['count']:g}  "
            f"{w['bytes_per_call'] * w['count'] / GIB:.2f} GiB  {w['name']}"
        )
    lines.append(f"ragged_dot expanded to dense dots: {len(inv['ragged_dot_dense'])}")
    for x in inv["ragged_dot_dense"][:4]:
        lines.append(f"  {x['lhs']} x {x['rhs']} -> {x['out']}  x{x['count']:g}")
    lines.append(f"f32 matmuls over the vocabulary: {len(inv['f32_vocab_matmuls'])}")
    for x in inv["f32_vocab_matmuls"][:4]:
        lines.append(
            f"  {x['lhs']} x {x['rhs']} -> {x['out']}  x{x['count']:g}  {x['gflops']:.1f} GFLOP"
        )
    lines.append(
        "custom calls: "
        + (", ".join(f"{k} x{v:g}" for k, v in inv["custom_calls"].items()) or "none")
    )
    lines.append(
        "collectives: "
        + (", ".join(f"{k} x{v:g}" for k, v in inv.get("collectives", {}).items()) or "none")
    )
    ratio = r["hlo_over_model"]
    if r.get("unread_matmuls"):
        lines.append(
            "matmul FLOPs: not read (XLA:TPU's convolutions: the reader is checked on a "
            "plain dot only, and overcounts the MoE programs)"
        )
    elif r["matmul_tflop_hlo"] == 0:
        lines.append("matmul FLOPs: no dot, GEMM call or convolution found in the program")
    elif r.get("packing"):  # one micro-batch: the loop's body, or the whole program
        pk, x = r["packing"], f" (program / model = {ratio:.2f})" if ratio else ""
        lines.append(
            f"matmul FLOPs per device, one micro-batch of {pk['rows']} buffer rows (of up to "
            f"{pk['micro']}): program {r['micro_tflop_hlo'] or math.nan:.2f} TFLOP, model "
            f"{r['matmul_tflop_model']:.2f} TFLOP{x}; expected {r['expected_over_model']:.2f}"
        )
    elif r["unknown_trip_counts"]:
        tf = r["matmul_tflop_model"]  # None: sampler_refill's steps run until rows finish
        tf = f"{tf:.2f} TFLOP" if tf is not None else "FLOPs (not applicable: data-dependent)"
        lines.append(
            f"matmul FLOPs per device: program {r['matmul_tflop_hlo']:.2f} TFLOP with "
            f"{r['unknown_trip_counts']} loop(s) of unknown trip count counted once (the "
            f"decode loop stops on its own): not comparable with the model's {tf}; the "
            "decode part gives one step's"
        )
    else:
        lines.append(
            f"matmul FLOPs per device: program {r['matmul_tflop_hlo']:.2f} TFLOP, model "
            f"{r['matmul_tflop_model']:.2f} TFLOP"
            + (
                f" (program / model = {ratio:.2f}; expected {r['expected_over_model']:.2f} "
                "with the recompute the remat policy and the chunked loss imply)"
                if ratio
                else ""
            )
        )
    return "\n".join(lines)


def main(argv=None, *, sample=None) -> list[dict]:  # sample: default lengths.sample
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="h200", help="h100 | h200 | b200 [xN] | v5p:2x2x1 ...")
    ap.add_argument("--size", default="h200", choices=sorted(programs.SIZES) + ["flagship"])
    ap.add_argument("--layers", type=int, default=0, help="0: the size's")
    ap.add_argument("--parts", default="train,logprob,prefill,decode")
    ap.add_argument("--batches", default="", help="sampler-side batches (default: the size's)")
    ap.add_argument(
        "--backend",
        default="auto",
        help="MoE dispatch: auto (the target's), blocked, ragged, dense",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a ModelConfig field or shape setting (rows, micro_batches, "
        "logprob_micro_batches, ...), repeatable",
    )
    ap.add_argument(
        "--lora",
        default="",
        metavar="RANK[,TARGET,...]",
        help="the RL phase with LoRA adapters (train, logprob): e.g. "
        "16,q,k,v,o,expert_gate,expert_up,expert_down",
    )
    ap.add_argument("--mesh", default="", help="e.g. data=1,fsdp=-1,expert=1,tensor=1")
    ap.add_argument("--mem-fraction", type=float, default=0.95)
    ap.add_argument("--top", type=int, default=8, help="largest buffers listed")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--lengths", default="flagship", help="experiments.bench.lengths' name")
    ap.add_argument("--lengths-seed", type=int, default=0, help="the lengths' draw")
    ap.add_argument("--group-size", type=int, default=8, help="samples sharing a prompt")
    args = ap.parse_args(argv)

    try:
        target = cpu_target() if args.target == "cpu" else targets.compile_devices(args.target)
    except targets.TargetUnavailable as e:
        print(f"compile_report: {e}", file=sys.stderr)
        sys.exit(2)
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        try:
            overrides[k] = json.loads(v)
        except json.JSONDecodeError:
            overrides[k] = v
    if args.lora:
        overrides["lora"] = parse_lora(args.lora)
    mesh_shape = args.mesh and {k: int(v) for k, v in (x.split("=") for x in args.mesh.split(","))}
    mesh = mesh_for(target, mesh_shape)
    layers = args.layers if args.size != "flagship" else 0  # the flagship's own (48)
    sh = programs.shape(args.size, args.backend, layers, platform=target.platform, **overrides)
    sh = programs.on_mesh(sh, mesh)
    batches = [int(b) for b in args.batches.split(",") if b] or list(sh.sampler_batches)
    rows, extra = [], {}
    print(f"# python -m experiments.compile_report {' '.join(argv or sys.argv[1:])}")
    print(
        f"# {target.kind} x{mesh.size} ({args.target}), jax {jax.__version__}, "
        f"{sh.cfg.num_layers} layers, {sh.cfg.num_params() / 1e9:.2f}B parameters"
        + (
            f", LoRA rank {sh.lora.rank} ({programs.adapter_params(sh.cfg, sh.lora) / 1e6:.1f}M "
            f"adapter parameters, trains {sh.trainable!r})"
            if sh.lora and sh.lora.rank
            else ""
        ),
        flush=True,
    )
    for part in [p for p in args.parts.split(",") if p]:
        for b in batches if part in SAMPLER_SIDE else [0]:
            r = report_one(
                part, sh, target, mesh, batch=b, mem_fraction=args.mem_fraction, top=args.top
            )
            rows.append(r)
            print(render(r) + "\n", flush=True)
            _dump(args.json, rows, extra)  # as it goes: a long report keeps what it finished
    if any(r.get("packing") for r in rows):
        source = f"{getattr(sample, '__module__', None)}.{getattr(sample, '__name__', None)}"
        if sample is None:
            from experiments.bench import lengths

            kw = dict(name=args.lengths, group_size=args.group_size)
            sample = functools.partial(lengths.sample, **kw)
            source = f"experiments.bench.lengths {args.lengths!r}, groups of {args.group_size}"
        batch = lengths_batch(sh, sample, args.lengths_seed, source)
        passes_rows = [r for r in rows if r["part"].split("_")[0] in ("train", "logprob")]
        for r in passes_rows:
            r["tokens"] = token_figures(r, sh, mesh, batch["valid"])
        extra["lengths"] = batch["summary"]
        print(compile_tables.packed_table(passes_rows, batch["summary"]), flush=True)
        _dump(args.json, rows, extra)
    return rows


def _dump(path: str, rows: list[dict], extra: dict):
    if path:
        with open(path, "w") as f:
            json.dump(dict(jax=jax.__version__, rows=rows, **extra), f, indent=1)


if __name__ == "__main__":
    main()
