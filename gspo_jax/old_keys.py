"""Config keys that moved or went, and how a config (or a workdir's saved config) that
still uses one is read: a moved key's value goes to its new path with a one-line
notice (`move_deprecated`; `move_deprecated_record` for a saved record, silently); a
removed key runs at the one value it ever accepted, with a notice, and any other
value is refused (`removed_key`)."""

from __future__ import annotations

import sys
from typing import Any

import ml_collections

from gspo_jax import config_fields
from gspo_jax.config_fields import err as _err

# Keys that are gone, with the one value they ever accepted and why: a config that
# still sets that value is run with a one-line notice, any other value is refused.
REMOVED_KEYS = {
    "rollout.top_p": (1.0, "RL samples the whole softmax(logits / temperature)"),
    "rollout.top_k": (0, "RL samples the whole softmax(logits / temperature)"),
}


def move_deprecated(c: ml_collections.ConfigDict) -> None:
    """Moves a value set at a deprecated path to its new one, with a one-line notice on
    stderr; the old path is then None (so a config reads the same either way):

      updates.gamma_min -> objective.hparams.gamma_min (RSPO's floor; under another
                           objective, which takes no floor, the value is dropped)

    Called by `validate`, and before a resume compares a config with the saved one."""
    old = c.updates.gamma_min
    if old is None:
        return
    if not (config_fields.is_real(old) and 0 < old <= 1):
        raise _err("updates.gamma_min", f"must be finite and in (0, 1], got {old!r}")
    if "gamma_min" in c.objective.hparams:
        from gspo_jax import objectives  # local: keeps config import light

        new = c.objective.hparams.gamma_min
        if new not in (old, objectives.get("rspo").defaults["gamma_min"]):
            raise _err(
                "updates.gamma_min",
                f"{old!r} conflicts with config.objective.hparams.gamma_min={new!r}; "
                "set only the latter (updates.gamma_min is deprecated)",
            )
        c.objective.hparams.gamma_min = float(old)
        where = f"now config.objective.hparams.gamma_min={float(old)!r}"
    else:
        where = f"dropped: objective {c.objective.name!r} takes no floor (RSPO's hyperparameter)"
    print(
        "gspo_jax: config.updates.gamma_min is deprecated; use "
        f"config.objective.hparams.gamma_min ({where})",
        file=sys.stderr,
    )
    c.updates.gamma_min = None


def move_deprecated_record(record: dict) -> dict:
    """A saved config record (a workdir's config.json) with `move_deprecated`'s moves
    made, silently: a workdir written before a move resumes under the new path."""
    updates = record.get("updates", {})
    old = updates.get("gamma_min")
    if old is None:
        return record
    record = {**record, "updates": {**updates, "gamma_min": None}}
    objective = record.get("objective", {})
    if "gamma_min" in objective.get("hparams", {}) or objective.get("name") == "rspo":
        hparams = {**objective.get("hparams", {}), "gamma_min": float(old)}
        record["objective"] = {**objective, "hparams": hparams}
    return record


def removed_key(path: str, value: Any) -> None:
    """A removed key (`REMOVED_KEYS`) of a config: a notice at its one accepted value,
    else ConfigError naming it."""
    only, why = REMOVED_KEYS[path]
    if isinstance(value, bool) or value != only:
        raise _err(
            path,
            f"removed ({why}; a truncated distribution would bias the gradient); it only "
            f"ever accepted {only!r}, got {value!r}",
        )
    print(f"config.{path}: removed ({why}); ignored, delete it", file=sys.stderr)
