"""Accelerator benchmark: the train step's model FLOP utilisation, the sampler's decode
rate against the HBM roofline, the old-log-prob pass, and peak device memory, each as a
ratio to what the hardware allows, in one run.

    python -m experiments.bench.bench_accelerator --size h200 --json out.json   # one H200
    python -m experiments.bench.bench_accelerator --size tiny                   # any CPU, seconds

The model (``--size h200``) is Qwen3-MoE-shaped and trains on one H200 from random
initialisation: 12 layers by default (``--layers``), d_model 2048, 32 query / 4 KV heads
of 128 with q/k norm, 64 experts of width 768, top-8, Qwen3's 151,936-entry vocabulary
(untied), f32 storage, bf16 compute. The model, the batch and every program come from
`experiments/programs.py`, which `experiments/compile_report.py` compiles for a device
the machine does not have: a device run and a compile report describe one program.
The benchmark sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` unless it is set
(`gspo_jax.multihost.claim_device_memory`; JAX's default 0.75 would leave 35 GiB of an H200
unused).

What each figure is:

* Train step: `gspo_jax.step.train_step` (GRPO's loss, micro-batched, AdamW) on a
  mini-batch of rollout-shaped rows (prompt + response). Model FLOPs per token are
  6 x the active matmul parameters (the output head included) plus causal attention,
  6 x L x H x head_dim x T. Rematerialisation is not counted. MFU = model FLOP/s over
  the bf16 dense peak (``--peak-tflops``; 790 measured on the H200 of this project).
  One row per MoE dispatch path (``--backends``).
* Old log-probs: `gspo_jax.passes.logprob_pass` over the same mini-batch (forward only:
  2 x FLOPs).
* Sampler: `gspo_jax.rollout.Sampler`, prompts of ``prompt_len`` tokens, responses of
  exactly ``--new-tokens`` tokens (no stop token). The decode step is the difference
  of an n-token and an n/2-token call over n/2 (prefill and per-call costs cancel). The
  roofline counts the bytes one decode step must read: all non-expert weights in bf16,
  the experts the batch touches (expected distinct experts of top-K picks over E,
  uniform routing), and the KV cache at the mean context of the timed steps. It divides
  them by the HBM bandwidth (``--hbm-tbs``, 4.8 TB/s). Prefill is timed by a one-token
  call.
* Peak memory: XLA's compiled estimate (arguments + outputs + temporaries - aliased)
  of each program, and the runtime's ``peak_bytes_in_use`` after each part, which
  accumulates (run one part per process for clean peaks: ``--parts``).
"""

from __future__ import annotations

import argparse
import json
import time

from gspo_jax.multihost import claim_device_memory

