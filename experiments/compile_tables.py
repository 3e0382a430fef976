"""Markdown tables of committed compile reports (`experiments/compile_report.py --json`):
peak memory per program before and after a change, at every layer count, the report
beside what the H200 itself recorded, and the LoRA train steps beside full fine-tuning
(``lora_*.json``).

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


if __name__ == "__main__":
    main()
