"""Streaming, sharded Hugging Face checkpoint I/O (gspo_jax.models.hf_load, hf_export).

* `from_pretrained(path, mesh=...)` maps each tensor from its file and puts each
  block straight on the devices of its sharding: a > 1 GB bf16 Qwen3-MoE checkpoint
  loads on 8 fake CPU devices with a peak resident memory about the file's size
  (the parameters themselves) plus the process's baseline, and each parameter ends
  on the sharding the rules give, equal to the unsharded load.
* `export_pretrained` writes shards + model.safetensors.index.json that
  transformers loads back with the same logits.
* The pieces: `write_sharded`, `TensorReader`, dtype rules, error messages.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import subprocess_env
from flax import nnx
from jax.sharding import Mesh

from gspo_jax.models import export_pretrained, from_pretrained, param_shardings
from gspo_jax.models import hf_load
from gspo_jax.models.safetensors_io import (
    TensorReader,
    parse_size,
    read_safetensors,
    tensor_infos,
    write_safetensors,
    write_sharded,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def _mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    devices = np.asarray(jax.devices()[:8]).reshape(1, 4, 2, 1)
    return Mesh(devices, ("data", "fsdp", "expert", "tensor"))


def _forward(model, tokens):
    graphdef, state = nnx.split(model)
    logits, _ = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.asarray(tokens))
    return np.asarray(logits)


def _leaves(model):
    return nnx.to_flat_state(nnx.state(model, nnx.Param))


# ---------------------------------------------------------------------------
# A synthetic Qwen3-MoE checkpoint, written with write_sharded.


def _qwen3_moe_config(v, d, layers, heads, kv, hd, ff, experts, moe_ff, dense=(0,)):
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": v,
        "hidden_size": d,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": ff,
        "moe_intermediate_size": moe_ff,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(dense),
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _hf_specs(c):
    """(name, shape) of every tensor of the HF checkpoint for config dict ``c``:
    written out here from the HF layout, independently of hf_layout's tables."""
    d, hd, ff, moe_ff = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))]
        out += [(p + "self_attn.q_proj.weight", (q, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, q)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        if i in c["mlp_only_layers"]:
            out += [(p + "mlp.gate_proj.weight", (ff, d)), (p + "mlp.up_proj.weight", (ff, d)),
                    (p + "mlp.down_proj.weight", (d, ff))]
            continue
        out.append((p + "mlp.gate.weight", (c["num_experts"], d)))
        for x in range(c["num_experts"]):
            q_ = f"{p}mlp.experts.{x}."
            out += [(q_ + "gate_proj.weight", (moe_ff, d)), (q_ + "up_proj.weight", (moe_ff, d)),
                    (q_ + "down_proj.weight", (d, moe_ff))]
    v = c["vocab_size"]
    out += [("model.embed_tokens.weight", (v, d)), ("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]
    return out


def _write_synthetic(folder, c, max_shard_size, dtype=BF16, seed=0):
    """A random checkpoint for config ``c``: weights N(0, 0.02^2), norms 1 + N(0, 0.1^2).

    Each tensor is a random window of one shared pool of random values, so writing
    a GB takes seconds and the writer holds one tensor at a time."""
    rng = np.random.default_rng(seed)
    pool = (0.02 * rng.standard_normal(1 << 24, np.float32)).astype(dtype)
    norms = (1 + 0.1 * rng.standard_normal(1 << 16, np.float32)).astype(dtype)
    specs = _hf_specs(c)

    def arrays():
        for name, shape in specs:
            src = norms if name.endswith("norm.weight") else pool
            n = int(np.prod(shape))
            start = int(rng.integers(0, src.size - n + 1))
            yield src[start:start + n].reshape(shape)

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)
    files = write_sharded(folder, [(n, dtype, s) for n, s in specs], arrays(),
                          max_shard_size=max_shard_size, metadata={"format": "pt"})
    return files


# ---------------------------------------------------------------------------
# The 1 GB load on an (fsdp=4, expert=2) mesh, in a subprocess.

_BIG = dict(v=8192, d=1024, layers=11, heads=8, kv=4, hd=128, ff=2048, experts=16, moe_ff=1024)

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    from gspo_jax.models import from_pretrained, param_shardings

    def peak():  # ru_maxrss is in KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    ckpt, out = sys.argv[1], sys.argv[2]
    mesh = Mesh(np.asarray(jax.devices()).reshape(1, 4, 2, 1), ("data", "fsdp", "expert", "tensor"))
    jnp.zeros(8).block_until_ready()
    res = {"baseline_rss": peak()}
    t = time.time()
    model = from_pretrained(ckpt, mesh=mesh)
    jax.block_until_ready(nnx.state(model))
    res["load_s"] = time.time() - t
    res["peak_rss"] = peak()

    # Every parameter is on the sharding the rules give, each device holding its shard.
    state = nnx.state(model, nnx.Param)
    want = dict(nnx.to_flat_state(param_shardings(state, mesh, model.cfg)))
    bad, device_bytes, param_bytes = [], 0, 0
    for path, var in nnx.to_flat_state(state):
        a, s = var.get_value(), want[path].get_value()
        if a.sharding != s or a.dtype != jnp.bfloat16:
            bad.append([str(path), str(a.sharding), str(s), str(a.dtype)])
        for shard in a.addressable_shards:
            if shard.data.shape != s.shard_shape(a.shape):
                bad.append([str(path), "shard", str(shard.data.shape)])
            device_bytes += shard.data.nbytes
        param_bytes += a.nbytes
    res.update(bad=bad, device_bytes=device_bytes, param_bytes=param_bytes)

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, model.cfg.vocab_size, (2, 16)), jnp.int32)
    graphdef, st = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0])
    sharded_logits = np.asarray(fwd(st, tokens))

    single = from_pretrained(ckpt)  # everything on one device: the reference
    gd1, st1 = nnx.split(single)
    single_logits = np.asarray(jax.jit(lambda st, t: nnx.merge(gd1, st)(t)[0])(st1, tokens))
    res["max_logit_diff"] = float(np.max(np.abs(sharded_logits - single_logits)))
    res["logit_scale"] = float(np.max(np.abs(single_logits)))
    unequal = []
    for (path, a), (_, b) in zip(nnx.to_flat_state(state), nnx.to_flat_state(nnx.state(single, nnx.Param))):
        a, b = a.get_value(), np.asarray(b.get_value())
        # Bit for bit, each device's shard against its block of the unsharded load, as
        # unsigned integers (gathering 1 GB of sharded bfloat16 and comparing it as
        # bfloat16 took seconds).
        bits = lambda x: x.view(f"u{x.dtype.itemsize}")  # noqa: E731
        if a.dtype != b.dtype or a.shape != b.shape or not all(
                np.array_equal(bits(np.asarray(s.data)), bits(b[s.index])) for s in a.addressable_shards):
            unequal.append(str(path))
    res["unequal"] = unequal
    json.dump(res, open(out, "w"))
