# syntax=docker/dockerfile:1
# hl7-agent: HL7 v2 over MLLP in, durable SQLite queue, forwarded over a WebSocket.
#
#   docker build -t hl7-agent:1.0.0 .
#   docker run -d --name hl7-agent --stop-timeout 30 -p 2575:2575 \
#     -v hl7-agent-data:/var/lib/hl7-agent --env-file /etc/hl7-agent/agent.env \
#     -v /etc/hl7-agent/token:/run/secrets/hl7-agent-token:ro \
#     -e HL7_AGENT_SERVER__TOKEN_FILE=/run/secrets/hl7-agent-token \
#     -e 'HL7_AGENT_CHANNELS=[{"name": "adt", "listen": "0.0.0.0:2575"}]' hl7-agent:1.0.0
#
# docs/deploy.md (section Docker) has the full steps, run verbatim by
# tests/deploy/test_container.py, and the two-container upgrade overlap.
# Configuration comes from the environment alone, or from a file
# mounted at /etc/hl7-agent/agent.toml (the default path, read only if it
# exists). HL7_AGENT_CONFIG is deliberately not set here: a missing file named
# by it would be an error. No secret is ever baked into a layer: pass the
# token as a mounted file (token_file) or a compose/swarm secret.
# Podman: build with --format docker (or BUILDAH_FORMAT=docker), or the image
# loses its HEALTHCHECK (OCI images have none).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- builder ----
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel needs (.dockerignore keeps tests, caches and .git out).
# agent/_sql is a symlink to ../queue: both are copied, the wheel resolves it.
# LICENSE, docs/, config/ and systemd/ are the wheel's license and data files
# (/opt/hl7-agent/share/doc/hl7-agent/ in the image).
COPY pyproject.toml README.md LICENSE ./
COPY queue ./queue
COPY docs ./docs
COPY config ./config
COPY systemd ./systemd
COPY agent ./agent
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/hl7-agent \
 && /opt/hl7-agent/bin/pip install /wheels/*.whl \
 && /opt/hl7-agent/bin/python -c "import agent.app.cli"

# ---------------------------------------------------------------- runtime ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="hl7-agent" \
      org.opencontainers.image.description="Durable HL7 v2 MLLP edge agent forwarding over a WebSocket" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed non-root uid, so a volume's ownership survives image upgrades and
# two overlapping containers share one effective uid (SO_REUSEPORT requires it).
RUN groupadd --system --gid 10001 hl7-agent \
 && useradd --system --uid 10001 --gid hl7-agent --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin hl7-agent \
 && install -d -m 0700 -o hl7-agent -g hl7-agent /var/lib/hl7-agent \
 && install -d -m 0755 /etc/hl7-agent

COPY --from=builder /opt/hl7-agent /opt/hl7-agent

ENV PATH=/opt/hl7-agent/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HL7_AGENT_AGENT__DATA_DIR=/var/lib/hl7-agent

# queue.db with its -wal and -shm side files (they must stay together on one
# filesystem: never mount them separately), and handover.sock for upgrades.
VOLUME ["/var/lib/hl7-agent"]
# 2575: MLLP (default channel port). 9575: admin (/healthz /readyz /metrics);
# it listens on 127.0.0.1 unless HL7_AGENT_ADMIN__LISTEN says 0.0.0.0:9575.
EXPOSE 2575 9575

# Numeric, so orchestrators can verify runAsNonRoot without /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/hl7-agent
# Runs inside the container, so the default 127.0.0.1 admin address works.
# Podman runs it periodically only through systemd timers: to wait for a
# container, run `docker exec NAME hl7-agent health` instead (docs/deploy.md).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["hl7-agent", "health"]
# The daemon drains on SIGTERM (stop accepting, finish, release the lease);
# give it time: docker stop --time 30 / compose stop_grace_period: 30s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["hl7-agent"]
CMD ["run"]
