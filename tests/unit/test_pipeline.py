"""User pipelines: loading one, the lazy sample it gets, seeding, checking what it returns, the probe.

Everything runs on real files: small ImageFolder, list and tar sources written here, pipelines
written as .py files, and the probe as the real child process the service starts.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import torch

from loader_service.dataset.index import DatasetIndex, build_index
from loader_service.decode.pipeline import (
    OutputError,
    PipelineError,
    call_pipeline,
    infer_fields,
    load_pipeline,
    parse_spec,
    run_into,
    store_output,
)
from loader_service.decode.probe import probe_fields
from loader_service.decode.reading import SampleReader
from loader_service.decode.sample import RESERVED, Sample
from protocol.layout import FieldSpec

pytestmark = pytest.mark.usefixtures("restore_process_state")

MAX_BYTES = 1 << 20
COLOURS = {"red": (0, 0, 255), "green": (0, 255, 0), "blue": (255, 0, 0)}  # OpenCV's BGR


def png(colour: str, height: int = 24, width: int = 32) -> bytes:
    ok, data = cv2.imencode(".png", np.full((height, width, 3), COLOURS[colour], np.uint8))
    assert ok
    return data.tobytes()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """class a: red.png, green.png; class b: blue.png and bad.jpg, which is not an image."""
    root = tmp_path / "folder"
    for cls, name in (("a", "red"), ("a", "green"), ("b", "blue")):
        (root / cls).mkdir(parents=True, exist_ok=True)
        (root / cls / f"{name}.png").write_bytes(png(name))
    (root / "b" / "bad.jpg").write_bytes(b"not an image at all")
    return root


def reader_for(data: Path) -> tuple[DatasetIndex, SampleReader]:
    index = build_index(data)
    return index, SampleReader(index, MAX_BYTES)


def pipeline_file(tmp_path: Path, body: str, name: str = "pipe.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def sample_of(data: Path, relpath: str, epoch: int = 0) -> Sample:
    index, reader = reader_for(data)
    return Sample(reader, index, [index.relpath(i) for i in range(len(index))].index(relpath), epoch)


# --- loading --------------------------------------------------------------------------------------


def test_specs_name_a_file_or_a_module_and_a_function() -> None:
    assert parse_spec("aug/train.py:make") == ("aug/train.py", "make")
    assert parse_spec("pkg.sub.mod:fn") == ("pkg.sub.mod", "fn")
    for bad in ("aug.py", "aug.py:", ":fn", "pkg.mod:1fn", "pkg/mod:fn", "a b:fn", "pkg..mod:fn"):
        with pytest.raises(ValueError, match="pipeline"):
            parse_spec(bad)


def test_a_file_pipeline_imports_its_neighbours(tmp_path: Path) -> None:
    pipeline_file(tmp_path, "SCALE = 3\n", "helpers_for_pipe.py")
    path = pipeline_file(tmp_path, "from helpers_for_pipe import SCALE\ndef fn(sample, rng): return SCALE\n")
    fn = load_pipeline(f"{path}:fn")
    assert fn(None, None) == 3  # type: ignore[arg-type]
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1


def test_a_module_pipeline_is_found_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "userpkg_for_test").mkdir()
    (tmp_path / "userpkg_for_test" / "__init__.py").write_text("")
    pipeline_file(tmp_path / "userpkg_for_test", "def fn(sample, rng): return 'module'\n", "aug.py")
    monkeypatch.chdir(tmp_path)
    try:
        assert load_pipeline("userpkg_for_test.aug:fn")(None, None) == "module"  # type: ignore[arg-type]
    finally:
        for name in [m for m in sys.modules if m.startswith("userpkg_for_test")]:
            del sys.modules[name]


def test_import_failures_carry_the_users_traceback(tmp_path: Path) -> None:
    broken = pipeline_file(tmp_path, "import os\nraise RuntimeError('no GPU here, says line 2')\n")
    with pytest.raises(PipelineError) as err:
        load_pipeline(f"{broken}:fn")
    text = str(err.value)
    assert f'"{broken}", line 2' in text and "RuntimeError: no GPU here, says line 2" in text
    assert "importlib" not in text and "loader_service" not in text  # only the user's frames
    good = pipeline_file(tmp_path, "VALUE = 1\n", "good.py")
    with pytest.raises(PipelineError, match=r"good\.py defines no fn"):
        load_pipeline(f"{good}:fn")
    with pytest.raises(PipelineError, match=r"VALUE in .*good\.py is a int, not a function"):
        load_pipeline(f"{good}:VALUE")
    with pytest.raises(PipelineError, match="No module named 'no_such_module_here'"):
        load_pipeline("no_such_module_here:fn")
    with pytest.raises(PipelineError, match="no file"):
        load_pipeline(f"{tmp_path / 'missing.py'}:fn")


# --- the sample -----------------------------------------------------------------------------------


def test_the_sample_holds_rgb_pixels_and_the_reserved_keys(folder: Path) -> None:
    sample = sample_of(folder, "a/red.png", epoch=4)
    assert list(sample) == list(RESERVED) and len(sample) == len(RESERVED)
    assert sample["image"].shape == (24, 32, 3) and sample["image"].dtype == np.uint8
    assert sample["image"][0, 0].tolist() == [255, 0, 0]  # RGB, not OpenCV's BGR
    assert sample["bytes"] == png("red")
    assert (sample["label"], sample["epoch"], sample["path"]) == (0, 4, "a/red.png")
    assert sample["image"] is sample["image"]  # decoded once
    with pytest.raises(KeyError):
        sample["caption"]
    with pytest.raises(TypeError):
        sample["label"] = 3  # type: ignore[index]


def test_a_pipeline_that_never_reads_the_image_never_decodes_it(folder: Path) -> None:
    sample = sample_of(folder, "b/bad.jpg")
    fields = (FieldSpec("label", "int64", ()),)
    rows = {"label": np.zeros((), np.int64)}
    assert "image" in sample and "bytes" in sample  # membership loads nothing either
    assert run_into(lambda s, rng: {"label": s["label"]}, sample, 0, fields, rows) is None
    assert rows["label"] == 1
    reading = run_into(lambda s, rng: {"label": s["image"].sum()}, sample, 0, fields, rows)
    assert reading == "not a decodable image"  # the file's own reason, as for the built-in path


def test_list_metadata_by_name_with_reserved_names_winning(tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(png("red"))
    (tmp_path / "blue.png").write_bytes(png("blue"))
    (tmp_path / "train.csv").write_text(
        "path,label,caption,epoch\nred.png,5,a red square,x\nblue.png,6,blue,y\n"
    )
    index, reader = reader_for(tmp_path / "train.csv")
    sample = Sample(reader, index, 0, 2)
    assert list(sample) == [*RESERVED, "caption"]
    assert "caption" in sample and "nothing" not in sample
    assert (sample["caption"], sample["epoch"], sample["label"], sample["path"]) == (
        "a red square",
        2,
        5,
        "red.png",
    )
    assert sample.hidden == ("epoch",)


def test_tar_members_are_metadata_bytes_by_extension(tmp_path: Path) -> None:
    shard = tmp_path / "train-000000.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("s0.png", png("green")), ("s0.cls", b"7"), ("s0.json", b'{"id": 11}')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index, reader = reader_for(tmp_path)
    sample = Sample(reader, index, 0, 0)
    assert sample["path"] == "train-000000.tar:s0" and sample["label"] == 7
    assert json.loads(sample["json"]) == {"id": 11}
    assert sample["image"][0, 0].tolist() == [0, 255, 0]


# --- seeding --------------------------------------------------------------------------------------


def draws(sample: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Randomness from every generator the service seeds."""
    return {
        "rng": rng.random(3),
        "py": np.float64(random.random()),
        "np": np.random.rand(3),
        "torch": torch.rand(3),
    }


