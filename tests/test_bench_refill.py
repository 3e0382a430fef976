"""`experiments/bench/bench_refill.py`: the fill rule's host simulation counts the steps the
refilling program runs, and the bench's three programs decode the same rows."""

import numpy as np

from experiments.bench import bench_refill


def test_simulated_steps_by_hand():
    # 2 slots, chunk 1: rows of 3, 1, 2, 4 tokens. Fill: slots take rows 0 (2 steps left)
    # and 1 (ends at its first token: slot 1 free), then row 2 (1 left). Step 1: row 2
    # ends, row 3 takes its slot (3 left). Step 2: row 0 ends. Steps 3-4: row 3 ends.
    assert bench_refill.simulate_steps([3, 1, 2, 4], 2, 1) == 4
    # Chunk 2: row 3 waits until both slots are free (after step 2), then 3 more steps.
    assert bench_refill.simulate_steps([3, 1, 2, 4], 2, 2) == 4 + 1
    assert bench_refill.simulate_steps([5] * 4, 4, 4) == 4  # every row at once


def test_bench_runs_and_its_simulation_is_the_program(capsys):
    out = bench_refill.main(["--prompts", "4", "--group-size", "4", "--max-new-tokens", "24",
                             "--stop", "40", "--slots", "8", "--chunk", "2", "--layers", "1",
                             "--repeats", "1"])
    progs = out["programs"]
    assert set(progs) == {"all_at_once", "batches_of_8", "refill_8x2"}
    assert all(p["same_lengths"] for p in progs.values())
    refill = progs["refill_8x2"]
    assert refill["decode_steps"] == refill["simulated_steps"]
    assert progs["all_at_once"]["decode_steps"] == out["lengths"]["max"] - 1
    assert 0 < refill["live_share"] <= 1 and refill["slot_steps"] == 8 * refill["decode_steps"]
    assert "refill steps simulated" in capsys.readouterr().out
    flagship = out["flagship_steps"]["flagship"]
    assert flagship["all_at_once"] == flagship["max"] - 1
    assert flagship["refill_256x32"] < flagship["batches_of_256"]
    np.testing.assert_equal(sorted(out["flagship_steps"]), ["flagship", "flagship_thinking"])
