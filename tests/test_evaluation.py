"""Held-out metrics (gspo_jax.heldout) and the evaluate entry point (gspo_jax.evaluate):
pass@k against hand-computed cases and a brute-force enumeration, maj@k, the config
field, and evaluation of a smoke run's workdir and of a tiny Hugging Face directory."""

import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from math import comb

import numpy as np
import pytest
from conftest import subprocess_env

from gspo_jax import config as config_lib
from gspo_jax import heldout, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from configs import default as default_config  # noqa: E402

# --------------------------------------------------------------------------
# pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 4, 4, 1.0),  # all correct
        (4, 0, 4, 0.0),  # none correct
        (4, 1, 4, 1.0),  # n = k: one correct is enough
        (4, 0, 1, 0.0),
        (4, 3, 1, 0.75),  # pass@1 = c / n
        (10, 1, 3, 0.3),  # 1 - C(9,3)/C(10,3) = 1 - 84/120
        (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
        (5, 3, 3, 1.0),  # n - c < k
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert heldout.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _brute_force(n, c, k):
    """Exact pass@k: the share of k-subsets of n samples (the first c correct) holding
    a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in s) for s in subsets)
    return Fraction(hits, len(subsets))


def test_pass_at_k_matches_brute_force_enumeration():
    for n in range(1, 8):
        for k in range(1, n + 1):
            cs = np.arange(n + 1)
            got = heldout.pass_at_k(n, cs, k)  # vectorised over prompts
            for c in cs:
                exact = _brute_force(n, int(c), k)
                assert exact == 1 - Fraction(comb(n - c, k), comb(n, k))
                assert got[c] == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form does not.
    got = heldout.pass_at_k(1000, [0, 1, 10, 1000], 500)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:2], [0.0, 0.5], atol=1e-12)
    assert got[3] == 1.0 and 0.99 < got[2] <= 1.0


def test_pass_at_k_per_prompt_sample_counts_and_errors():
    np.testing.assert_allclose(heldout.pass_at_k([5, 4], [2, 1], 2), [0.7, 0.5])
    with pytest.raises(ValueError, match="at least 3"):
        heldout.pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="num_correct"):
        heldout.pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        heldout.pass_at_k(2, 1, 0)


# --------------------------------------------------------------------------
# maj@k and answers


def test_maj_at_k_hand_cases():
    answers = [
        ["7", "8", "8", "7"],  # 8 wins at k=3; 7 and 8 tie at k=4 -> 7 (first)
        [None, "5", None, "6"],  # no answer does not vote
        [None, None, None, None],  # nothing to vote on: 0
        ["1+2", "2+1", "2+1", "1+2"],  # countdown: strings; tie at k=4 -> "1+2"
    ]
    correct = np.array([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(heldout.maj_at_k(answers, correct, 1), [0, 0, 0, 1])
    np.testing.assert_array_equal(heldout.maj_at_k(answers, correct, 2), [0, 1, 0, 1])
    np.testing.assert_array_equal(heldout.maj_at_k(answers, correct, 3), [1, 1, 0, 1])
    np.testing.assert_array_equal(heldout.maj_at_k(answers, correct, 4), [0, 1, 0, 1])
    # A wrong majority beats a right minority.
    assert heldout.maj_at_k([["3", "4", "4"]], [[1, 0, 0]], 3)[0] == 0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        heldout.maj_at_k(answers, correct, 5)


def _answer_kind(task, **fields):
    c = config_lib.base_config()
    c.task.name = task
    c.task.update(fields)
    return tasks.get(task).answer_kind(c.task)


def test_final_answers():
    # Each task says how its answers compare: Countdown by the tag's text, numeric ones by value.
    kinds = {t: _answer_kind(t) for t in ("countdown", "gsm8k", "arithmetic")}
    assert kinds == {"countdown": "tag", "gsm8k": "numeric", "arithmetic": "numeric"}
    assert _answer_kind("file", verifier="numeric") == "numeric"  # a user-file verifier
    assert _answer_kind("file", verifier="exact_match") == "tag"
    assert _answer_kind("file", verifier="math:isclose") == "tag"  # a plug-in reward
    assert heldout.final_answer(kinds["countdown"], "x <answer>(1 + 2) * 3</answer>") == "(1+2)*3"
    assert heldout.final_answer(kinds["countdown"], "<answer> </answer>") is None
    # Whitespace that keeps two numbers or words apart stays: "1 2" is not 12 for maj@k.
    tag = functools.partial(heldout.final_answer, "tag")
    assert tag("<answer>1 2</answer>") == "1 2" != tag("<answer>12</answer>") == "12"
    assert tag("<answer> x  =\n 3 </answer>") == "x=3" and tag("<answer>New\n York</answer>") == "New York"
    assert heldout.final_answer(kinds["countdown"], "no tag") is None
    # Numeric tasks compare values: 72, 72.0 and $72 are one answer.
    a = heldout.final_answers(kinds["gsm8k"], ["#### 72", "<answer>72.0</answer>", "The answer is $72."])
    assert a == ["72", "72", "72"]
    assert heldout.final_answer(kinds["arithmetic"], "<answer>0.5</answer>") == "1/2"
    assert heldout.final_answer(kinds["arithmetic"], "<answer>72 or 73</answer>") is None
    assert heldout.final_answer(_answer_kind("file", verifier="numeric"), "#### 1,000") == "1000"
    with pytest.raises(ValueError, match="kind must be one of"):
        heldout.final_answer("countdown", "<answer>1</answer>")


def test_eval_metrics_dict():
    correct = np.array([[1, 0, 1, 0], [0, 0, 0, 0]])
    answers = [["a", "b", "a", "b"], [None, "x", "x", "y"]]
    m = heldout.eval_metrics(correct, answers, ks=(1, 2, 4), greedy_correct=[1, 0])
    assert set(m) == {
        "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@1", "eval/maj@2", "eval/maj@4",
        "eval/mean@4", "eval/greedy"}
    assert m["eval/pass@1"] == pytest.approx(0.25) and m["eval/mean@4"] == pytest.approx(0.25)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6) / 2)
    assert m["eval/pass@4"] == pytest.approx(0.5)
    assert m["eval/maj@4"] == pytest.approx(0.5) and m["eval/greedy"] == pytest.approx(0.5)


# --------------------------------------------------------------------------
# The config field.


def test_eval_pass_k_is_validated():
    c = default_config.get_config("smoke")
    assert tuple(c.task.eval_pass_k) == (1, 2) and c.task.eval_samples == 2
    assert tuple(default_config.get_config("").task.eval_pass_k) == (1, 4)
    config_lib.validate(c, num_devices=1)
    for bad in [(1, 3), (0,), (), (1.5,), (True,)]:
        c.task.eval_pass_k = bad
        with pytest.raises(config_lib.ConfigError, match=r"config\.task\.eval_pass_k"):
            config_lib.validate(c, num_devices=1)


# --------------------------------------------------------------------------
# The entry point.

METRIC_KEYS = {"eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2", "eval/mean@2",
               "eval/greedy", "eval_reward_mean", "eval_greedy_reward"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds_eval"))


@pytest.fixture(scope="module")
def smoke_workdir(tmp_path_factory, data_dir):
    from gspo_jax import train

    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    workdir = str(tmp_path_factory.mktemp("smoke_run"))
    records = train.run(c, workdir)
    rl = [r for r in records if r["phase"] == "rl"]
    assert METRIC_KEYS <= set(rl[-1]), METRIC_KEYS - set(rl[-1])  # logged during training
    return workdir, c


def test_evaluate_a_workdir(smoke_workdir, tmp_path):
    from gspo_jax.evaluate import evaluate_checkpoint

    workdir, c = smoke_workdir
    out = evaluate_checkpoint(c, workdir)
    assert out["restored"] == "rl/2" and out["split"] == "test"
    assert out["num_prompts"] == c.task.eval_size
    assert METRIC_KEYS <= set(out), METRIC_KEYS - set(out)
    for k in METRIC_KEYS:
        assert 0.0 <= out[k] <= 1.0
    assert out["eval/mean@2"] == pytest.approx(out["eval_reward_mean"])
    assert out["eval/pass@1"] == pytest.approx(out["eval/mean@2"])
    assert out["eval/greedy"] == out["eval_greedy_reward"]
    assert out["eval/pass@2"] >= out["eval/pass@1"]
    # The last RL evaluation of the run scored the same parameters and prompts alike.
    from gspo_jax.metrics_log import read_metrics

    last = [r for r in read_metrics(workdir) if r["phase"] == "rl"][-1]
    for k in METRIC_KEYS:
        assert out[k] == pytest.approx(last[k]), k

    # Without RL checkpoints: the warm start's newest; another split and size.
    sft_only = str(tmp_path / "sft_only")
    shutil.copytree(workdir, sft_only, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(os.path.join(sft_only, "checkpoints", "rl"))
    out = evaluate_checkpoint(c, sft_only, split="train", num_prompts=3)
    assert out["restored"] == "sft/2" and out["split"] == "train" and out["num_prompts"] == 3
    assert METRIC_KEYS <= set(out)

    with pytest.raises(FileNotFoundError, match="neither a workdir"):
        evaluate_checkpoint(c, str(tmp_path / "nothing"))


def test_evaluate_command_line(smoke_workdir, data_dir, tmp_path):
    workdir, _ = smoke_workdir
    out_file = tmp_path / "m.json"
    env = subprocess_env(1)
    cmd = [sys.executable, "-m", "gspo_jax.evaluate", "--config=configs/default.py:smoke",
           f"--checkpoint={workdir}", "--split=test", f"--out={out_file}",
           f"--config.task.data_dir={data_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(out_file.read_text())
    assert METRIC_KEYS <= set(out) and out["restored"] == "rl/2"

    # --out a file of the run: refused before anything is evaluated, the file kept.
    metrics = os.path.join(workdir, "metrics.jsonl")
    before = open(metrics).read()
    cmd[cmd.index(f"--out={out_file}")] = f"--out={metrics}"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines() == [
        f"FileExistsError: --out={metrics} exists and is not an earlier evaluation's output; "
        "writing the scores there would replace it: name a new file. Nothing was evaluated"]
    assert open(metrics).read() == before


def test_evaluate_out_replaces_only_an_earlier_evaluation(tmp_path):
    from gspo_jax.evaluate import check_out_file

    check_out_file(str(tmp_path / "new.json"))
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"checkpoint": "/runs/a", "restored": "rl/2", "eval/pass@1": 0.5}))
    check_out_file(str(earlier))
    for name, text in (("config.json", json.dumps({"objective": {"name": "gspo"}})),
                       ("metrics.jsonl", '{"step": 1}\n{"step": 2}\n'), ("notes.txt", "mine")):
        (tmp_path / name).write_text(text)
        with pytest.raises(FileExistsError, match="is not an earlier evaluation's output"):
            check_out_file(str(tmp_path / name))
    with pytest.raises(FileExistsError):
        check_out_file(str(tmp_path))  # a folder


def _tiny_hf_dir(path):
    """A Qwen3-MoE checkpoint (export_pretrained of a fresh tiny model) with a byte-level
    BPE tokenizer.json trained here."""
    import jax
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gspo_jax.models import ModelConfig, Transformer, export_pretrained

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_end|>", "<answer>", "</answer>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Make 16 from 3 5 2 with + - * /, each once. <answer>(3+5)*2</answer>"],
                            trainer)
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, d_ff=64, moe_d_ff=32, num_experts=4, top_k=2)
    with jax.default_device(jax.devices()[0]):
        export_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), path)


def test_evaluate_a_hugging_face_directory(data_dir, tmp_path):
    from gspo_jax.evaluate import evaluate_checkpoint, is_hf_dir

    hf = str(tmp_path / "hf")
    _tiny_hf_dir(hf)
    assert is_hf_dir(hf)
    c = default_config.get_config("smoke")
    c.task.data_dir = data_dir
    c.task.eval_size = 4
    out = evaluate_checkpoint(c, hf)
    assert out["restored"] == "pretrained" and out["num_prompts"] == 4
    assert METRIC_KEYS <= set(out), METRIC_KEYS - set(out)
    assert not any(name.startswith("gspo_eval_") for name in os.listdir(str(tmp_path)))


def _tree(root):
    """Every file and directory under ``root`` with its size and modification time: a
    write anywhere (a file made and removed again changes its directory's mtime) shows."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), root)] = (st.st_size, st.st_mtime_ns)
    st = os.stat(root)
    out["."] = (st.st_size, st.st_mtime_ns)
    return out


def _chmod_tree(root, write):
    for d, dirs, files in os.walk(root):
        for name in files + dirs + [""]:
            p = os.path.join(d, name)
            mode = os.stat(p).st_mode
            os.chmod(p, mode | 0o200 if write else mode & ~0o222)


def test_evaluate_a_read_only_workdir(smoke_workdir, data_dir, tmp_path):
    # chmod -R a-w (as root, write permission is not enforced: then the snapshot of
    # every file's and directory's size and mtime is what shows a write).
    from gspo_jax.evaluate import evaluate_checkpoint
    from gspo_jax.metrics_log import read_metrics

    workdir, c = smoke_workdir
    c = c.copy_and_resolve_references()
    c.task.data_dir = ""  # the run's <workdir>/data, else prepared outside the workdir
    last = [r for r in read_metrics(workdir) if r["phase"] == "rl"][-1]

    # Without prepared data in the workdir, and step 2 damaged: step 1, nothing moved aside.
    bare = str(tmp_path / "bare")
    shutil.copytree(workdir, bare, ignore=shutil.ignore_patterns(".lock"))
    state = os.path.join(bare, "checkpoints", "rl", "2", "state")
    big = max((os.path.join(d, f) for d, _, fs in os.walk(state) for f in fs), key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        f.write(b"\xff" * 64)
    # With the run's prepared data in <workdir>/data.
    with_data = str(tmp_path / "with_data")
    shutil.copytree(workdir, with_data, ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(data_dir, os.path.join(with_data, "data"))
    before = {w: _tree(w) for w in (bare, with_data)}
    for w in before:
        _chmod_tree(w, write=False)
    try:
        out_bare = evaluate_checkpoint(c, bare)
        out = evaluate_checkpoint(c, with_data)
    finally:
        for w in before:
            _chmod_tree(w, write=True)
    for w, tree in before.items():
        after = _tree(w)
        changed = sorted(k for k in set(tree) | set(after) if tree.get(k) != after.get(k))
        assert not changed, (w, changed)
    assert out_bare["restored"] == "rl/1" and out["restored"] == "rl/2"
    for k in METRIC_KEYS:
        assert out[k] == pytest.approx(last[k]), k


def _read_only_mount_prefix(probe_dir):
    """The argv prefix ``prefix + [folder, shell_command]`` that runs ``shell_command``
    with ``folder`` bind-mounted read-only over itself, in a private mount namespace
    (``unshare -rm``: nothing leaks, nothing to undo); a pytest skip naming what is
    missing where that cannot be done (tried on ``probe_dir``). Unlike ``chmod``, which
    root ignores, a read-only mount refuses every write."""
    import shlex

    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("mount") is None:
        pytest.skip("a read-only mount needs unshare and mount, and this machine lacks them")
    prefix = [unshare, "-rm", "sh", "-c",
              'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && '
              'eval "$@"', "sh"]
    probe = subprocess.run(prefix + [str(probe_dir), f"! touch {shlex.quote(str(probe_dir))}/x"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount in a private namespace here: {probe.stderr[-300:]}")
    return prefix


def test_evaluate_a_read_only_mounted_workdir_with_its_own_data(smoke_workdir, data_dir, tmp_path):
    """`python -m gspo_jax.evaluate` on workdirs under a read-only mount (an archive, a
    snapshot; root cannot write there either). The smoke run's Countdown is generated in
    memory: whatever its data/ holds (a run's leftovers, an empty .prepare_locks/), or a
    read-only data dir given (task.data_dir), nothing there is read or written. A task
    prepared on disk (a user's file) is read there without a lock where it is prepared;
    where it is not, a given data dir that cannot be written is refused in one line.
    Nothing under the mount changes."""
    import shlex

    from gspo_jax.metrics_log import read_metrics

    workdir, _ = smoke_workdir
    last = [r for r in read_metrics(workdir) if r["phase"] == "rl"][-1]
    ro = tmp_path / "ro"
    with_data, unprepared = ro / "with_data", ro / "unprepared"
    shutil.copytree(workdir, with_data, ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(data_dir, with_data / "data")  # whatever a run leaves there
    shutil.copytree(workdir, unprepared, ignore=shutil.ignore_patterns(".lock"))
    os.makedirs(unprepared / "data" / ".prepare_locks")
    # A workdir of a user's file (no checkpoint is read before the data are).
    file_run = ro / "file_run"
    os.makedirs(file_run / "checkpoints")
    os.makedirs(file_run / "data" / ".prepare_locks")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": i + 1}) + "\n"
                            for i in range(8)))
    # Its data prepared before the mount (a run's data/): read there without a lock.
    from gspo_jax.data import PromptSource
    from gspo_jax.tasks.user_file import FileTask

    spec = FileTask(file=str(rows))
    prepared = PromptSource("file", "train", data_dir=file_run / "prepared", file_task=spec)
    shutil.rmtree(file_run / "prepared" / ".prepare_locks")
    read = ("import sys; from gspo_jax.data import PromptSource; from gspo_jax.tasks.user_file "
            "import FileTask; src = PromptSource('file', 'train', data_dir=sys.argv[1], "
            "file_task=FileTask(file=sys.argv[2])); print([e.prompt for e in src.first(9)])")
    os.makedirs(tmp_path / "probe")
    prefix = _read_only_mount_prefix(tmp_path / "probe")
    before = _tree(str(ro))
    evaluate = [sys.executable, "-m", "gspo_jax.evaluate", "--config=configs/default.py:smoke"]
    outs = {"with_data": with_data, "unprepared": unprepared, "given": unprepared}
    commands = [
        shlex.join(evaluate + [f"--checkpoint={w}", f"--out={tmp_path / (name + '.json')}"]
                   + ([f"--config.task.data_dir={w / 'data'}"] if name == "given" else []))
        for name, w in outs.items()
    ]
    given = shlex.join([sys.executable, "-m", "gspo_jax.evaluate",
                        f"--config=configs/file_task.py:file={rows},smoke",
                        f"--checkpoint={file_run}", f"--config.task.data_dir={file_run / 'data'}"])
    err = tmp_path / "given.err"
    commands.append(f"{{ {given} 2> {shlex.quote(str(err))}; test $? = 1; }}")
    commands.append(shlex.join([sys.executable, "-c", read, str(file_run / "prepared"), str(rows)]))
    proc = subprocess.run(prefix + [str(ro), " && ".join(commands)], cwd=REPO,
                          env=subprocess_env(8), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:] + (err.read_text() if err.exists() else "")
    assert proc.stdout.strip().splitlines()[-1] == repr([e.prompt for e in prepared.first(9)])
    line = [x for x in err.read_text().strip().splitlines() if "Using custom data configuration" not in x]
    assert len(line) == 1 and re.fullmatch(
        re.escape("DataDirNotWritable: gspo_user_file/sha256_") + "[0-9a-f]{24}"
        + re.escape(f"/2.0.0 is not prepared under the data dir {file_run / 'data'}, and nothing "
                    "can be written there to prepare it (Read-only file system): prepare it in a "
                    "data dir that can be written"), line[0]), line
    after = _tree(str(ro))
    assert not sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    for name in outs:
        out = json.loads((tmp_path / (name + ".json")).read_text())
        assert out["restored"] == "rl/2", (name, out)
        for k in METRIC_KEYS:  # the run's own prompts, scored as during training
            assert out[k] == pytest.approx(last[k]), (name, k)


def test_evaluate_names_the_config_fields_that_differ(smoke_workdir, data_dir, tmp_path):
    from gspo_jax.evaluate import evaluate_checkpoint

    workdir, c = smoke_workdir
    other = c.copy_and_resolve_references()
    other.model.fields.moe_d_ff = 48
    other.rollout.temperature = 0.5
    with pytest.raises(config_lib.ConfigError) as e:
        evaluate_checkpoint(other, workdir)
    msg = str(e.value)
    assert "config.model.fields.moe_d_ff: 32 -> 48" in msg and "config.rollout.temperature: 1.0 -> 0.5" in msg
    assert "2 field(s)" in msg and os.path.join(workdir, "config.json") in msg
    assert "Move these" not in msg  # the checkpoints are not blamed
    # Without config.json: the newest RL checkpoint's own record.
    forked = str(tmp_path / "forked")
    shutil.copytree(workdir, forked, ignore=shutil.ignore_patterns(".lock", "config.json"))
    with pytest.raises(config_lib.ConfigError, match=r"(?s)config\.model\.fields\.moe_d_ff: 32 -> 48.*rl/2/meta/metadata"):
        evaluate_checkpoint(other, forked)

    # On the command line: the message alone, in a few lines, exit status 2.
    env = subprocess_env(1)
    cmd = [sys.executable, "-m", "gspo_jax.evaluate", "--config=configs/default.py:smoke",
           f"--checkpoint={workdir}", f"--config.task.data_dir={data_dir}", "--config.model.fields.moe_d_ff=48"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "config.model.fields.moe_d_ff: 32 -> 48" in proc.stderr
    assert len(proc.stderr.splitlines()) < 10 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