def test_same_seed_epoch_and_index_give_the_same_draws_whatever_ran_before(folder: Path) -> None:
    index, reader = reader_for(folder)

    def run(i: int, epoch: int = 0, seed: int = 9) -> list[Any]:
        out = call_pipeline(draws, Sample(reader, index, i, epoch), seed)
        assert isinstance(out, dict)
        return [np.asarray(v).tolist() for v in out.values()]

    first = run(2)
    random.random(), np.random.rand(), torch.rand(5)  # a worker that did other work in between
    assert run(0) != first and run(2) == first
    assert run(2, epoch=1) != first and run(2, seed=10) != first
    rng_draw, py, npd, td = first
    assert len({rng_draw[0], py, npd[0], td[0]}) == 4  # four streams, not one seed used four times


# --- what it returns ------------------------------------------------------------------------------

LAYOUT = (FieldSpec("image", "float16", (3, 4, 4)), FieldSpec("label", "int64", ()))


def rows_for(fields: tuple[FieldSpec, ...]) -> dict[str, np.ndarray]:
    return {f.name: np.zeros(f.shape, f.dtype) for f in fields}


def test_arrays_tensors_and_plain_numbers_are_stored_in_place() -> None:
    rows = rows_for(LAYOUT)
    store_output({"image": torch.full((3, 4, 4), 0.5, dtype=torch.float16), "label": 3}, LAYOUT, rows)
    assert (rows["image"] == 0.5).all() and rows["label"] == 3
    store_output({"label": np.int64(4), "image": np.ones((3, 4, 4), ">f2")}, LAYOUT, rows)  # any order
    assert (rows["image"] == 1).all() and rows["label"] == 4
    grad = torch.zeros((3, 4, 4), dtype=torch.float16, requires_grad=True)
    store_output({"image": grad, "label": np.array(5)}, LAYOUT, rows)
    assert rows["label"] == 5
    assert infer_fields({"ok": True, "n": 2, "x": 1.5, "t": torch.zeros(2, 1, dtype=torch.bool)}) == (
        FieldSpec("ok", "bool", ()),
        FieldSpec("n", "int64", ()),
        FieldSpec("x", "float64", ()),
        FieldSpec("t", "bool", (2, 1)),
    )


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ([1, 2], "returned a list, not a dict of fields"),
        ({"image": np.zeros((3, 4, 4), np.float16)}, "no field 'label' (the batch has image, label)"),
        (
            {"image": np.zeros((3, 4, 4), np.float32), "label": 1},
            "field image float32[3, 4, 4], the batch has image float16[3, 4, 4]",
        ),
        (
            {"image": np.zeros((3, 4, 5), np.float16), "label": 1},
            "field image float16[3, 4, 5], the batch has",
        ),
        (
            {"image": np.zeros((3, 4, 4), np.float16), "label": 1, "extra": 2},
            "field 'extra' is not in the batch",
        ),
        ({"image": np.zeros((3, 4, 4), np.complex64), "label": 1}, "dtype complex64, not one of uint8"),
        (
            {"image": torch.zeros((3, 4, 4), dtype=torch.bfloat16), "label": 1},
            "dtype torch.bfloat16, not one of",
        ),
        (
            {"image": torch.zeros((3, 4, 4), device="meta"), "label": 1},
            "a tensor on meta; return CPU tensors",
        ),
        ({"image": "pixels", "label": 1}, "field 'image' is a str, not a numpy array or torch tensor"),
        ({"image": np.zeros((3, 4, 4), np.float16), "label": 2**70}, "does not fit int64"),
    ],
)
def test_a_mismatch_is_a_bad_sample_naming_it(result: object, reason: str) -> None:
    rows = rows_for(LAYOUT)
    with pytest.raises(OutputError) as err:
        store_output(result, LAYOUT, rows)
    assert reason in str(err.value)


