"""LoRA adapters and Hugging Face PEFT (gspo_jax.models.hf_peft, export_pretrained's
merged and PEFT outputs), against peft + transformers (torch, CPU) on tiny Qwen3 and
Qwen3-MoE models. The adapters are built here beside the weights, as the spec lays
them out (`<w>_lora_a` / `<w>_lora_b`, f32, leading layer dims)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from gspo_jax.models import export_pretrained, from_pretrained  # noqa: E402
from gspo_jax.models.hf_export import export_peft  # noqa: E402
from gspo_jax.models.hf_peft import (  # noqa: E402
    TARGETS, PeftLora, block_adapters, load_peft, merge_lora, read_peft_config)
from gspo_jax.models.safetensors_io import read_safetensors  # noqa: E402
from gspo_jax.models.lora import LoRAParam, LoRASpec  # noqa: E402

V = 96
ATTN = ("q", "k", "v", "o")
EXPERTS = ("expert_gate", "expert_up", "expert_down")
DENSE = ("gate", "up", "down")


def _hf_model(kind: str):
  torch.manual_seed(0)
  common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, attn_implementation="eager")
  if kind == "qwen3_moe":  # layer 1 dense; head_dim != D / H
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=3, head_dim=16, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                      norm_topk_prob=True, **common)
    model = transformers.Qwen3MoeForCausalLM(cfg)
  else:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=2,
                                                                   head_dim=16, **common))
  return model.eval()


def _tokens():
  return np.random.RandomState(0).randint(0, V, (2, 9)).astype(np.int32)


def _ours(model, tokens):
  graphdef, state = nnx.split(model)
  logits, _ = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.asarray(tokens))
  return np.asarray(logits)


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _n_in(w: str) -> int:
  """How many of the weight's dims (after stack and experts) are its input dims."""
  return 2 if w == "o" else 1


def _add_adapters(model, targets, rank, seed=0, zero=False, alpha=None):
  """Adapters of the spec's shapes beside the weights: A [stack, (E,) in..., r],
  B [stack, (E,) r, out...], f32, random nonzero (or zeros); each adapted module's
  ``lora`` (rank, alpha, targets) gives the forward its scaling (`lora.add_adapters`
  sets it so; alpha default 2r)."""
  spec = LoRASpec(rank, float(2 * rank if alpha is None else alpha), tuple(targets))
  key = jax.random.key(seed)
  for seg in model.segments:
    for blk in seg.blocks:
      for target in targets:
        mod, w, _ = TARGETS[target]
        if mod == "mlp" and (target in EXPERTS) != blk.is_moe:
          continue
        module = getattr(blk, mod)
        shape = getattr(module, w).shape
        lead = 2 if target in EXPERTS else 1
        n_in = _n_in(w)
        a_shape = shape[:lead + n_in] + (rank,)
        b_shape = shape[:lead] + (rank,) + shape[lead + n_in:]
        key, ka, kb = jax.random.split(key, 3)
        fan_in = int(np.prod(shape[lead:lead + n_in]))
        a = jax.random.normal(ka, a_shape, jnp.float32) / np.sqrt(fan_in)
        b = 0.1 * jax.random.normal(kb, b_shape, jnp.float32)
        if zero:
          a, b = jnp.zeros_like(a), jnp.zeros_like(b)
        setattr(module, f"{w}_lora_a", LoRAParam(a))
        setattr(module, f"{w}_lora_b", LoRAParam(b))
        module.lora = spec


