"""Data sets prepared on disk, under a data dir (``config.task.data_dir``), with TFDS.

Two tasks keep their data there: GSM8K (TFDS's own builder, from the network or from
supplied files) and a user's file (its checked rows). The synthetic tasks generate their
examples in memory (:mod:`gspo_jax.tasks.synthetic`) and write nothing. TensorFlow
Datasets is imported only through :func:`tfds`, when one of those two tasks is used.

What preparing on disk guarantees:

* runs started together on a fresh data dir (a sweep's points, a study's two pinned
  processes) prepare a data set once: :func:`prepare_lock` holds the others until the
  first is done, and :func:`current` gives them a builder that sees its result;
* a data set already prepared is read without the lock and writes nothing, so a
  read-only data dir (a workdir's ``data/`` on an archive) serves as it is;
* one that is not prepared, under a data dir that cannot be written, is
  :class:`DataDirNotWritable`, before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.resources
import os
import sys

from etils import epath


def tfds():
    """The ``tensorflow_datasets`` module, imported on first use.

    TFDS 4.9 looks up ``importlib_resources.abc.Traversable`` (the PyPI backport)
    whenever it locates a builder's code, which every ``download_and_prepare`` does;
    where the backport is absent (recent ``etils`` no longer installs it), the standard
    library's ``importlib.resources``, which has the same ``abc.Traversable``, stands in.
    """
    try:
        import importlib_resources  # noqa: F401
    except ImportError:
        sys.modules.setdefault("importlib_resources", importlib.resources)
    import tensorflow_datasets

    return tensorflow_datasets


class DataDirNotWritable(OSError):
    """A dataset to prepare under a data dir this process cannot write (a read-only
    mount, another user's folder); nothing was written. The message names both."""


def is_prepared(builder) -> bool:
    """Whether ``builder``'s dataset is prepared under its data dir. TFDS writes a dataset
    into a folder of its own and renames it into place once complete, so a dataset seen
    prepared stays so: reading it needs no lock."""
    return (epath.Path(builder.data_dir) / "dataset_info.json").exists()


# What opening a file for writing raises in a folder this process may not write to.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def prepare_lock(builder):
    """Held while ``builder``'s dataset is prepared: one process (or thread) at a time
    per dataset and data dir, so that runs started together on a fresh data dir do not
    both generate it and fail renaming into the folder the other one made.

    A dataset already prepared (`is_prepared`) is read without the lock, writing
    nothing. One that is not, under a data dir that cannot be written, raises
    `DataDirNotWritable` naming both, before anything is written. A remote data dir
    (``gs://``) is not locked."""
    path = os.fspath(builder.data_dir).rstrip("/")
    if "://" in path or is_prepared(builder):
        yield
        return
    # Beside the data sets, not inside one: TFDS reads every entry of a data set's
    # folder as a version of it.
    root = os.fspath(builder.data_dir_root)
    locks = os.path.join(root, ".prepare_locks")
    name = os.path.relpath(path, root).replace(os.sep, "__")
    try:
        os.makedirs(locks, exist_ok=True)
        f = open(os.path.join(locks, name + ".lock"), "a")
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
        raise DataDirNotWritable(
            f"{name.replace('__', '/')} is not prepared under the data dir {root}, and "
            f"nothing can be written there to prepare it ({e.strerror}): prepare it in a "
            "data dir that can be written"
        ) from e
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def current(builder, make=None):
    """``builder``, or one made again (``make()``; by default as TFDS copies a builder,
    from its constructor's arguments) when it was made before another run prepared its
    data, while this one waited for `prepare_lock`: its info is then an empty folder's,
    which names TFDS's default file format, not the array_record every task writes."""
    array_record = tfds().core.file_adapters.FileFormat.ARRAY_RECORD
    written = epath.Path(builder.data_dir) / "dataset_info.json"  # is_prepared() warns
    if builder.info.file_format != array_record and written.exists():
        return make() if make is not None else type(builder)(**builder._original_state)
    return builder


def prepared(builder):
    """``builder`` (a TFDS builder of one's own) prepared as array_record under its data
    dir: generated on first use, under `prepare_lock`, and reused after."""
    with prepare_lock(builder):
        builder = current(builder)
        builder.download_and_prepare(file_format="array_record")
    return builder