def test_failures_are_one_line_reasons(folder: Path) -> None:
    index, reader = reader_for(folder)
    rows = rows_for(LAYOUT)

    def reason(fn: Any) -> str | None:
        return run_into(fn, Sample(reader, index, 0, 0), 0, LAYOUT, rows)

    def raises(sample: Any, rng: Any) -> Any:
        raise ValueError("first line\nsecond line" + "x" * 500)

    def empty(sample: Any, rng: Any) -> Any:
        raise KeyError

    assert reason(raises) == "pipeline: ValueError: first line"
    assert reason(empty) == "pipeline: KeyError"
    image_only = {"image": np.zeros((3, 4, 4), np.float16)}
    assert reason(lambda s, rng: image_only) == "pipeline: no field 'label' (the batch has image, label)"
    assert reason(lambda s, rng: s["caption"]) == "pipeline: KeyError: 'caption'"
    assert reason(lambda s, rng: 1 / 0) == "pipeline: ZeroDivisionError: division by zero"
    huge = reason(lambda s, rng: (_ for _ in ()).throw(RuntimeError("y" * 1000)))
    assert huge is not None and len(huge) == 200


# --- the probe ------------------------------------------------------------------------------------


@pytest.fixture
def saved_index(folder: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "index"
    directory.mkdir()
    build_index(folder).save(directory)
    return directory


def probe(pipeline: Path, index_dir: Path, func: str = "fn", timeout: float = 60.0) -> tuple[FieldSpec, ...]:
    return probe_fields(f"{pipeline}:{func}", index_dir, seed=3, max_file_bytes=MAX_BYTES, timeout=timeout)


def test_the_probe_learns_the_fields_in_the_returned_order(tmp_path: Path, saved_index: Path) -> None:
    path = pipeline_file(
        tmp_path,
        """
        import os
        import numpy as np
        print("chatter on stdout must not spoil the result")
        os.write(2, b"a library's bytes on stderr need not be UTF-8: \\xff\\xfe\\n")
        def fn(sample, rng):
            print("more chatter", sample["path"])
            image = np.zeros((3, 8, 8), np.float16)
            return {"label": sample["label"], "image": image, "flip": rng.random() < 0.5}
        """,
    )
    assert probe(path, saved_index) == (
        FieldSpec("label", "int64", ()),
        FieldSpec("image", "float16", (3, 8, 8)),
        FieldSpec("flip", "bool", ()),
    )


def test_the_numpy_example_probes_to_float16_images_and_labels(saved_index: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "pipelines" / "numpy_aug.py"
    expected = (FieldSpec("image", "float16", (3, 224, 224)), FieldSpec("label", "int64", ()))
    assert probe(example, saved_index, "train") == expected


def test_probe_errors_carry_the_users_traceback(tmp_path: Path, saved_index: Path) -> None:
    raising = pipeline_file(tmp_path, "def fn(sample, rng):\n    return {'x': 1 / 0}\n", "raising.py")
    with pytest.raises(PipelineError) as err:
        probe(raising, saved_index)
    assert "failed on sample 0 (a/green.png)" in str(err.value)
    assert f'"{raising}", line 2, in fn' in str(err.value) and "ZeroDivisionError" in str(err.value)
    assert "loader_service" not in str(err.value)
    broken = pipeline_file(tmp_path, "import no_such_module_here\n", "broken.py")
    with pytest.raises(PipelineError, match=r"cannot import(.|\n)*No module named 'no_such_module_here'"):
        probe(broken, saved_index)


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ([1, 2], "returned a list, not a dict of fields"),
        ({}, "returned an empty dict"),
        ({1: np.zeros(3)}, "keys are not all strings"),
        ({"x": np.zeros(3, np.complex64)}, "dtype complex64"),
        ({"x": np.zeros((3, 0))}, "shape (3, 0) must have"),
        ({"not valid": 1}, "field name 'not valid'"),
    ],
)
def test_what_is_not_a_batch_cannot_make_the_layout(result: object, reason: str) -> None:
    with pytest.raises(OutputError) as err:
        infer_fields(result)
    assert reason in str(err.value)


