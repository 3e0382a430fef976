"""`experiments/compile_report.py`: programs compiled for an H200 this machine does not
have, their memory accounted for, and the ops the report looks for found where they are
planted (and not where they are not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments import compile_report, hlo, programs, targets


@pytest.fixture(autouse=True)
def no_persistent_cache():
    """Programs for a compile-only device are not for the session's compilation cache
    (they cannot be loaded from it)."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def h200():
    try:
        return targets.compile_devices("h200")
    except targets.TargetUnavailable as e:  # the CUDA plugin is an optional extra
        pytest.skip(str(e))


def _compile(fn, *shapes, device):
    sh = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    c = jax.jit(fn).lower(*args).compile()
    comps = hlo.parse_module(c.as_text())
    counts, unknown = hlo.execution_counts(comps)
    return c, comps, counts, unknown


def test_unknown_targets_are_named():
    with pytest.raises(ValueError, match="'h300'.*h100, h200, b200"):
        targets.compile_devices("h300")


def test_gpu_specs_fill_in_the_cudnn_version():
    spec = targets.gpu_spec("h100")
    assert "DNNVER" not in spec and "DNNMAJ" not in spec and 'name: "NVIDIA H100 80GB HBM3"' in spec


def test_planted_expert_weight_scatter_and_f32_vocab_matmul_are_found(h200):
    E, D, F, V = 8, 256, 128, 4096
    dev = h200.devices[0]

    def planted(w, idx, h, head):
        # A per-row gather of expert weights and the scatter-add of its gradient.
        copies = w[idx]  # [rows, D, F]
        grad = jnp.zeros_like(w).at[idx].add(copies)
        logits = jnp.dot(h, head, preferred_element_type=jnp.float32)  # f32 over V
        return grad, logits

    _, comps, counts, _ = _compile(
        planted,
        ((E, D, F), jnp.bfloat16),
        ((64,), jnp.int32),
        ((32, D), jnp.float32),
        ((D, V), jnp.float32),
        device=dev,
    )
    inv = hlo.inventory(comps, counts, vocab_size=V, expert_shapes=[(D, F), (F, D)], num_experts=E)
    ops = {w["opcode"] for w in inv["expert_weight_copies"]}
    assert ops == {"gather", "scatter"}, inv["expert_weight_copies"]
    assert inv["expert_weight_copy_gib"] == pytest.approx(2 * 64 * D * F * 2 / 2**30, rel=0.01)
    assert len(inv["f32_vocab_matmuls"]) == 1
    assert inv["f32_vocab_matmuls"][0]["gflops"] == pytest.approx(2 * 32 * D * V / 1e9)

    # The same program in bf16, reading the experts in place: nothing to report.
    def clean(w, h, head):
        return jnp.einsum("edf,ed->ef", w, h[:E]), jnp.dot(h, head)

    _, comps, counts, _ = _compile(
        clean,
        ((E, D, F), jnp.bfloat16),
        ((32, D), jnp.bfloat16),
        ((D, V), jnp.bfloat16),
        device=dev,
    )
    inv = hlo.inventory(comps, counts, vocab_size=V, expert_shapes=[(D, F), (F, D)], num_experts=E)
    assert inv["expert_weight_copies"] == [] and inv["f32_vocab_matmuls"] == []


def test_matmul_flops_count_loop_trips(h200):
    def looped(x, w):
        return jax.lax.fori_loop(0, 7, lambda i, x: jnp.tanh(x @ w), x)

    _, comps, counts, unknown = _compile(
        looped, ((128, 256), jnp.bfloat16), ((256, 256), jnp.bfloat16), device=h200.devices[0]
    )
    total = sum(m.flops * m.count for m in hlo.matmuls(comps, counts))
    assert not unknown and total == 7 * 2 * 128 * 256 * 256


