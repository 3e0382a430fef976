"""CharTokenizer, and HFTokenizer against transformers on a tokenizer built here."""
import json

import numpy as np
import pytest

from gspo_jax import tokenizers as gtok


# ---------------------------------------------------------------------------
# CharTokenizer.

def test_char_roundtrip_and_ids():
  tok = gtok.CharTokenizer()
  assert tok.vocab_size == 100
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
  text = "Make 16 from 3 5 2 with + - * /, each once.\n<answer>(3+5)*2</answer>"
  ids = tok.encode(text)
  assert len(ids) == len(text)
  assert tok.decode(ids) == text
  # Fixed ids: "\n" first after the 4 specials, then printable ASCII in order.
  assert tok.encode("\n ") == [4, 5]
  assert tok.encode("0") == [4 + 1 + ord("0") - 32]
  assert isinstance(tok, gtok.Tokenizer)


def test_char_words_are_single_tokens():
  tok = gtok.CharTokenizer(words=("<answer>", "</answer>"))
  assert tok.vocab_size == 102
  ids = tok.encode("x<answer>7</answer><a")
  assert ids[1] == tok.token_to_id("<answer>") == 4
  assert ids[3] == tok.token_to_id("</answer>") == 5
  assert len(ids) == 1 + 1 + 1 + 1 + 2
  assert tok.decode(ids) == "x<answer>7</answer><a"


def test_char_specials_and_errors():
  tok = gtok.CharTokenizer()
  ids = [tok.bos_id] + tok.encode("ab") + [tok.eos_id, tok.pad_id, tok.pad_id]
  assert tok.decode(ids) == "ab"
  assert tok.decode(ids, skip_special_tokens=False) == "<bos>ab<eos><pad><pad>"
  assert tok.decode(np.array([[tok.encode("a")[0]]], np.int32)) == "a"
  with pytest.raises(ValueError, match=r"'é' \(U\+00E9\) at position 2"):
    tok.encode("caé")
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])
  unk = gtok.CharTokenizer(unknown="unk")
  assert unk.encode("aé") == [unk.encode("a")[0], unk.unk_id]
  with pytest.raises(ValueError, match="unknown must be"):
    gtok.CharTokenizer(unknown="skip")
  with pytest.raises(ValueError, match="duplicate"):
    gtok.CharTokenizer(chars="aa")
  with pytest.raises(ValueError, match="at least 2"):
    gtok.CharTokenizer(words=("x",))


# ---------------------------------------------------------------------------
# HFTokenizer on a tokenizer.json trained here.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = [
    "Make 16 from 3 5 2 with + - * /, each once.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips.",
    "<answer>(3+5)*2</answer> The answer is 72.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes.",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  path = tmp_path_factory.mktemp("hf_tok")
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  tok.save(str(path / "tokenizer.json"))
  config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
            "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 512}
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  return path


MESSAGES = [{"role": "system", "content": "Answer in <answer></answer>."},
            {"role": "user", "content": "Make 16 from 3 5 2. Ünïcödé ok?"}]


def test_hf_tokenizer_basics(hf_dir):
  tok = gtok.HFTokenizer.from_dir(hf_dir)
  assert isinstance(tok, gtok.Tokenizer)
  assert tok.eos_id == tok.token_to_id("<|im_end|>")
  assert tok.pad_id == tok.token_to_id("<|endoftext|>")
  assert tok.bos_id is None
  text = "Make 16 from 3 5 2.<|im_end|>"
  ids = tok.encode(text)
  assert ids[-1] == tok.eos_id  # special tokens in text are matched as added tokens
  assert tok.decode(ids) == "Make 16 from 3 5 2."
  assert tok.decode(ids, skip_special_tokens=False) == text
  rendered = tok.apply_chat_template(MESSAGES)
  assert rendered == ("<|im_start|>system\nAnswer in <answer></answer>.<|im_end|>\n"
                      "<|im_start|>user\nMake 16 from 3 5 2. Ünïcödé ok?<|im_end|>\n"
                      "<|im_start|>assistant\n")
  assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")
  import jinja2
  with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])
  with pytest.raises(ValueError, match=r"messages\[0\] needs 'role' and 'content'"):
    tok.apply_chat_template([{"content": "x"}])


def test_hf_matches_transformers(hf_dir):
  transformers = pytest.importorskip("transformers")
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
  tok = gtok.HFTokenizer.from_dir(hf_dir)
  assert tok.eos_id == ref.eos_token_id and tok.pad_id == ref.pad_token_id
  for text in CORPUS + ["unseen wörds 12345 <answer>9</answer>", ""]:
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
  for gen in (True, False):
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == ref.apply_chat_template(
        MESSAGES, add_generation_prompt=gen, tokenize=False)