""")


def test_one_gb_checkpoint_streams_onto_an_fsdp_expert_mesh(tmp_path):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    c = _qwen3_moe_config(**_BIG)
    ckpt = tmp_path / "big"
    try:
        files = _write_synthetic(str(ckpt), c, max_shard_size="300MB")
        assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
        file_bytes = sum(os.path.getsize(ckpt / f) for f in files[:-1])
        assert file_bytes >= 10**9
        infos = [i for f in files[:-1] for i in tensor_infos(str(ckpt / f)).values()]
        largest, data_bytes = max(i.nbytes for i in infos), sum(i.nbytes for i in infos)

        out = tmp_path / "result.json"
        env = subprocess_env(8)
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), str(out)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        res = json.loads(out.read_text())
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)

    assert res["bad"] == []
    assert res["unequal"] == []  # every parameter bit-for-bit the unsharded load's
    # Same parameters; only the order of the sharded matmuls' sums differs.
    assert res["max_logit_diff"] <= 1e-5 * max(1.0, res["logit_scale"]), res
    assert res["param_bytes"] == data_bytes  # bf16 kept: the parameters are the file's data
    # Peak resident memory: the CPU "devices" hold the parameters in host memory,
    # so the floor is the device bytes (the file's size, plus the copies of the
    # parameters the mesh replicates: attention and embeddings over the expert
    # axis) over the process's baseline. Margin on top of that: 2 x the largest
    # tensor (one block being converted while its source pages are mapped) + 64 MiB.
    replicated = res["device_bytes"] - res["param_bytes"]
    margin = res["baseline_rss"] + replicated + 2 * largest + (64 << 20)
    assert res["peak_rss"] < file_bytes + margin, dict(res, file_bytes=file_bytes, margin=margin)
    print(json.dumps(dict(res, file_bytes=file_bytes, largest=largest, margin=margin,
                          over_file=res["peak_rss"] - file_bytes)))


# ---------------------------------------------------------------------------
# In-process loads on the mesh (small).

_SMALL = dict(v=64, d=32, layers=3, heads=4, kv=2, hd=8, ff=48, experts=4, moe_ff=16)


def test_small_load_on_mesh_matches_rules_and_single_device(tmp_path):
    mesh = _mesh()
    c = _qwen3_moe_config(**_SMALL)
    _write_synthetic(str(tmp_path), c, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    sharded = from_pretrained(str(tmp_path), mesh=mesh)
    single = from_pretrained(str(tmp_path))
    assert sharded.cfg.param_dtype == "bfloat16" and sharded.cfg.dtype == "float32"
    want = dict(nnx.to_flat_state(param_shardings(nnx.state(sharded), mesh, sharded.cfg)))
    for (path, a), (_, b) in zip(_leaves(sharded), _leaves(single)):
        assert a.get_value().sharding == want[path].get_value(), path
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    spec = sharded.segments[1].blocks[0].mlp.gate[...].sharding.spec
    assert spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
    tokens = np.random.RandomState(0).randint(0, 64, (2, 7)).astype(np.int32)
    np.testing.assert_allclose(_forward(sharded, tokens), _forward(single, tokens), atol=1e-5)


def test_fused_expert_layout_loads_the_same(tmp_path):
    """transformers' fused experts (gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    c = _qwen3_moe_config(**_SMALL)
    _write_synthetic(str(tmp_path / "a"), c, max_shard_size="5GB")
    t = dict(read_safetensors(str(tmp_path / "a" / "model.safetensors")))
    e = c["num_experts"]
    for i in range(1, c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = [t.pop(f"{p}{x}.gate_proj.weight") for x in range(e)]
        up = [t.pop(f"{p}{x}.up_proj.weight") for x in range(e)]
        t[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        t[p + "down_proj"] = np.stack([t.pop(f"{p}{x}.down_proj.weight") for x in range(e)])
    os.makedirs(tmp_path / "b")
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    write_safetensors(str(tmp_path / "b" / "model.safetensors"), t)
    a, b = from_pretrained(str(tmp_path / "a")), from_pretrained(str(tmp_path / "b"))
    for (path, x), (_, y) in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), str(path))