claim_device_memory()  # before JAX touches a device: 95% of each GPU, not JAX's 75%

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import programs  # noqa: E402
from experiments.programs import SIZES, matmul_params, model_config  # noqa: E402, F401
from gspo_jax.models import ModelConfig  # noqa: E402
from gspo_jax.rollout import Sampler  # noqa: E402


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x active matmul parameters + causal attention (6 x L x H x hd x T)."""
    attn = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * matmul_params(cfg, active=True) + attn


def decode_bytes(cfg: ModelConfig, batch: int, context: float) -> float:
    """Bytes one decode step reads at bf16: every non-expert weight once, the experts
    that ``batch`` tokens touch (expected distinct of top-K out of E, uniform), and the
    KV cache of ``context`` positions per row."""
    d, hd = cfg.d_model, cfg.head_dim
    dense = cfg.vocab_size * d  # output head (the embedding rows read are negligible)
    expert = 3 * d * cfg.moe_d_ff
    touched = 0.0
    for moe in cfg.layer_kinds:
        dense += d * hd * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * hd * d
        if moe:
            dense += d * cfg.num_experts
            p_untouched = (1 - cfg.top_k / cfg.num_experts) ** batch
            touched += cfg.num_experts * (1 - p_untouched) * expert
        else:
            dense += 3 * d * cfg.d_ff
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * hd
    return 2.0 * (dense + touched + kv)


def timed(fn, *args, reps: int):
    """(median seconds of ``reps`` calls after one warm-up, the warm-up's seconds, out)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), first, out


def compiled_bytes(jitted, *args) -> int | None:
    """XLA's peak estimate of a jitted program: arguments + outputs + temporaries -
    aliased (donated) buffers."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
    except Exception:  # not every backend reports it
        return None
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def runtime_peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a ratio of a tiny CPU run is not rounded to 0)."""
    return float(f"{x:.4g}")


def gib(x) -> float | None:
    return None if x is None else round(x / 2**30, 2)


def top_ops(trace_dir: str, n: int = 25) -> list[dict]:
    """The device ops that took the most time in a `jax.profiler.trace` (its Perfetto
    JSON): name, total milliseconds, calls, share of all device time."""
    import glob
    import gzip

    paths = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not paths:
        return []
    with gzip.open(paths[0]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        e["pid"]: e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in names.items() if "/device:" in name}
    total: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device and "dur" in e:
            t = total.setdefault(e["name"], [0.0, 0])
            t[0] += e["dur"] / 1e3
            t[1] += 1
    all_ms = sum(v[0] for v in total.values()) or 1.0
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        dict(op=k[:120], ms=round(v[0], 3), calls=v[1], share=round(v[0] / all_ms, 4))
        for k, v in rows
    ]


def bench_train(size: str, backend: str, args) -> dict:
    sh = programs.shape(size, backend, args.layers)
    cfg = sh.cfg
    mesh = programs.single_device_mesh()
    graphdef, params = programs.model_params(cfg, mesh, abstract=False)
    seq = sh.seq_len
    tokens = sh.rows * seq

    logp, lp_args = programs.logprob_program(
        sh, mesh, abstract=False, graphdef=graphdef, params=params
    )
    old_mem = compiled_bytes(logp, *lp_args)
    old_s, old_first, old = timed(logp, *lp_args, reps=args.reps)
    train, (state, batch, rng) = programs.train_program(
        sh, mesh, abstract=False, graphdef=graphdef, params=params, old=old
    )
    del old, lp_args, params
    train_mem = compiled_bytes(train, state, batch, rng)

    def run(st):  # the state is donated: thread it through
        st, m = train(st, batch, rng)
        return st, m

    t0 = time.perf_counter()
    state, m = jax.block_until_ready(run(state))
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        state, m = jax.block_until_ready(run(state))
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    profile = None
    if args.profile:  # one more step, traced
        d = f"{args.profile}/train_{backend}"
        with jax.profiler.trace(d, create_perfetto_trace=True):
            state, m = jax.block_until_ready(run(state))
        profile = top_ops(d)
    flops = train_flops_per_token(cfg, seq) * tokens
    peak = args.peak_tflops * 1e12
    return dict(
        part="train",
        backend=backend,
        layers=cfg.num_layers,
        params=cfg.num_params(),
        active_params=cfg.num_params(active=True),
        tokens=tokens,
        seq_len=seq,
        micro_batches=sh.micro_batches,
        step_s=round(sec, 4),
        first_call_s=round(first, 2),
        tokens_per_s=round(tokens / sec, 1),
        model_tflops=round(flops / sec / 1e12, 2),
        mfu=_sig(flops / sec / peak),
        loss_finite=bool(np.isfinite(float(m["loss"].compute()))),
        old_logp_s=round(old_s, 4),
        old_logp_first_call_s=round(old_first, 2),
        old_logp_mfu=_sig(flops / 3 / old_s / peak),
        train_compiled_gib=gib(train_mem),
        old_logp_compiled_gib=gib(old_mem),
        runtime_peak_gib=gib(runtime_peak()),
        profile=profile,
    )