def test_tiny_train_step_report_adds_up(h200):
    sh = programs.shape("tiny", "blocked", platform="cuda", dtype="bfloat16")
    mesh = compile_report.mesh_for(h200, {"data": 1})
    r = compile_report.report_one("train", sh, h200, mesh, batch=0, mem_fraction=0.95, top=10_000)
    mem = r["memory"]
    assert mem["peak_gib"] == pytest.approx(
        mem["arguments_gib"] + mem["outputs_gib"] + mem["temporaries_gib"] - mem["aliased_gib"]
    )
    assert mem["usable_gib"] == pytest.approx(151397597184 * 0.95 / 2**30)
    # The arguments are the state and the batch, each labelled by what it is.
    args = [b for b in r["largest_buffers"] if not b["name"].startswith("heap slot")]
    # (XLA counts each argument rounded up to its alignment: a few bytes per scalar.)
    arg_bytes = sum(b["bytes"] for b in args)
    assert 0 <= mem["arguments_gib"] * 2**30 - arg_bytes <= 64 * len(args)
    kinds = {b["what"] for b in args}
    assert {"parameter", "optimizer state", "input"} <= kinds
    params = {b["name"]: b for b in args if b["what"] == "parameter"}
    assert sum(b["bytes"] for b in params.values()) == 4 * sh.cfg.num_params()  # f32
    # Adam's two moments: one array of each parameter's shape and dtype.
    state = [b for b in args if b["what"] == "optimizer state"]
    moments = sorted((b["shape"], b["bytes"]) for b in state if b["shape"] != "s32[]")
    assert moments == sorted(2 * [(b["shape"], b["bytes"]) for b in params.values()])
    # The heap's slots hold the temporaries (XLA reports them in slots of its heap).
    heap = sum(b["bytes"] for b in r["largest_buffers"] if b["name"].startswith("heap slot"))
    assert heap >= 0.9 * mem["temporaries_gib"] * 2**30
    # The blocked dispatch gathers expert weights per block; their gradient is a matmul
    # with the blocks' one-hot experts, not a scatter (dispatch.take_expert_blocks).
    ops = {w["opcode"] for w in r["inventory"]["expert_weight_copies"]}
    assert ops == {"gather"}
    assert r["inventory"]["f32_vocab_matmuls"] == []  # the head's backward runs in bf16
    assert r["hlo_over_model"] > 1  # rematerialisation and block padding, never fewer
    text = compile_report.render(r)
    assert "NVIDIA H200" in text and "expert-weight gathers/scatters" in text


def test_ragged_train_step_reads_experts_in_place(h200):
    """'auto' on the H200 is the ragged dispatch: tokamax's Hopper kernel in the
    forward, lhs-gradient and weight-gradient forms, no copy of expert weights, no
    dense expansion, and the kernels' FLOPs in the program's count."""
    sh = programs.shape("tiny", "auto", platform="cuda", dtype="bfloat16")
    mesh = compile_report.mesh_for(h200, {"data": 1})
    r = compile_report.report_one("train", sh, h200, mesh, batch=0, mem_fraction=0.95, top=5)
    assert r["moe_backend"] == "auto"
    inv = r["inventory"]
    assert inv["expert_weight_copies"] == [] and inv["ragged_dot_dense"] == []
    assert inv["custom_calls"].get("mosaic_gpu_v2", 0) > 0
    # The program's matmuls: the model's, plus what the remat policy recomputes, and
    # not more than 1.3x of that.
    assert 1 <= r["hlo_over_model"] <= 1.3 * r["expected_over_model"]


