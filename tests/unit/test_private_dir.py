"""The data dir is 0700 and the folders made above it are never writable by others, whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.storage.sqlite import make_private_dir


def test_under_umask_000_parents_are_0755_and_the_data_dir_0700(tmp_path: Path) -> None:
    """Path.mkdir(parents=True) would give the parents 0777: another user could swap the data dir."""
    target = tmp_path / "srv" / "hl7" / "data"
    old = os.umask(0)
    try:
        make_private_dir(target)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "srv").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "srv" / "hl7").stat().st_mode) == 0o755
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_an_existing_data_dir_is_tightened_and_its_parents_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "shared" / "data"
    target.mkdir(parents=True)
    os.chmod(tmp_path / "shared", 0o775)  # noqa: S103 - the loose parent under test
    os.chmod(target, 0o755)  # noqa: S103 - the loose data dir under test
    make_private_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o775