def _adapters(model):
  return {str(k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))
          if "_lora_" in str(k[-1])}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_export_peft_and_merged_load_in_transformers(kind, tmp_path):
  hf = _hf_model(kind)
  src, base = str(tmp_path / "hf"), str(tmp_path / "base")
  hf.save_pretrained(src, safe_serialization=True)
  model = from_pretrained(src, dtype="float32")
  export_pretrained(model, base)  # the base, before any adapter
  tokens = _tokens()
  base_logits = _ours(model, tokens)

  targets = ATTN + (EXPERTS if kind == "qwen3_moe" else DENSE)
  lora = PeftLora(rank=4, alpha=8.0, targets=targets)
  _add_adapters(model, targets, lora.rank, alpha=lora.alpha)
  before = _adapters(model)

  # The adapters alone, in PEFT's format.
  out = str(tmp_path / "peft")
  assert export_pretrained(model, out, lora=lora, lora_format="peft") == [
      "adapter_model.safetensors"]
  cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
  tensors = read_safetensors(os.path.join(out, "adapter_model.safetensors"))
  if kind == "qwen3_moe":
    assert tensors["base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"].shape \
        == (4, 32)
    assert tensors["base_model.model.model.layers.2.mlp.experts.1.down_proj.lora_B.weight"].shape \
        == (32, 4)
    assert not any("layers.1.mlp" in k for k in tensors)  # the dense layer: no MLP targets
  else:
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape \
        == (64, 4)
  assert all(v.dtype == np.float32 for v in tensors.values())

  # The merged model (export with lora=..., merged by default) and our forward on it.
  merged_dir = str(tmp_path / "merged")
  export_pretrained(model, merged_dir, lora=lora)
  assert _adapters(model).keys() == before.keys()  # exporting changes nothing
  unmerged = _ours(model, tokens)  # the forward with the adapters (x W + s (x A) B)
  merge_lora(model, lora.scaling)
  ours = _ours(model, tokens)
  assert float(np.max(np.abs(ours - base_logits))) > 1e-2  # the adapters matter
  np.testing.assert_allclose(unmerged, ours, atol=1e-4)

  peft_model = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager"),
      out).eval()
  np.testing.assert_allclose(_torch_logits(peft_model, tokens), ours, atol=1e-4)
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      merged_dir, attn_implementation="eager").eval()
  np.testing.assert_allclose(_torch_logits(merged, tokens), ours, atol=1e-4)
  np.testing.assert_allclose(_ours(from_pretrained(merged_dir), tokens), ours, atol=1e-5)

  # Import back: the adapters round-trip exactly.
  assert read_peft_config(out, model.cfg) == PeftLora(4, 8.0, targets)
  back = from_pretrained(base, dtype="float32")
  _add_adapters(back, targets, 4, zero=True)
  assert load_peft(out, back) == PeftLora(4, 8.0, targets)
  got = _adapters(back)
  assert got.keys() == before.keys()
  for k in before:
    np.testing.assert_array_equal(got[k], before[k], err_msg=k)

  # What peft writes back (on transformers >= 5, the experts' adapters converted to
  # LoRA on the fused parameters, gate_up block-diagonal at rank 2r) imports to the same.
  resaved = str(tmp_path / "resaved")
  peft_model.save_pretrained(resaved)
  if kind == "qwen3_moe":
    assert any("experts.base_layer.lora_A" in k for k in read_safetensors(
        os.path.join(resaved, "adapter_model.safetensors")))
  again = from_pretrained(base, dtype="float32")
  _add_adapters(again, targets, 4, zero=True)
  assert load_peft(resaved, again) == PeftLora(4, 8.0, targets)
  got = _adapters(again)
  for k in before:
    np.testing.assert_allclose(got[k], before[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("layout", ["qwen3", "moe_target_modules", "moe_target_parameters"])
def test_import_an_adapter_peft_wrote(layout, tmp_path):
  """peft writes an adapter (random weights) on the transformers model; imported into
  our tree, our forward on the merged weights gives peft's logits, and exporting it
  again gives an adapter peft loads with the same logits."""
  kind = "qwen3" if layout == "qwen3" else "qwen3_moe"
  hf = _hf_model(kind)
  base = str(tmp_path / "base")
  hf.save_pretrained(base, safe_serialization=True)
  if layout == "qwen3":
    kw = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"])
  elif layout == "moe_target_modules":  # peft converts: fused gate_up at rank 2r, block-diag
    kw = dict(target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
  else:  # LoRA on the fused parameters: gate and up share A
    kw = dict(target_modules=["v_proj"],
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
  torch.manual_seed(1)
  pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=6, init_lora_weights=False, **kw))
  with torch.no_grad():  # non-trivial B's (peft's random init is small)
    for name, p in pm.named_parameters():
      if "lora_B" in name:
        p.normal_(0, 0.1)
  pm.eval()
  adir = str(tmp_path / "adapter")
  pm.save_pretrained(adir)
  tokens = _tokens()
  want = _torch_logits(pm, tokens)

  lora = read_peft_config(adir, from_pretrained(base).cfg)
  # peft gives the fused gate_up_proj rank 2r (and alpha 2 alpha) when it converts
  # per-module targets: imported at rank 2r throughout, the scaling unchanged.
  assert lora.rank == (4 if layout == "moe_target_modules" else 2) and lora.scaling == 3
  if kind == "qwen3_moe":
    assert set(EXPERTS) <= set(lora.targets)
  model = from_pretrained(base, dtype="float32")
  _add_adapters(model, lora.targets, lora.rank, zero=True)
  load_peft(adir, model)
  assert any(np.any(v) for k, v in _adapters(model).items() if k.endswith("lora_b')"))
  out = str(tmp_path / "again")
  export_peft(model, out, lora)
  merge_lora(model, lora.scaling)
  np.testing.assert_allclose(_ours(model, tokens), want, atol=1e-4)

  again = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager"),
      out).eval()
  np.testing.assert_allclose(_torch_logits(again, tokens), want, atol=1e-4)


def test_what_peft_cannot_express_is_refused(tmp_path):
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  model = from_pretrained(str(tmp_path / "hf"), dtype="float32")
  _add_adapters(model, ("q", "gate"), 2)  # dense-MLP targets on a MoE with a dense layer
  with pytest.raises(ValueError, match="dense layers"):
    export_peft(model, str(tmp_path / "a"), PeftLora(2, 4.0, ("q", "gate")))
  with pytest.raises(ValueError, match="pass lora="):
    export_pretrained(model, str(tmp_path / "m"))
  with pytest.raises(ValueError, match="lora.targets"):
    export_peft(model, str(tmp_path / "a"), PeftLora(2, 4.0, ("q",)))

  model = from_pretrained(str(tmp_path / "hf"), dtype="float32")
  _add_adapters(model, ("expert_gate",), 2)
  with pytest.raises(ValueError, match="expert_gate without expert_up"):
    export_peft(model, str(tmp_path / "a"), PeftLora(2, 4.0, ("expert_gate",)))

  (tmp_path / "a").mkdir()
  with pytest.raises(ValueError, match="no adapter_config.json"):
    read_peft_config(str(tmp_path / "a"), model.cfg)


def test_sharded_adapters_export_and_load_like_unsharded(tmp_path):
  """On the (fsdp=4, expert=2) mesh, adapters sharded with their experts: the PEFT
  export and the merged export equal the unsharded ones, and load_peft puts each
  adapter back on its sharding."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 4, 2, 1), ("data", "fsdp", "expert", "tensor"))
  hf = _hf_model("qwen3_moe")
  src = str(tmp_path / "hf")
  hf.save_pretrained(src, safe_serialization=True)
  targets = ("q", "o") + EXPERTS
  lora = PeftLora(2, 4.0, targets)
  plain = from_pretrained(src, dtype="float32")
  _add_adapters(plain, targets, 2)
  sharded = from_pretrained(src, dtype="float32", mesh=mesh)
  _add_adapters(sharded, targets, 2)
  for seg in sharded.segments:
    for blk in seg.blocks:
      for target in EXPERTS if blk.is_moe else ():
        for n in ("_lora_a", "_lora_b"):
          p = getattr(blk.mlp, TARGETS[target][1] + n)
          p.set_value(jax.device_put(p[...], NamedSharding(mesh, P(None, "expert"))))
  for name, model in (("plain", plain), ("sharded", sharded)):
    export_peft(model, str(tmp_path / name), lora)
    export_pretrained(model, str(tmp_path / (name + "_merged")), lora=lora)
  for suffix, file in (("", "adapter_model.safetensors"), ("_merged", "model.safetensors")):
    a = read_safetensors(str(tmp_path / ("plain" + suffix) / file))
    b = read_safetensors(str(tmp_path / ("sharded" + suffix) / file))
    assert sorted(a) == sorted(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  before = _adapters(sharded)
  shardings = {str(k): v.get_value().sharding for k, v in nnx.to_flat_state(nnx.state(sharded))
               if "_lora_" in str(k[-1])}
  for seg in sharded.segments:  # zero them, then load back
    for blk in seg.blocks:
      for _, module, w in block_adapters(blk):
        for n in ("_lora_a", "_lora_b"):
          p = getattr(module, w + n)
          p.set_value(jnp.zeros_like(p[...]))
  load_peft(str(tmp_path / "sharded"), sharded)
  for k, v in nnx.to_flat_state(nnx.state(sharded)):
    if "_lora_" in str(k[-1]):
      assert v.get_value().sharding == shardings[str(k)], k
      np.testing.assert_array_equal(np.asarray(v.get_value()), before[str(k)], err_msg=str(k))


def test_merged_export_of_a_bf16_base_merges_in_f32(tmp_path):
  hf = _hf_model("qwen3_moe")
  hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  model = from_pretrained(str(tmp_path / "hf"), dtype="bfloat16")
  _add_adapters(model, ("q", "expert_down"), 2)
  export_pretrained(model, str(tmp_path / "m"), lora=PeftLora(2, 4.0, ("q", "expert_down")))
  got = read_safetensors(str(tmp_path / "m" / "model.safetensors"))
  attn, mlp = model.segments[0].blocks[0].attn, model.segments[0].blocks[0].mlp
  assert model.segments[0].blocks[0].is_moe
  f32 = lambda p: np.asarray(p[...], np.float32)[0]
  q = f32(attn.q) + 2.0 * np.einsum("dr,rhk->dhk", f32(attn.q_lora_a), f32(attn.q_lora_b))
  want = q.reshape(32, -1).T.astype(got["model.layers.0.self_attn.q_proj.weight"].dtype)
  assert want.dtype == jnp.bfloat16
  close = lambda x, y: np.testing.assert_allclose(  # bf16 of the same f32 sum, to an ulp
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2 ** -7, atol=1e-7)
  close(got["model.layers.0.self_attn.q_proj.weight"], want)
  down = f32(mlp.down)[3] + 2.0 * f32(mlp.down_lora_a)[3] @ f32(mlp.down_lora_b)[3]
  assert got["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == want.dtype
  close(got["model.layers.0.mlp.experts.3.down_proj.weight"], down.T.astype(want.dtype))
