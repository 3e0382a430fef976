"""`python -m gspo_jax.export` on the workdirs of smoke runs (LoRA and full fine-tuning):
the merged model loads in transformers, the PEFT adapters in peft onto the exported
base, both with the logits of our forward on the run's restored parameters; bad input is
refused by name. And the import direction: RL starting from a PEFT adapter on a Hugging
Face base (``config.lora.peft_adapter``)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import subprocess_env
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from configs import default as default_config  # noqa: E402
from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax.export import export_run  # noqa: E402
from gspo_jax.models.lora import adapters_off  # noqa: E402
from test_peft import _add_adapters, _adapters, _ours, _torch_logits  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds_export"))


def _run(data_dir, workdir, arg):
    from gspo_jax import train

    c = default_config.get_config(arg)
    c.task.data_dir = data_dir
    if "lora" in arg:  # updates that move the adapters whatever the (smoke) rewards
        c.entropy_coef = 0.05
        c.updates.update_without_signal = True
        c.optimizer.warmup_steps = 0
        c.lora.train_router = True  # the routers travel in the PEFT adapter too
    train.run(c, workdir)
    return c


@pytest.fixture(scope="module")
def lora_workdir(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("lora_run"))
    return workdir, _run(data_dir, workdir, "lora,smoke")


@pytest.fixture(scope="module")
def full_workdir(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("full_run"))
    return workdir, _run(data_dir, workdir, "smoke")


def _restored(c, workdir):
    """The run's model as the export reads it, and the restored checkpoint's name."""
    import copy
    import shutil

    from gspo_jax.evaluate import open_workdir, restore_params

    trainer, tmp = open_workdir(copy.deepcopy(c), workdir)
    if tmp is not None:
        shutil.rmtree(tmp)
    params, restored = restore_params(trainer)
    return nnx.merge(trainer.graphdef, params), restored


def _tokens(model):
    return np.random.RandomState(0).randint(0, model.cfg.vocab_size, (2, 11)).astype(np.int32)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def test_export_a_lora_run_as_peft_and_merged(lora_workdir, data_dir, tmp_path):
    workdir, c = lora_workdir
    model, restored = _restored(c, workdir)
    assert restored == "rl/2"
    adapters = _adapters(model)
    assert adapters and any(np.any(v != 0) for k, v in adapters.items() if "_lora_b" in k)
    tokens = _tokens(model)
    ours = _ours(model, tokens)  # the forward with the adapters, unmerged

    # The command line, in PEFT's format.
    peft_dir = tmp_path / "peft"
    env = subprocess_env(1)
    cmd = [sys.executable, "-m", "gspo_jax.export", "--config=configs/default.py:lora,smoke",
           f"--workdir={workdir}", f"--out={peft_dir}", "--format=peft",
           f"--config.task.data_dir={data_dir}", "--config.entropy_coef=0.05",
           "--config.updates.update_without_signal=True", "--config.optimizer.warmup_steps=0",
           "--config.lora.train_router=True"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["restored"] == "rl/2" and out["files"] == ["adapter_model.safetensors"]
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["lora_alpha"] == 16.0
    assert conf["base_model_name_or_path"] is None  # the base is the warm start's result
    assert conf["modules_to_save"] == ["mlp.gate"]  # lora.train_router: the trained routers

    base = export_run(c, workdir, str(tmp_path / "base"), format="base")
    merged = export_run(c, workdir, str(tmp_path / "merged"), format="merged")
    assert base["restored"] == merged["restored"] == "rl/2"
    peft_model = peft.PeftModel.from_pretrained(_hf(base["out"]), str(peft_dir)).eval()
    np.testing.assert_allclose(_torch_logits(peft_model, tokens), ours, atol=1e-4)
    np.testing.assert_allclose(_torch_logits(_hf(merged["out"]), tokens), ours, atol=1e-4)
    # The base alone is the model with its adapters off, and they matter.
    base_logits = _torch_logits(_hf(base["out"]), tokens)
    graphdef, state = nnx.split(model)
    off = nnx.merge(graphdef, adapters_off(state))
    np.testing.assert_allclose(base_logits, _ours(off, tokens), atol=1e-4)
    assert float(np.max(np.abs(base_logits - ours))) > 1e-2


def test_evaluating_a_lora_workdir_scores_the_trained_adapters(lora_workdir):
    """The restore the export uses gives the parameters the run ended with: scoring them
    gives the run's last logged evaluation."""
    from gspo_jax.evaluate import evaluate_checkpoint
    from gspo_jax.metrics_log import read_metrics

    workdir, c = lora_workdir
    out = evaluate_checkpoint(c, workdir)
    assert out["restored"] == "rl/2"
    last = [r for r in read_metrics(workdir) if r["phase"] == "rl"][-1]
    for k in ("eval_reward_mean", "eval_greedy_reward", "eval/pass@1"):
        assert out[k] == pytest.approx(last[k]), k


