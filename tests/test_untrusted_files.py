"""Model files from elsewhere are untrusted: malformed safetensors headers, an index
that points outside the checkpoint folder, chat templates that never end or grow
without bound. Each is refused with a ValueError naming the file (and the tensor)."""
import json
import os
import struct
import threading
import time

import numpy as np
import pytest

from gspo_jax import tokenizers as gtok
from gspo_jax.models import hf_load
from gspo_jax.models.safetensors_io import read_safetensors, write_safetensors


# ---------------------------------------------------------------------------
# safetensors headers.


def raw(path, header, data=b"", length=None):
    """A safetensors file with ``header`` (a JSON-able object, or bytes) as given."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length))
        f.write(blob)
        f.write(data)
    return str(path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def refused(path, *words):
    with pytest.raises(ValueError) as e:
        read_safetensors(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_valid_files_still_load(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_safetensors(str(tmp_path / "ok.safetensors"), {"a": a, "empty": np.zeros((0, 4), np.int32)},
                      metadata={"format": "pt"})
    out = read_safetensors(str(tmp_path / "ok.safetensors"))
    np.testing.assert_array_equal(out["a"], a)
    assert out["empty"].shape == (0, 4)
    assert read_safetensors(raw(tmp_path / "none.safetensors", {"__metadata__": {"k": "v"}})) == {}


def test_header_length(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02")
    refused(str(p), "shorter than 8 bytes")
    # An absurd length is refused from the file size, before anything is allocated.
    refused(raw(p, {}, length=2**63), "header length 9223372036854775808", "truncated")
    refused(raw(p, {"a": entry()}, b"\0" * 8, length=10_000), "header length 10000")
    with open(p, "wb") as f:  # a (sparse) file big enough for a 150 MB header
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(160_000_000)
    refused(str(p), "header length 150000000 is over the 100000000 limit")


def test_header_json(tmp_path):
    p = tmp_path / "x.safetensors"
    refused(raw(p, b"{not json"), "bad safetensors header")
    refused(raw(p, b"\xff\xfe{}"), "bad safetensors header")
    refused(raw(p, b"[" * 100_000 + b"]" * 100_000), "nested too deeply")
    refused(raw(p, [1, 2]), "a JSON list, not an object")
    refused(raw(p, b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}', b"\0" * 8),
            "'a' appears twice")
    refused(raw(p, {"__metadata__": {"k": 1}}), "__metadata__ must map strings to strings")
    refused(raw(p, {"__metadata__": ["k"]}), "__metadata__")


@pytest.mark.parametrize("bad, words", [
    ([1, 2], ["tensor 'w'", "entry is a list"]),
    ({"dtype": "F32", "shape": [2]}, ["tensor 'w'", "no data_offsets"]),
    (entry(dtype="F8_E4M3"), ["tensor 'w'", "unsupported dtype 'F8_E4M3'"]),
    (entry(dtype=7), ["tensor 'w'", "unsupported dtype 7"]),
    (entry(shape=(2, -1)), ["tensor 'w'", "shape [2, -1]"]),
    (entry(shape=(2.0,)), ["tensor 'w'", "not a list of non-negative integers"]),
    (entry(shape=(True,)), ["tensor 'w'", "shape"]),
    (dict(entry(), shape="2"), ["tensor 'w'", "shape"]),
    (entry(offsets=(0, 4, 8)), ["tensor 'w'", "not two integers"]),
    (entry(offsets=("0", "8")), ["tensor 'w'", "not two integers"]),
    (entry(offsets=(8, 0)), ["tensor 'w'", "outside the 16 data bytes"]),
    (entry(offsets=(-8, 0)), ["tensor 'w'", "outside"]),
    (entry(offsets=(8, 24)), ["tensor 'w'", "data_offsets [8, 24] outside the 16 data bytes"]),
    (entry(shape=(3,)), ["tensor 'w'", "hold 8 bytes, but F32 [3] needs 12"]),
    (entry(shape=(2**40, 2**40)), ["tensor 'w'", "needs"]),
])
def test_bad_tensor_entries(tmp_path, bad, words):
    refused(raw(tmp_path / "x.safetensors", {"ok": entry(offsets=(8, 16)), "w": bad}, b"\0" * 16),
            *words)


def test_overlapping_tensors(tmp_path):
    p = raw(tmp_path / "x.safetensors",
            {"a": entry(shape=(3,), offsets=(0, 12)), "b": entry(offsets=(8, 16))}, b"\0" * 16)
    refused(p, "tensors 'a' and 'b' overlap")
    # Back to back is fine, and so is a zero-size tensor anywhere.
    p = raw(tmp_path / "y.safetensors",
            {"a": entry(offsets=(0, 8)), "b": entry(offsets=(8, 16)), "z": entry(shape=(0,), offsets=(4, 4))},
            b"\0" * 16)
    assert sorted(read_safetensors(p)) == ["a", "b", "z"]


# ---------------------------------------------------------------------------
# model.safetensors.index.json.


def shard(path, name="w"):
    write_safetensors(str(path), {name: np.ones(2, np.float32)})


def index(folder, weight_map):
    os.makedirs(folder, exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


def index_refused(folder, *words):
    with pytest.raises(ValueError) as e:
        hf_load._read_checkpoint(str(folder))
    msg = str(e.value)
    assert msg.startswith(os.path.join(str(folder), "model.safetensors.index.json")), msg
    for w in words:
        assert w in msg, (w, msg)


def test_index_names_files_inside_the_folder(tmp_path):
    ckpt = tmp_path / "ckpt"
    outside = tmp_path / "outside.safetensors"
    shard(outside)
    index(ckpt, {"w": str(outside)})
    index_refused(ckpt, repr(str(outside)), "not inside the checkpoint folder")
    index(ckpt, {"w": "../outside.safetensors"})
    index_refused(ckpt, "'../outside.safetensors'", "not inside")
    index(ckpt, {"w": "sub/../../outside.safetensors"})
    index_refused(ckpt, "not inside")
    os.symlink(outside, ckpt / "link.safetensors")
    index(ckpt, {"w": "link.safetensors"})
    index_refused(ckpt, "'link.safetensors' links to", "outside the checkpoint folder")
    index(ckpt, {"w": "missing.safetensors"})
    index_refused(ckpt, "'missing.safetensors' does not exist")
    (ckpt / "config.json").write_text("{}")
    index(ckpt, {"w": "config.json"})
    index_refused(ckpt, "'config.json' is not a .safetensors file")
    index(ckpt, {"w": 3})
    index_refused(ckpt, "tensor 'w' maps to 3, not a file name")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(["model.safetensors"]))
    index_refused(ckpt, "no 'weight_map' object")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    index_refused(ckpt, "'weight_map' is a list, not an object")
    (ckpt / "model.safetensors.index.json").write_text("{")
    index_refused(ckpt, "invalid JSON")


def test_index_good_cases(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt / "sub")
    shard(ckpt / "a.safetensors", "a")
    shard(ckpt / "sub" / "b.safetensors", "b")
    index(ckpt, {"a": "a.safetensors", "b": "sub/b.safetensors"})
    assert sorted(hf_load._read_checkpoint(str(ckpt))) == ["a", "b"]
    # A Hugging Face hub cache snapshot links its files to the repository's blobs.
    repo = tmp_path / "models--org--name"
    os.makedirs(repo / "blobs")
    snap = repo / "snapshots" / "0123abc"
    os.makedirs(snap)
    shard(repo / "blobs" / "deadbeef", "w")
    os.symlink("../../blobs/deadbeef", snap / "model.safetensors")
    assert sorted(hf_load._read_checkpoint(str(snap) + "/")) == ["w"]


def test_tensor_in_two_shards(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    shard(ckpt / "a.safetensors", "w")
    shard(ckpt / "b.safetensors", "w")
    index(ckpt, {"w": "a.safetensors", "x": "b.safetensors"})
    with pytest.raises(ValueError, match=r"tensor 'w' is in both .*a\.safetensors and .*b\.safetensors"):
        hf_load._read_checkpoint(str(ckpt))


def test_from_pretrained_names_the_bad_shard(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}))
    raw(ckpt / "model.safetensors", {"model.embed_tokens.weight": entry(shape=(8, 8), offsets=(0, 64))})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight'"):
        hf_load.from_pretrained(str(ckpt))


# ---------------------------------------------------------------------------
# Chat templates.


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<eos>": 0, "x": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path.read_bytes()


def template_dir(tmp_path, tokenizer_json, template, in_config=True):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json)
    config = {"eos_token": "<eos>"}
    if in_config:
        config["chat_template"] = template
    else:
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


MESSAGES = [{"role": "user", "content": "hello"}]


def render_refused(tok, *words):
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template(MESSAGES)
    msg = str(e.value)
    assert msg.startswith(tok.chat_template_file), msg
    for w in words:
        assert w in msg, (w, msg)


def chat_template_threads():
    return [t for t in threading.enumerate() if t.name == "chat-template"]


def test_template_that_never_ends_times_out(tmp_path, tokenizer_json):
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tok = gtok.HFTokenizer.from_dir(template_dir(tmp_path, tokenizer_json, forever, in_config=False))
    tok.template_timeout_s = 0.5
    t0 = time.perf_counter()
    render_refused(tok, "chat_template.jinja", "did not finish within 0.5 s")
    assert time.perf_counter() - t0 < 3
    deadline = time.time() + 5  # the rendering thread is stopped, not left spinning
    while chat_template_threads() and time.time() < deadline:
        time.sleep(0.05)
    assert not chat_template_threads()


@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", ["output passed 4194304 characters"]),
    ("{{ 'x' * 10**10 }}", ["repeats a value 10000000000 times"]),
    ("{{ [0] * 10**10 }}", ["repeats a value"]),
    ("{{ 2 ** 100000000 }}", ["too large a number"]),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     ["longer than 4194304 characters"]),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     ["built a value of"]),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
     ["built a value of"]),
    ("{% set big = 'x' * 100000 %}{% set c %}{% for i in range(1000) %}{{ big }}{% endfor %}{% endset %}",
     ["longer than"]),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", ["RecursionError"]),
])
def test_templates_that_grow_without_bound_are_refused(tmp_path, tokenizer_json, template, words):
    tok = gtok.HFTokenizer.from_dir(template_dir(tmp_path, tokenizer_json, template))
    render_refused(tok, "tokenizer_config.json", "chat template refused", *words)


def test_template_source_limits(tmp_path, tokenizer_json):
    huge = "x" * (gtok.CHAT_TEMPLATE_MAX_SOURCE + 1)
    with pytest.raises(ValueError, match=r"chat_template\.jinja: chat template is longer than"):
        gtok.HFTokenizer.from_dir(template_dir(tmp_path, tokenizer_json, huge, in_config=False))
    os.remove(tmp_path / "chat_template.jinja")
    deep = "{{ " + "(" * 50_000 + "1" + ")" * 50_000 + " }}"
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat template nests too deeply"):
        gtok.HFTokenizer.from_dir(template_dir(tmp_path, tokenizer_json, deep))


def test_ordinary_templates_still_render(tmp_path, tokenizer_json):
    template = ("{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] | trim }}\n{% endfor %}"
                "{{ (messages | map(attribute='role') | list | tojson) * 2 }}{{ '%d' % 7 }}{{ 2 ** 10 }}")
    tok = gtok.HFTokenizer.from_dir(template_dir(tmp_path, tokenizer_json, template))
    assert tok.apply_chat_template(MESSAGES) == 'user: hello\n["user"]["user"]71024'
