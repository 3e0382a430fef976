r"""A user's own prompts and answers: a JSONL or Parquet file, a verifier by name.

    python -m gspo_jax.train --config=configs/file_task.py:file=data/my_prompts.jsonl \
        --workdir=runs/mine
    python -m gspo_jax.train --config=configs/file_task.py:file=data/my_prompts.jsonl,smoke \
        --config.task.verifier=boxed_math --workdir=/tmp/smoke

Arguments (comma-separated): ``file=<path>`` (a ``.jsonl`` or ``.parquet`` file; it
can also be set with ``--config.task.file``), ``smoke`` shrinks everything to two steps.

Defaults: the rows' ``prompt`` and ``answer`` columns, verifier ``numeric``, bad rows
(checked up front, with the run's tokenizer and prompt length) listed and skipped, each
prompt kept once, about 10% of them held out as the test split (by a hash of the
prompt, so an edited file keeps every other row's split), no warm start
(``sft.steps=0``: a file has no reference solutions unless ``task.solution_column``
names them). The columns, the verifier (``numeric``, ``countdown``, ``exact_match``,
``boxed_math`` or a reward function ``module:function``), a chat ``messages_column``
and a ``test_file`` are ``config.task`` fields (gspo_jax/tasks/user_file.py).
"""

from gspo_jax import config as config_lib


def get_config(arg: str | None = None):
    args = config_lib.parse_arg(arg, known=("file", "smoke"))
    c = config_lib.base_config()
    config_lib.set_objective(c, "gspo", dict(eps_low=0.02, eps_high=0.03))
    c.task.name = "file"
    c.task.difficulty = ""
    c.task.file = args.get("file", "")
    c.sft.steps = 0
    # A user's prompts may be longer than the built-in tasks': 256 tokens (characters
    # with the char tokenizer) by default; a longer one stops the run with an error
    # naming config.rollout.max_prompt_len (or set rollout.long_prompts="truncate").
    c.rollout.max_prompt_len = 256
    if args.get("smoke"):
        config_lib.apply_smoke(c)
        c.sft.steps = 0
    return c