def test_ragged_backward_leaves_the_stacked_expert_weights_in_their_layout(h200):
    """The lhs gradient of the grouped matmul reads each expert matrix transposed. On
    the GPU that transpose is of the layer's own bf16 weight: XLA's layout assignment
    does not move it up to the stacked f32 weights that the layer scan slices, which
    used to be transposed whole into a copy before the backward's layer loop (18 GiB
    at the benchmark's 16 layers: `dispatch.transposed_in_place`, docs/moe.md)."""
    from gspo_jax.models import dispatch

    layers, e, d, f, n, k = 3, 8, 256, 128, 64, 2

    def step(ws, x, idx, gates):
        def loss(ws):
            def layer(h, w):
                wg, wu, wd = (a.astype(jnp.bfloat16) for a in w)
                return h + dispatch.dispatch_ragged(h, idx, gates, wg, wu, wd), None

            h, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
            return jnp.sum(h.astype(jnp.float32) ** 2)

        return jax.tree.map(lambda w, g: w - g, ws, jax.grad(loss)(ws))

    sh = jax.sharding.SingleDeviceSharding(h200.devices[0])
    up, down = (layers, e, d, f), (layers, e, f, d)
    ws = tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh) for s in (up, up, down))
    rows = [((n, d), jnp.bfloat16), ((n, k), jnp.int32), ((n, k), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=sh) for s, t in rows]
    with targets.compiling_for(h200):
        text = jax.jit(step, donate_argnums=0).lower(ws, *args).compile().as_text()
    stacked = {f"f32[{','.join(map(str, s))}]" for s in (up, down)}
    moved = [
        i
        for c in hlo.parse_module(text).values()
        for i in c.instrs
        if i.type.split("{")[0] in stacked
        and (i.opcode == "transpose" or not i.type.endswith("{3,2,1,0}"))
    ]
    assert moved == [], [f"{i.opcode} {i.type}" for i in moved]
    assert "mosaic_gpu_v2" in text  # the GPU kernels, not XLA's ragged_dot