def test_dtype_rules_and_value_head(tmp_path):
    c = _qwen3_moe_config(**_SMALL)
    _write_synthetic(str(tmp_path), c, max_shard_size="5GB")
    kept = from_pretrained(str(tmp_path))  # the file's bf16 kept, compute float32
    assert kept.embed[...].dtype == jnp.bfloat16 and kept.cfg.dtype == "float32"
    f32 = from_pretrained(str(tmp_path), param_dtype="float32")
    assert f32.embed[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(f32.embed[...]), np.asarray(kept.embed[...], np.float32))
    f16 = from_pretrained(str(tmp_path), dtype="float16")  # param_dtype follows dtype
    assert f16.embed[...].dtype == jnp.float16 and f16.cfg.dtype == "float16"
    # The trainer's call: runtime fields, a value head, padding rows, a mesh.
    mesh = _mesh()
    m = from_pretrained(str(tmp_path), mesh=mesh, value_head=True, num_valid_tokens=60,
                        dtype="float32", param_dtype="float32", scan_layers=False)
    assert m.cfg.value_head and m.cfg.num_valid_tokens == 60 and not m.cfg.scan_layers
    # On the host: jnp ops on sharded arrays compile a program per op and sharding.
    value_w, value_b = np.asarray(m.value_w[...]), np.asarray(m.value_b[...])
    assert value_w.shape == (32,) and float(np.std(value_w)) > 0
    assert float(np.max(np.abs(value_b))) == 0.0


