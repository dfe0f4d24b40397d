"""``check_cudart``: how a failed CUDA runtime call is reported, without a GPU.

The fake below stands in for ``torch.cuda.cudart()`` because this project's machines have no CUDA;
tests/gpu/test_cuda_path.py runs the same checks against the real runtime where there is one.
"""

from __future__ import annotations

import os

import pytest

from gpu_worker import device
from gpu_worker.device import CudaCallError, check_cudart, loaded_library_function

ALREADY_REGISTERED = 712
NAMES = {
    0: "no error",
    ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
}


class FakeError:
    """Like the binding's ``cudaError`` enum: converts to int, and is all cudaGetErrorString accepts."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __int__(self) -> int:
        return self.code


class OldTorchCudart:
    """A runtime whose calls fail with ``code`` and leave it as the thread's last error, as CUDA does.

    Like ``torch.cuda.cudart()`` of a torch that binds no cudaGetLastError.
    """

    def __init__(self, code: int) -> None:
        self.code = code
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> FakeError:  # noqa: N802 (CUDA's name)
        if self.code:
            self.last_error = self.code
        return FakeError(self.code)

    def cudaGetErrorString(self, err: FakeError) -> str:  # noqa: N802
        # The real binding raises TypeError for a plain int; so must the fake, to catch that mistake.
        if not isinstance(err, FakeError):
            raise TypeError(f"cudaGetErrorString(): incompatible function arguments: {err!r}")
        return NAMES[int(err)]


class FakeCudart(OldTorchCudart):
    """The same runtime as a recent torch binds it, with cudaGetLastError."""

    def cudaGetLastError(self) -> FakeError:  # noqa: N802
        err, self.last_error = self.last_error, 0
        return FakeError(err)


def test_success_passes_and_leaves_the_last_error_alone() -> None:
    cudart = FakeCudart(0)
    cudart.last_error = ALREADY_REGISTERED  # someone else's: not ours to consume
    check_cudart(cudart, cudart.cudaHostRegister(4096, 4096, 1), "cudaHostRegister")
    assert cudart.last_error == ALREADY_REGISTERED


def test_failure_is_named_and_clears_the_last_error() -> None:
    cudart = FakeCudart(ALREADY_REGISTERED)
    err = cudart.cudaHostRegister(4096, 4096, 1)
    with pytest.raises(CudaCallError) as caught:
        check_cudart(cudart, err, "cudaHostRegister")
    assert str(caught.value) == (
        "cudaHostRegister failed: part or all of the requested memory range is already mapped (cudaError 712)"
    )
    assert caught.value.cleared
    assert cudart.last_error == 0, "a later kernel launch must not report this failure"


def test_without_a_binding_the_loaded_runtime_clears_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = OldTorchCudart(ALREADY_REGISTERED)

    def runtime_function(prefix: str, name: str) -> object:
        assert (prefix, name) == ("libcudart.so", "cudaGetLastError")
        return lambda: setattr(cudart, "last_error", 0)

    monkeypatch.setattr(device, "loaded_library_function", runtime_function)
    with pytest.raises(CudaCallError) as caught:
        check_cudart(cudart, cudart.cudaHostRegister(4096, 4096, 1), "cudaHostRegister")
    assert caught.value.cleared and cudart.last_error == 0


def test_with_nothing_to_clear_it_the_error_says_it_is_still_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device, "loaded_library_function", lambda prefix, name: None)
    cudart = OldTorchCudart(ALREADY_REGISTERED)
    err = cudart.cudaHostRegister(4096, 4096, 1)
    with pytest.raises(CudaCallError, match="last error is still set") as caught:
        check_cudart(cudart, err, "cudaHostRegister")
    assert not caught.value.cleared
    assert cudart.last_error == ALREADY_REGISTERED


def test_a_function_is_found_only_in_a_library_already_loaded() -> None:
    getpid = loaded_library_function("libc.so", "getpid")  # every Python process has libc mapped
    assert getpid is not None and getpid() == os.getpid()
    assert loaded_library_function("libc.so", "no_such_function_here") is None
    assert loaded_library_function("libdataferry-never-loaded.so", "getpid") is None
