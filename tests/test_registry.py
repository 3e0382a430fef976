"""gspo_jax.registry: one registry style for objectives, estimators, tasks, verifiers."""

import pytest

from gspo_jax import advantages, objectives, tasks, verifiers
from gspo_jax.registry import Registry


def test_register_get_names_and_refusals():
    calls = []
    r = Registry("thing", discover=lambda: calls.append(1) or r.register("b", 2), sort=True)
    r.register("c", 3)
    assert r.names() == ("b", "c") and calls == [1]  # discovered once, on first use
    assert r.get("b") == 2 and "c" in r and "a" not in r and list(r) == ["b", "c"]
    assert r.register("c", 3) == 3  # the same thing again is no change
    with pytest.raises(ValueError, match="a thing named 'c' is already registered"):
        r.register("c", 4)
    with pytest.raises(ValueError, match=r"unknown thing 'a'; known: \('b', 'c'\)"):
        r.get("a")
    r.unregister("c")
    assert r.names() == ("b",) and calls == [1]


def test_every_kind_is_one_registry():
    for registry in (objectives.REGISTRY, advantages.GROUP_ESTIMATORS, tasks.REGISTRY,
                     verifiers.VERIFIERS):
        assert isinstance(registry, Registry) and registry.names()
    assert objectives.names()[:2] == ("ppo", "grpo")  # the order the module declares
    assert advantages.GROUP_ESTIMATORS.names() == ("group", "group_no_std", "rloo")
    assert tasks.names() == tuple(sorted(tasks.names()))


@pytest.mark.parametrize("old, new", [("generate", "decode"), ("evaluation", "heldout"),
                                      ("fields", "config_fields"), ("lora_rl", "lora_training"),
                                      ("sweep_points", "sweep_grid"), ("trainer", "run_parts")])
def test_renamed_modules_keep_their_old_import_paths(old, new):
    """A renamed module's old path imports as the module itself for one release."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        moved = importlib.import_module(f"gspo_jax.{old}")
    assert moved is importlib.import_module(f"gspo_jax.{new}")
    if old == "trainer":  # and the class under its old name
        assert moved.Trainer is moved.RunParts
