"""The docs' pipeline and trainer examples (docs/data.md), run as written against a list source
through the CLI."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from gpu_worker import ServiceLoader
from tests.helpers import REPO, ServiceFactory, folder_samples

pytestmark = pytest.mark.e2e


def readme_block(first_line: str) -> str:
    """The fenced code block of docs/data.md that starts with ``first_line``."""
    text = (REPO / "docs" / "data.md").read_text()
    match = re.search(r"```\w*\n(" + re.escape(first_line) + r"\n.*?)```", text, re.S)
    assert match, f"docs/data.md has no code block starting {first_line!r}"
    return match.group(1)


def test_the_readme_pipeline_serves_the_fields_the_readme_trainer_expects(
    photos: Path, start_service: ServiceFactory, tmp_path: Path
) -> None:
    pipeline = tmp_path / "aug.py"
    pipeline.write_text(readme_block("# /srv/aug.py"))
    listing = tmp_path / "train.csv"
    samples = folder_samples(photos)
    with open(listing, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "caption"])
        writer.writerows([str(photos / rel), label, "x" * i] for i, (rel, label) in enumerate(samples))
    service = start_service(listing, pipeline=f"{pipeline}:train", batch_size=8, image_size=224)
    service.wait_for(r"batch fields image uint8\[3, 224, 224\], label int64\[\], caption_len int32\[\]")
    # The README's trainer states image and label only; this feed has a third field, so it is refused
    # by name, and accepted once the expectation lists it.
    expected = {"image": ((3, 224, 224), torch.uint8), "label": ((), torch.int64)}
    with pytest.raises(Exception, match="extra field caption_len int32"):
        ServiceLoader(service.endpoint, fields=expected, timeout=30).close()
    expected["caption_len"] = ((), torch.int32)
    with ServiceLoader(service.endpoint, fields=expected, timeout=30) as loader:
        seen = 0
        for batch in loader:
            images, labels, caption_len = batch
            assert images.shape[1:] == (3, 224, 224)
            for row, idx in enumerate(batch.indices.tolist()):
                assert int(labels[row]) == samples[idx][1]
                assert int(caption_len[row]) == idx
            seen += len(batch.indices)
    assert seen == len(samples)
