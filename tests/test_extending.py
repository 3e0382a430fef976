"""The extend pages (docs/extending.md) run, and what they quote is the code.

Each page's fenced blocks are read in order (`blocks`): a ``python`` block runs in the
page's namespace; ``python module=NAME`` becomes the importable module NAME; a block
whose info string names a file after the language is a quote of that file, and a
``diff FILE`` block an edit of it (its context and removed lines are the file's). After
a page has run, its test checks what the page built against values computed by hand,
and the registries the page added to (objectives, tasks, verifiers, plug-in rewards)
are restored, so that no other test sees the page's additions.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re
import sys
import tempfile
import types

import jax
import numpy as np
import pytest

from gspo_jax import config as config_lib
from gspo_jax import objectives, reward_plugins, rewards, safety, tasks, verifiers
from gspo_jax.answers import DEFAULT_LIMITS
from gspo_jax.data import PromptSource
from gspo_jax.objectives import registry

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("extend_objective.md", "extend_task.md", "extend_reward.md", "extend_config.md")
_OPEN = re.compile(r"^```(\w*)[ \t]*(.*)$")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the block's first line of code
    lang: str
    args: list[str]
    text: str

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``docs/<page>``, in order."""
    out, current = [], None
    for i, line in enumerate((REPO / "docs" / page).read_text().split("\n"), start=1):
        if current is None:
            m = _OPEN.match(line)
            if m:
                current = Block(page, i + 1, m.group(1), m.group(2).split(), "")
                lines = []
        elif line.rstrip() == "```":
            current.text = "\n".join(lines) + "\n"
            out.append(current)
            current = None
        else:
            lines.append(line)
    assert current is None, f"docs/{page}: a code block is not closed"
    return out


def _chunks(text: str) -> list[list[str]]:
    """The block's lines, cut at the lines ``...``."""
    out = [[]]
    for line in text.rstrip("\n").split("\n"):
        if line.strip() == "...":
            out.append([])
        else:
            out[-1].append(line)
    return [c for c in out if c]


def check_quote(block: Block) -> None:
    """A quote's chunks are in its file as they are, in order."""
    path = block.args[0]
    source = (REPO / path).read_text()
    pos = 0
    for chunk in _chunks(block.text):
        text = "\n".join(chunk) + "\n"
        found = source.find(text, pos)
        assert found >= 0, f"{block.where}: not in {path} (after offset {pos}):\n{text}"
        pos = found + len(text)


def check_diff(block: Block) -> None:
    """Each hunk's context and removed lines are a stretch of its file, as they are."""
    path = block.args[0]
    source = (REPO / path).read_text()
    for hunk in _chunks(block.text):
        old = [line[1:] for line in hunk if line.startswith((" ", "-")) or not line]
        text = "\n".join(old) + "\n"
        assert text in source, f"{block.where}: the edit's old lines are not in {path}:\n{text}"
        assert any(line.startswith(("+", "-")) for line in hunk), f"{block.where}: no change"


def run_page(page: str, monkeypatch) -> dict:
    """Runs the page's blocks in order; returns its namespace (a module of its own, as
    a script's, so that its dataclasses resolve their annotations)."""
    page_module = types.ModuleType(f"docs_{page[:-3]}")
    monkeypatch.setitem(sys.modules, page_module.__name__, page_module)
    namespace = page_module.__dict__
    ran = 0
    for block in blocks(page):
        if block.lang != "python" or block.args[:1] and not block.args[0].startswith("module="):
            continue  # prose, a quote or an edit
        # Padded so that a traceback's line numbers are the page's.
        code = compile("\n" * (block.line - 1) + block.text, f"docs/{page}", "exec",
                       dont_inherit=True)
        if block.args:
            name = block.args[0].removeprefix("module=")
            module = types.ModuleType(name)
            monkeypatch.setitem(sys.modules, name, module)
            exec(code, module.__dict__)
        else:
            exec(code, namespace)
        ran += 1
    assert ran, f"docs/{page} has no block that runs"
    return namespace


# ---------------------------------------------------------------------------


