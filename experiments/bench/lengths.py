r"""Prompt and response lengths for benchmarks at the flagship's shape, and the share of
real tokens they leave in the padded and the packed layout.

The flagship (`configs/qwen3_moe_gsm8k.py`: GSM8K, Qwen3-30B-A3B's architecture) pads
prompts to 384 tokens and responses to 1,024. A randomly initialised benchmark model
runs its responses to the cap (full rows), which says nothing about what packing saves;
benchmarks at that shape draw lengths from `DISTRIBUTIONS` instead (`sample`), and
`shares` / `pass_shares` give the real-token share of the padded rows and of the packed
buffers of `gspo_jax.packing` for them.

    python -m experiments.bench.lengths            # the flagship-shape table (no model)
    python -m experiments.bench.lengths --json experiments/bench/results/flagship_shares.json

Each length is a shifted log-normal, ``shift + exp(mu + sigma * z)``, rounded and
clipped to ``[1, cap]`` (a response at ``max_new_tokens`` counts as truncated); the G
samples of a prompt share its prompt length (``group_size``).

**Where the numbers come from, and what is assumed.**

* Prompts (both distributions): verl's GSM8K run of Qwen2.5-0.5B-Instruct that verl's
  docs link as a baseline (https://github.com/volcengine/verl/blob/main/docs/algo/baseline.md,
  "command and log":
  https://github.com/eric-haibin-lin/verl-data/blob/experiments/gsm8k/Qwen2.5-0.5B-bsz256_2-prompt1024-resp512-0.567.log).
  Over its 435 steps of 256 GSM8K training prompts (verl's GSM8K preprocessing: the
  question plus "Let's think step by step and output the final answer after ####", in
  the Qwen chat template) ``prompt_length/mean`` averages 103.6 tokens (100.3 to 109.0),
  the batch maximum 197.2 (at most 256) and the batch minimum 66.5 (at least 56). verl's
  quickstart log (https://verl.readthedocs.io/en/latest/start/quickstart.html) agrees:
  mean 104.9, min 68, max 175. `PROMPT_GSM8K` reproduces the three averages for batches
  of 256 (shift 48.2, mu 3.945, sigma 0.370). Assumed: Qwen3 tokenizes GSM8K as
  Qwen2.5 does (the same 151,643-token BPE vocabulary); the Qwen2.5 template's default
  system prompt (about 20 tokens) is absent from Qwen3's, and the flagship's own
  instruction differs from verl's, so real flagship prompts may be some 20 tokens
  shorter or longer. 384 holds every one.
* Responses, ``flagship`` (the default; non-thinking answers, a few hundred tokens):
  the same verl log. ``response_length/mean`` averages 278.5 tokens over the run
  (248 to 329 per step), the batch minimum 114.3, and the batch maximum is the 512-token
  cap in nearly every step (mean 511.9). A shifted log-normal with 2% of responses at or
  past 512 fits the mean and minimum (shift 18.1, mu 5.511, sigma 0.336) and then gives
  the batch maximum 511.9 as well. At 1,024 tokens it truncates about 1 response in
  60,000. Assumed, and the weak point of this distribution: **no published response
  length of a Qwen3 model under GRPO on GSM8K was found** (searched: verl's and
  NeMo-RL's docs, example logs and test suites, GitHub issues, blog posts); this takes
  Qwen2.5-Instruct's GSM8K answers (PPO, 0.5B) to stand for a non-thinking Qwen3's.
* Responses, ``flagship_thinking``: the published Qwen3 GRPO run on math problems,
  NeMo-RL's performance summary ("NeMo RL v0.6", H100 BF16 table, row "GRPO
  Qwen3-30B3A On policy": https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html,
  https://github.com/NVIDIA-NeMo/RL/blob/main/docs/about/performance-summary.md). Qwen3-30B-A3B
  (thinking mode: the recipe passes no ``enable_thinking``) on OpenMathInstruct-2, whose
  problems are drawn from GSM8K's and MATH's, with ``max_total_sequence_length`` 4,096:
  the average sequence is 3,203 tokens. With `PROMPT_GSM8K`'s prompts (assumed) and an
  assumed sigma of 0.336 (the GSM8K fit's), mu = 8.052 gives that average (untruncated
  mean 3,322 tokens). At the flagship's 1,024-token cap almost every response (over 99.9%;
  96% to 100% for sigma 0.25 to 0.7) is truncated: in thinking mode the flagship's rows
  are full, and packing can only recover the prompts' padding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class ShiftedLogNormal:
    """Lengths ``shift + exp(mu + sigma * z)``, z standard normal."""

    shift: float
    mu: float
    sigma: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.shift + np.exp(self.mu + self.sigma * rng.standard_normal(n))


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A prompt-length and a response-length distribution, in tokens."""

    prompt: ShiftedLogNormal
    response: ShiftedLogNormal


