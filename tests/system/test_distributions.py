"""The sdist and the wheel carry the license, the docs, the units and the example configs.

Both are built once per module with ``python -m build`` (an isolated build, as
pip does), listed, and the wheel is installed into a fresh venv, where every
unit's ``Documentation=`` must then name a file that exists (the unit's venv,
``/opt/hl7-agent`` or ``/opt/hl7-agent-%i``, replaced by the test's).
"""

from __future__ import annotations

import email
import hashlib
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
UNITS = ("hl7-agent.service", "hl7-agent@.service", "hl7-agent.socket")
CONFIGS = ("agent.example.toml", "agent.production.toml")
#: The Apache License 2.0 as published (https://www.apache.org/licenses/LICENSE-2.0.txt).
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path
    prefix: Path


def _docs() -> list[str]:
    return sorted(p.name for p in (REPO / "docs").iterdir() if p.suffix in (".md", ".json", ".png"))


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    out = tmp_path_factory.mktemp("dist")
    try:
        import build  # noqa: F401 - only to say what is missing
    except ImportError:
        pytest.fail("the build package is missing: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("hl7_agent-*.tar.gz")
    (wheel,) = out.glob("hl7_agent-*.whl")
    # A venv of its own, as docs/deploy.md makes one: pip install --prefix from this
    # interpreter would first uninstall the hl7-agent the test run itself imports.
    prefix = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(prefix / "bin" / "python"),
                           "install", "--quiet", "--no-deps", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return Dists(sdist, wheel, prefix)


class TestLicense:
    def test_license_file_is_the_full_apache_2_text(self) -> None:
        """LICENSE is the Apache License 2.0, whole and unchanged, as pyproject's metadata says."""
        text = (REPO / "LICENSE").read_bytes()
        assert hashlib.md5(text).hexdigest() == APACHE_2_MD5  # noqa: S324 - a checksum, not security
        pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
        assert re.search(r'(?m)^license = "Apache-2.0"$', pyproject)
        assert re.search(r'(?m)^license-files = \["LICENSE"\]$', pyproject)

    def test_wheel_metadata_names_the_license(self, dists: Dists) -> None:
        """The wheel's METADATA has the SPDX expression and ships LICENSE in dist-info."""
        with zipfile.ZipFile(dists.wheel) as whl:
            names = whl.namelist()
            (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
            meta = email.message_from_bytes(whl.read(metadata))
            (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
            assert whl.read(license_file) == (REPO / "LICENSE").read_bytes()
        assert meta["License-Expression"] == "Apache-2.0"
        assert meta.get_all("License-File") == ["LICENSE"]


class TestSdist:
    def test_sdist_carries_docs_units_configs_and_license(self, dists: Dists) -> None:
        """The source distribution has everything a packager or an offline install needs."""
        with tarfile.open(dists.sdist) as tar:
            root = tar.getnames()[0].split("/")[0]
            names = {name.removeprefix(f"{root}/") for name in tar.getnames()}
        expected = {"LICENSE", "README.md", "pyproject.toml",
                    *(f"docs/{name}" for name in _docs()),
                    *(f"systemd/{name}" for name in (*UNITS, "upgrade.sh")),
                    *(f"config/{name}" for name in CONFIGS),
                    "agent/_sql/sqlite/queries.sql", "agent/_sql/sqlite/migrations/0001_initial.sql"}
        assert expected <= names, expected - names

    def test_wheel_is_built_from_the_sdist(self, dists: Dists) -> None:
        """python -m build makes the wheel from the unpacked sdist, so the wheel's data files
        prove the sdist is enough to build it (no file only the git tree has)."""
        with zipfile.ZipFile(dists.wheel) as whl:
            assert any(n.endswith(".data/data/share/doc/hl7-agent/deploy.md") for n in whl.namelist())
            assert "agent/_sql/sqlite/queries.sql" in whl.namelist()


class TestWheelDataFiles:
    def test_wheel_lists_docs_units_and_configs(self, dists: Dists) -> None:
        """The wheel's data files: docs in share/doc/hl7-agent, units and configs in share/hl7-agent."""
        with zipfile.ZipFile(dists.wheel) as whl:
            data = {n.split(".data/data/", 1)[1] for n in whl.namelist() if ".data/data/" in n}
            modes = {n.split(".data/data/", 1)[1]: (i.external_attr >> 16) for n, i in
                     ((i.filename, i) for i in whl.infolist()) if ".data/data/" in n}
        expected = {*(f"share/doc/hl7-agent/{name}" for name in (*_docs(), "README.md", "LICENSE")),
                    *(f"share/hl7-agent/systemd/{name}" for name in (*UNITS, "upgrade.sh")),
                    *(f"share/hl7-agent/config/{name}" for name in CONFIGS)}
        assert data == expected
        assert modes["share/hl7-agent/systemd/upgrade.sh"] & stat.S_IXUSR

    def test_installed_where_the_units_documentation_points(self, dists: Dists) -> None:
        """Installed into a venv, each unit's Documentation= file exists in that venv."""
        for unit in UNITS:
            text = (dists.prefix / "share" / "hl7-agent" / "systemd" / unit).read_text(encoding="utf-8")
            assert text == (REPO / "systemd" / unit).read_text(encoding="utf-8")
            (url,) = re.findall(r"(?m)^Documentation=(\S+)$", text)
            path = re.sub(r"^file:///opt/hl7-agent(-%i)?/", "", url)
            assert path != url, url
            assert (dists.prefix / path).is_file(), (unit, url)
        for name in CONFIGS:
            assert (dists.prefix / "share" / "hl7-agent" / "config" / name).is_file()
        assert (dists.prefix / "share" / "hl7-agent" / "systemd" / "upgrade.sh").stat().st_mode & stat.S_IXUSR