def test_the_probe_refuses_what_is_not_a_batch(tmp_path: Path, saved_index: Path) -> None:
    path = pipeline_file(tmp_path, "import numpy as np\ndef fn(sample, rng):\n    return [sample['image']]\n")
    with pytest.raises(PipelineError) as err:
        probe(path, saved_index)
    assert str(err.value) == (
        f"pipeline {path}:fn returned no usable batch for sample 0 (a/green.png): "
        "returned a list, not a dict of fields"
    )


def test_the_probe_times_out_on_a_hanging_pipeline(tmp_path: Path, saved_index: Path) -> None:
    path = pipeline_file(tmp_path, "import threading\ndef fn(sample, rng):\n    threading.Event().wait()\n")
    # Whether the import or the pipeline is still running at the deadline, the verdict is the same.
    with pytest.raises(PipelineError, match="no result for sample 0 within 3 s"):
        probe(path, saved_index, timeout=3)


def test_the_probe_warns_of_unseeded_randomness_and_skips_bad_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (data / "a" / "0.jpg").write_bytes(b"broken")  # sample 0: a bad file
    (data / "a" / "1.png").write_bytes(png("red"))
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    build_index(data).save(index_dir)
    path = pipeline_file(
        tmp_path,
        """
        import numpy as np
        OWN = np.random.default_rng()
        def fn(sample, rng):
            return {"image": sample["image"], "noise": OWN.random(2)}
        """,
    )
    with caplog.at_level("WARNING"):
        fields = probe(path, index_dir)
    assert fields == (FieldSpec("image", "uint8", (24, 32, 3)), FieldSpec("noise", "float64", (2,)))
    assert "sample 0 (a/0.jpg) is a bad file (not a decodable image)" in caplog.text
    assert "field 'noise' differs between two runs on sample 1" in caplog.text
    assert "'image' differs" not in caplog.text


