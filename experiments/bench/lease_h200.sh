#!/usr/bin/env bash
# One GPU lease's measurements (experiments/accelerator.md, 2026-11-26), in priority
# order, each program in its own process with its own time limit, so that a failure or
# an out-of-memory error costs only its own row. Run from the repository root on the GPU
# machine. The image's JAX is used; carry as wheels what it lacks: tokamax and its
# imports (einshape, pydantic, pydantic-core, annotated-types, typing-inspection, qwix,
# immutabledict, tensorboardX, xprof, fire, termcolor) and ml-collections. Results: $OUT.
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/lease}
mkdir -p "$out"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib, flax, optax, tokamax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
bench() {  # name, time limit (s), arguments of bench_accelerator
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" python3 -m experiments.bench.bench_accelerator --size h200 "$@" \
    --json "$out/$name.json" >"$out/$name.log" 2>&1
  echo "rc=$? wall=$((SECONDS - t0))s" | tee -a "$out/$name.log"
  grep '^{"part"' "$out/$name.log" | cut -c1-400
  grep -m3 -i -E "error|Resource" "$out/$name.log" | cut -c1-300
}
bench train8_auto 170 --layers 8 --parts train --backends auto
bench train8_blocked 130 --layers 8 --parts train --backends blocked
bench train8_dense 80 --layers 8 --parts train --backends dense --reps 2
bench sampler12_auto 200 --parts sampler --sampler-backend auto --sampler-batches 64,256,1024
bench train16_blocked 110 --layers 16 --parts train --backends blocked
bench train16_auto 110 --layers 16 --parts train --backends auto
bench train8_auto_prof 150 --layers 8 --parts train --backends auto --reps 2 --profile /tmp/prof8
tar czf "$out/prof8.tgz" -C /tmp prof8
