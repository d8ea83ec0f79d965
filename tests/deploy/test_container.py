"""The Dockerfile built and run by a real container engine, with docs/deploy.md's own commands.

The engine is podman (Debian 12's, daemonless, runtime runc, no systemd on
this host) in a namespace of its own (``deploytest.PodmanSandbox``); the doc's
``docker`` commands run there verbatim, ``docker`` being podman.

What is adapted, and why:

- The base image ``python:3.11-slim-bookworm`` cannot be pulled (no internet),
  so a local stand-in of that name is made from a debootstrapped Debian 12:
  its python3 is 3.11 too, but under /usr/bin rather than /usr/local/bin,
  with Debian's pip, venv and ``python`` (python-is-python3). It also carries
  the dependency wheels and an ``/etc/pip.conf`` pointing pip at them, which
  the Dockerfile's ``pip wheel`` and ``pip install`` steps then use offline.
- The upstream is the test's ``agent.app.devserver`` in the sandbox's network
  namespace; the bridge network reaches it as ``host.containers.internal``,
  the host network as 127.0.0.1. Its URL and the token are the edits the doc
  asks the user to make in /etc/hl7-agent.
- Traffic crosses podman's bridge inside that private namespace (the
  documented ``-p 2575:2575``); nothing leaves the machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agenttest import DevServerThread, ack_code, hl7_message, wait_for
from deploytest import (
    Load,
    PodmanSandbox,
    Release,
    build_release,
    debian_rootfs,
    devserver_in,
    doc_block,
    exchange_in,
    offline_pip_conf,
    require_root_and_kernel,
)

pytestmark = [pytest.mark.deploy, pytest.mark.slow, pytest.mark.timeout(600)]

#: The stand-in's packages besides minbase (part of its cache key).
PYTHON_IMAGE_PACKAGES = ["python3", "python3-venv", "python3-pip", "python-is-python3"]
BASE_IMAGE = "docker.io/library/python:3.11-slim-bookworm"
TOKEN = "container-test-token"
DEV_PORT = 8080
WHEELS = "/usr/share/hl7-agent-test-wheels"


@dataclass
class World:
    box: PodmanSandbox
    dev: DevServerThread
    release: Release


def stand_in_base_image(box: PodmanSandbox, rootfs: Path, wheelhouse: Path, tmp: Path) -> None:
    """``python:3.11-slim-bookworm`` made locally from a Debian 12 tree (see the module docstring)."""
    context = tmp / "base-image"
    context.mkdir()
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(context / "rootfs.tar"), "."], check=True, timeout=300)
    box.sh(f"podman import -q --change 'CMD [\"python3\"]' --change 'ENV LANG=C.UTF-8' "
           f"{context / 'rootfs.tar'} localhost/hl7-agent-test-debian12-python >/dev/null")
    (context / "rootfs.tar").unlink()
    shutil.copytree(wheelhouse, context / "wheels")
    (context / "pip.conf").write_text(offline_pip_conf(WHEELS))
    (context / "Containerfile").write_text(
        "FROM localhost/hl7-agent-test-debian12-python\n"
        f"COPY wheels/ {WHEELS}/\n"
        "COPY pip.conf /etc/pip.conf\n"
    )
    box.sh(f"podman build -q --pull=never -t {BASE_IMAGE} {context} >/dev/null")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    require_root_and_kernel("podman", "runc", "debootstrap", "unshare", "nsenter")
    rootfs = debian_rootfs("debian12-python", PYTHON_IMAGE_PACKAGES)
    tmp = tmp_path_factory.mktemp("container")
    release = build_release(tmp, versions=("1.0.0",))
    box = PodmanSandbox(tmp / "podman")
    dev: DevServerThread | None = None
    try:
        stand_in_base_image(box, rootfs, release.wheelhouse, tmp)
        dev = devserver_in(box.netns, token=TOKEN, host="0.0.0.0", port=DEV_PORT)
        yield World(box, dev, release)
    finally:
        if dev is not None:
            dev.stop()
        box.close()


def set_url(world: World, url: str) -> None:
    """The user's edit of /etc/hl7-agent/agent.env: the server's URL."""
    world.box.sh(f"grep -q '^HL7_AGENT_SERVER__URL=' /etc/hl7-agent/agent.env\n"
                 f"sed -i 's|^HL7_AGENT_SERVER__URL=.*$|HL7_AGENT_SERVER__URL={url}|' /etc/hl7-agent/agent.env")


class TestImage:
    def test_build_with_the_documented_command(self, world: World) -> None:
        """`docker build` gives an image that runs as uid 10001, keeps its HEALTHCHECK and
        drains on SIGTERM."""
        box = world.box
        box.sh(doc_block("docker-build"), cwd=world.release.tree, timeout=600)
        assert box.inspect("hl7-agent:1.0.0", "{{.User}}") == "10001:10001"
        assert box.inspect("hl7-agent:1.0.0", "{{json .HealthCheck.Test}}") == '["CMD","hl7-agent","health"]'
        assert box.inspect("hl7-agent:1.0.0", "{{json .Config.Entrypoint}}") == '["hl7-agent"]'
        assert box.inspect("hl7-agent:1.0.0", "{{json .Config.Cmd}}") == '["run"]'
        assert box.inspect("hl7-agent:1.0.0", "{{.Config.StopSignal}}") == "SIGTERM"


class TestDocumentedRun:
    def test_docker_run(self, world: World) -> None:
        """The documented `docker run` (token from a secret file, channels from the environment)
        becomes healthy, runs as uid 10001, accepts on the published port and delivers."""
        box = world.box
        box.sh(doc_block("docker-prepare"))
        box.sh(f"printf '%s\\n' {TOKEN} > /etc/hl7-agent/token")
        set_url(world, f"ws://host.containers.internal:{DEV_PORT}/agent")
        box.sh(doc_block("docker-run"), cwd=world.release.tree, timeout=180)
        assert box.sh("docker exec hl7-agent id -u").stdout.strip() == "10001"
        pid = box.inspect("hl7-agent", "{{.State.Pid}}")
        uids = re.search(r"(?m)^Uid:\s+(.*)$", Path(f"/proc/{pid}/status").read_text())
        assert uids and uids.group(1).split() == ["10001"] * 4
        # The token is a mounted file, not in the container's configuration.
        assert TOKEN not in box.inspect("hl7-agent", "{{json .Config.Env}}")
        ack = exchange_in(box.netns, 2575, hl7_message("DOCKER-RUN-1"))
        assert ack_code(ack) == "AA", ack
        wait_for(lambda: "DOCKER-RUN-1" in {t.control_id for t in list(world.dev.server.received)}, 60,
                 what="the message at the dev-server (the token from the secret file was accepted)")

    def test_healthcheck(self, world: World) -> None:
        """The image's HEALTHCHECK passes when run; without systemd podman does not run it by
        itself, which is why the doc waits with `docker exec ... hl7-agent health`."""
        box = world.box
        assert box.inspect("hl7-agent", "{{.State.Health.Status}}") in ("starting", "healthy")
        box.sh("podman healthcheck run hl7-agent")
        assert box.inspect("hl7-agent", "{{.State.Health.Status}}") == "healthy"

    def test_volume_modes(self, world: World) -> None:
        """The named volume's directory is 0700 and the database files 0600, owned by 10001."""
        mountpoint = Path(world.box.inspect("hl7-agent-data", "{{.Mountpoint}}"))
        st = mountpoint.stat()
        assert (oct(st.st_mode & 0o777), st.st_uid, st.st_gid) == ("0o700", 10001, 10001)
        for name in ("queue.db", "queue.db-wal", "queue.db-shm"):
            st = (mountpoint / name).stat()
            assert (oct(st.st_mode & 0o777), st.st_uid) == ("0o600", 10001), name

    def test_graceful_stop_under_load(self, world: World) -> None:
        """`docker stop --time 30` while a sender sends: exit 0; after `docker start` every
        message that got an AA reaches the server once, in order."""
        box = world.box
        with Load(box.netns, {"adt": 2575}, "DSTOP") as load:
            load.wait_acked(20)
            box.sh(doc_block("docker-stop"), timeout=60)
            assert box.inspect("hl7-agent", "{{.State.ExitCode}}") == "0"
            box.sh("docker start hl7-agent\n"
                   "timeout 90 sh -c 'until docker exec hl7-agent hl7-agent health; do sleep 2; done'", timeout=120)
            load.wait_acked(20)
        logs = box.sh("docker logs hl7-agent 2>&1").stdout
        assert '"exit_code": 0, "event": "agent_stopped"' in logs, logs[-2000:]
        load.assert_delivered_once_in_order(world.dev)


class TestUpgradeOverlap:
    def test_two_container_overlap_under_load(self, world: World) -> None:
        """The documented overlap: blue serves on the host network, green starts next to it,
        turns healthy, blue stops. No connection refused, every message gets its AA and reaches
        the server once, in order; green took the listeners over the shared volume."""
        box = world.box
        box.sh("docker stop --time 30 hl7-agent && docker rm hl7-agent", timeout=60)
        # On the host network the dev-server is at the namespace's own loopback.
        set_url(world, f"ws://127.0.0.1:{DEV_PORT}/agent")
        box.sh(doc_block("docker-overlap-blue"), cwd=world.release.tree, timeout=180)
        with Load(box.netns, {"adt": 2575}, "OVERLAP") as load:
            load.wait_acked(20)
            proc = box.sh(doc_block("docker-overlap-upgrade"), cwd=world.release.tree, check=False, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            load.wait_acked(20)
        names = box.sh("docker ps --format '{{.Names}}'").stdout.split()
        assert names == ["hl7-agent-green"], names
        logs = box.sh("docker logs hl7-agent-green 2>&1").stdout
        assert '"source": "handover"' in logs, logs[-2000:]
        assert load.refused == 0, load.report()
        load.assert_delivered_once_in_order(world.dev)
