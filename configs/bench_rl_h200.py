r"""One whole RL step at a realistic rollout on one GPU, for `experiments/bench/bench_rl_step.py`.

The benchmark model of `experiments/programs.py` (``--size h200``): Qwen3-MoE-shaped,
d_model 2048, 32/4 heads of 128 with q/k norm, 64 experts of 768 top-8, a 151,936-entry
vocabulary (rows past the character tokenizer's are padding, never sampled), f32
parameters and bf16 compute, 8 layers by default; randomly initialised, so responses
run to ``max_new_tokens`` unless the end token happens to be drawn. The rollout: 64
prompts x 8 samples, 1,024 new tokens, 4 mini-batches of 128 rows in micro-batches of 32
rows' tokens (the train step's shape of the accelerator benchmark; packed, or padded with
``--config.updates.packing=False``), no warm start, no evaluation, no checkpoints.

    python -m experiments.bench.bench_rl_step --config configs/bench_rl_h200.py --steps 3
    python -m experiments.bench.bench_rl_step --config configs/bench_rl_h200.py:layers=16
    python -m experiments.bench.bench_rl_step --config configs/bench_rl_h200.py:tiny   # CPU

Arguments: ``layers=<n>``; ``tiny`` shrinks the model and the rollout to run on a CPU
in seconds (the same code path, for the tests); ``smoke`` as every config has it.
"""

import dataclasses

from configs import default
from experiments.programs import SIZES
from gspo_jax import config as config_lib
from gspo_jax.models.config import ModelConfig


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("layers", "tiny", "smoke"))
    c = default.get_config()
    c.sft.steps = 0
    c.eval_every = 10**6
    c.checkpoint_every = 10**6
    c.progress_bar = False
    # The accelerator benchmark's model (experiments/programs.py), its runtime settings
    # (dtypes, remat, logits chunk, block size) where the config keeps them.
    model = dict(SIZES["tiny" if args.get("tiny") else "h200"]["model"])
    for key in config_lib.MODEL_RUNTIME_FIELDS:
        if key in model:
            c.model[key] = model.pop(key)
    c.model.moe_backend = "auto"
    if "layers" in args:
        model["num_layers"] = int(args["layers"])
    elif not args.get("tiny"):
        model["num_layers"] = 8
    # Every field the default config declares, at ModelConfig's default where the
    # benchmark's model does not set it, so that each can be overridden on the command line.
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(ModelConfig)
        if f.name in c.model.fields and f.default is not dataclasses.MISSING
    }
    c.model.fields = {**defaults, **model}
    c.rollout.prompts_per_step = 64
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 1024
    c.updates.num_minibatches = 4
    if args.get("tiny"):
        # 32 rows: mini-batches of 8, one row per device on 8 (the tests' fake devices).
        c.rollout.prompts_per_step = 8
        c.rollout.group_size = 4
        c.rollout.max_new_tokens = 16
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    # Micro-batches (and log-prob pieces) of 32 rows' tokens: packed buffer rows, or with
    # --config.updates.packing=False the padded twin's 32 rows (4 per mini-batch of 128).
    seq = c.rollout.max_prompt_len + c.rollout.max_new_tokens - 1
    c.updates.micro_batch_tokens = 32 * seq
    c.updates.micro_batches = c.updates.logprob_micro_batches = 1
    return c
