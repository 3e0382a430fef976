"""GSM8K through TFDS's own ``gsm8k`` builder.

With network access, ``prepare_gsm8k(data_dir)`` lets TFDS download the four
jsonl files of openai/grade-school-math and prepare them. Without network,
supply the files: put ``train.jsonl``, ``test.jsonl``, ``train_socratic.jsonl``
and ``test_socratic.jsonl`` (from the repository's ``grade_school_math/data/``)
in a folder and call ``prepare_gsm8k(data_dir, files_dir=folder)``. The files
are placed in TFDS's download cache exactly as its download manager leaves a
finished download (file named from the URL, ``.INFO`` file beside it); the
real builder and download manager then run unchanged and find them cached.
The cache check is TFDS's own, so nothing is patched.

Each jsonl line is ``{"question": ..., "answer": "...#### 72"}``; the builder
splits the answer into ``annotation`` and ``short_answer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core.download import checksums as tfds_checksums
from tensorflow_datasets.core.download import resource as tfds_resource

# Importing the module registers the `gsm8k` builder with tfds.builder(...)
# (tfds.list_builders() needs TensorFlow; this does not).
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

SPLITS = ("train", "test", "train_socratic", "test_socratic")


def gsm8k_urls() -> dict[str, str]:
    """The URLs the TFDS builder downloads, by split."""
    return dict(tfds_gsm8k._URLS)  # pylint: disable=protected-access


def supply_gsm8k_files(files_dir: os.PathLike | str, download_dir: os.PathLike | str) -> None:
    """Places local GSM8K jsonl files in a TFDS download cache.

    Args:
      files_dir: folder with ``<split>.jsonl`` for every split in SPLITS.
      download_dir: the ``download_dir`` later given to ``download_and_prepare``.

    Raises:
      ValueError: naming the missing file if one is absent.
    """
    files_dir = epath.Path(files_dir)
    download_dir = epath.Path(download_dir)
    for split, url in gsm8k_urls().items():
        src = _split_file(files_dir, split)
        resource = tfds_resource.Resource(url=url)
        # The path the download manager checks for a URL whose checksum is not
        # registered (gsm8k registers none): <download_dir>/<dataset>/<name(url)>.
        dst = (
            download_dir
            / "gsm8k"
            / resource.relative_download_dir
            / tfds_resource.get_dl_fname(url)
        )
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        info_path = tfds_resource.get_info_path(dst)
        if info_path.exists():
            info_path.unlink()  # A new file replaces a previous supply.
        tfds_resource.write_info_file(
            url=url,
            path=dst,
            dataset_name="gsm8k",
            original_fname=f"{split}.jsonl",
            url_info=tfds_checksums.compute_url_info(dst),
        )


def gsm8k_builder(data_dir: os.PathLike | str) -> tfds.core.DatasetBuilder:
    """``tfds.builder("gsm8k")`` under ``data_dir``."""
    return tfds.builder("gsm8k", data_dir=os.fspath(data_dir))


def prepare_gsm8k(
    data_dir: os.PathLike | str,
    *,
    files_dir: os.PathLike | str | None = None,
    download_dir: os.PathLike | str | None = None,
) -> tfds.core.DatasetBuilder:
    """Prepares GSM8K as array_record under ``data_dir`` and returns the builder.

    Args:
      data_dir: TFDS data dir.
      files_dir: optional folder with the four jsonl files (no network needed). If
        ``data_dir`` already holds GSM8K prepared from different files, ValueError.
      download_dir: TFDS download cache; default ``<data_dir>/downloads``.
    """
    builder = gsm8k_builder(data_dir)
    download_dir = epath.Path(download_dir or epath.Path(data_dir) / "downloads")
    if files_dir is None:
        builder.download_and_prepare(download_dir=download_dir, file_format="array_record")
        return builder
    digests = _file_digests(files_dir)
    record = epath.Path(builder.data_dir) / _SOURCES_FILE
    if builder.is_prepared() and record.exists():
        if json.loads(record.read_text()) != digests:
            raise ValueError(
                f"GSM8K under {os.fspath(builder.data_dir)!r} was prepared from other files than those "
                f"in files_dir {os.fspath(files_dir)!r}; remove that folder to prepare it again, or "
                "use another data_dir"
            )
        return builder
    supply_gsm8k_files(files_dir, download_dir)
    builder.download_and_prepare(download_dir=download_dir, file_format="array_record")
    record.write_text(json.dumps(digests, sort_keys=True))
    return builder


# Beside a GSM8K prepared from supplied files: the sha256 of each file, so that
# other files given later are noticed instead of being silently ignored.
_SOURCES_FILE = "gspo_jax_supplied_files.json"


def _file_digests(files_dir: os.PathLike | str) -> dict[str, str]:
    """sha256 of ``<split>.jsonl`` for every split; ValueError naming a missing file."""
    return {
        split: hashlib.sha256(_split_file(files_dir, split).read_bytes()).hexdigest()
        for split in SPLITS
    }


def _split_file(files_dir: os.PathLike | str, split: str) -> epath.Path:
    """``<files_dir>/<split>.jsonl``; ValueError naming it if it is missing."""
    path = epath.Path(files_dir) / f"{split}.jsonl"
    if not path.exists():
        raise ValueError(
            f"files_dir {os.fspath(files_dir)!r} lacks {split}.jsonl; GSM8K needs "
            f"{', '.join(s + '.jsonl' for s in SPLITS)}"
        )
    return path