def bench_sampler(size: str, backend: str, args) -> list[dict]:
    sh = programs.shape(size, backend, args.layers)
    cfg = sh.cfg
    mesh = programs.single_device_mesh()
    # One bf16 copy of the weights, as a rollout holds them (the f32 ones are freed).
    graphdef, params = programs._sampler_params(sh, mesh, abstract=False)
    p = sh.prompt_len
    sampler = Sampler(graphdef, params, vocab_size=cfg.vocab_size, prompt_len=p)
    rs = np.random.RandomState(0)
    rows = []
    batches = [int(x) for x in args.sampler_batches.split(",") if x] or sh.sampler_batches
    for b in batches:
        prompts = rs.randint(1, cfg.vocab_size, (b, p)).tolist()

        def sample(n, prompts=prompts):
            return sampler(
                prompts,
                num_samples=1,
                max_new_tokens=n,
                rng=jax.random.key(0),
                temperature=1.0,
                eos_id=None,
                routing="none",
            ).tokens

        n = args.new_tokens or sh.new_tokens
        half = max(1, n // 2)
        prefill_s, _, _ = timed(sample, 1, reps=args.reps)
        total_s, first, _ = timed(sample, n, reps=args.reps)
        half_s, _, _ = timed(sample, half, reps=args.reps)
        profile = None
        if args.profile and b == max(batches):
            d = f"{args.profile}/sampler_{b}"
            with jax.profiler.trace(d, create_perfetto_trace=True):
                jax.block_until_ready(sample(min(n, 64)))
            profile = top_ops(d)
        # The decode step from two lengths: the second half's steps alone, so the
        # prefill and any per-call cost cancel (on the H200 the one-token call of the
        # first batch once took 4 s after its warm-up, which made total - prefill
        # meaningless). Its roofline is at the mean context of those steps.
        if total_s <= half_s:  # too few tokens to see the steps above the noise
            raise SystemExit(
                f"batch {b}: {n} tokens took no longer than {half}: raise --new-tokens"
            )
        per_step = (total_s - half_s) / (n - half)
        roof = decode_bytes(cfg, b, p + (n + half) / 2) / (args.hbm_tbs * 1e12)
        rows.append(
            dict(
                part="sampler",
                backend=backend,
                batch=b,
                prompt_len=p,
                new_tokens=n,
                total_s=round(total_s, 3),
                first_call_s=round(first, 2),
                prefill_s=round(prefill_s, 4),
                prefill_us_per_prompt_token=round(prefill_s / (b * p) * 1e6, 3),
                decode_step_ms=round(per_step * 1e3, 3),
                decode_tokens_per_s=round(b / per_step, 1),
                roofline_step_ms=round(roof * 1e3, 3),
                frac_roofline=_sig(roof / per_step),
                runtime_peak_gib=gib(runtime_peak()),
                profile=profile,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--parts", default="train,sampler", help="train, sampler (comma-separated)")
    ap.add_argument("--backends", default="auto,dense", help="MoE dispatch paths of the train step")
    ap.add_argument("--sampler-backend", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="0: the size's")
    ap.add_argument("--new-tokens", type=int, default=0, help="0: the size's")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense peak")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    ap.add_argument("--sampler-batches", default="", help="comma-separated; default: the size's")
    ap.add_argument("--profile", default="", help="trace one step of each part into this folder")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    res = dict(
        device=getattr(dev, "device_kind", dev.platform),
        backend=jax.default_backend(),
        jax=jax.__version__,
        size=args.size,
        model=SIZES[args.size]["model"],
        peak_tflops=args.peak_tflops,
        hbm_tbs=args.hbm_tbs,
        rows=[],
    )
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    parts = [x for x in args.parts.split(",") if x]
    if "sampler" in parts:
        res["rows"] += bench_sampler(args.size, args.sampler_backend, args)
    if "train" in parts:
        for backend in [x for x in args.backends.split(",") if x]:
            row = bench_train(args.size, backend, args)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
