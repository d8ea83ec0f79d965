"""The ``[queue]`` keys of the PostgreSQL backend: backend, dsn, password_file (docs/configuration.md).

A dsn's password is masked wherever the configuration is shown; the
SQLite-only keys are refused with ``backend = "postgresql"`` (a setting is
never silently ignored); a missing driver is one line with the fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.app import config as config_module
from agent.app.config import load_settings, render_effective
from agent.errors import ConfigError
from agent.storage.conninfo import dsn_has_password, mask_dsn

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep a real /etc/hl7-agent/agent.toml on the test host out of every test."""
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "agent.toml")


def write(tmp_path: Path, queue: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nid = "edge-01"\ndata_dir = "state"\n\n[queue]\n{queue}\n', encoding="utf-8")
    return path


def error_of(tmp_path: Path, queue: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(str(write(tmp_path, queue)), environ or {})
    message = str(info.value)
    assert "\n" not in message and message.startswith("config error: queue")
    return message


class TestMaskDsn:
    @pytest.mark.parametrize(("dsn", "masked"), [
        ("postgresql://hl7:s3cret@db:5432/hl7", "postgresql://hl7:***@db:5432/hl7"),
        ("postgres://hl7:s3cret@db1:5432,db2:5432/hl7?target_session_attrs=read-write",
         "postgres://hl7:***@db1:5432,db2:5432/hl7?target_session_attrs=read-write"),
        ("postgresql://hl7@db/hl7?sslmode=require&password=s3cret",
         "postgresql://hl7@db/hl7?sslmode=require&password=***"),
        ("postgresql://hl7@db/hl7", "postgresql://hl7@db/hl7"),
        ("host=db user=hl7 password=s3cret dbname=hl7", "host=db user=hl7 password=*** dbname=hl7"),
        ("host=db password = 's3 cr\\'et' dbname=hl7", "host=db password = *** dbname=hl7"),
        ("host=db dbname=hl7", "host=db dbname=hl7"),
        # A URL of another scheme is refused, and the refusal shows it: masked too.
        ("mysql://u:s3cret@h/db", "mysql://u:***@h/db"),
    ])
    def test_the_password_never_shows(self, dsn: str, masked: str) -> None:
        """URL user info, a URL's password parameter and a key/value password are all masked."""
        assert mask_dsn(dsn) == masked
        assert "s3" not in mask_dsn(dsn)

    def test_a_password_is_found_in_every_form(self) -> None:
        """password_file beside a password in the dsn is detected in each libpq form."""
        assert dsn_has_password("postgresql://u:p@h/d")
        assert dsn_has_password("postgresql://u@h/d?password=p")
        assert dsn_has_password("host=h password=p")
        assert not dsn_has_password("postgresql://u@h/d")
        assert not dsn_has_password("host=h user=u")


class TestBackendKeys:
    def test_sqlite_is_the_default_and_needs_no_dsn(self) -> None:
        """Nothing set: the SQLite file backend, no dsn."""
        queue = load_settings(None, {}).queue
        assert (queue.backend, queue.dsn, queue.password_file) == ("sqlite", None, None)

    def test_postgresql_with_dsn_and_password_file(self, tmp_path: Path) -> None:
        """The three keys load; a relative password_file is relative to the config file's folder."""
        settings = load_settings(str(write(tmp_path, 'backend = "postgresql"\n'
                                                      'dsn = "postgresql://hl7@db:5432/hl7"\n'
                                                      'password_file = "secrets/db"')), {})
        assert settings.queue.backend == "postgresql"
        assert settings.queue.dsn == "postgresql://hl7@db:5432/hl7"
        assert settings.queue.password_file == tmp_path / "secrets" / "db"

    def test_environment_sets_them_too(self) -> None:
        """HL7_AGENT_QUEUE__BACKEND / __DSN work like every key (containers)."""
        settings = load_settings(None, {"HL7_AGENT_QUEUE__BACKEND": "PostgreSQL",
                                        "HL7_AGENT_QUEUE__DSN": "host=db dbname=hl7"})
        assert (settings.queue.backend, settings.queue.dsn) == ("postgresql", "host=db dbname=hl7")

    @pytest.mark.parametrize("key", ["synchronous = \"normal\"", "max_db_bytes = \"1GiB\"",
                                     "min_free_disk_bytes = 0", "checkpoint_interval = \"30s\""])
    def test_sqlite_only_keys_are_refused_with_postgresql(self, tmp_path: Path, key: str) -> None:
        """Each SQLite-only key set beside backend = "postgresql" is an error naming it."""
        message = error_of(tmp_path, f'backend = "postgresql"\ndsn = "host=db"\n{key}')
        assert key.split(" ")[0] in message and "SQLite-only" in message

    def test_sqlite_only_key_from_the_environment_is_refused_too(self, tmp_path: Path) -> None:
        """Also when the key comes from HL7_AGENT_QUEUE__SYNCHRONOUS."""
        message = error_of(tmp_path, 'backend = "postgresql"\ndsn = "host=db"',
                           {"HL7_AGENT_QUEUE__SYNCHRONOUS": "full"})
        assert "synchronous" in message and "HL7_AGENT_QUEUE__SYNCHRONOUS" in message

    def test_dsn_with_sqlite_is_refused(self, tmp_path: Path) -> None:
        """A dsn without backend = "postgresql" would be silently unused: refused."""
        assert "dsn applies only to backend" in error_of(tmp_path, 'dsn = "host=db"')

    def test_postgresql_needs_a_dsn(self, tmp_path: Path) -> None:
        """backend = "postgresql" alone is an error with an example dsn."""
        assert "needs dsn" in error_of(tmp_path, 'backend = "postgresql"')

    def test_an_unparsable_dsn_is_refused_masked(self, tmp_path: Path) -> None:
        """libpq's parser rejects it at load, and the message never shows the password."""
        message = error_of(tmp_path, 'backend = "postgresql"\ndsn = "host=db password=s3cret bogus"')
        assert "not a libpq connection string" in message and "s3cret" not in message

    def test_a_dsn_of_another_scheme_is_refused_masked(self, tmp_path: Path) -> None:
        """mysql://u:pw@h/db is no libpq string; the error (which quotes libpq's, quoting the dsn) never shows pw."""
        message = error_of(tmp_path, 'backend = "postgresql"\ndsn = "mysql://u:s3cret@h/db"')
        assert "not a libpq connection string" in message and "s3cret" not in message

    def test_password_in_two_places_is_refused(self, tmp_path: Path) -> None:
        """A dsn password and a password_file: which one wins would be a guess."""
        message = error_of(tmp_path, 'backend = "postgresql"\ndsn = "postgresql://u:pw@db/hl7"\n'
                                     'password_file = "pw"')
        assert "keep only one" in message and "pw@" not in message


class TestShown:
    def test_check_config_masks_the_dsn_password(self, tmp_path: Path) -> None:
        """The effective configuration shows the dsn with *** for its password, and loads back."""
        path = write(tmp_path, 'backend = "postgresql"\ndsn = "postgresql://hl7:s3cret@db:5432/hl7"')
        text = render_effective(load_settings(str(path), {}))
        assert 'dsn = "postgresql://hl7:***@db:5432/hl7"' in text and "s3cret" not in text
        assert 'backend = "postgresql"' in text

    def test_check_config_output_loads_back_as_the_same_configuration(self, tmp_path: Path) -> None:
        """The SQLite-only keys, which this backend refuses, are comments in its output, not keys."""
        path = write(tmp_path, 'backend = "postgresql"\ndsn = "postgresql://hl7@db:5432/hl7"')
        settings = load_settings(str(path), {})
        text = render_effective(settings)
        assert '# synchronous: SQLite only, not used with backend = "postgresql"' in text
        again = tmp_path / "again.toml"
        again.write_text(text)
        reloaded = load_settings(str(again), {})
        assert reloaded.queue == settings.queue
        assert render_effective(reloaded).splitlines()[2:] == text.splitlines()[2:]

    def test_missing_psycopg_is_one_line_with_the_fix(self, tmp_path: Path) -> None:
        """Without the postgresql extra, check-config exits 2 saying what to install."""
        path = write(tmp_path, 'backend = "postgresql"\ndsn = "host=db"')
        # sys.modules[name] = None makes that import fail as if not installed (the
        # one way to remove an installed package from one interpreter only).
        code = ("import sys; sys.modules['psycopg'] = None; from agent.app.cli import main; "
                f"sys.exit(main(['check-config', '--config', {str(path)!r}]))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              cwd=REPO, check=False)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1
        assert "needs psycopg" in lines[0] and "pip install 'hl7-agent[postgresql]'" in lines[0]