def test_export_a_full_fine_tuning_run(full_workdir, tmp_path):
    workdir, c = full_workdir
    model, restored = _restored(c, workdir)
    assert restored == "rl/2" and not _adapters(model)
    tokens = _tokens(model)
    out = export_run(c, workdir, str(tmp_path / "merged"))
    assert out["restored"] == "rl/2" and "model.safetensors" in out["files"]
    np.testing.assert_allclose(_torch_logits(_hf(out["out"]), tokens), _ours(model, tokens),
                               atol=1e-4)
    for fmt in ("peft", "base"):
        with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.rank=0.*--format=merged"):
            export_run(c, workdir, str(tmp_path / fmt), format=fmt)


def test_bad_input_is_refused_by_name(lora_workdir, full_workdir, data_dir, tmp_path):
    lora_dir, lora_c = lora_workdir
    full_dir, full_c = full_workdir
    with pytest.raises(FileNotFoundError, match="not a workdir"):
        export_run(lora_c, str(tmp_path / "nothing"), str(tmp_path / "out"))
    # A workdir of another config: every differing field named.
    with pytest.raises(config_lib.ConfigError, match=r"another config(.|\n)*lora\.rank"):
        export_run(full_c, lora_dir, str(tmp_path / "out"))
    # A workdir without checkpoints: the command line says so in one line, exit status 1.
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    env = subprocess_env(1)
    cmd = [sys.executable, "-m", "gspo_jax.export", "--config=configs/default.py:smoke",
           f"--workdir={empty}", f"--out={tmp_path / 'out'}", f"--config.task.data_dir={data_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "FileNotFoundError: " in proc.stderr and "no RL or warm-start checkpoint" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_export_writes_only_into_a_folder_of_its_own(lora_workdir, data_dir, tmp_path):
    """--out must be new, empty, or an earlier export of the same format (whose files
    are replaced): not the run's workdir (its config.json), not a folder of other files,
    not beside an export of another format (transformers with peft installed would
    apply the adapters onto the merged weights)."""
    workdir, c = lora_workdir
    config_json = open(os.path.join(workdir, "config.json")).read()
    listing = sorted(os.listdir(workdir))
    # The command line, --out the workdir: exit status 1, one message, nothing written.
    cmd = [sys.executable, "-m", "gspo_jax.export", "--config=configs/default.py:lora,smoke",
           f"--workdir={workdir}", f"--out={workdir}", f"--config.task.data_dir={data_dir}",
           "--config.entropy_coef=0.05", "--config.updates.update_without_signal=True",
           "--config.optimizer.warmup_steps=0", "--config.lora.train_router=True"]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(1), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"--out={workdir} is the run's workdir" in proc.stderr, proc.stderr[-4000:]
    assert open(os.path.join(workdir, "config.json")).read() == config_json
    assert sorted(os.listdir(workdir)) == listing
    for out in (os.path.dirname(workdir), os.path.join(workdir, "checkpoints")):
        with pytest.raises(FileExistsError, match="(holds it|is not empty)"):
            export_run(c, workdir, out)
    # A merged export, then a PEFT one into the same folder: refused; merged again: replaced.
    both = tmp_path / "both"
    first = export_run(c, workdir, str(both))
    with pytest.raises(FileExistsError, match=r"holds a --format=merged export; a --format=peft"):
        export_run(c, workdir, str(both), format="peft")
    assert not (both / "adapter_config.json").exists()
    again = export_run(c, workdir, str(both), max_shard_size="20KB")  # now shards
    assert not (both / "model.safetensors").exists() and "model.safetensors.index.json" in again["files"]
    record = json.loads((both / "gspo_jax_export.json").read_text())
    assert record["complete"] and record["format"] == "merged" and record["restored"] == first["restored"]
    assert set(record["files"]) == set(os.listdir(both)) - {"gspo_jax_export.json"}
    # A folder with other files in it.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is not empty \(notes\.txt\) and no export of ours"):
        export_run(c, workdir, str(other))
    assert os.listdir(other) == ["notes.txt"]


def test_trained_routers_travel_in_the_peft_adapter(tmp_path):
    """With the routers trained (lora.train_router), the PEFT adapter holds them as
    modules_to_save: PEFT on the untouched Hugging Face base is the trained model, which
    it is not with the adapters alone; our import reads them back."""
    from gspo_jax.models import export_peft, from_pretrained, load_peft
    from gspo_jax.models.hf_peft import PeftLora
    from test_evaluation import _tiny_hf_dir

    hf = str(tmp_path / "hf")
    _tiny_hf_dir(hf)
    lora = PeftLora(8, 16.0, default_config.LORA["targets"])
    model = from_pretrained(hf)
    _add_adapters(model, lora.targets, lora.rank, alpha=lora.alpha)
    rng = np.random.RandomState(0)
    for seg in model.segments:  # routers moved by training
        for blk in seg.blocks:
            if blk.is_moe:
                r = blk.mlp.router
                r.set_value(r[...] + rng.normal(0, 0.5, r.shape).astype(np.float32))
    tokens = _tokens(model)
    ours = _ours(model, tokens)
    routed, adapters_only = str(tmp_path / "routed"), str(tmp_path / "adapters_only")
    export_peft(model, routed, lora, base_model_name_or_path=hf, routers=True)
    export_peft(model, adapters_only, lora, base_model_name_or_path=hf)
    assert json.loads(open(os.path.join(routed, "adapter_config.json")).read())["modules_to_save"] == ["mlp.gate"]
    got = _torch_logits(peft.PeftModel.from_pretrained(_hf(hf), routed).eval(), tokens)
    np.testing.assert_allclose(got, ours, atol=1e-4)
    without = _torch_logits(peft.PeftModel.from_pretrained(_hf(hf), adapters_only).eval(), tokens)
    assert float(np.max(np.abs(without - ours))) > 1e-2
    back = from_pretrained(hf)
    _add_adapters(back, lora.targets, lora.rank, alpha=lora.alpha, zero=True)
    load_peft(routed, back)
    np.testing.assert_allclose(_ours(back, tokens), ours, atol=1e-5)


def test_rl_starts_from_a_peft_adapter_on_a_hugging_face_base(data_dir, tmp_path):
    from gspo_jax.models import export_peft, from_pretrained
    from gspo_jax.models.hf_peft import PeftLora
    from gspo_jax.run_parts import RunParts
    from test_evaluation import _tiny_hf_dir

    hf = str(tmp_path / "hf")
    _tiny_hf_dir(hf)
    lora = PeftLora(8, 16.0, default_config.LORA["targets"])
    donor = from_pretrained(hf)
    _add_adapters(donor, lora.targets, lora.rank, alpha=lora.alpha)
    adapter = str(tmp_path / "adapter")
    export_peft(donor, adapter, lora)

    def config(**lora_fields):
        c = default_config.get_config("lora,smoke")
        c.task.data_dir = data_dir
        c.model.pretrained = c.tokenizer = hf
        c.sft.steps = 0
        c.lora.peft_adapter = adapter
        c.lora.update(lora_fields)
        return c

    t = RunParts(config(), str(tmp_path / "run"))
    model = nnx.merge(t.graphdef, t.init_params)
    got, want = _adapters(model), _adapters(donor)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    tokens = _tokens(model)
    np.testing.assert_allclose(_ours(model, tokens), _ours(donor, tokens), atol=1e-5)

    # Refused by name: another rank or alpha, a folder that is no adapter, no HF base,
    # a warm start.
    with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.rank: 4, but the PEFT"):
        RunParts(config(rank=4), str(tmp_path / "r4"))
    with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.alpha: 8\.0, .*alpha=16\.0"):
        RunParts(config(alpha=8.0), str(tmp_path / "a8"))
    with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.peft_adapter: .*no adapter_config"):
        config_lib.validate(config(peft_adapter=hf), num_devices=1)
    for fields in (dict(pretrained=""), dict(steps=2)):
        c = config()
        c.model.pretrained = fields.get("pretrained", c.model.pretrained)
        if fields.get("pretrained") == "":
            c.tokenizer = "char"
        c.sft.steps = fields.get("steps", 0)
        with pytest.raises(config_lib.ConfigError, match=r"config\.lora\.peft_adapter: .*sft\.steps=0"):
            config_lib.validate(c, num_devices=1)


def test_a_workdir_saved_before_a_field_existed_compares_at_its_default():
    """A run saved before config.lora.peft_adapter existed is the run with it at its
    default: a resume, evaluation or export compares alike; any other value differs."""
    from gspo_jax import safety

    c = default_config.get_config("lora,smoke")
    saved = safety.config_record(c)
    del saved["lora"]["peft_adapter"]
    assert safety.config_differences(saved, safety.config_record(c)) == []
    c.lora.peft_adapter = "/some/adapter"
    assert safety.config_differences(saved, safety.config_record(c)) == [
        "config.lora.peft_adapter: '<absent>' -> '/some/adapter'"]
