"""``moved_to``: a moment in another folder, and back to the very folder the process was in
(NOTE [ Nothing from the working folder ])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loader_service.working_folder import moved_to


def test_back_in_the_folder_it_was_in_even_when_its_name_now_means_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user who can write in the folder above swaps the folder's name meanwhile: the way
    back is the folder itself, not whatever now has its name."""
    start, private = tmp_path / "start", tmp_path / "private"
    start.mkdir()
    private.mkdir()
    monkeypatch.chdir(start)
    with moved_to(private):
        assert Path.cwd() == private
        start.rename(tmp_path / "moved")
        (tmp_path / "start").mkdir()  # the decoy
    assert Path.cwd() == tmp_path / "moved"


def test_back_where_it_was_when_the_folder_cannot_be_entered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError), moved_to(tmp_path / "missing"):
        pass
    assert Path.cwd() == tmp_path
    assert set(os.listdir("/proc/self/fd")) <= before, "the descriptor of the way back is closed"
