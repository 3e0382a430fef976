"""One process of `tests/test_multihost.py`'s Hugging Face export and load across
processes (not a test module): a small MoE initialised in its shardings on an
(fsdp=4, expert=2) mesh of all the processes' devices, exported to ``<out>/a``, loaded
back onto the mesh with `from_pretrained` and exported again to ``<out>/b``.

    python tests/hf_export_worker.py OUT [PORT PROCESS_ID]   # two processes: PORT and id
"""

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

out = sys.argv[1]
if len(sys.argv) > 2:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[3]))

from gspo_jax.models import ModelConfig, export_pretrained, from_pretrained  # noqa: E402
from gspo_jax.models.transformer import init_sharded  # noqa: E402

mesh = Mesh(np.asarray(jax.devices()).reshape(1, 4, 2, 1), ("data", "fsdp", "expert", "tensor"))
cfg = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    d_ff=48, moe_d_ff=16, num_experts=4, top_k=2,
)
model = init_sharded(cfg, mesh, seed=0)
spread = not next(iter(jax.tree.leaves(model))).is_fully_addressable
files_a = export_pretrained(model, os.path.join(out, "a"), max_shard_size="20KB")
loaded = from_pretrained(os.path.join(out, "a"), mesh=mesh)
files_b = export_pretrained(loaded, os.path.join(out, "b"), max_shard_size="20KB")
print(
    json.dumps(
        dict(process=jax.process_index(), spread=spread, files_a=files_a, files_b=files_b)
    ),
    flush=True,
)
