"""Stage 3, replay and the router-aware objectives: the setting and the arms
(experiments/stability/README.md, "Stage 3").

The setting's learning rate is chosen from stage 2's results by the README's "Setting"
rule and must be given here (``lr=``); GSPO's range is stage 1's calibrated one
(``results/stage1/calibration.json``, written by ``stage1_probes.py --report``). Neither
is ever chosen by hand.

    python -m experiments.stability.stage3_replay --root runs/stability \
        --config experiments/stability/stage3_config.py:lr=0.003     # moe2, 16 updates
    python -m experiments.stability.stage3_replay --root runs/stability \
        --config experiments/stability/stage3_config.py:lr=0.003,arm=moe4,dense_arm=dense4
    python -m experiments.stability.stage3_replay --root runs/stability \
        --config experiments/stability/stage3_config.py:lr=0.003,task=hard
    python -m experiments.stability.stage3_replay --root /tmp/s3 \
        --config experiments/stability/stage3_config.py:smoke          # seconds

Arguments (comma-separated): ``lr`` (required outside smoke), ``arm`` / ``dense_arm``
(the setting's MoE and its dense twin, default moe2 / dense2; the README's fallbacks
moe4 / dense4 and moe2k1 / dense2), ``updates`` (optimizer updates per rollout, default
16; the fallback 32), ``task`` (``small``, the default, or the last fallback's ``hard``:
Countdown ``hard`` with responses up to 48 characters, common.TASKS), ``scale``
(``cpu``, the default, or ``gpu``: the replication, `GPU_ARMS` on ``moe12e64`` and
``dense12`` in bf16 on ``hard``; results in ``results/stage3_gpu``), ``smoke``.
"""

import json
import os

import ml_collections

CALIBRATION = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "stage1", "calibration.json"
)

GRPO_EPS = (0.2, 0.28)
PAPER_GSPO_EPS = (3e-4, 4e-4)

# The arms (README, "Arms"): name -> (objective, replay, RSPO's gamma floor or None).
# Hyperparameters are filled in by `arm_table` (GSPO's range is the calibrated one).
ARMS = (
    ("grpo", "grpo", "none", None),
    ("grpo_r2", "grpo", "R2", None),
    ("grpo_r3", "grpo", "R3", None),
    ("gspo", "gspo", "none", None),
    ("gmpo", "gmpo", "none", None),
    ("rspo_g0.5", "rspo", "none", 0.5),
    ("rspo_g0.1", "rspo", "none", 0.1),
    ("sapo", "sapo", "none", None),
)
# Not arms of the README's rule, run on request (``--only-arms grpo_dense``): objectives
# on the setting's dense twin. GRPO there is the reference; GMPO there is the control
# added for the shared-collapse setting (README, Stage 3, "Dense GMPO"), read against
# that reference. The report shows each one present.
DENSE_REFERENCE = "grpo_dense"
DENSE_ARMS = {DENSE_REFERENCE: "grpo", "gmpo_dense": "gmpo"}  # name -> objective
# The KL-matched controls (README, Stage 3, "The KL-matched GRPO control" and "... GSPO
# control"), also run on request: an objective on the MoE at the lr whose first-rollout
# KL matches another arm's (`stage3_replay.kl_matched_lr`, on stage 2's grid of that
# objective). GRPO matched to GMPO is read against the arms that prevented the collapse;
# GSPO matched to GRPO against GRPO, by the stage's rule.
KL_MATCHED = {  # name -> (objective, the arm whose first step it matches)
    "grpo_kl_matched": ("grpo", "gmpo"),
    "gspo_kl_matched": ("gspo", "grpo"),
    "sapo_kl_matched": ("sapo", "grpo"),
}
# The one-step lr grid of an objective stage 2 did not run (README, "The KL-matched SAPO
# control"): its first rollout's updates at these lrs and seeds (`--kl-grid`).
KL_GRID_LRS = (1e-4, 3e-4, 1e-3)
KL_GRID_SEEDS = (0, 1, 2)

