"""Orbax checkpoints of a training phase: state arrays plus a JSON record.

Each phase (``sft``, ``rl``) has its own directory under ``<workdir>/checkpoints``
and its own step count. A checkpoint holds

* ``state``: the :class:`~gspo_jax.step.TrainState` pytree (parameters,
  optimizer state, step, skipped-update count), restored with the shardings of
  a target state so a resumed run lands on the same mesh; an RL checkpoint holds
  ``{"train": state, "queue": the scored batches waiting}`` (`gspo_jax.rl.CHECKPOINT_LAYOUT`);
* ``meta``: a JSON dict with what the host loop needs to continue exactly
  (the data position, counters);
* ``checksums.json``: the size and SHA-256 of every file of ``state`` and
  ``meta``.

Saves are asynchronous; ``max_to_keep`` keeps the last K. Orbax writes into a
temporary directory (``<step>.orbax-checkpoint-tmp``) and renames it when
complete, so a run killed mid-save leaves the previous checkpoint intact. The
checksums are computed in orbax's background finalize thread, once the arrays
are written and before that rename, so every finished checkpoint has them.

Orbax itself checks no data bytes: a flipped byte restores as a wrong (often
NaN) weight. :meth:`PhaseCheckpointer.restore` therefore tries the checkpoints
newest first and takes the first one that is complete, matches its checksums,
restores, and holds only finite values; it prints one line for each one it
skips, and moves the skipped newer ones aside (renamed ``<step>.unusable``) so
that the resumed run can save those steps again. Empty directories named like a
step are removed, and orbax's temporary directories are never taken for a step.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from gspo_jax import multihost

MANIFEST = "checksums.json"
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")  # orbax's step directory names
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """No checkpoint of a phase could be restored; the message lists each and why."""


# ---------------------------------------------------------------------------
# Checksums.


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _data_files(step_dir: str) -> list[str]:
    """The files of a step's items (``state/``, ``meta/``), relative to ``step_dir``.

    The files directly in ``step_dir`` are orbax's bookkeeping, rewritten after
    the checksums are taken (``_CHECKPOINT_METADATA``, ``commit_success.txt``).
    """
    out = []
    for root, _, files in os.walk(step_dir):
        if root == step_dir:
            continue
        out += [os.path.relpath(os.path.join(root, f), step_dir) for f in files]
    return sorted(out)


def write_manifest(step_dir: str) -> None:
    """Write ``checksums.json`` (size and SHA-256 of each data file) into ``step_dir``."""
    files = {}
    for rel in _data_files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel.replace(os.sep, "/")] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify_manifest(step_dir: str) -> str | None:
    """Why the step's files do not match its ``checksums.json``, or None if they do.

    A step without the file (saved before checksums were written) is not
    checked here; :meth:`PhaseCheckpointer.restore` says so when it restores one.
    """
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
        entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__}: {e})"
    if not any(rel.startswith("state/") for rel, _, _ in entries):
        return f"{MANIFEST} lists no state/ file"
    for rel, size, _ in entries:  # cheap checks first: a missing or short file
        if rel.startswith("/") or ".." in rel.split("/"):
            return f"{MANIFEST} names a file outside the checkpoint: {rel!r}"
        path = os.path.join(step_dir, *rel.split("/"))
        if not os.path.isfile(path):
            return f"incomplete: {rel} is missing"
        if os.path.getsize(path) != size:
            return (
                f"incomplete: {rel} has {os.path.getsize(path)} bytes, "
                f"{MANIFEST} says {size} (truncated?)"
            )
    for rel, _, digest in entries:
        if _sha256(os.path.join(step_dir, *rel.split("/"))) != digest:
            return f"checksum mismatch in {rel}"
    return None


# ---------------------------------------------------------------------------
# Finite values.


@jax.jit
def _finite_flags(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def check_finite(tree: Any) -> str | None:
    """The path (``params/embed/value``) of the first leaf of ``tree`` holding a NaN
    or an infinity, or None when every floating-point leaf is finite.

    Integer and boolean leaves are not checked. One device round trip for the
    whole tree (the per-leaf reductions run in one jitted call).
    """
    items = [
        (path, x)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not items:
        return None
    try:
        flags = np.asarray(jax.device_get(_finite_flags([x for _, x in items])))
    except ValueError:  # leaves on different devices cannot share one jitted call
        flags = [bool(jnp.all(jnp.isfinite(x))) for _, x in items]
    for (path, _), ok in zip(items, flags):
        if not ok:
            return jax.tree_util.keystr(path, simple=True, separator="/")
    return None


# ---------------------------------------------------------------------------
# What a resume rebuilds from a source that can change on disk.


class SourceChanged(RuntimeError):
    """Parameters a resumed run rebuilds from their source (the reference policy of a KL
    term from the warm start's checkpoint or ``model.pretrained``; LoRA's frozen base)
    differ from those its RL checkpoint was trained against."""


@jax.jit
def _leaf_sums(leaves):
    """Per array: a sum over its bits, as uint32, weighted by position (mod 2^32: the
    same on any mesh, as integer sums do not depend on their order)."""

    def one(a):
        if a.dtype == jnp.int4:  # a quantized base's int4 values: 1 byte each
            a = a.astype(jnp.int8)
        bits = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))
        u = bits.reshape(-1).astype(jnp.uint32)
        w = jnp.arange(u.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        return jnp.sum(u * w, dtype=jnp.uint32) ^ jnp.sum(u, dtype=jnp.uint32)

    return [one(a) for a in leaves]


def tree_checksum(tree: Any) -> str:
    """A checksum of a tree of arrays: their bits, dtypes, shapes and paths (one device
    round trip of a few bytes per array)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = jax.device_get(_leaf_sums([a for _, a in flat]))
    crc = 0
    for (path, a), s in zip(flat, sums):
        crc = zlib.crc32(
            f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}:{int(s)};".encode(), crc
        )
    return f"{crc:08x}"


