"""Benchmark of a whole RL step (sample, score, old/reference log-probs, updates) at a config.

    python -m experiments.bench.bench_rl_step                 # default config, 5 timed steps
    python -m experiments.bench.bench_rl_step --steps 3 --compare-padded   # and its padded twin
    python -m experiments.bench.bench_rl_step --steps 3 \\
        --variant "padded:updates.packing=False,updates.micro_batch_tokens=0"
    python -m experiments.bench.bench_rl_step --config configs/bench_rl_h200.py --steps 3 \\
        --lengths flagship --compare-padded --no-flops --json /tmp/rl_step.json   # one GPU
    python -m experiments.bench.bench_rl_step --steps 10 --arg objective=grpo

Per step, averaged over ``--steps`` steps after one warm-up step (which compiles), for
each variant of the config (``--variant``, ``--compare-padded``; each run in turn in
this process, the previous one freed first), side by side:

* tokens generated (the sampler's responses) and, with ``--lengths``, the lengths
  imposed on the batch (below);
* the positions each pass computed and the share of them that are real tokens: the
  sampler (its prefill of the padded prompts plus decode steps x rows, counted from the
  rollout's lengths: the decode loop runs until its longest row stops), the old-log-prob
  pass and, when the config has a KL term, the reference pass (the same shape: both are
  in one program), and the train step over all the step's updates (the step's
  ``computed_tokens`` / ``real_token_share`` metrics, `gspo_jax.packing`);
* seconds per stage: sample, score (the verifier on the decoded responses), the rest of
  collecting (shaping, assembling the batch), the old/reference passes with the
  advantages (one program, `gspo_jax.prepare.prepare_batch`), the updates;
* tokens per second per device as NeMo-RL reports it: the tokens the step processed, the
  rollout's real prompt and response tokens, over the whole step's time, divided by the
  devices (https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html:
  "Total Tokens Processed / (Time for Stage x Number of GPUs)"; its Qwen3-30B-A3B row,
  1,102 tok/s/GPU, is 2,048 sequences of 3,203 tokens in 192 s on 32 GPUs).

``--lengths NAME`` imposes a length distribution of `experiments/bench/lengths.py` on the
rollouts, in the bench only: each collected batch's prompt and response masks are
replaced by ones of drawn lengths (a prompt's G samples share its length), so that the
log-prob passes and the train step see that distribution. The sampler's own decode is not
changed: its tokens and times stay those of the config's model, whose random weights run
responses to max_new_tokens. Without it, the freshly initialised policy's responses are
full rows, which says nothing of packing at realistic lengths.

``--set key=value`` (repeatable) overrides a config field for every variant, e.g.
``--set updates.packing=False``; a variant ``LABEL:key=value,key=value`` adds its own.
It also gives the first variant's update FLOPs (XLA's cost analysis of the compiled
train step) against this machine's dense f32 matmul peak, and the objective's share of an
update (jitted value and gradient with its metrics, on the update's own mini-batch);
``--no-flops`` skips them and their compiles.
The policy is the config's freshly initialised model (no warm start).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import yaml

from configs import default as default_config
from experiments.bench import lengths as lengths_lib
from gspo_jax import objectives, sweep
from gspo_jax.rl import RLPhase
from gspo_jax.run_parts import RunParts


def load_config(spec: str):
    """``path[:argument]`` -> the config file's ``get_config(argument)``."""
    path, _, _ = spec.partition(":")
    if not os.path.exists(path):
        raise SystemExit(f"--config: no file {path}")
    return sweep.load_config(spec)