def test_clear_errors_name_the_file_and_tensor(tmp_path):
    c = _qwen3_moe_config(**_SMALL)
    _write_synthetic(str(tmp_path), c, max_shard_size="5GB")
    file = str(tmp_path / "model.safetensors")
    good = dict(read_safetensors(file))

    def refused(tensors, *words):
        write_safetensors(file, tensors)
        with pytest.raises(ValueError) as e:
            from_pretrained(str(tmp_path))
        for w in words:
            assert w in str(e.value), (w, str(e.value))

    name = "model.layers.2.self_attn.k_proj.weight"
    refused(dict(good, **{name: good[name].astype(np.int32)}), file, repr(name), "I32",
            "does not convert")
    refused(dict(good, **{name: good[name][:8]}), file, repr(name), "shape (8, 32)",
            "expected (16, 32)")
    refused({k: a for k, a in good.items() if k != name}, str(tmp_path), "missing", repr(name))
    refused(dict(good, extra=good[name]), "unexpected tensors", "'extra'")


# ---------------------------------------------------------------------------
# Export: shards + index, read back by transformers.


def _hf_moe(dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=3, head_dim=16, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
        rms_norm_eps=1e-6, attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def _hf_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_export_round_trips_through_transformers(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf_moe(getattr(torch, dtype))
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    hf.save_pretrained(src, safe_serialization=True)
    tokens = np.random.RandomState(0).randint(0, 96, (2, 9)).astype(np.int32)
    ref = _hf_logits(hf, tokens)

    model = from_pretrained(src, mesh=_mesh())  # exported from its shardings
    assert model.cfg.param_dtype == dtype  # the file's dtype kept
    # A stale single-file export in the folder must not shadow the new shards.
    os.makedirs(dst)
    write_safetensors(os.path.join(dst, "model.safetensors"), {"stale": np.zeros(1, np.float32)})
    files = export_pretrained(model, dst, max_shard_size="40KB")
    assert len(files) > 3 and files[-1] == "model.safetensors.index.json"
    assert sorted(os.listdir(dst)) == sorted(files + ["config.json"])
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files[:-1]
    src_tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(src_tensors)
    out = {}
    for f in files[:-1]:
        out.update(read_safetensors(os.path.join(dst, f)))
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in out.values())
    for name, a in src_tensors.items():  # the same tensors, in the file's dtype
        assert out[name].dtype == a.dtype, name
        np.testing.assert_array_equal(out[name], a, err_msg=name)
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == dtype

    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        d, attn_implementation="eager").eval()
    hf2 = load(dst)
    assert next(hf2.parameters()).dtype == getattr(torch, dtype)
    # Same weights, same program: equal to transformers' load of the source files (not
    # to `hf` itself in bf16, whose RoPE buffer `.to(bfloat16)` rounded).
    np.testing.assert_array_equal(_hf_logits(hf2, tokens), _hf_logits(load(src), tokens))
    np.testing.assert_allclose(_hf_logits(hf2, tokens), ref, atol=1e-5 if dtype == "float32" else 0.05)
    tol = 1e-4 if dtype == "float32" else 0.1  # bf16: transformers computes in bf16, we in f32
    np.testing.assert_allclose(_forward(from_pretrained(dst), tokens), ref, atol=tol)