def test_a_probe_process_that_dies_is_reported(tmp_path: Path, saved_index: Path) -> None:
    path = pipeline_file(tmp_path, "import os\ndef fn(sample, rng):\n    os._exit(7)\n")
    with pytest.raises(PipelineError, match="exited with code 7 before it reported"):
        probe(path, saved_index)


# --- the torchvision example ----------------------------------------------------------------------


def torchvision_or_skip() -> None:
    try:
        importlib.import_module("torchvision.transforms.v2")
    except Exception as exc:  # missing, or built for another torch ("operator torchvision::nms ...")
        pytest.skip(
            f"torchvision is not usable here ({type(exc).__name__}: {exc}); "
            "install it with the matching torch: pip install 'dataferry[pipelines]'"
        )


def test_the_torchvision_example_gives_the_same_float16_crop_per_sample(
    folder: Path, saved_index: Path
) -> None:
    torchvision_or_skip()
    example = Path(__file__).resolve().parents[2] / "examples" / "pipelines" / "torchvision_v2.py"
    expected = (FieldSpec("image", "float16", (3, 224, 224)), FieldSpec("label", "int64", ()))
    assert probe(example, saved_index, "train") == expected
    assert probe(example, saved_index, "evaluate") == expected
    train = load_pipeline(f"{example}:train")
    index, reader = reader_for(folder)

    def image(epoch: int) -> bytes:
        out = call_pipeline(train, Sample(reader, index, 1, epoch), 3)
        assert isinstance(out, dict)
        return bytes(out["image"].numpy().tobytes())

    first = image(0)
    torch.rand(10)  # whatever the worker drew before
    assert image(0) == first and image(1) != first