PROMPT_GSM8K = ShiftedLogNormal(shift=48.22, mu=3.9454, sigma=0.3703)
DISTRIBUTIONS = {
    "flagship": Lengths(PROMPT_GSM8K, ShiftedLogNormal(shift=18.13, mu=5.5105, sigma=0.3361)),
    "flagship_thinking": Lengths(PROMPT_GSM8K, ShiftedLogNormal(shift=0.0, mu=8.0518, sigma=0.336)),
}


def sample(
    n: int,
    *,
    seed: int,
    max_prompt_len: int,
    max_new_tokens: int,
    name: str = "flagship",
    group_size: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens int64[n], response_lens int64[n]) drawn from ``DISTRIBUTIONS[name]``,
    clipped to ``[1, max_prompt_len]`` and ``[1, max_new_tokens]``; rows ``i * group_size
    .. (i + 1) * group_size - 1`` (one prompt's samples) share a prompt length."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"lengths: no distribution {name!r}; known: {sorted(DISTRIBUTIONS)}")
    if n % group_size:
        raise ValueError(f"lengths: {n} rows are not groups of {group_size}")
    dist = DISTRIBUTIONS[name]
    rng = np.random.default_rng(seed)
    prompts = np.repeat(dist.prompt.draw(rng, n // group_size), group_size)
    responses = dist.response.draw(rng, n)
    clip = lambda x, cap: np.clip(np.rint(x), 1, cap).astype(np.int64)  # noqa: E731
    return clip(prompts, max_prompt_len), clip(responses, max_new_tokens)


def truncated(response_lens: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """bool[n]: the responses at the cap (cut there, not ended)."""
    return np.asarray(response_lens) >= max_new_tokens


def valid_mask(prompt_lens, response_lens, *, max_prompt_len: int, max_new_tokens: int):
    """bool[n, S], S = P + T - 1: the valid input positions of rows whose prompt is
    left-padded to P and response right-padded to T, as
    `gspo_jax.passes.sequence_inputs` builds them (the last response position is no
    input)."""
    p = np.asarray(prompt_lens)[:, None]
    r = np.asarray(response_lens)[:, None]
    prompt = np.arange(max_prompt_len)[None, :] >= max_prompt_len - p
    response = np.arange(max_new_tokens)[None, :] < r
    return np.concatenate([prompt, response], axis=1)[:, :-1]


def shares(prompt_lens, response_lens, *, max_prompt_len: int, max_new_tokens: int, packing):
    """The real-token share of one batch's pass, padded and packed.

    ``packing``: the pass's `gspo_jax.packing.Packing` (``None``: padded rows only).
    Padded: real / (n * S). Packed: real / (used * rows * L), ``used`` the micro-batches
    `gspo_jax.packing.plan` fills (the packed pass computes only those) and L the buffer
    row's slots (``packing.length`` where the package has it, else S). Returns a dict:
    rows, seq (S), real, padded_slots, padded_share and, with ``packing``,
    micro_batches_used, packed_slots, packed_share."""
    valid = valid_mask(
        prompt_lens, response_lens, max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens
    )
    n, s = valid.shape
    real = int(valid.sum())
    out = dict(rows=n, seq=s, real=real, padded_slots=n * s, padded_share=real / (n * s))
    if packing is not None:
        import jax.numpy as jnp

        from gspo_jax import packing as packing_lib

        used = int(packing_lib.plan(jnp.asarray(valid), packing).used)
        slots = used * packing.rows * (getattr(packing, "length", 0) or s)
        out.update(micro_batches_used=used, packed_slots=slots, packed_share=real / slots)
    return out


def pass_shares(
    prompt_lens,
    response_lens,
    *,
    max_prompt_len: int,
    max_new_tokens: int,
    shapes,
    num_minibatches: int,
    seed: int = 0,
) -> dict[str, dict]:
    """The real-token shares of an RL step's passes over one rollout batch, under a run's
    `gspo_jax.packing.Shapes` (``shapes``, from `gspo_jax.packing.shapes`): the log-prob
    pass over the whole batch (``logprob``) and the train step over its
    ``num_minibatches`` mini-batches, a random permutation's consecutive slices as
    `gspo_jax.rl.RLPhase` takes them (``train``: slots and real tokens summed). Packed
    figures are those of the run's packed shapes, or of none (padded) where the run
    does not pack."""
    kw = dict(max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens)
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    logprob = shares(p, r, packing=shapes.logprob, **kw)
    perm = np.random.default_rng(seed).permutation(len(p))
    parts = [
        shares(p[idx], r[idx], packing=shapes.train, **kw)
        for idx in np.split(perm, num_minibatches)
    ]
    train = {k: sum(x[k] for x in parts) for k in ("rows", "real", "padded_slots")}
    train.update(seq=parts[0]["seq"], padded_share=train["real"] / train["padded_slots"])
    if shapes.train is not None:
        train["micro_batches_used"] = sum(x["micro_batches_used"] for x in parts)
        train["packed_slots"] = sum(x["packed_slots"] for x in parts)
        train["packed_share"] = train["real"] / train["packed_slots"]
    for d in (logprob, train):
        d.setdefault("packed_slots", d["padded_slots"])
        d.setdefault("packed_share", d["padded_share"])
    return {"logprob": logprob, "train": train}


def describe(prompt_lens, response_lens, max_new_tokens: int) -> dict[str, float]:
    """Summary figures of drawn lengths: means, percentiles, maxima, truncated share."""
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    q = lambda x, k: float(np.percentile(x, k))  # noqa: E731
    return dict(
        prompt_mean=float(p.mean()),
        prompt_p50=q(p, 50),
        prompt_p99=q(p, 99),
        prompt_max=int(p.max()),
        response_mean=float(r.mean()),
        response_p50=q(r, 50),
        response_p90=q(r, 90),
        response_p99=q(r, 99),
        response_max=int(r.max()),
        truncated=float(truncated(r, max_new_tokens).mean()),
    )


# ---- the flagship-shape table (no model) ------------------------------------


def _flagship_layouts():
    """(label, config, batch shards) of the flagship's passes: `configs/qwen3_moe_gsm8k.py`
    as it is (16 prompts x 8; 8 batch shards: FSDP over one node of 8 GPUs), at 64 x 8 =
    512 rows (configs/bench_rl_h200.py's rollout), and at 512 rows in micro-batches of 32
    rows' tokens (configs/bench_rl_h200.py's ``updates.micro_batch_tokens``) on 8 shards
    and on one GPU, and of 8 rows' tokens on 8 shards; and, where the package has
    ``updates.pack_length``, in buffer rows of 2S slots."""
    import runpy

    get = runpy.run_path("configs/qwen3_moe_gsm8k.py")["get_config"]
    base = get("ckpt=/unused")
    c512 = get("ckpt=/unused")
    c512.rollout.prompts_per_step = 64
    seq = base.rollout.max_prompt_len + base.rollout.max_new_tokens - 1
    budgets = []
    for rows in (32, 8):
        b = get("ckpt=/unused")
        b.rollout.prompts_per_step = 64
        b.updates.micro_batch_tokens = rows * seq
        budgets.append(b)
    out = [
        ("qwen3_moe_gsm8k.py, 128 rows, 8 shards", base, 8),
        ("qwen3_moe_gsm8k.py, 512 rows, 8 shards", c512, 8),
        ("512 rows, micro_batch_tokens=32*S, 8 shards", budgets[0], 8),
        ("512 rows, micro_batch_tokens=32*S, 1 shard", budgets[0], 1),
        ("512 rows, micro_batch_tokens=8*S, 8 shards", budgets[1], 8),
    ]
    if "pack_length" in base.updates:  # buffer rows longer than S, where the package has them
        long = get("ckpt=/unused")
        long.rollout.prompts_per_step = 64
        long.updates.micro_batch_tokens = 32 * seq
        long.updates.pack_length = 2 * seq
        out.append(("512 rows, micro_batch_tokens=32*S, pack_length=2*S, 8 shards", long, 8))
    return out


def flagship_table(name: str = "flagship", seed: int = 0) -> dict:
    """The real-token shares of the train step and the log-prob pass at the flagship's
    shape under ``DISTRIBUTIONS[name]``, padded and packed, for each of
    `_flagship_layouts` (packing's shapes from `gspo_jax.packing.shapes`)."""
    from gspo_jax import packing as packing_lib

    rows = []
    for label, c, shards in _flagship_layouts():
        P, T = c.rollout.max_prompt_len, c.rollout.max_new_tokens
        g = c.rollout.group_size
        n = c.rollout.prompts_per_step * g
        p, r = sample(n, seed=seed, max_prompt_len=P, max_new_tokens=T, name=name, group_size=g)
        shapes = packing_lib.shapes(c.updates, c, shards)
        res = pass_shares(
            p,
            r,
            max_prompt_len=P,
            max_new_tokens=T,
            shapes=shapes,
            num_minibatches=c.updates.num_minibatches,
            seed=seed,
        )
        rows.append(
            dict(
                layout=label,
                rows=n,
                max_prompt_len=P,
                max_new_tokens=T,
                shards=shards,
                num_minibatches=c.updates.num_minibatches,
                train_packing=dataclasses.asdict(shapes.train) if shapes.train else None,
                logprob_packing=dataclasses.asdict(shapes.logprob) if shapes.logprob else None,
                lengths=describe(p, r, T),
                **res,
            )
        )
    return dict(distribution=name, seed=seed, layouts=rows)


def markdown(table: dict) -> str:
    """`flagship_table`'s figures as a Markdown table."""
    out = [
        f"distribution `{table['distribution']}` (seed {table['seed']})",
        "",
        "| layout | pass | real tokens | padded slots | padded share | packed slots "
        "| packed share | micro-batches used |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table["layouts"]:
        for pass_ in ("train", "logprob"):
            d = row[pass_]
            used = d.get("micro_batches_used", "-")
            out.append(
                f"| {row['layout']} | {pass_} | {d['real']:,} | {d['padded_slots']:,} "
                f"| {d['padded_share']:.1%} | {d['packed_slots']:,} | {d['packed_share']:.1%} "
                f"| {used} |"
            )
    lens = table["layouts"][-1]["lengths"]
    out += ["", "lengths drawn (the last layout's batch): " + json.dumps(_round(lens))]
    return "\n".join(out)


def _round(d: dict) -> dict:
    return {
        k: round(v, 4) if isinstance(v, float) and not math.isnan(v) else v for k, v in d.items()
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--name", default="", help="a distribution (default: every one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    names = [args.name] if args.name else sorted(DISTRIBUTIONS)
    tables = [flagship_table(name, args.seed) for name in names]
    for t in tables:
        print(markdown(t))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tables, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