def identity(source: str, tree: Any) -> dict[str, str]:
    """What an RL checkpoint records of parameters rebuilt on resume: where they come
    from (``source``, for the message) and `tree_checksum`."""
    return {"source": source, "checksum": tree_checksum(tree)}


# ---------------------------------------------------------------------------
# The checkpointer.


def _summary(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def step_dirs(directory: str) -> dict[int, str]:
    """Step -> directory, for the directories of a phase named like a step that hold
    anything. Orbax's temporary directories and empty directories are not steps."""
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if _STEP_NAME.fullmatch(name) and os.path.isdir(path) and os.listdir(path):
            out[int(name)] = path
    return out


class PhaseCheckpointer:
    """Save and restore one phase's checkpoints.

    Args:
      workdir: the run's directory; checkpoints go to ``<workdir>/checkpoints/<phase>``.
      phase: ``"sft"`` or ``"rl"``.
      every: save every this many steps (``save(..., force=True)`` saves any step).
      keep: how many of the newest checkpoints to keep.
      async_save: write in the background (the next save or :meth:`close` waits).
      read_only: restore only, writing nothing under ``workdir`` (``gspo_jax.evaluate``):
        no directory created or cleaned, a step that does not restore is skipped but
        left where it is.

    Creating one removes what a killed save left (orbax's temporary directories,
    empty step directories): keep one open per directory at a time.
    """

    def __init__(
        self,
        workdir: str,
        phase: str,
        *,
        every: int,
        keep: int,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.phase = phase
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints", phase))
        self._async = async_save
        self.read_only = read_only
        if not read_only:
            os.makedirs(self.directory, exist_ok=True)
            self._remove_empty_step_dirs()  # orbax would count them as steps, never saved
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            cleanup_tmp_directories=not read_only,  # what a killed save left behind
            read_only=read_only,
            async_options=(
                ocp.AsyncOptions(post_finalization_callback=self._checksum_pending_save)
                if async_save
                else None
            ),
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        self._closed = False

    # ---- directory ----------------------------------------------------------

    def _log(self, message: str) -> None:
        print(f"checkpoints/{self.phase}: {message}", flush=True)

    def _step_dirs(self) -> dict[int, str]:
        return step_dirs(self.directory)

    def _remove_empty_step_dirs(self) -> None:
        if jax.process_index() != 0:
            return
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if _STEP_NAME.fullmatch(name) and os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
                self._log(f"removed the empty directory {name} (not a checkpoint)")

    def _checksum_pending_save(self) -> None:
        """Orbax's post-finalization callback: runs in its background thread on the
        primary host, after the arrays are written and before the temporary
        directory is renamed to the step. One save is in flight at a time, so the
        newest temporary directory is the one being finished."""
        try:
            pending = glob.glob(os.path.join(self.directory, f"*{_TMP_SUFFIX}*"))
            pending = [p for p in pending if os.path.isdir(p)]
            if not pending:
                self._log("no temporary directory to checksum; this save has no checksums")
                return
            write_manifest(max(pending, key=os.path.getmtime))
        except Exception as e:  # a failed checksum must not fail the save
            self._log(f"could not write {MANIFEST} ({_summary(e)}); this save has no checksums")

    def latest_step(self) -> int | None:
        """The newest step that has a checkpoint directory (empty and temporary
        directories do not count), or None. Whether it is usable is decided by
        :meth:`restore`, which may fall back to an earlier step."""
        steps = self._step_dirs()
        return max(steps) if steps else None

    # ---- save ---------------------------------------------------------------

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        saved = self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        if saved and not self._async and jax.process_index() == 0:
            write_manifest(os.path.join(self.directory, str(step)))
        return saved

    # ---- restore ------------------------------------------------------------

    def _problem(self, step_dir: str) -> str | None:
        """Why the files of a step cannot be used, before reading any array."""
        if os.path.exists(os.path.join(step_dir, MANIFEST)):
            return verify_manifest(step_dir)
        missing = [d for d in ("state", "meta") if not os.path.isdir(os.path.join(step_dir, d))]
        if missing:
            return f"incomplete: no {' or '.join(d + '/' for d in missing)} directory"
        return None

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        if callable(target):  # the target depends on what this step recorded
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            target = target(dict(meta["meta"]))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"])

    def restore(self, target_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restore onto the shapes, dtypes and shardings of ``target_state``, or of
        ``target_state(meta)`` when it is a function of the step's JSON record (a
        tree whose shapes were the config's at that save, such as a queue of batches).

        Without ``step``, tries the checkpoints newest first and restores the
        first that is complete, matches its checksums, restores without error and
        holds only finite values; prints one line for each one skipped and why.
        The skipped steps newer than the restored one are renamed
        ``<step>.unusable`` (kept for inspection; the resumed run saves those
        steps afresh), unless ``read_only``. With ``step``, tries that step only.

        Returns:
          ``(state, meta, step)``, ``step`` being the step actually restored.

        Raises:
          FileNotFoundError: the phase has no checkpoint.
          CheckpointError: none could be restored; the message lists each step and why.
        """
        steps = self._step_dirs()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no {self.phase!r} checkpoint {step} in {self.directory}")
            steps = {step: steps[step]}
        if not steps:
            raise FileNotFoundError(f"no {self.phase!r} checkpoint in {self.directory}")
        if not self.read_only:
            self._remove_empty_step_dirs()
        multihost.barrier(f"checkpoints/{self.phase}: empty directories removed")
        self._mngr.reload()  # see the directories as they are now
        skipped: list[tuple[int, str]] = []
        first_error = None  # the newest restore failure, chained for its traceback
        for s in sorted(steps, reverse=True):
            why = self._problem(steps[s])
            if why is None:
                try:
                    state, meta = self._restore_step(s, target_state)
                except Exception as e:  # any orbax/TensorStore failure: try the next one
                    why = f"restore failed: {_summary(e)}"
                    first_error = first_error or e
                else:
                    bad = check_finite(state)
                    if bad is None:
                        if not os.path.exists(os.path.join(steps[s], MANIFEST)):
                            self._log(f"step {s} has no {MANIFEST} (an older save): not verified")
                        self._move_aside(skipped)
                        return state, meta, s
                    why = f"non-finite value in {bad}"
                    del state
            self._log(f"skipping step {s}: {why}")
            skipped.append((s, why))
        listing = "\n".join(f"  step {s}: {why}" for s, why in skipped)
        raise CheckpointError(
            f"no usable {self.phase!r} checkpoint in {self.directory}:\n{listing}\n"
            "Move these step directories away to start the phase afresh."
        ) from first_error

    def _move_aside(self, skipped: list[tuple[int, str]]) -> None:
        """Rename the skipped (newer) steps to ``<step>.unusable`` so orbax saves them anew."""
        if not skipped or self.read_only:
            return
        if jax.process_index() == 0:
            for s, _ in skipped:
                src = os.path.join(self.directory, str(s))
                dst, n = src + ".unusable", 1
                while os.path.exists(dst):
                    dst, n = f"{src}.unusable{n}", n + 1
                os.rename(src, dst)
                self._log(f"moved step {s} aside to {os.path.basename(dst)}")
        multihost.barrier(f"checkpoints/{self.phase}: moved aside")
        self._mngr.reload()

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for a save in flight, then release orbax's threads (once; again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> "PhaseCheckpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Every way out of a phase waits for the save in flight. On an error (a bad
        prompt, the health check, out of memory) the newest checkpoint was often begun
        a moment before: without the wait the interpreter would shut down under orbax's
        writer and the next start would delete the unfinished step. A failure of the
        wait itself is said in one line; the error that left the phase is raised."""
        if exc_type is None or self._closed or self.read_only:
            self.close()
            return False
        if self._mngr.is_saving_in_progress():  # else there is nothing to say
            self._log(f"stopped by {exc_type.__name__}: finishing the checkpoint being written")
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the phase's own error matters more
            self._log(f"could not finish the checkpoint in flight ({_summary(e)})")
        return False