def test_every_page_is_on_the_index():
    index = (REPO / "docs" / "extending.md").read_text()
    assert set(re.findall(r"\((extend_\w+\.md)\)", index)) == set(PAGES)
    assert {p.name for p in (REPO / "docs").glob("extend_*.md")} == set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_quotes_and_edits_are_the_code(page):
    kinds = set()
    for block in blocks(page):
        if block.lang == "diff":
            check_diff(block)
        elif block.args and not block.args[0].startswith("module="):
            check_quote(block)
        else:  # runs (python), or prose (a formula, a command)
            assert block.lang in ("python", "", "text", "sh") and not block.args[1:], block.where
            continue
        kinds.add(block.lang)
    assert kinds, f"docs/{page} walks no real code"


def test_the_checks_reject_a_stale_quote_and_edit():
    quote = Block("x.md", 1, "python", ["gspo_jax/objectives/sapo.py"],
                  '    name = "sapo"\n...\n    tau_pos: float = 2.0\n')
    with pytest.raises(AssertionError, match="not in gspo_jax/objectives/sapo.py"):
        check_quote(quote)
    out_of_order = Block("x.md", 1, "python", ["gspo_jax/objectives/sapo.py"],
                         '    tau_neg: float = 1.05\n...\n    name = "sapo"\n')
    with pytest.raises(AssertionError):
        check_quote(out_of_order)
    edit = Block("x.md", 1, "diff", ["gspo_jax/objectives/sapo.py"],
                 '     name = "sapo"\n-    tau_pos: float = 0.5\n+    tau_pos: float = 2.0\n')
    with pytest.raises(AssertionError, match="old lines are not in"):
        check_diff(edit)


