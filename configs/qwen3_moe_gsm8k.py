r"""GSM8K with a Qwen3-MoE checkpoint (Qwen3-30B-A3B's architecture), for GPUs and TPUs.

    python -m gspo_jax.train \
        --config=configs/qwen3_moe_gsm8k.py:ckpt=/path/to/Qwen3-30B-A3B,gsm8k_files=/path/to/gsm8k \
        --workdir=runs/qwen3_gsm8k

The checkpoint directory holds config.json, *.safetensors and tokenizer.json
(with the chat template in tokenizer_config.json); it is loaded with
``gspo_jax.models.from_pretrained``. ``gsm8k_files`` is a folder with the GSM8K
jsonl files where TFDS cannot download them (omit it where it can).

Arguments: ``ckpt`` (required), ``gsm8k_files``, ``objective`` (default gspo,
with the paper's clip range for long responses), ``replay`` (none | R2 | R3),
``smoke``, ``lora`` (rank-16 LoRA on attention and every expert, the routers frozen,
base frozen in bf16: docs/lora.md). The mesh shards parameters over fsdp (all devices) and experts over
``expert``; change ``--config.mesh.*`` for a pod, e.g. data=4, fsdp=-1, expert=8.

Memory (docs/memory.md, compiled for the devices by ``python -m
experiments.compile_report --size flagship``): sized for one node of 8x H100 80GB, where
f32 parameters and AdamW moments with one f32 gradient take 56.9 GiB of each GPU. Hence
no gradient accumulation (``micro_batches=1``: an accumulator would add 14.2 GiB), 16
prompts x 8 samples in 4 mini-batches (4 rows of P + T - 1 = 1407 tokens per GPU per
update), remat 'full', logits in chunks of 128 positions, cuDNN flash attention, 128
held-out prompts, the 'blocked' dispatch in blocks of 512 rows and Adam's first moment
in bf16: the train step's compiled peak is 63.3 of the 75.2 GiB of an H100 that XLA may
take at ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` (the trainer sets it), 70.4 with an f32
first moment. The 'ragged' dispatch does not fit (XLA's GPU lowering of ``ragged_dot``
computes every expert: 166 GiB per GPU) and does not compile for a TPU with the rows
split over devices. A KL term (``objective=grpo``) adds a 7.1 GiB reference copy: it
does not fit one node. On TPU the attention is XLA's; a v5p-8 (4 chips) cannot hold the
f32 state (114 GiB per chip), a v5p-16 (8 chips) runs this config (76.2 GiB per chip
with an f32 first moment, of 90.2).
"""

from gspo_jax import config as config_lib

LORA = dict(
    rank=16,
    alpha=32.0,
    targets=("q", "k", "v", "o", "expert_gate", "expert_up", "expert_down"),
    train_router=False,
)

PAPER_EPS = {
    "gspo": dict(eps_low=3e-4, eps_high=4e-4),
    "gspo_token": dict(eps_low=3e-4, eps_high=4e-4),
}


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(
        arg, known=("ckpt", "gsm8k_files", "objective", "replay", "smoke", "lora")
    )
    if not args.get("ckpt") or args["ckpt"] is True:
        raise config_lib.ConfigError(
            "configs/qwen3_moe_gsm8k.py: the argument ckpt=<Hugging Face "
            "checkpoint directory> is required"
        )
    c = config_lib.base_config()
    c.task.name = "gsm8k"
    c.task.difficulty = ""
    c.task.gsm8k_files = args.get("gsm8k_files", "")
    c.task.style = "instruct"
    c.task.eval_size = 128  # x 4 samples at once: a 8.2 GiB KV cache per GPU
    c.task.format_reward = 0.1
    c.model.pretrained = args["ckpt"]
    c.tokenizer = c.model.pretrained  # tokenizer.json beside the weights
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    # Each block of 512 rows gathers its expert's weights once (docs/memory.md). 'ragged'
    # ('auto' on a GPU) reads them in place, but compiles to 73.6 GiB per H100 here
    # against blocked's 70.4 with the same f32 moments: FSDP's f32 copies of the stacked
    # expert weights, which both make, hold its peak (docs/moe.md).
    c.model.moe_backend = "blocked"
    c.model.moe_block_size = 512
    c.model.remat_policy = "full"  # keeps 4 KiB per token per layer (docs/memory.md)
    c.model.attention_impl = "auto"  # cuDNN flash attention on GPU, XLA elsewhere
    c.model.logits_chunk_size = 128  # [rows, 128, 151936] f32 logits at a time
    c.mesh = dict(data=1, fsdp=-1, expert=1, tensor=1)

    name = args.get("objective", "gspo")
    config_lib.set_objective(c, name, PAPER_EPS.get(name, {}))
    c.updates.routing_replay = args.get("replay", "none")
    c.rollout.prompts_per_step = 16
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 1024
    # GSM8K's longest question is 985 characters (train; 848 test): about 250 tokens,
    # plus the instruction and the chat template; 384 holds every one, in one shape.
    c.rollout.max_prompt_len = 384
    c.updates.num_minibatches = 4
    c.updates.micro_batches = 1
    # Packed, in one micro-batch of the mini-batch's 32 buffer rows: no saving. A token
    # budget (updates.micro_batch_tokens = 8 * 1407) computes only the micro-batches the
    # real tokens fill (GSM8K-like lengths, experiments/bench/lengths.py: 2 of 4, 57% of
    # the positions real against 28% padded), but accumulates the gradient over them:
    # the 14.2 GiB accumulator above, which an H100 node does not have (an H200 node does).
    c.optimizer.lr = 1e-6
    c.optimizer.warmup_steps = 10
    c.optimizer.weight_decay = 0.01
    c.optimizer.mu_dtype = "bfloat16"  # 7.1 GiB less per GPU; v and the weights stay f32
    c.sft.steps = 0  # the checkpoint is already an instruction model
    c.total_rl_steps = 500
    c.eval_every = 20
    c.checkpoint_every = 20
    if args.get("lora"):
        # The base frozen in bf16 (the compute dtype), adapters and their moments in
        # f32: a KL term's reference is the base itself (no copy), so objective=grpo
        # fits as well.
        c.lora.update(LORA)
        c.optimizer.lr = 1e-5  # 10x full fine-tuning's, as LoRA usually takes
        c.optimizer.mu_dtype = "float32"  # the adapters' moments are small
    if args.get("smoke"):
        config_lib.apply_smoke(c)
    return c
