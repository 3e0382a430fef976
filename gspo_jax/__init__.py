"""gspo_jax: reinforcement learning of language models in JAX/Flax.

Modules:
  objectives  -- every policy objective (PPO, GRPO, Dr.GRPO, DAPO, GSPO,
                 GSPO-token, CISPO, GMPO, RSPO, SAPO) as pure jit-able functions.
  advantages  -- group / RLOO / GAE advantage estimators (vmap-ed over groups).
  shaping     -- DAPO's data-side techniques.
  routing     -- RSPO's router shift and MoE routing diagnostics.
  models      -- Flax NNX decoder transformer with MoE layers, HF checkpoints.
  rollout     -- jit-compiled batched sampler with a KV cache.
  train       -- the RL trainer (the main job).
"""

__version__ = "0.1.0"
