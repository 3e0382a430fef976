"""Decoder-only MoE transformer in Flax NNX, with exposed routing and HF checkpoints.

    from gspo_jax.models import ModelConfig, Transformer
    model = Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    logits, aux = model(tokens, positions=None, attn_mask=None, replay=None)
    logp, entropy, aux = model.token_logprobs(tokens, targets, chunk_size=128)
    cache = model.init_cache(batch_size, max_len)
    logits, aux, cache = model.decode(tokens, cache, positions=positions, attn_mask=mask)

Modules: config (ModelConfig), layers (norm, RoPE, attention, MLP), moe (router,
replay, the MoE layer and its routing record), dispatch (the MoE dispatch backends:
dense, ragged, blocked), expert_parallel (the ragged dispatch on a mesh), blocks
(the decoder layer, segments of stacked repeats, remat policies), precision (f32
parameters, the output head, the inference copy), transformer (Transformer,
RouterAux, KVCache, sharded init), sharding (logical axis rules -> mesh, the run's
mesh), the Hugging Face checkpoints in hf_layout (config.json and tensor names <->
ours), hf_load (from_pretrained) and hf_export (export_pretrained, export_peft),
hf_peft (LoRA adapters in PEFT's format: the layout, load_peft), safetensors_io
(pickle-free tensor files).
"""

from gspo_jax.models.config import ModelConfig
from gspo_jax.models.hf_export import export_peft, export_pretrained
from gspo_jax.models.hf_load import from_pretrained
from gspo_jax.models.hf_peft import PeftLora, load_peft, read_peft_config
from gspo_jax.models.sharding import logical_to_mesh_spec, param_shardings
from gspo_jax.models.transformer import KVCache, RouterAux, Transformer, init_sharded

__all__ = [
    "ModelConfig",
    "Transformer",
    "RouterAux",
    "KVCache",
    "from_pretrained",
    "export_pretrained",
    "export_peft",
    "load_peft",
    "read_peft_config",
    "PeftLora",
    "init_sharded",
    "param_shardings",
    "logical_to_mesh_spec",
]