def test_export_dtype_override_and_single_file(tmp_path):
    c = _qwen3_moe_config(**_SMALL)
    _write_synthetic(str(tmp_path / "a"), c, max_shard_size="5GB")
    model = from_pretrained(str(tmp_path / "a"), param_dtype="float32")
    assert export_pretrained(model, str(tmp_path / "b")) == ["model.safetensors"]  # f32
    assert export_pretrained(model, str(tmp_path / "c"), dtype="bfloat16") == ["model.safetensors"]
    a = read_safetensors(str(tmp_path / "a" / "model.safetensors"))
    b = read_safetensors(str(tmp_path / "b" / "model.safetensors"))
    c16 = read_safetensors(str(tmp_path / "c" / "model.safetensors"))
    for name in a:
        assert b[name].dtype == np.float32 and c16[name].dtype == BF16
        np.testing.assert_array_equal(c16[name], a[name])  # bf16 -> f32 -> bf16 is exact


# ---------------------------------------------------------------------------
# The safetensors pieces.


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size(1234) == 1234 and parse_size("1.5 kb") == 1500
    for bad in ("5 parsecs", "-1GB", 0, "GB"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_write_sharded_checks_and_layout(tmp_path):
    specs = [("a", np.float32, (4, 4)), ("b", BF16, (8,)), ("c", np.float32, (100,))]
    arrays = [np.ones((4, 4)), np.arange(8), np.arange(100)]
    files = write_sharded(str(tmp_path), specs, iter(arrays), max_shard_size=100)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    index = json.loads((tmp_path / files[-1]).read_text())
    assert index == {"metadata": {"total_size": 64 + 16 + 400},
                     "weight_map": {"a": files[0], "b": files[0], "c": files[1]}}
    got = read_safetensors(str(tmp_path / files[0]))
    assert got["b"].dtype == BF16 and got["a"].dtype == np.float32
    np.testing.assert_array_equal(got["b"], np.arange(8))
    # A later, single-file export removes the shards of this one.
    assert write_sharded(str(tmp_path), specs[:1], [np.ones((4, 4))]) == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \(4,\), expected \(4, 4\)"):
        write_sharded(str(tmp_path / "x"), specs[:1], [np.ones(4)])
    with pytest.raises(ValueError, match="ran out before tensor 'b'"):
        write_sharded(str(tmp_path / "x"), specs[:2], [np.ones((4, 4))])
    with pytest.raises(ValueError, match="more arrays"):
        write_sharded(str(tmp_path / "x"), specs[:1], [np.ones((4, 4))] * 2)
    with pytest.raises(ValueError, match="listed twice"):
        write_sharded(str(tmp_path / "x"), specs[:1] * 2, [np.ones((4, 4))] * 2)
    assert not [f for f in os.listdir(tmp_path / "x") if f.endswith(".tmp")]


def test_tensor_reader_maps_one_tensor(tmp_path):
    a = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    b = np.arange(7).astype(BF16)
    write_safetensors(str(tmp_path / "t.safetensors"), {"a": a, "b": b, "z": np.zeros((0, 2), np.int8)})
    infos = tensor_infos(str(tmp_path / "t.safetensors"))
    with TensorReader() as reader:
        got = reader.array(infos["a"])
        np.testing.assert_array_equal(got, a)
        assert not got.flags.writeable
        np.testing.assert_array_equal(reader.array(infos["b"]), b)
        assert reader.array(infos["z"]).shape == (0, 2)
    assert hf_load._file_dtype(infos) == "float32"
