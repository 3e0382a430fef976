"""experiments/bench_objectives.py's harness: chained passes compute what single calls do,
and bad arguments are refused by name."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from experiments import bench_objectives as bench  # noqa: E402
from gspo_jax import objectives  # noqa: E402


def _vg(name):
    fn = objectives.get(name)
    return jax.value_and_grad(
        lambda lp, old, adv, m, ref: fn(lp, old, adv, m, ref_logp=ref, kl_coef=0.04), has_aux=True)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_chained_passes_equal_single_calls(name):
    sets = 3
    x = bench.stacked_inputs(6, 16, sets)
    args = (x["logp"], x["old"], x["adv"], x["mask"], x["ref"])
    chained = bench.chained(_vg(name), sets)(*args)
    single = jax.jit(_vg(name))
    assert len(chained) == sets
    for i in range(sets):
        ((loss, metrics), grad) = single(*(a[i] for a in args))
        ((c_loss, c_metrics), c_grad) = chained[i]
        # Pass i > 0 sees logp + 1e-30 * loss: the same floats.
        assert float(c_loss) == float(loss)
        np.testing.assert_array_equal(c_grad, grad)
        for k in metrics:
            assert float(c_metrics[k]) == float(metrics[k]), k
    # The input sets differ (else the chain would time one set, cached).
    assert not np.array_equal(x["logp"][0], x["logp"][1])


def test_bad_arguments_are_refused(monkeypatch, capsys):
    for argv, msg in ((["--chain", "0"], "--chain must be >= 1"),
                      (["--profile", "--chain", "2"], "takes no --chain")):
        monkeypatch.setattr(sys, "argv", ["bench_objectives.py", *argv])
        with pytest.raises(SystemExit):
            bench.main()
        assert msg in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the error is for other backends")
def test_profile_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_objectives.py", "--profile", "--n", "2", "--t", "4",
                                      "--runs", "1", "--warmup", "0"])
    with pytest.raises(RuntimeError, match="needs a GPU backend"):
        bench.main()
