# The server itself: `mcp-code-sandbox serve --transport http` on the docker backend, for a
# container beside a Docker engine whose socket it mounts (deploy/compose.yaml runs it).
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
COPY --from=venv /opt/mcp-code-sandbox /opt/mcp-code-sandbox
# Inside the container the server listens on every interface, so it starts only with API
# tokens (SANDBOX_API_TOKENS or SANDBOX_API_TOKENS_FILE): deploy/.env.example sets one.
# The state dir must be a bind mount of a host directory, and SANDBOX_DOCKER_HOST_STATE_DIR
# its path on the host, unless it is mounted at the same path (see deploy/compose.yaml).
ENV PATH=/opt/mcp-code-sandbox/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SANDBOX_BACKEND=docker \
    SANDBOX_STATE_DIR=/var/lib/mcp-code-sandbox \
    SANDBOX_HTTP_HOST=0.0.0.0 \
    SANDBOX_HTTP_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SANDBOX_HTTP_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["mcp-code-sandbox", "serve", "--transport", "http"]
