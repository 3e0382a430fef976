"""`experiments/bench/bench_accelerator.py` runs end to end at its tiny size (on CPU here,
the same code as on a GPU), and its FLOP and byte counts are the model's."""

import math

from experiments.bench import bench_accelerator as bench


def test_flop_and_byte_counts_follow_the_shape():
    cfg = bench.model_config("h200", "blocked", 8)
    # Active matmul parameters: head + per layer (attention + router + top-8 experts).
    d, hd = 2048, 128
    layer = d * hd * (32 + 8) + 32 * hd * d + d * 64 + 8 * 3 * d * 768
    assert bench.matmul_params(cfg, active=True) == 151936 * d + 8 * layer
    assert (
        bench.train_flops_per_token(cfg, 100)
        == 6 * (151936 * d + 8 * layer) + 6 * 8 * 32 * hd * 100
    )
    # At a batch of 1 the decode step touches top-K experts of E (in expectation),
    # at a large batch all of them.
    one, many = bench.decode_bytes(cfg, 1, 0), bench.decode_bytes(cfg, 4096, 0)
    expert = 2 * 3 * d * 768
    assert math.isclose(many - one, 8 * expert * (64 - 8), rel_tol=1e-6)


def test_tiny_run_reports_every_figure(tmp_path):
    out = bench.main(
        [
            "--size",
            "tiny",
            "--parts",
            "train,sampler",
            "--backends",
            "blocked",
            "--reps",
            "1",
            "--sampler-batches",
            "4",
            # Enough steps that 32 of them take measurably longer than the noise of a call.
            "--new-tokens",
            "64",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    rows = {r["part"]: r for r in out["rows"]}
    train, sampler = rows["train"], rows["sampler"]
    assert train["loss_finite"] and train["tokens"] == 4 * 31 and train["micro_batches"] == 2
    for key in ("mfu", "old_logp_mfu", "tokens_per_s"):
        assert 0 < train[key] < math.inf, key
    assert 0 < sampler["frac_roofline"] and sampler["decode_tokens_per_s"] > 0
    assert (tmp_path / "r.json").exists()