def apply_overrides(c, sets) -> None:
    """Set ``key=value`` overrides (dotted config paths; values read as YAML: ``False``,
    ``0``, ``1e-3``, ``R3``) on config ``c``; an unknown key exits naming it."""
    for spec in sets:
        key, sep, raw = spec.partition("=")
        if not sep:
            raise SystemExit(f"--set {spec!r}: expected key=value")
        node, parts = c, key.strip().split(".")
        for i, part in enumerate(parts):
            if part not in node:
                raise SystemExit(f"--set {spec!r}: the config has no {'.'.join(parts[: i + 1])}")
            if i < len(parts) - 1:
                node = node[part]
        node[parts[-1]] = yaml.safe_load(raw)


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``LABEL:key=value,key=value`` (or ``LABEL``) -> (label, overrides)."""
    label, _, rest = spec.partition(":")
    return label, [s for s in rest.split(",") if s]


def time_fn(fn, args, warmup: int, runs: int) -> float:
    """Median ms of ``fn(*args)`` over ``runs`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def objective_ms(cfg, mini, warmup: int = 3, runs: int = 21) -> float:
    """Median ms of the objective's jitted value-and-grad with metrics, on a mini-batch.

    The current log-probs are the old ones shifted by a little noise, so that some
    tokens clip; the router shift is drawn in [0.5, 1].
    """
    fn = objectives.get(cfg.objective)
    old, mask = mini["old_logp"], mini["mask"].astype(np.float32)
    noise = jax.random.normal(jax.random.key(1), old.shape) * 0.1
    extra = {}
    if mini.get("ref_logp") is not None:
        extra["ref_logp"] = mini["ref_logp"]
    if fn.needs_router_shift:
        extra["router_shift"] = jax.random.uniform(
            jax.random.key(2), old.shape, minval=0.5, maxval=1.0
        )

    @jax.jit
    def vg(lp):
        return jax.value_and_grad(
            lambda x: fn(x, old, mini["advantages"], mask, **extra, hp=cfg.hparams), has_aux=True
        )(lp)

    return time_fn(vg, (old + noise,), warmup, runs)


# ---- instrumentation (the bench's own wrappers; the package is unchanged) ----------


def cut_masks(device: dict, prompt_lens, response_lens, *, overlong_filter: bool) -> dict:
    """The batch ``device`` with its ``prompt_mask`` and ``mask`` replaced by those of
    rows of ``prompt_lens`` (left-padded) and ``response_lens`` (right-padded) tokens,
    on the arrays' own devices and shardings; a response at max_new_tokens carries no
    mask under ``overlong_filter`` (as `gspo_jax.collect` does)."""
    out = dict(device)
    P, T = device["prompt_mask"].shape[1], device["mask"].shape[1]
    p = np.asarray(prompt_lens)[:, None]
    r = np.asarray(response_lens)[:, None]
    prompt = np.arange(P)[None, :] >= P - p
    response = np.arange(T)[None, :] < r
    if overlong_filter:
        response = response & (r < T)
    for key, value in (("prompt_mask", prompt), ("mask", response)):
        old = device[key]
        out[key] = jax.device_put(value.astype(old.dtype), old.sharding)
    return out


class Probe:
    """Wrappers around one run's `RLPhase` that record, per RL step, what the package's
    metrics do not: the verifier's seconds, the sampler's rows, prompt and response
    lengths (its positions computed), and, with ``lengths``, the lengths imposed on each
    collected batch (`cut_masks`)."""

    def __init__(self, rl: RLPhase, lengths: str = "", seed: int = 0):
        self.rl, self.lengths, self.seed = rl, lengths, seed
        self.rounds: list[dict] = []  # sampling rounds since the last `take`
        self.imposed: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch step -> lengths
        t = rl.t
        score, collect = t.score, rl.collect_batch

        def timed_score(examples, ro, **kw):
            t0 = time.perf_counter()
            out = score(examples, ro, **kw)
            host = out[3]
            self.rounds.append(
                dict(
                    seconds=time.perf_counter() - t0,
                    prompts=len(examples),
                    prompt_len=int(ro.prompt_tokens.shape[1]),
                    prompt_real=float(np.asarray(ro.prompt_mask).sum()),
                    lengths=np.asarray(host["lengths"]),
                )
            )
            return out

        def collect_batch(j, *, version):
            queued = collect(j, version=version)
            if not self.lengths:
                return queued
            cfg = rl.cfg
            n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
            p, r = lengths_lib.sample(
                n,
                seed=self.seed * 1_000_003 + j,
                max_prompt_len=cfg.rollout.max_prompt_len,
                max_new_tokens=cfg.rollout.max_new_tokens,
                name=self.lengths,
                group_size=cfg.rollout.group_size,
            )
            self.imposed[queued.step] = (p, r)
            dev = cut_masks(queued.device, p, r, overlong_filter=cfg.dapo.overlong_filter)
            return dataclasses.replace(queued, device=dev)

        t.score = timed_score
        rl.collect_batch = collect_batch

    def take(self) -> list[dict]:
        out, self.rounds = self.rounds, []
        return out

    def sampler_positions(self, rounds: list[dict]) -> dict[str, float]:
        """The sampler's positions computed and real tokens over ``rounds``: the prefill
        of b padded prompts (b bucketed as `gspo_jax.rollout.Sampler.batch_bucket` does)
        and ``min(longest response, T - 1)`` decode steps of b x G rows; real are the
        prompts' tokens and, per row, the decode steps it was running."""
        T = self.rl.cfg.rollout.max_new_tokens
        slots = real = 0.0
        for r in rounds:
            g = len(r["lengths"]) // r["prompts"]
            b = self.rl.t.sampler.batch_bucket(r["prompts"], g)
            steps = min(int(r["lengths"].max()), T - 1)
            slots += b * r["prompt_len"] + b * g * steps
            real += r["prompt_real"] / g + float(np.minimum(r["lengths"], steps).sum())
        return dict(sampler_tokens=slots, sampler_real=real)


def step_record(probe: Probe, s: int, m: dict, rounds: list[dict]) -> dict:
    """One measured step's figures (``m``: `RLPhase.step`'s metrics)."""
    rec = dict(
        step_time=m["step_time"],
        sample_time=m.get("sample_time", float("nan")),
        score_time=sum(r["seconds"] for r in rounds),
        prepare_time=m["old_logp_time"],
        update_time=m["update_time"],
        gen_tokens=float(m["gen_tokens"]),
        response_len=m["response_len"],
        train_tokens=m["computed_tokens"],
        train_real=m["computed_tokens"] * m["real_token_share"],
    )
    rec["collect_other_time"] = m["rollout_time"] - rec["sample_time"] - rec["score_time"]
    rec.update(probe.sampler_positions(rounds))
    if "logprob_computed_tokens" in m:
        rec["logprob_tokens"] = m["logprob_computed_tokens"]
        rec["logprob_real"] = m["logprob_computed_tokens"] * m["logprob_real_token_share"]
        if probe.rl.prepare_cfg.reference != "none":  # pi_ref's pass: the same shape
            rec["reference_tokens"], rec["reference_real"] = (
                rec["logprob_tokens"],
                rec["logprob_real"],
            )
    if s in probe.imposed:
        p, r = probe.imposed[s]
        rec.update(imposed_prompt=float(p.sum()), imposed_response=float(r.sum()))
        rec["step_tokens"] = rec["imposed_prompt"] + rec["imposed_response"]
    else:
        rec["step_tokens"] = sum(x["prompt_real"] for x in rounds) + rec["gen_tokens"]
    rec["tokens_per_s_per_device"] = rec["step_tokens"] / rec["step_time"] / jax.device_count()
    return rec


def run_variant(c, steps: int, *, lengths: str = "", seed: int = 0, flops: bool = False):
    """``steps`` measured RL steps of config ``c`` after a warm-up step. Returns (the
    per-step records, extras: the ``--flops`` figures and the run's shape)."""
    c.sft.steps = 0
    c.progress_bar = False
    c.total_rl_steps = steps + 1
    trainer = RunParts(c, tempfile.mkdtemp(prefix="bench_rl_"))
    rl = RLPhase(trainer, trainer.init_params)
    probe = Probe(rl, lengths, seed)
    records = []
    for s in range(steps + 1):
        probe.take()
        m, _ = rl.step(s)
        if s:  # step 0 compiles everything
            records.append(step_record(probe, s, m, probe.take()))
    extras = dict(
        devices=jax.device_count(),
        updates_per_step=rl.updates_per_step,
        reference_pass=rl.prepare_cfg.reference,
        train_packing=dataclasses.asdict(rl.shapes.train) if rl.shapes.train else None,
        logprob_packing=dataclasses.asdict(rl.shapes.logprob) if rl.shapes.logprob else None,
        micro_batches=rl.shapes.micro_batches,
        logprob_micro_batches=rl.shapes.logprob_micro_batches,
    )
    if flops:
        extras.update(flop_figures(rl, c, records))
    return records, extras


def flop_figures(rl: RLPhase, c, records) -> dict[str, float]:
    """The update's FLOPs from XLA's cost analysis of the compiled train step, the
    achieved rate against this run's dense f32 matmul peak, the objective's time."""
    from experiments.bench.bench_model import matmul_peak

    batch, _ = rl.prepare(rl.collect_batch(0, version=0), 0)
    mb = batch["tokens"].shape[0] // int(c.updates.num_minibatches)
    mini = {k: v[:mb] for k, v in batch.items()}
    cost = rl.train_fn.lower(rl.state, mini, jax.random.key(0)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    update_t = float(np.mean([r["update_time"] for r in records]))
    return dict(
        flops_per_update=float(cost["flops"]),
        achieved_flops=float(cost["flops"]) * rl.updates_per_step / update_t,
        matmul_peak=matmul_peak(),
        objective_ms=objective_ms(rl.step_cfg, mini),
        update_ms=update_t / rl.updates_per_step * 1e3,
    )


def summarize(records: list[dict]) -> dict[str, float]:
    """The mean of every figure over the measured steps, and the real shares."""
    keys = sorted({k for r in records for k in r})
    out = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}
    for p in ("sampler", "logprob", "reference", "train"):
        if f"{p}_tokens" in out:
            out[f"{p}_share"] = out[f"{p}_real"] / out[f"{p}_tokens"]
    return out


ROWS = [  # (label, key, format)
    ("tokens generated (sampler)", "gen_tokens", "{:,.0f}"),
    ("response length, sampled", "response_len", "{:.1f}"),
    ("prompt tokens imposed (--lengths)", "imposed_prompt", "{:,.0f}"),
    ("response tokens imposed (--lengths)", "imposed_response", "{:,.0f}"),
    ("sampler positions (prefill + decode steps x rows)", "sampler_tokens", "{:,.0f}"),
    ("  real share", "sampler_share", "{:.1%}"),
    ("old-log-prob pass positions", "logprob_tokens", "{:,.0f}"),
    ("  real share", "logprob_share", "{:.1%}"),
    ("reference pass positions", "reference_tokens", "{:,.0f}"),
    ("  real share", "reference_share", "{:.1%}"),
    ("train step positions (all updates)", "train_tokens", "{:,.0f}"),
    ("  real share", "train_share", "{:.1%}"),
    ("s sample", "sample_time", "{:.3f}"),
    ("s score", "score_time", "{:.3f}"),
    ("s rest of collecting", "collect_other_time", "{:.3f}"),
    ("s old/reference passes + advantages", "prepare_time", "{:.3f}"),
    ("s updates", "update_time", "{:.3f}"),
    ("s whole step", "step_time", "{:.3f}"),
    ("tokens processed (real prompt + response)", "step_tokens", "{:,.0f}"),
    ("tokens/s/device (NeMo-RL's measure)", "tokens_per_s_per_device", "{:,.0f}"),
]


def table(results: dict[str, dict]) -> str:
    """The variants' summaries side by side, as Markdown."""
    labels = list(results)
    lines = ["| per step | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for name, key, fmt in ROWS:
        cells = [results[v]["summary"].get(key) for v in labels]
        if all(x is None for x in cells):
            continue
        text = ["-" if x is None else fmt.format(x) for x in cells]
        lines.append(f"| {name} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--config",
        default="configs/default.py",
        help="a config file, optionally with its argument: configs/bench_rl_h200.py:layers=16",
    )
    ap.add_argument("--arg", default="", help="the default config's argument, e.g. objective=grpo")
    ap.add_argument("--data_dir", default="")
    ap.add_argument("--set", action="append", default=[], help="key=value, for every variant")
    ap.add_argument("--variant", action="append", default=[], help="LABEL:key=value,key=value")
    ap.add_argument(
        "--compare-padded",
        action="store_true",
        help="run the config and its padded twin (updates.packing=False), side by side",
    )
    ap.add_argument("--lengths", default="", choices=["", *sorted(lengths_lib.DISTRIBUTIONS)])
    ap.add_argument("--lengths-seed", type=int, default=0)
    ap.add_argument(
        "--flops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the update's FLOPs and the objective's time (--no-flops: skip their compiles)",
    )
    ap.add_argument("--json", default="", help="write every figure here")
    args = ap.parse_args(argv)

    variants = [parse_variant(v) for v in args.variant]
    if args.compare_padded:
        variants = variants or [("packed", [])]
        variants.append(("padded twin", ["updates.packing=False"]))
    variants = variants or [("as given", [])]
    results = {}
    for label, sets in variants:
        if args.config == "configs/default.py":
            c = default_config.get_config(args.arg)
        else:
            c = load_config(args.config)
        if args.data_dir:
            c.task.data_dir = args.data_dir
        apply_overrides(c, [*args.set, *sets])
        records, extras = run_variant(
            c,
            args.steps,
            lengths=args.lengths,
            seed=args.lengths_seed,
            flops=args.flops and not results,  # the first variant's
        )
        results[label] = dict(
            overrides=[*args.set, *sets],
            summary=summarize(records),
            steps=records,
            **extras,
        )
        gc.collect()  # the run's state and programs, before the next variant's
        jax.clear_caches()

    first = results[next(iter(results))]
    print(
        f"config: {args.config}:{args.arg}  prompts={c.rollout.prompts_per_step} "
        f"G={c.rollout.group_size} max_prompt_len={c.rollout.max_prompt_len} "
        f"max_new_tokens={c.rollout.max_new_tokens} updates/step={first['updates_per_step']} "
        f"devices={first['devices']}"
    )
    print(f"mean over {args.steps} steps after one warm-up step; variants: ")
    for label, r in results.items():
        print(
            f"  {label}: {' '.join(r['overrides']) or '(the config)'}; train packing "
            f"{r['train_packing']}, log-prob packing {r['logprob_packing']}, padded pieces "
            f"{r['micro_batches']}/{r['logprob_micro_batches']}, reference pass {r['reference_pass']}"
        )
    if args.lengths:
        print(
            f"lengths: '{args.lengths}' of experiments/bench/lengths.py imposed on the batches' "
            "prompt and response masks (the log-prob passes and the train step); the sampler's "
            "decode is the model's own, unchanged"
        )
    print()
    print(table(results))
    print()
    for label, r in results.items():
        s = r["summary"]
        print(
            f"tokens/s/device ({label}; the rollout's real prompt and response tokens over the "
            f"whole step, NeMo-RL's measure): {s['tokens_per_s_per_device']:.0f}"
        )
    if args.flops:
        f = first
        print(
            f"update: {f['flops_per_update'] / 1e9:.2f} GFLOP per mini-batch (XLA cost analysis), "
            f"{f['achieved_flops'] / 1e9:.1f} GFLOP/s achieved; dense f32 matmul peak in this run "
            f"{f['matmul_peak'] / 1e9:.1f} GFLOP/s -> {f['achieved_flops'] / f['matmul_peak']:.1%}; "
            f"objective alone {f['objective_ms']:.3f} ms, {f['objective_ms'] / f['update_ms']:.3%} "
            f"of one update ({f['update_ms']:.0f} ms)"
        )
    if args.json:
        record = dict(command=["python", "-m", "experiments.bench.bench_rl_step", *sys.argv[1:]])
        if argv is not None:
            record["command"] = ["python", "-m", "experiments.bench.bench_rl_step", *argv]
        record.update(config=args.config, arg=args.arg, lengths=args.lengths, variants=results)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=float)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
