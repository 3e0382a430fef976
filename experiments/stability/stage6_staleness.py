"""Stage 6 of the stability study: staleness (experiments/stability/README.md).

GRPO at stage 2's lr 3e-4 with 16 updates per rollout, each RL step training on the
batch the policy of k steps before sampled (``rollout.staleness`` = k, docs/offpolicy.md),
k in {0, 1, 2, 4, 8}, under two trust regions: the clip around the sampler's policy
(``behaviour``, AReaL's naive PPO) and the clip around the proximal policy with the
behaviour weight truncated at 2 (``decoupled_tis``, AReaL's decoupled loss), each
with and without R3 on the MoE; moe2 and its dense twin, 3 seeds, 60 RL steps, from the
same warm starts as every stage (the arms: `stage6_config`). Each run resumes from its
own checkpoints in ``<root>/<config name>/<name>`` (``stage6``, or ``stage6_small_steps``
for control C1); its compact summary goes to ``<out>/runs/<name>.jsonl`` (``--out``,
by default ``results/<config name>``) when it finishes, and a run with a summary is skipped.

    taskset -c 0 python -m experiments.stability.stage6_staleness --root runs/stability \
        --only-arms moe2 --max-minutes 55                               # beside dense2
    taskset -c 1 python -m experiments.stability.stage6_staleness --root runs/stability \
        --only-arms dense2 --max-minutes 55
    python -m experiments.stability.stage6_staleness --report
    python -m experiments.stability.stage6_staleness --root runs/stability --resummarize
    python -m experiments.stability.stage6_staleness --root runs/stability \
        --config experiments/stability/stage6_config.py:small_steps     # control C1
"""

from __future__ import annotations

import os

from experiments.stability import common, stage6_report
from experiments.stability.stage6_report import arm_table


def out_dir(sc) -> str:
    """The committed results of the config's grid: ``results/<sc.name>``."""
    return os.path.join(common.RESULTS, sc.name)


def runs_cell(sc, arm: str, variant: str, k: int) -> bool:
    """Whether the grid has a run of ``variant`` on architecture ``arm`` at staleness
    ``k``: replay only on the MoE; at k = 0 only the decoupled arms."""
    trust_region, _, replay = arm_table(sc)[variant]
    if replay != "none" and not common.is_moe(arm):
        return False
    return int(k) > 0 or trust_region == "decoupled"


def overrides(sc, variant: str, k: int) -> dict:
    """The config overrides of one run: stage 2's GRPO (0.2/0.28, no KL) at ``sc.lr``,
    ``sc.updates`` updates per rollout, staleness ``k`` and the arm's trust region,
    rollout correction (token TIS truncated at ``sc.tis_cap``) and routing replay."""
    table = arm_table(sc)
    if variant not in table:
        raise ValueError(f"variant {variant!r}: expected one of {sorted(table)}")
    trust_region, mode, replay = table[variant]
    lo, hi = sc.grpo_eps
    out = {
        "objective": (
            "grpo",
            {"eps_low": float(lo), "eps_high": float(hi), "kl_coef": float(sc.kl_coef)},
        ),
        "optimizer.lr": float(sc.lr),
        "updates.num_minibatches": int(sc.updates),
        "rollout.staleness": int(k),
        "updates.trust_region": trust_region,
        "rollout_correction.mode": mode,
        "updates.routing_replay": replay,
    }
    if mode == "token_tis":
        # token_tis truncates at rollout_correction.cap (c_low/c_high are the mask
        # modes' bounds: gspo_jax/objectives/correction.py).
        out["rollout_correction.cap"] = float(sc.tis_cap)
    return out


def run_name(arm: str, variant: str, k: int, seed: int) -> str:
    return f"{arm}_{variant}_k{int(k)}_s{seed}"


def staleness_order(stalenesses) -> list[int]:
    """The order the stalenesses run in: k = 0 and the largest k first, then the rest
    from large to small (0, 8, 4, 2, 1), so that a chunk that stops early leaves the
    ends of the curve, which the rules read, done."""
    ks = sorted({int(k) for k in stalenesses})
    return [k for k in ks if k == 0] + sorted((k for k in ks if k > 0), reverse=True)


def grid(sc):
    """The grid's runs in the order they run: staleness by `staleness_order`; within a
    k, seed by seed, then architecture (``sc.arms``' order, moe2 before dense2), then
    arm in the table's order."""
    table = arm_table(sc)
    for k in staleness_order(sc.stalenesses):
        for seed in sc.seeds:
            for arm in sc.arms:
                for variant in sc.variants:
                    if not runs_cell(sc, arm, variant, k):
                        continue
                    trust_region, mode, replay = table[variant]
                    meta = dict(
                        arm=arm,
                        variant=variant,
                        staleness=int(k),
                        trust_region=trust_region,
                        correction=mode,
                        tis_cap=float(sc.tis_cap) if mode == "token_tis" else None,
                        replay=replay,
                        lr=float(sc.lr),
                        seed=int(seed),
                        updates=int(sc.updates),
                        steps=int(sc.steps),
                        task=sc.task,
                    )
                    yield common.GridRun(
                        run_name(arm, variant, k, int(seed)),
                        arm,
                        int(seed),
                        overrides(sc, variant, k),
                        int(sc.steps),
                        meta,
                        sc.task,
                    )


def describe(summary: dict) -> str:
    """A finished run in one line: its staleness, behaviour KL, collapse and held-out
    reward."""
    kl = stage6_report.run_mean(summary, "behaviour_kl")
    stale = stage6_report.run_mean(summary, "staleness_mean")
    return f"staleness_mean {stale:.3g}, behaviour_kl {kl:.3g}, {common.collapse_line(summary)}"


def run_all(sc, root: str, out: str, budget: common.Budget, log=print) -> int:
    """Every run of the grid without a summary in ``<out>/runs``, until the budget
    expires. Returns the number of runs done."""
    return common.run_grid(
        grid(sc),
        root,
        sc.name,
        os.path.join(out, "runs"),
        budget,
        smoke=sc.smoke,
        check=common.same_setting,
        describe=describe,
        log=log,
    )


def main(argv=None) -> None:
    only = ("arms", "seeds", "stalenesses")
    ap = common.stage_parser(__doc__, None, "stage6_config.py", only)
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="rewrite the finished runs' summaries from their logs under --root, adding "
        "series added to common.SERIES since (nothing that they hold may change)",
    )
    args = ap.parse_args(argv)
    sc = common.stage_config(args, only)
    out = args.out or out_dir(sc)
    if args.resummarize:
        n = common.resummarize(grid(sc), args.root, sc.name, os.path.join(out, "runs"))
        print(f"stage 6: {n} summaries rewritten in {out}")
        return
    if args.report:
        stage6_report.report(out, sc)
        return
    n = run_all(sc, args.root, out, common.Budget(args.max_minutes))
    print(f"stage 6: {n} runs finished into {out}")


if __name__ == "__main__":
    main()
