"""Markdown tables of committed compile reports (`experiments/compile_report.py --json`):
peak memory per program before and after a change, at every layer count, the report
beside what the H200 itself recorded, the LoRA train steps beside full fine-tuning
(``lora_*.json``), and the packed train step and log-prob pass beside the padded ones
(``packed_*.json``).

    python -m experiments.compile_tables experiments/accelerator/compile
"""

from __future__ import annotations

import argparse
import glob
import json
import os

# What the H200 of this project recorded (experiments/accelerator.md, 2026-11-24, jax
# 0.11.2, the code of that day): (program, layers, batch) -> (XLA's compiled estimate on
# the device, the runtime's peak or what the failed allocation asked for), GiB.
H200_RECORDED = {
    ("train", 8, 32): (94.15, 94.17),
    ("logprob", 8, 32): (87.95, None),
    ("train", 12, 32): (None, 108.2),  # out of memory: what XLA's rematerialization reached
    ("train", 16, 32): (None, 133.8),  # out of memory
    ("sampler", 12, 1024): (None, 154.0),  # out of memory: what XLA asked for
}


def load(folder: str, which: str) -> dict[tuple, dict]:
    rows = {}
    for path in sorted(glob.glob(os.path.join(folder, f"{which}_*.json"))):
        for r in json.load(open(path))["rows"]:
            rows[(r["part"], r["layers"], r["batch"])] = r
    return rows


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    m = r["memory"]
    flag = " **no**" if m["fraction_of_usable"] > 0.9 else ""
    return f"{m['peak_gib']:.1f} ({100 * m['fraction_of_usable']:.0f}%){flag}"


def before_after(folder: str) -> str:
    before, after = load(folder, "before"), load(folder, "after")
    keys = sorted(
        {(p, b) for p, _, b in list(before) + list(after)},
        key=lambda k: (["train", "logprob", "prefill", "decode", "sampler"].index(k[0]), k[1]),
    )
    layers = sorted({L for _, L, _ in list(before) + list(after)})
    head = "| program | batch | " + " | ".join(f"{L} layers before | after" for L in layers)
    lines = [head + " |", "|---|---:|" + "---:|---:|" * len(layers)]
    for p, b in keys:
        cells = []
        for L in layers:
            cells += [_cell(before.get((p, L, b))), _cell(after.get((p, L, b)))]
        lines.append(f"| {p} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against_h200(folder: str) -> str:
    before = load(folder, "before")
    lines = [
        "| program | layers | batch | report (jax 0.12.0.1, before) | H200: XLA's estimate | "
        "H200: runtime peak or failed request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (p, L, b), (est, run) in H200_RECORDED.items():
        r = before.get((p, L, b))
        rep = f"{r['memory']['peak_gib']:.2f}" if r else "not compiled"
        lines.append(
            f"| {p} | {L} | {b} | {rep} | {'' if est is None else est} | "
            f"{'' if run is None else run} |"
        )
    return "\n".join(lines)


def _gib(r: dict, *kinds: str) -> str:
    return f"{sum(r['peak_by_kind_gib'].get(k, 0.0) for k in kinds):.2f}"


def lora_table(folder: str) -> str:
    """The train steps of ``lora_*.json``, per target: peak, and what it holds by kind
    (arguments, and XLA's heap slots by their largest array)."""
    lines = [
        "| target | dispatch | trains | peak GiB (% of usable) | parameters (of them adapters) | "
        "optimizer state | gradients | weights in compute dtype | activations, logits, "
        "dispatch copies |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in sorted(glob.glob(os.path.join(folder, "lora_*.json"))):
        for r in json.load(open(path))["rows"]:
            if r["part"] != "train":
                continue
            lo, m = r.get("lora"), r["memory"]
            trains = (
                f"LoRA r{lo['rank']} ({lo['trainable']})"
                if lo
                else f"all (Adam's first moment {r['mu_dtype']})"
            )
            flag = " **no**" if m["fraction_of_usable"] > 0.9 else ""
            backend = {"auto": "auto (ragged)"}.get(r["moe_backend"], r["moe_backend"]) + (
                f" {r['moe_block_size']}" if r["moe_backend"] == "blocked" else ""
            )
            lines.append(
                f"| {r['device']} x{r['devices']}, {r['layers']} layers | {backend} | {trains} | "
                f"{m['peak_gib']:.2f} ({100 * m['fraction_of_usable']:.0f}%){flag} | "
                f"{_gib(r, 'parameter', 'adapter')} ({_gib(r, 'adapter')}) | "
                f"{_gib(r, 'optimizer state')} | {_gib(r, 'gradient')} | "
                f"{_gib(r, 'weights in compute dtype')} | "
                f"{_gib(r, 'activation / other', 'logits', 'dispatch copy of expert weights')} |"
            )
    return "\n".join(lines)


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def packed_table(rows: list[dict], lengths: dict) -> str:
    """The train and log-prob rows of a report with their figures at sampled lengths
    (`experiments.compile_report.token_figures`), padded and packed side by side."""
    s = lengths
    lines = [
        f"{s['rows']} rows at lengths from {s['source']} (seed {s['seed']}): prompts "
        f"{s['prompt_mean']:.0f} tokens on average, responses {s['response_mean']:.0f} "
        f"({100 * s['response_at_max']:.1f}% at the maximum); {s['real_tokens']:,} real "
        "input positions\n",
        "| program | rows | micro-batch | micro-batches used | peak GiB | TFLOP per "
        "micro-batch | real-token share | GFLOP per real token | model's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, used = r["tokens"], r["tokens"]["micro_batches_used"]
        lines.append(
            f"| {r['part']} | {r['batch']} | {' x '.join(map(str, t['micro_batch']))} | "
            f"{', '.join(map(str, used)) if len(set(used)) > 1 else used[0]} | "
            f"{r['memory']['peak_gib']:.2f} | {_num(t['tflop_per_micro_batch'], ',.2f')} | "
            f"{100 * t['real_share']:.1f}% | {_num(t['gflop_per_real_token'], ',.2f')} | "
            f"{t['gflop_per_real_token_model']:,.2f} |"
        )
    lines.append(
        "\nmicro-batches used: per call (the train step's per mini-batch of the batch); peak "
        "GiB: per device; "
        "TFLOP and GFLOP: the compiled program's matmuls over all devices; model's: the "
        "model's FLOPs per position computed (6 x active parameters in a train step, 2 x "
        "in a forward) times the positions computed, per real token"
    )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    args = ap.parse_args(argv)
    print(
        "Peak GiB on one H200 (% of the 133.9 GiB usable at a memory fraction of 0.95; "
        "**no**: above the 90% budget)\n"
    )
    print(before_after(args.folder))
    print("\nThe report beside the H200's own figures\n")
    print(against_h200(args.folder))
    print("\nThe train step with LoRA beside full fine-tuning (GiB per device)\n")
    print(lora_table(args.folder))
    for path in sorted(glob.glob(os.path.join(args.folder, "packed_*.json"))):
        report = json.load(open(path))
        rows = [r for r in report["rows"] if "tokens" in r]
        if not rows:
            continue
        r = rows[0]
        print(
            f"\nPadded against packed, {r['device']} x{r['devices']}, {r['layers']} layers ", end=""
        )
        print(f"({os.path.basename(path)})\n")
        print(packed_table(rows, report["lengths"]))


if __name__ == "__main__":
    main()