def test_adding_an_objective(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", copy.deepcopy(registry.REGISTRY))
    ns = run_page("extend_objective.md", monkeypatch)

    fn = objectives.get("pg")
    assert fn.hparams_class is ns["PGHparams"] and fn.fn is ns["pg"]
    assert fn.defaults == {"kl_coef": 0.0, "kl_estimator": "k3", "agg": "token-mean",
                           "norm_len": None, "adv_clip": 5.0}
    # The page's batch: ratios [[2, 1], [1, pad]], A = [3, -0.5] clipped at 2 to [2, -0.5].
    # token-mean: -(2*2 + 2*1 - 0.5*1) / 3; a missing clip would give -(3*2 + 3 - 0.5) / 3.
    assert np.isfinite(float(ns["loss"])) and np.all(np.isfinite(np.asarray(ns["grads"])))
    np.testing.assert_allclose(float(ns["loss"]), -5.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(ns["grads"], [[-4 / 3, -2 / 3], [0.5 / 3, 0.0]], rtol=1e-6)
    # Another aggregation, by hand: seq-mean-token-mean = (-(4 + 2) / 2 + 0.5 / 1) / 2.
    loss = jax.jit(lambda lp: fn(lp, ns["old_logp"], ns["advantages"], ns["mask"], adv_clip=2.0,
                                 agg="seq-mean-token-mean")[0])(ns["logp"])
    np.testing.assert_allclose(float(loss), (-3.0 + 0.5) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="pg: adv_clip must be > 0"):
        fn(ns["logp"], ns["old_logp"], ns["advantages"], ns["mask"], adv_clip=0.0)
    with pytest.raises(ValueError, match=r"pg: advantages must be f32\[N\] or f32\[N,T\]"):
        fn(ns["logp"], ns["old_logp"], np.ones(3, np.float32), ns["mask"])
    assert ns["error"] == "config.objective.hparams.adv_clip: must be > 0.0, got -1.0"

    monkeypatch.undo()
    assert "pg" not in objectives.names()


def test_adding_a_task(monkeypatch, tmp_path):
    tasks.names()  # the built-in tasks registered before the registry is copied
    tasks.names()  # the built-in tasks registered before the registry is copied
    monkeypatch.setattr(tasks, "REGISTRY", copy.deepcopy(tasks.REGISTRY))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the page's data_dir
    ns = run_page("extend_task.md", monkeypatch)

    assert tasks.get("digit_sum") is ns["TASK"] and ns["TASK"].levels is None
    assert pathlib.Path(ns["data_dir"]).parent == tmp_path
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # generated in memory
    # It yields examples: every one of the test split, whose answers are digit sums.
    src = PromptSource("digit_sum", "test", data_dir=ns["data_dir"], shuffle=False, style="instruct")
    assert len(src) == 32
    for e in src.first(32):
        n = e.prompt.removeprefix("What is the sum of the digits of ").split("?")[0]
        assert 100 <= int(n) < 1_000_000 and e.meta["answer"] == str(sum(int(d) for d in n))
        assert e.task == "digit_sum" and e.reference == f"<answer>{e.meta['answer']}</answer>"
    assert [e.index for e in ns["batch"]] == list(ns["train"].indices(0, 8))
    # It scores: 4821 -> 15.
    meta = {"answer": "15"}
    assert rewards.verify("digit_sum", "<answer>15</answer>", meta, DEFAULT_LIMITS).correct
    assert not rewards.verify("digit_sum", "<answer>16</answer>", meta, DEFAULT_LIMITS).correct
    c = config_lib.base_config()
    c.task.name, c.task.difficulty = "digit_sum", "easy"
    with pytest.raises(config_lib.ConfigError, match=r"^config\.task\.difficulty: digit_sum has no"):
        config_lib.validate(c, 1)

    monkeypatch.undo()
    assert "digit_sum" not in tasks.names()


def test_adding_a_reward_and_a_verifier(monkeypatch):
    monkeypatch.setattr(verifiers, "VERIFIERS", copy.deepcopy(verifiers.VERIFIERS))
    monkeypatch.setattr(reward_plugins, "_REWARD_FNS", {})
    ns = run_page("extend_reward.md", monkeypatch)

    assert ns["error"] == ("config.task.verifier: module 'my_rewards' has no function "
                           "'short_and_rigth'")
    # The plug-in scores a known answer: 250 characters are 50 past 200, 0.05 off.
    meta = {"verifier": "my_rewards:short_and_right", "answer": "7", "row": {}}
    texts = ["<answer> 7 </answer>", "y" * 232 + "<answer>7</answer>", "<answer>8</answer>"]
    reward, _, counts = rewards.score("file", texts, [meta] * 3)
    np.testing.assert_allclose(reward, [1.0, 0.95, 0.0], rtol=1e-6)
    # The verifier by name.
    v = verifiers.get("set_match")
    assert "set_match" in verifiers.names() and v.answer_kind == "tag"
    assert v.verify("<answer>c,a, b</answer>", {"answer": "a,b,c"}, DEFAULT_LIMITS).correct
    assert not v.verify("<answer>a,b</answer>", {"answer": "a,b,c"}, DEFAULT_LIMITS).correct
    assert v.reference_problem({"answer": "a"}) is None

    monkeypatch.undo()
    assert "set_match" not in verifiers.names() and "my_rewards" not in sys.modules
    assert "my_rewards:short_and_right" not in reward_plugins._REWARD_FNS


def test_adding_a_config_field(monkeypatch):
    ns = run_page("extend_config.md", monkeypatch)
    assert ns["error"] == "config.optimizer.eps: must be finite and > 0, got 0.0"
    assert ns["row"] == ("| `config.optimizer.eps` | `1e-08` | finite float > 0 | fixed | "
                         "Adam's epsilon (optax.adamw's eps) |")

    # The page's tree as the config's declaration: the field is in the whole config.
    config_lib.resumable_fields()  # cached from the package's own tree
    monkeypatch.setattr(config_lib, "_declaration", lambda: ns["RunConfig"])
    c = config_lib.base_config()
    assert c.optimizer.eps == 1e-8
    config_lib.validate(c, 1)
    assert config_lib.typed(c).optimizer.eps == 1e-8
    assert "| `config.optimizer.eps` | `1e-08` |" in config_lib.docs_table()
    for bad in (float("inf"), float("nan"), -1e-8, 0.0):
        c.optimizer.eps = bad
        with pytest.raises(config_lib.ConfigError, match=r"^config\.optimizer\.eps: must be finite and > 0"):
            config_lib.validate(c, 1)
    # A workdir saved before the field resumes at its default, and only there.
    saved = safety.config_record(config_lib.base_config())
    del saved["optimizer"]["eps"]
    c = config_lib.base_config()
    assert safety.config_differences(saved, safety.config_record(c)) == []
    c.optimizer.eps = 1e-6
    assert safety.config_differences(saved, safety.config_record(c)) == [
        "config.optimizer.eps: '<absent>' -> 1e-06"
    ]

    monkeypatch.undo()
    assert "eps" not in config_lib.base_config().optimizer
