r"""One whole RL step at a realistic rollout on one GPU, for `experiments/bench_rl_step.py`.

The benchmark model of `experiments/programs.py` (``--size h200``): Qwen3-MoE-shaped,
d_model 2048, 32/4 heads of 128 with q/k norm, 64 experts of 768 top-8, a 151,936-entry
vocabulary (rows past the character tokenizer's are padding, never sampled), f32
parameters and bf16 compute, 8 layers by default; randomly initialised, so responses
run to ``max_new_tokens`` unless the end token happens to be drawn. The rollout: 64
prompts x 8 samples, 1,024 new tokens, 4 mini-batches of 128 rows in micro-batches of 32
(the train step's shape of the accelerator benchmark), no warm start, no evaluation, no
checkpoints.

    python experiments/bench_rl_step.py --config configs/bench_rl_h200.py --steps 3
    python experiments/bench_rl_step.py --config configs/bench_rl_h200.py:layers=16
    python experiments/bench_rl_step.py --config configs/bench_rl_h200.py:tiny   # CPU

Arguments: ``layers=<n>``; ``tiny`` shrinks the model and the rollout to run on a CPU
in seconds (the same code path, for the tests); ``smoke`` as every config has it.
"""

from configs import default
from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("layers", "tiny", "smoke"))
    c = default.get_config()
    c.sft.steps = 0
    c.eval_every = 10**6
    c.checkpoint_every = 10**6
    c.progress_bar = False
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.moe_backend = "auto"
    c.model.moe_block_size = 512
    c.model.remat_policy = "dots_no_scores"
    c.model.logits_chunk_size = 512
    c.model.fields = dict(
        vocab_size=151_936,
        d_model=2048,
        num_layers=int(args.get("layers", 8)),
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        moe_d_ff=768,
        num_experts=64,
        top_k=8,
        qk_norm=True,
        tie_embeddings=False,
    )
    c.rollout.prompts_per_step = 64
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 1024
    c.updates.num_minibatches = 4
    c.updates.micro_batches = 4
    c.updates.logprob_micro_batches = 4
    if args.get("tiny"):
        c.model.dtype = "float32"
        c.model.logits_chunk_size = 16
        c.model.fields = dict(
            c.model.fields,
            vocab_size=512,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            d_ff=128,
            moe_d_ff=32,
            num_experts=8,
            top_k=2,
        )
        # 32 rows: mini-batches of 8, one row per device on 8 (the tests' fake devices).
        c.rollout.prompts_per_step = 8
        c.rollout.group_size = 4
        c.rollout.max_new_tokens = 16
        c.updates.micro_batches = 1
    if args.get("smoke"):
        config_lib.apply_smoke(c)
        c.updates.logprob_micro_batches = 1
    return c