# ``scale=gpu``: the replication on an accelerator (README, "GPU replication"): 12
# layers with 64 experts (``moe12e64``) and its dense twin, bf16 compute, Countdown
# ``hard`` (longer responses), 3 seeds, the key comparison of stage 3's arms.
SCALES = ("cpu", "gpu")
GPU_ARMS = ("grpo", "grpo_r3", "gspo", "rspo_g0.5", DENSE_REFERENCE)


def load_calibration(path: str | None = None) -> tuple[float, float]:
    """GSPO's calibrated (eps_low*, eps_high*) from stage 1 (README, stage 1 rule 3)."""
    path = path or CALIBRATION
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: missing. Stage 3 runs GSPO at the range calibrated in stage 1 (rule 3); "
            "stage 1's report makes this file: "
            "`python -m experiments.stability.stage1_probes --report`"
        )
    with open(path) as f:
        calib = json.load(f)
    if not calib.get("eps_low") or not calib.get("eps_high"):
        raise ValueError(
            f"{path}: stage 1 found no calibrated GSPO range ({calib.get('note', 'no eps_low')}); "
            "stage 3 cannot run GSPO at ε* (README, stage 1 rule 3)"
        )
    return float(calib["eps_low"]), float(calib["eps_high"])


def arm_table(gspo_eps) -> tuple:
    """Rows (name, objective, hparams as (key, value) pairs, replay, gamma_min or None)."""
    grpo = (("eps_low", GRPO_EPS[0]), ("eps_high", GRPO_EPS[1]), ("kl_coef", 0.0))
    hparams = {
        "grpo": grpo,
        "gspo": (("eps_low", float(gspo_eps[0])), ("eps_high", float(gspo_eps[1]))),
        "gmpo": (),
        "rspo": (),
        "sapo": (),
    }
    rows = tuple((name, obj, hparams[obj], replay, gamma) for name, obj, replay, gamma in ARMS)
    dense = tuple((name, obj, hparams[obj], "none", None) for name, obj in DENSE_ARMS.items())
    matched = tuple(
        (name, obj, hparams[obj], "none", None) for name, (obj, _) in KL_MATCHED.items()
    )
    return rows + dense + matched


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    from experiments.stability import common
    from gspo_jax import config as config_lib

    args = config_lib.parse_arg(
        arg, known=("smoke", "lr", "arm", "dense_arm", "updates", "task", "scale")
    )
    c = ml_collections.ConfigDict()
    c.smoke = bool(args.get("smoke", False))
    c.scale = str(args.get("scale", "cpu"))
    if c.scale not in SCALES:
        raise ValueError(f"stage3_config: scale={c.scale!r}; expected one of {', '.join(SCALES)}")
    gpu = c.scale == "gpu"
    # The setting (README, "Setting"): the MoE arm and its dense twin, the learning rate
    # chosen from stage 2, updates per rollout; the first setting that qualifies.
    if not gpu:
        arm, dense = "moe2", "dense2"
    elif c.smoke:  # the replication's plumbing (bf16, task, arms) on a model CPU runs fast
        arm, dense = "moe2e8", "dense2"
    else:
        arm, dense = "moe12e64", "dense12"
    c.arm = str(args.get("arm", arm))
    c.dense_arm = str(args.get("dense_arm", dense))
    c.lr = float(args["lr"]) if "lr" in args else None
    c.updates = int(args.get("updates", 16))
    c.task = common.check_task(str(args.get("task", "hard" if gpu else "small")))
    c.dtype = "bfloat16" if gpu else "float32"  # the compute dtype (model.dtype)
    c.steps = 80
    c.seeds = (0, 1, 2) if gpu else (0, 1, 2, 3, 4)
    c.arms = GPU_ARMS if gpu else tuple(row[0] for row in ARMS)
    if c.smoke:
        c.arms = ("grpo", DENSE_REFERENCE) if gpu else ("grpo", "grpo_r3", "rspo_g0.5")
        c.seeds = (0,)
        c.steps = 2
        c.updates = int(args.get("updates", 2))
        c.lr = float(args.get("lr", 1e-3))
        gspo_eps = PAPER_GSPO_EPS
    else:
        gspo_eps = load_calibration()
    c.gspo_eps = gspo_eps
    c.table = arm_table(gspo_eps)
    return c
