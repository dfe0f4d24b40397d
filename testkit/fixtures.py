"""Fixture files the tests and benchmarks read: an ImageFolder (from ``make_sample_dataset``) written
again as WebDataset-style tar shards or as the Parquet files Hugging Face ``datasets`` writes."""

from __future__ import annotations

import json
from pathlib import Path


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
    dataset = datasets.Dataset.from_dict(table, features=features)
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        dataset.shard(files, k, contiguous=True).to_parquet(
            str(folder / f"train-{k:05d}-of-{files:05d}.parquet")
        )
    return folder
