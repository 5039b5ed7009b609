"""The sandbox image with the operator's packages: ``SANDBOX_RUNTIME_PACKAGES`` on Docker.

The bwrap backend builds its runtime env from that list (:mod:`..bwrap.runtime`). On
Docker the same setting names a derived image: the sandbox image (``SANDBOX_IMAGE``) and
a ``pip install`` of the list on top, tagged by a hash of the list
(``mcp-code-sandbox:latest-packages-<hash>``). ``mcp-code-sandbox image build`` builds it
after the sandbox image (:func:`...provision.image.build_packages_image`); the docker
backend, ``auto``'s choice and ``doctor`` use it instead of ``SANDBOX_IMAGE``
(:func:`sandbox_image`). When it is missing the backend is not ready and says the command
that builds it, as for a missing sandbox image: a sandbox never starts without the
packages the operator asked for.

Semantics: an empty list (the default) means no derived image: ``SANDBOX_IMAGE`` itself.
The image's own packages (DESIGN §3) stay; pip leaves those of the list it already has.
The tag depends on the list only (names compared as pip compares them, in any order): a
rebuilt sandbox image needs ``image build`` again, which rebuilds both.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from mcp_code_sandbox.settings import Settings

__all__ = ["dockerfile", "normalized", "packages_tag", "sandbox_image"]

#: Hex digits of the list's hash in the tag: enough that two lists never meet by chance.
_HASH_CHARS = 12
#: Docker's limit on a tag's length.
_TAG_MAX = 128


def normalized(packages: Sequence[str]) -> tuple[str, ...]:
    """The names as pip compares them (PEP 503: case, and runs of ``-_.``), sorted, once."""
    return tuple(sorted({re.sub(r"[-_.]+", "-", name).lower() for name in packages}))


def packages_tag(image: str, packages: Sequence[str]) -> str:
    """The derived image of ``image`` with ``packages``: its repository, and its tag (or
    ``latest``; ``digest`` for an image named by digest) with ``-packages-<hash>``."""
    name = image.split("@", 1)[0]
    repository, tag = name, "latest" if "@" not in image else "digest"
    slash = name.rfind("/")
    if ":" in name[slash + 1 :]:
        repository, tag = name.rsplit(":", 1)
    digest = hashlib.sha256(",".join(normalized(packages)).encode()).hexdigest()[:_HASH_CHARS]
    suffix = f"-packages-{digest}"
    return f"{repository}:{tag[: _TAG_MAX - len(suffix)]}{suffix}"


def sandbox_image(settings: Settings) -> str:
    """The image the docker backend starts sandboxes from: the derived one when
    ``SANDBOX_RUNTIME_PACKAGES`` names packages, else ``SANDBOX_IMAGE``."""
    if not settings.runtime_packages:
        return settings.image
    return packages_tag(settings.image, settings.runtime_packages)


def dockerfile(base: str, packages: Sequence[str]) -> str:
    """The derived image's Dockerfile: ``base`` and the packages installed into its venv
    as root, then the base's user again. A CA bundle for the build (``build-ca/ca.pem``,
    maybe empty) is copied under /tmp, which is a private tmpfs in every sandbox: no
    sandbox sees it. Its label ``sandbox.packages`` is set afterwards (the versions are
    read from the built image)."""
    names = " ".join(normalized(packages))
    return f"""FROM {base}
USER 0:0
COPY build-ca/ /tmp/build-ca/
RUN set -eu; \\
    if [ -s /tmp/build-ca/ca.pem ]; then \\
        export PIP_CERT=/tmp/build-ca/ca.pem SSL_CERT_FILE=/tmp/build-ca/ca.pem; \\
    fi; \\
    /opt/sandbox/venv/bin/python -m pip install --no-cache-dir --no-input \\
        --progress-bar off --disable-pip-version-check {names}; \\
    rm -rf /tmp/build-ca
USER 1000:1000
"""
