"""Parity with Hugging Face transformers (torch, CPU) on tiny random Qwen models,
loading through `from_pretrained` and round-tripping through `export_pretrained`."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gspo_jax.models import export_pretrained, from_pretrained  # noqa: E402
from gspo_jax.models.safetensors_io import read_safetensors, write_safetensors  # noqa: E402

V = 96


def _hf_model(kind: str):
  torch.manual_seed(0)
  common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, attn_implementation="eager")
  if kind == "qwen3_moe":
    # Layer 1 dense via mlp_only_layers; layers 0, 2, 3 MoE; head_dim != D / H.
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=4, head_dim=16, moe_intermediate_size=16,
                                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                      mlp_only_layers=[1], norm_topk_prob=True,
                                      rope_theta=1e6, **common)
    model = transformers.Qwen3MoeForCausalLM(cfg)
  elif kind == "qwen3_moe_sparse_step":
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=4, head_dim=8, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                                      norm_topk_prob=False, tie_word_embeddings=True, **common)
    model = transformers.Qwen3MoeForCausalLM(cfg)
  elif kind == "qwen3":
    cfg = transformers.Qwen3Config(num_hidden_layers=2, head_dim=16, **common)
    model = transformers.Qwen3ForCausalLM(cfg)
  else:
    cfg = transformers.Qwen2Config(num_hidden_layers=2, **common)
    model = transformers.Qwen2ForCausalLM(cfg)
  with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def _tokens():
  return np.random.RandomState(0).randint(0, V, (2, 9)).astype(np.int32)


def _hf_forward(model, tokens):
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
  logits = out.logits.float().numpy()
  topk = None
  if getattr(out, "router_logits", None):
    k = model.config.num_experts_per_tok
    topk = [torch.topk(torch.softmax(r.float(), -1), k, -1).indices.numpy().reshape(
        tokens.shape + (k,)) for r in out.router_logits]
  return logits, topk


def _ours(model, tokens):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.asarray(tokens))


def _check(ours, hf_logits, hf_topk):
  logits, aux = ours
  assert float(np.max(np.abs(np.asarray(logits) - hf_logits))) <= 1e-4
  if hf_topk is None:
    assert aux.topk_indices.shape[2] == 0
    return
  assert aux.topk_indices.shape[2] == len(hf_topk)
  for layer, idx in enumerate(hf_topk):
    np.testing.assert_array_equal(np.asarray(aux.topk_indices[:, :, layer]), idx)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_sparse_step", "qwen3", "qwen2"])
def test_parity_and_export_round_trip(kind, tmp_path):
  hf = _hf_model(kind)
  src = str(tmp_path / "hf")
  hf.save_pretrained(src, safe_serialization=True)
  tokens = _tokens()
  hf_logits, hf_topk = _hf_forward(hf, tokens)

  model = from_pretrained(src, dtype="float32")
  if kind == "qwen3_moe":
    assert model.cfg.layer_kinds == (True, False, True, True)
    assert model.cfg.renormalize_topk and model.cfg.head_dim == 16
  if kind == "qwen3_moe_sparse_step":
    assert model.cfg.layer_kinds == (False, True, False, True) and model.cfg.tie_embeddings
  _check(_ours(model, tokens), hf_logits, hf_topk)

  # Export, then reload in transformers and in gspo_jax.
  dst = str(tmp_path / "export")
  export_pretrained(model, dst)
  hf2 = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
  l2, k2 = _hf_forward(hf2, tokens)
  np.testing.assert_allclose(l2, hf_logits, atol=1e-5)  # same f32 weights
  _check(_ours(from_pretrained(dst), tokens), hf_logits, hf_topk)
  # And the tensors themselves are identical.
  a, b = read_safetensors(os.path.join(src, "model.safetensors")), read_safetensors(
      os.path.join(dst, "model.safetensors"))
  if hf.config.tie_word_embeddings:
    a.pop("lm_head.weight", None)
  assert sorted(a) == sorted(b)
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_ragged_backend_and_bf16_load(tmp_path):
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(str(tmp_path), safe_serialization=True)
  tokens = _tokens()
  hf_logits, hf_topk = _hf_forward(hf, tokens)
  _check(_ours(from_pretrained(str(tmp_path), moe_backend="ragged"), tokens), hf_logits, hf_topk)
  m16 = from_pretrained(str(tmp_path), dtype="bfloat16")
  assert m16.embed[...].dtype == jnp.bfloat16
  export_pretrained(m16, str(tmp_path / "bf16"))
  assert read_safetensors(str(tmp_path / "bf16" / "model.safetensors"))[
      "model.embed_tokens.weight"].dtype == jnp.bfloat16


def test_router_aux_loss_coef_is_rescaled_to_our_load_balancing_loss():
  """transformers' load-balancing loss is K times ours (load summing to K, not 1)."""
  from gspo_jax.models import hf_layout
  cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64,
         "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 8, "intermediate_size": 32, "hidden_act": "silu", "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 8, "router_aux_loss_coef": 0.001}
  ours = hf_layout.config_from_hf(cfg)
  assert ours.aux_loss_coef == pytest.approx(0.002)
  assert hf_layout.config_to_hf(ours, "float32")["router_aux_loss_coef"] == pytest.approx(0.001)


def test_clear_errors(tmp_path):
  hf = _hf_model("qwen3")
  src = tmp_path / "m"
  hf.save_pretrained(str(src), safe_serialization=True)
  cfg = json.loads((src / "config.json").read_text())

  bad = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama")
  (src / "config.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="LlamaForCausalLM"):
    from_pretrained(str(src))

  bad = dict(cfg, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
  (src / "config.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match="rope"):
    from_pretrained(str(src))

  (src / "config.json").write_text(json.dumps(cfg))
  tensors = dict(read_safetensors(str(src / "model.safetensors")))
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  write_safetensors(str(src / "model.safetensors"), tensors)
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
    from_pretrained(str(src))