def test_hf_stop_ids_from_generation_config(tmp_path, hf_dir):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
  assert gtok.HFTokenizer.from_dir(tmp_path).stop_ids == (gtok.HFTokenizer.from_dir(tmp_path).eos_id,)
  tok = gtok.HFTokenizer.from_dir(hf_dir)
  im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
  assert gtok.HFTokenizer.from_dir(tmp_path).stop_ids == (im_end, eot)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eot}))
  assert gtok.HFTokenizer.from_dir(tmp_path).stop_ids == (im_end, eot)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
  with pytest.raises(ValueError, match="generation_config.json eos_token_id 1000000"):
    gtok.HFTokenizer.from_dir(tmp_path)


def test_hf_chat_template_tools_none_and_generation_tag_match_transformers(tmp_path, hf_dir):
  transformers = pytest.importorskip("transformers")
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  config["chat_template"] = (
      "{% if tools is not none %}TOOLS:{{ tools|length }}|{% endif %}"
      "{% if documents is not none %}DOCS|{% endif %}"
      "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
      "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = gtok.HFTokenizer.from_dir(tmp_path)
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
  msgs = MESSAGES + [{"role": "assistant", "content": "<answer>16</answer>"}]
  got = tok.apply_chat_template(msgs, add_generation_prompt=False)
  assert got == ref.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
  assert not got.startswith("TOOLS") and got.endswith("<answer>16</answer>")


# A template in the style of Qwen3's: a namespace, loop variables, message
# attributes and the enable_thinking keyword.
QWEN_STYLE_TEMPLATE = (
    "{%- set ns = namespace(system=false) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- set ns.system = true %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content | trim + '<|im_end|>' }}"
    "{%- if not loop.last %}{{- '\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\n<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")


def test_hf_chat_template_keywords_match_transformers(tmp_path, hf_dir):
  transformers = pytest.importorskip("transformers")
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  config["chat_template"] = QWEN_STYLE_TEMPLATE
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = gtok.HFTokenizer.from_dir(tmp_path)
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
  for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
    got = tok.apply_chat_template(MESSAGES, **kwargs)
    assert got == ref.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                          **kwargs)
    assert got.endswith("</think>\n\n") == (kwargs.get("enable_thinking") is False)


def test_train_prompts_use_the_chat_template_where_there_is_one(tmp_path, hf_dir):
  from gspo_jax.data.encoding import encode_prompt
  text = "Make 16 from 3 5 2."
  tok = gtok.HFTokenizer.from_dir(hf_dir)
  ids = encode_prompt(tok, text)
  assert ids == tok.encode("<|im_start|>user\nMake 16 from 3 5 2.<|im_end|>\n<|im_start|>assistant\n")
  assert ids[0] == tok.token_to_id("<|im_start|>")
  # No template: the text itself (after BOS where the tokenizer has one).
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  plain = gtok.HFTokenizer.from_dir(tmp_path)
  assert encode_prompt(plain, text) == plain.encode(text)
  char = gtok.CharTokenizer()
  assert encode_prompt(char, text) == [char.bos_id] + char.encode(text)


def test_hf_chat_template_file_and_sandbox(tmp_path, hf_dir):
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
  tok = gtok.HFTokenizer.from_dir(tmp_path)
  assert tok.chat_template is None
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(MESSAGES)
  # chat_template.jinja (newer checkpoints) is read too; the sandbox refuses Python internals.
  (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
  import jinja2
  with pytest.raises(jinja2.exceptions.SecurityError):
    gtok.HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)
  (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}|{{ messages | length }}")
  assert gtok.HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES) == "<|im_end|>|2"


def test_hf_bad_config(tmp_path, hf_dir):
  with pytest.raises(ValueError, match="no tokenizer.json"):
    gtok.HFTokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError, match="no 'eos_token'"):
    gtok.HFTokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
  with pytest.raises(ValueError, match="'eos_token' is '<nope>'"):
    gtok.HFTokenizer.from_dir(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="invalid JSON"):
    gtok.HFTokenizer.from_dir(tmp_path)
  tok_cfg = {"eos_token": "<|im_end|>", "chat_template": [{"name": "tool_use", "template": "x"}]}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
  with pytest.raises(ValueError, match="without a 'default'"):
    gtok.HFTokenizer.from_dir(tmp_path)
  tok = gtok.HFTokenizer.from_dir(hf_dir)
  with pytest.raises(ValueError, match="outside"):
    tok.decode([tok.vocab_size])
