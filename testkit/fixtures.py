"""Fixture files the tests and benchmarks read: an ImageFolder (from ``make_sample_dataset``) written
again as WebDataset-style tar shards, as the Parquet files Hugging Face ``datasets`` writes or as a
zip archive ``zipfile`` writes, and what damages such an archive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_shards(root: Path, out: Path, per_shard: int = 16) -> list[Path]:
    """The ImageFolder ``root`` as WebDataset-style tar shards in ``out``, ``per_shard`` samples each, in
    its index order: ``sampleNNNNNN.jpg``, ``.cls`` (the label) and ``.json`` (the source path)."""
    import io
    import tarfile

    from loader_service.dataset.index import build_index

    index = build_index(root, "imagefolder")
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for s, start in enumerate(range(0, len(index), per_shard)):
        path = out / f"train-{s:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(start + per_shard, len(index))):
                rel = index.relpath(i)
                members = [
                    ("jpg", (root / rel).read_bytes()),
                    ("cls", str(int(index.labels[i])).encode()),
                    ("json", json.dumps({"source": rel}).encode()),
                ]
                for ext, data in members:
                    info = tarfile.TarInfo(f"sample{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards.append(path)
    return shards


def write_parquet(root: Path, folder: Path, files: int = 1) -> Path:
    """The ImageFolder ``root`` as the Parquet files Hugging Face ``datasets`` writes (its own
    ``to_parquet``: an ``Image`` column, a ``ClassLabel`` label, a caption), in index order, split in
    ``files`` files named as the hub names them. Needs the ``datasets`` package."""
    dataset = _as_dataset(root)
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        dataset.shard(files, k, contiguous=True).to_parquet(
            str(folder / f"train-{k:05d}-of-{files:05d}.parquet")
        )
    return folder


def _as_dataset(root: Path) -> Any:
    """The ImageFolder ``root`` as a ``datasets.Dataset`` in index order: an ``Image`` column of
    its files' bytes (and paths), a ``ClassLabel`` label and a caption."""
    import datasets

    from loader_service.dataset.index import build_index

    index = build_index(root, "imagefolder")
    rows = range(len(index))
    table = {
        "image": [{"bytes": (root / index.relpath(i)).read_bytes(), "path": index.relpath(i)} for i in rows],
        "label": [int(index.labels[i]) for i in rows],
        "caption": [f"photo {i}" for i in rows],
    }
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=list(index.classes)),
            "caption": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(table, features=features)


def write_zip(root: Path, out: Path, top: str = "", order_seed: int | None = 3) -> Path:
    """The ImageFolder ``root`` as one zip archive made with Python's ``zipfile``: its class folders
    inside (under ``top`` if given), every other member deflated and the rest stored, with a
    directory entry per class, in an order shuffled by ``order_seed`` (None: the folder's order)."""
    import random
    import zipfile

    from loader_service.dataset.index import build_index

    index = build_index(root, "imagefolder")
    members = [index.relpath(i) for i in range(len(index))]
    if order_seed is not None:
        random.Random(order_seed).shuffle(members)
    prefix = f"{top}/" if top else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as archive:
        for name in index.classes:
            archive.writestr(zipfile.ZipInfo(f"{prefix}{name}/"), b"")
        for k, rel in enumerate(members):
            method = zipfile.ZIP_DEFLATED if k % 2 else zipfile.ZIP_STORED
            archive.write(root / rel, f"{prefix}{rel}", compress_type=method)
    return out


def set_zip_field(path: Path, member: str, offset: int, fmt: str, value: int) -> None:
    """Write ``value`` (``struct`` format ``fmt``) at ``offset`` of ``member``'s central directory
    entry: a damaged or hostile archive (8: flags, 10: method, 24: uncompressed size)."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    name = member.encode()
    while at >= 0:
        length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + length] == name:
            struct.pack_into(fmt, data, at + offset, value)
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 4)
    raise LookupError(member)


def zip_data_offset(path: Path, member: str) -> int:
    """Where ``member``'s data begins in the archive."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    local = path.read_bytes()[info.header_offset : info.header_offset + 30]
    name_len, extra_len = struct.unpack_from("<HH", local, 26)
    return int(info.header_offset) + 30 + int(name_len) + int(extra_len)


def write_save_to_disk(root: Path, folder: Path, shards: int = 2) -> Path:
    """The ImageFolder ``root`` as the folder Hugging Face ``datasets`` writes with ``save_to_disk``
    (an ``Image`` column, a ``ClassLabel`` label, a caption), in index order, in ``shards`` Arrow
    files. Needs the ``datasets`` package."""
    _as_dataset(root).save_to_disk(str(folder), num_shards=shards)
    return folder


def write_tfrecords(root: Path, folder: Path, files: int = 2, label_offset: int = 0) -> Path:
    """The ImageFolder ``root`` as TFRecord files the ``tfrecord`` package writes, in index order, as
    TensorFlow's ImageNet scripts lay them out: ``train-00000-of-00002`` (no suffix), each record a
    ``tf.train.Example`` of ``image/encoded``, ``image/class/label`` (plus ``label_offset``) and
    ``image/filename``. Needs the ``tfrecord`` package."""
    from tfrecord import TFRecordWriter

    from loader_service.dataset.index import build_index

    index = build_index(root, "imagefolder")
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(index) // files)
    for k in range(files):
        writer = TFRecordWriter(str(folder / f"train-{k:05d}-of-{files:05d}"))
        for i in range(k * per_file, min((k + 1) * per_file, len(index))):
            writer.write(
                {
                    "image/encoded": ((root / index.relpath(i)).read_bytes(), "byte"),
                    "image/class/label": (int(index.labels[i]) + label_offset, "int"),
                    "image/filename": (index.relpath(i).encode(), "byte"),
                }
            )
        writer.close()
    return folder
