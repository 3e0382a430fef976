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


def test_tiny_run_reports_every_figure(tmp_path, monkeypatch):
    # The sampler's figures are differences of two timings; on a loaded two-core machine
    # the longer call can come out faster (one CI run: 64 tokens no slower than 32). So
    # the sampler's calls run for real and report scripted seconds, 20 ms + 1 ms a
    # token, and the figures are checked against them exactly.
    real_timed = bench.timed

    def scripted(fn, *args, reps):
        sec, first, out = real_timed(fn, *args, reps=reps)
        if fn.__name__ != "sample":
            return sec, first, out
        (tokens,) = args
        return 0.02 + 0.001 * tokens, first, out

    monkeypatch.setattr(bench, "timed", scripted)
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
            "--new-tokens",
            "16",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    rows = {r["part"]: r for r in out["rows"]}
    train, sampler = rows["train"], rows["sampler"]
    assert train["loss_finite"] and train["tokens"] == 4 * 31 and train["micro_batches"] == 2
    for key in ("mfu", "old_logp_mfu", "tokens_per_s"):
        assert 0 < train[key] < math.inf, key
    assert sampler["new_tokens"] == 16 and sampler["prefill_s"] == 0.021
    assert sampler["total_s"] == 0.036
    assert sampler["decode_step_ms"] == 1.0 and sampler["decode_tokens_per_s"] == 4000.0
    # The roofline at the mean context of the timed steps (prompt + 12 of 16 tokens).
    sh = bench.programs.shape("tiny", "auto", 0)
    roof_s = bench.decode_bytes(sh.cfg, 4, sh.prompt_len + 12) / 4.8e12
    assert sampler["frac_roofline"] == bench._sig(roof_s / 0.001)
    assert (tmp_path / "r.json").exists()
