# The server itself on the docker backend, in a container beside a Docker engine whose
# socket it mounts; its sandboxes are sibling containers of that engine. Two uses:
#   the appliance: MCP over stdio, started by the client (a Mac's Docker Desktop, OrbStack,
#     Colima; Windows' Docker Desktop), its state in a named volume of the engine:
#       docker run -i --rm -v /var/run/docker.sock:/var/run/docker.sock \
#         -v mcp-code-sandbox:/var/lib/mcp-code-sandbox mcp-code-sandbox-server:latest
#   the service: `serve --transport http` (deploy/compose.yaml runs it so).
# Any other command runs in place of `serve`: `... mcp-code-sandbox-server:latest doctor`.
#
# Build it with `mcp-code-sandbox image build --server` (provision/server_image.py), which assembles
# the build context:
#   requirements.txt  the project's dependencies, from pyproject.toml
#   project/          pyproject.toml, README.md, src/ and images/ of the checkout
#   build-ca/         empty, or ca.pem: a CA bundle for TLS-intercepting proxies
# BASE is any Debian-family image: an official slim Python image, or the Debian base
# bootstrapped locally with debootstrap (mcp-code-sandbox-base:bookworm) when no registry
# can be reached. Python >= 3.11 and its venv module are installed from Debian's packages
# where the base lacks them. As in images/Dockerfile, the CA bundle only ever enters the
# `venv` stage; the final stage copies the finished venv out of it.
ARG BASE=python:3.11-slim

FROM ${BASE} AS python
RUN set -eu; \
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then \
        apt-get update -qq; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            python3 python3-venv >/tmp/apt.log 2>&1 || { tail -n 30 /tmp/apt.log; exit 1; }; \
        rm -rf /var/lib/apt/lists/* /tmp/apt.log; \
    fi; \
    python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'

FROM python AS venv
COPY build-ca/ /tmp/build-ca/
COPY requirements.txt /tmp/requirements.txt
# The dependencies first, in a layer of their own: a change of code reuses it.
RUN set -eu; \
    if [ -s /tmp/build-ca/ca.pem ]; then \
        export PIP_CERT=/tmp/build-ca/ca.pem SSL_CERT_FILE=/tmp/build-ca/ca.pem \
               REQUESTS_CA_BUNDLE=/tmp/build-ca/ca.pem; \
    fi; \
    python3 -m venv /opt/mcp-code-sandbox; \
    /opt/mcp-code-sandbox/bin/python -m pip install --no-cache-dir --no-input \
        --progress-bar off --disable-pip-version-check -r /tmp/requirements.txt
COPY project/ /tmp/project/
RUN set -eu; \
    if [ -s /tmp/build-ca/ca.pem ]; then \
        export PIP_CERT=/tmp/build-ca/ca.pem SSL_CERT_FILE=/tmp/build-ca/ca.pem \
               REQUESTS_CA_BUNDLE=/tmp/build-ca/ca.pem; \
    fi; \
    /opt/mcp-code-sandbox/bin/python -m pip install --no-cache-dir --no-input \
        --progress-bar off --disable-pip-version-check --no-deps /tmp/project; \
    /opt/mcp-code-sandbox/bin/mcp-code-sandbox --version

FROM python
# The MCP Registry checks that an OCI package names the server.json entry it belongs to.
LABEL io.modelcontextprotocol.server.name="io.github.mcp-code-sandbox/mcp-code-sandbox"
COPY --from=venv /opt/mcp-code-sandbox /opt/mcp-code-sandbox
# The state dir is a volume (named, for the appliance) or a bind mount of a host directory
# (compose; then SANDBOX_DOCKER_HOST_STATE_DIR may name its host path): the server finds
# which from its own container. Nothing of it may stay in the container's layer, where no
# sandbox could see it. The uid leases live in it too, so that appliances sharing the
# volume never give one uid to two sessions (compose shares the host's instead).
# Over HTTP the server listens on every interface, so it starts only with API tokens
# (SANDBOX_API_TOKENS or SANDBOX_API_TOKENS_FILE): deploy/.env.example sets one.
ENV PATH=/opt/mcp-code-sandbox/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SANDBOX_BACKEND=docker \
    SANDBOX_STATE_DIR=/var/lib/mcp-code-sandbox \
    SANDBOX_UID_LEASE_DIR=/var/lib/mcp-code-sandbox/uids \
    SANDBOX_HTTP_HOST=0.0.0.0 \
    SANDBOX_HTTP_PORT=8080
VOLUME /var/lib/mcp-code-sandbox
EXPOSE 8080
# No command: `mcp-code-sandbox` alone serves MCP over stdio. (No HEALTHCHECK either: over
# stdio there is nothing to ask; compose checks /healthz of the HTTP service itself.)
ENTRYPOINT ["mcp-code-sandbox"]