@pytest.mark.parametrize("rows", [200, 45024])
def test_grouped_matmul_compiles_for_the_gpu_at_any_row_count(h200, rows):
    """The GPU kernels tile rows (by 8, and by 64 in the weight gradient): a row
    count that is a multiple of neither compiles, forward and backward, with the
    three products as kernel calls and their FLOPs counted."""
    from gspo_jax.models import dispatch

    d, f, e = 256, 128, 8

    def loss(x, w, sizes):
        return jnp.sum(dispatch.grouped_matmul(x, w, sizes).astype(jnp.float32) ** 2)

    with targets.compiling_for(h200):
        c, comps, counts, _ = _compile(
            jax.grad(loss, argnums=(0, 1)),
            ((rows, d), jnp.bfloat16),
            ((e, d, f), jnp.bfloat16),
            ((e,), jnp.int32),
            device=h200.devices[0],
        )
    grouped = [m for m in hlo.matmuls(comps, counts) if m.kind == "grouped"]
    assert len(grouped) == 3
    padded = -(-rows // dispatch.GROUPED_ROW_TILE) * dispatch.GROUPED_ROW_TILE
    assert all(m.flops == 2 * padded * d * f for m in grouped)


def test_expert_parallel_train_step_on_eight_gpus_moves_token_rows():
    """On 8 compile-only H100s with an 8-way expert axis, each GPU holds one
    expert's weights and the step exchanges token rows by all-to-all."""
    try:
        h100x8 = targets.compile_devices("h100x8")
    except targets.TargetUnavailable as e:
        pytest.skip(str(e))
    # 16 rows in 2 micro-batches: 8 rows, one per GPU (the batch is split over the
    # expert axis too).
    sh = programs.shape("tiny", "auto", platform="cuda", dtype="bfloat16", rows=16, micro_batches=2)
    mesh = compile_report.mesh_for(h100x8, {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1})
    r = compile_report.report_one("train", sh, h100x8, mesh, batch=0, mem_fraction=0.95, top=5)
    inv = r["inventory"]
    assert inv["expert_weight_copies"] == [] and inv["custom_calls"].get("mosaic_gpu_v2", 0) > 0
    # Per MoE layer and micro-batch: rows out and back, and both again in the backward.
    moe_layers = sum(sh.cfg.layer_kinds)
    assert inv["collectives"]["all-to-all"] >= 4 * moe_layers
    assert "all-to-all x" in compile_report.render(r)


@pytest.mark.parametrize("part", ["logprob", "prefill", "decode", "sampler", "sampler_refill"])
def test_every_program_compiles_for_the_target(h200, part):
    sh = programs.shape("tiny", "blocked", platform="cuda", dtype="bfloat16")
    mesh = compile_report.mesh_for(h200, {"data": 1})
    r = compile_report.report_one(part, sh, h200, mesh, batch=8, mem_fraction=0.95, top=5)
    assert 0 < r["memory"]["peak_gib"] < 0.1
    assert r["matmul_tflop_hlo"] > 0


def test_refilling_sampler_is_reported_as_the_sampler_is():
    """``sampler_refill`` (``--target cpu``, the tiny size): the refilling program in 8
    slots over 16 rows (chunks of 8, the slots), its prompts replicated and its row count
    a scalar, reported with the sampler's fields and its slot KV cache found; its model
    FLOPs (data-dependent) not applicable, and said to be."""
    cpu = compile_report.cpu_target()
    sh = programs.shape("tiny", "blocked", platform="cpu")
    mesh = compile_report.mesh_for(cpu, {"data": 1})
    fn, args = programs.program("sampler_refill", sh, mesh, abstract=True, batch=8)
    assert (fn.spec.slots, fn.spec.chunk, fn.spec.batch.routing) == (8, 8, "none")
    assert args[3].shape == (16, sh.prompt_len) and args[3].sharding.spec == P()  # replicated
    assert (args[6].shape, args[6].dtype) == ((), jnp.int32)  # n_rows

    sampler, refill = (
        compile_report.report_one(p, sh, cpu, mesh, batch=8, mem_fraction=0.95, top=10_000)
        for p in ("sampler", "sampler_refill")
    )
    assert set(sampler) <= set(refill)
    assert refill["batch"] == 8 and refill["refill"] == dict(slots=8, rows=16, chunk=8)
    assert sampler["refill"] is None and sampler["matmul_tflop_model"] > 0
    mem = refill["memory"]
    assert mem["peak_gib"] > 0 and mem["peak_gib"] == pytest.approx(
        mem["arguments_gib"] + mem["outputs_gib"] + mem["temporaries_gib"] - mem["aliased_gib"]
    )
    kinds = {b["what"] for b in refill["largest_buffers"]}
    assert {"parameter", "KV cache"} <= kinds and "KV cache" in refill["peak_by_kind_gib"]
    assert refill["matmul_tflop_hlo"] > 0 and refill["unknown_trip_counts"] >= 2
    assert refill["matmul_tflop_model"] is None and refill["expected_over_model"] is None
    assert refill["hlo_over_model"] is None
    text = compile_report.render(refill)
    assert "batch 8 slots over 16 rows, chunks of 8" in text and "not applicable" in text


def test_missing_plugin_is_said(monkeypatch, capsys):
    def missing(name):
        raise targets.TargetUnavailable(f"target {name!r}: JAX's CUDA plugin is not installed")

    monkeypatch.setattr(targets, "compile_devices", missing)
    with pytest.raises(SystemExit) as e:
        compile_report.main(["--target", "h200", "--size", "tiny"])
    assert e.value.code == 2 and "CUDA plugin is not installed" in capsys.readouterr().err


def test_benchmark_train_step_fits_an_h200(h200):
    """The 16-layer, 5.8B-parameter benchmark model's train step within 90% of what JAX
    may use of an H200 at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (issue's budget)."""
    sh = programs.shape("h200", "blocked", 16, platform="cuda")
    mesh = compile_report.mesh_for(h200, {"data": 1})
    r = compile_report.report_one("train", sh, h200, mesh, batch=0, mem_fraction=0.95, top=5)
    assert r["memory"]["fraction_of_usable"] <= 0.90, compile_report.render(r)
    assert np.isclose(sh.cfg.num_params() / 1e9, 5.76, atol=0.01)


def test_fsdp_train_step_compiles_for_four_gpus(h200):
    """The tiny model's train step with FSDP over four compile-only H200s: the arguments
    are named by their path and sharded four ways, and cuDNN's attention partitioner gets
    q, k and v sharded by rows (2 KV heads, and 2 rows per micro-batch, do not divide
    over 4 devices; without the trainer's mesh the partitioner refuses what sharding
    propagation gives it, as it refused Qwen3-30B-A3B's on 8 GPUs)."""
    gpus = targets.compile_devices("h200x4")
    mesh = compile_report.mesh_for(gpus, None)  # fsdp over every device
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    sh = programs.on_mesh(
        programs.shape("tiny", "blocked", platform="cuda", dtype="bfloat16"), mesh
    )
    assert sh.cfg.moe_groups == 4 and sh.cfg.attention_impl == "cudnn"
    r = compile_report.report_one("train", sh, gpus, mesh, batch=0, mem_fraction=0.95, top=10_000)
    args = [b for b in r["largest_buffers"] if not b["name"].startswith("heap slot")]
    params = sum(b["bytes"] for b in args if b["what"] == "parameter")
    assert 4 * sh.cfg.num_params() / 4 <= params < 4 * sh.cfg.num_params() / 2  # mostly 1/4 each
    assert r["devices"] == 4

    fn, fargs = programs.train_program(sh, mesh, abstract=True)
    with pytest.raises(Exception, match="custom_partitioner"):
        fn.lower(*fargs).compile()  # no mesh set: cuDNN's partitioner refuses the shardings


def test_tpu_matmul_flops_through_an_inferred_trip_count():
    """XLA:TPU writes a dot as a convolution and gives no trip count: the FLOPs come from
    the convolution's kernel dims and the loop's own condition (i < 3, from 0, step 1)."""
    try:
        tpu = targets.compile_devices("v5e:2x2")
    except targets.TargetUnavailable as e:
        pytest.skip(str(e))

    def looped(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)

    _, comps, counts, unknown = _compile(
        looped, ((256, 512), jnp.bfloat16), ((512, 512), jnp.bfloat16), device=tpu.devices[0]
    )
    mms = hlo.matmuls(comps, counts)
    assert {m.kind for m in mms} == {"convolution"}
    assert not unknown and sum(m.flops * m.count for m in mms) == 3 * 2 * 256 * 512 * 512


LORA_TARGETS = "q,k,v,o,expert_gate,expert_up,expert_down"


@pytest.mark.parametrize("rank", [8, 16])
def test_grouped_matmul_takes_rank_wide_adapters_on_the_gpu(h200, rank):
    """LoRA's expert adapters through the grouped-matmul kernel: x A with A [E, D, r]
    (an output only r wide) and (x A) B with B [E, r, F] (a contraction over r), forward
    and backward, each product one kernel call with its FLOPs counted."""
    from gspo_jax.models import dispatch, lora

    d, f, e, rows = 256, 128, 8, 200

    def loss(x, w, a, b, sizes):
        y = dispatch.grouped_lora(x, lora.LoRAWeight(w, a, b), sizes)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with targets.compiling_for(h200):
        _, comps, counts, _ = _compile(
            jax.grad(loss, argnums=(0, 2, 3)),
            ((rows, d), jnp.bfloat16),
            ((e, d, f), jnp.bfloat16),
            ((e, d, rank), jnp.bfloat16),
            ((e, rank, f), jnp.bfloat16),
            ((e,), jnp.int32),
            device=h200.devices[0],
        )
    grouped = [m for m in hlo.matmuls(comps, counts) if m.kind == "grouped"]
    padded = -(-rows // dispatch.GROUPED_ROW_TILE) * dispatch.GROUPED_ROW_TILE
    # The base: forward and dx (no weight gradient); x A and (x A) B: all three each.
    flops = sorted(m.flops for m in grouped)
    assert flops == sorted([2 * padded * d * f] * 2 + [2 * padded * d * rank] * 3
                           + [2 * padded * rank * f] * 3)


def test_lora_train_step_compiles_for_the_gpu(h200):
    """The RL phase's train step with rank-8 LoRA on attention and the experts, the
    ragged dispatch ('auto' on a GPU): the base frozen in bf16 (routers f32), adapters
    and their two moments only in f32, and no weight gradient of the base in the
    program's matmuls."""
    lc = compile_report.parse_lora("8," + LORA_TARGETS)
    sh = programs.shape("tiny", "auto", platform="cuda", dtype="bfloat16", lora=lc)
    assert sh.trainable == "lora"
    mesh = compile_report.mesh_for(h200, {"data": 1})
    r = compile_report.report_one("train", sh, h200, mesh, batch=0, mem_fraction=0.95, top=10_000)
    assert r["lora"] == {"rank": 8, "targets": LORA_TARGETS.split(","), "trainable": "lora"}
    args = [b for b in r["largest_buffers"] if not b["name"].startswith("heap slot")]
    base = [b for b in args if b["what"] == "parameter"]
    adapters = [b for b in args if b["what"] == "adapter"]
    assert {b["shape"].split("[")[0] for b in base if "router" not in b["name"]} == {"bf16"}
    assert {b["shape"].split("[")[0] for b in adapters} == {"f32"}
    assert sum(b["bytes"] for b in adapters) == 4 * programs.adapter_params(sh.cfg, lc)
    state = [b for b in args if b["what"] == "optimizer state" and b["shape"] != "s32[]"]
    assert sorted((b["shape"], b["bytes"]) for b in state) == sorted(
        2 * [(b["shape"], b["bytes"]) for b in adapters]
    )
    inv = r["inventory"]
    assert inv["ragged_dot_dense"] == [] and inv["custom_calls"].get("mosaic_gpu_v2", 0) > 0
    # A weight gradient of the base would add 2 x its active parameters per token
    # (program / model near 1.5x the expected ratio).
    assert 1 <= r["hlo_over_model"] <= 1.15 * r["expected_over_model"]
    assert "LoRA rank 8" in compile_report.render(r)


def test_lora_option_is_checked_and_limited_to_the_trained_programs(h200):
    from gspo_jax.config import ConfigError

    with pytest.raises(ConfigError, match="--lora targets.*unknown.*'qq'"):
        compile_report.parse_lora("8,q,qq")
    lc = compile_report.parse_lora("4")
    assert lc.rank == 4 and lc.targets == programs.lora_training.DEFAULT_TARGETS
    sh = programs.shape("tiny", "blocked", platform="cuda", dtype="bfloat16", lora=lc)
    mesh = compile_report.mesh_for(h200, {"data": 1})
    with pytest.raises(ValueError, match="part 'prefill': with LoRA only the train and logprob"):
        programs.program("prefill", sh, mesh, abstract=True, batch=8)


def test_packed_log_prob_pass_is_reported_beside_the_padded_one(capsys):
    """``--target cpu`` on the tiny size: the packed log-prob pass beside the padded one,
    one micro-batch's FLOPs (the body of its loop, whose trip count the program computes)
    half the padded pass's whole batch of two micro-batches, and at short lengths one
    micro-batch used, a larger real-token share and fewer FLOPs per real token."""

    def short(n, *, seed, max_prompt_len, max_new_tokens):  # rows of 2 to 9 tokens
        rs = np.random.RandomState(seed)
        return rs.randint(2, 5, n), rs.randint(1, 7, n)

    argv = ["--target", "cpu", "--size", "tiny", "--parts", "logprob,logprob_packed"]
    argv += ["--set", "logprob_micro_batches=2", "--top", "2"]
    padded, packed = compile_report.main(argv, sample=short)
    assert {k: packed["packing"][k] for k in ("rows", "micro", "shards")} == dict(
        rows=2, micro=2, shards=1
    )
    assert 0 < packed["micro_tflop_hlo"] < padded["matmul_tflop_hlo"]
    assert packed["micro_tflop_hlo"] == pytest.approx(padded["matmul_tflop_hlo"] / 2, rel=0.05)
    assert packed["unknown_trip_counts"] == 0 and packed["hlo_over_model"] > 0
    t, tp = padded["tokens"], packed["tokens"]
    assert t["micro_batches_used"] == [2] and tp["micro_batches_used"] == [1]
    assert t["computed_slots"] == 4 * 31 and tp["computed_slots"] == 2 * 31
    assert t["real_tokens"] == tp["real_tokens"] < 2 * 31
    assert tp["real_share"] == pytest.approx(2 * t["real_share"])
    assert tp["gflop_per_real_token"] == pytest.approx(t["gflop_per_real_token"] / 2, rel=0.05)
    out = capsys.readouterr().out
    assert "| logprob | 4 | 2 x 31 | 2 |" in out and "| logprob_packed | 4 | 2 x 31 | 1 |" in out
