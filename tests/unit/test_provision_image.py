"""The pure parts of ``provision.image``: apt sources → mirror, build arguments, the context."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_sandbox.backends.bwrap.runtime import PACKAGES
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision import image as provision_image
from mcp_code_sandbox.provision.image import (
    LOCAL_BASE,
    AptSource,
    apt_sources,
    build_kwargs,
    choose_mirror,
    debootstrap_argv,
    find_mirror,
    parse_deb822,
    parse_one_line,
    prepare_context,
    requirements_text,
)
from mcp_code_sandbox.provision.venv import SESSION_SITE_PTH, TOOLS
from mcp_code_sandbox.settings import ca_bundle_from_env

DEB822 = """\
# a comment before the stanza
Types: deb
URIs: http://deb.example.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 xyz
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: http://deb.example.org/debian-security
Suites: bookworm-security
Components: main
"""


def _apt_dir(tmp_path: Path, sources_list: str = "", parts: dict[str, str] | None = None) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    if sources_list:
        (apt / "sources.list").write_text(sources_list)
    for name, text in (parts or {}).items():
        (apt / "sources.list.d" / name).write_text(text)
    return apt


def test_one_line_format_skips_comments_deb_src_and_options() -> None:
    text = (
        "# deb http://old.example.org/debian buster main\n"
        "deb-src http://src.example.org/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] https://m.example.org/debian/ bookworm main contrib\n"
    )
    assert parse_one_line(text) == [
        AptSource("https://m.example.org/debian/", ("bookworm",), ("main", "contrib"))
    ]


def test_deb822_reads_stanzas_with_continuation_lines() -> None:
    found = parse_deb822(DEB822)
    assert [s.uri for s in found] == [
        "http://deb.example.org/debian",
        "http://deb.example.org/debian-security",
    ]
    assert found[0].suites == ("bookworm", "bookworm-updates")


def test_deb822_skips_disabled_and_source_only_stanzas() -> None:
    text = (
        "Types: deb\nURIs: http://a.example.org/debian\nSuites: bookworm\nComponents: main\n"
        "Enabled: no\n\n"
        "Types: deb-src\nURIs: http://b.example.org/debian\nSuites: bookworm\nComponents: main\n"
    )
    assert parse_deb822(text) == []


def test_mirror_from_a_deb822_host(tmp_path: Path) -> None:
    apt = _apt_dir(tmp_path, parts={"debian.sources": DEB822, "x.sources.disabled": "junk"})
    assert find_mirror(apt) == "http://deb.example.org/debian"


def test_mirror_prefers_the_suite_over_third_party_and_security(tmp_path: Path) -> None:
    apt = _apt_dir(
        tmp_path,
        sources_list="deb http://security.example.org/debian-security bookworm-security main\n",
        parts={
            "docker.list": "deb https://download.example.com/linux/debian bookworm stable\n",
            "node.list": "deb https://node.example.com/node nodistro main\n",
            "zz.list": "deb http://ftp.example.org/debian/ bookworm main\n",
        },
    )
    assert find_mirror(apt) == "http://ftp.example.org/debian"


def test_mirror_of_another_debian_release_serves_bookworm() -> None:
    sources = [
        AptSource("https://node.example.com/node", ("nodistro",), ("main",)),
        AptSource("http://deb.example.org/debian", ("trixie", "trixie-updates"), ("main",)),
    ]
    assert choose_mirror(sources) == "http://deb.example.org/debian"


def test_no_debian_mirror_is_an_error_naming_the_way_out(tmp_path: Path) -> None:
    apt = _apt_dir(tmp_path, sources_list="deb cdrom:[Debian]/ bookworm main\n")
    assert apt_sources(apt)  # it is read, just not usable
    with pytest.raises(BackendUnavailable, match="--base"):
        find_mirror(apt)


def test_missing_apt_dir_has_no_sources(tmp_path: Path) -> None:
    assert apt_sources(tmp_path / "nope") == []


def test_debootstrap_argv() -> None:
    argv = debootstrap_argv(Path("/s/rootfs"), "http://deb.example.org/debian")
    assert argv[0].endswith("debootstrap")
    assert argv[1:] == [
        "--variant=minbase",
        "--include=python3,python3-venv,ca-certificates",
        "bookworm",
        "/s/rootfs",
        "http://deb.example.org/debian",
    ]


def test_build_kwargs_pass_the_base_and_never_pull() -> None:
    kwargs = build_kwargs(Path("/s/context"), "img:tag", LOCAL_BASE)
    assert kwargs["path"] == "/s/context"
    assert kwargs["tag"] == "img:tag"
    assert kwargs["buildargs"] == {"BASE": LOCAL_BASE}
    assert kwargs["pull"] is False
    assert kwargs["decode"] is True
    assert "nocache" not in kwargs  # rebuilds reuse cached layers


def test_requirements_come_from_the_one_package_list() -> None:
    assert requirements_text().splitlines() == [*PACKAGES, *TOOLS]
    assert requirements_text(["a", "b"]) == "a\nb\n"


def test_ca_bundle_from_env_order() -> None:
    assert ca_bundle_from_env({}) is None
    assert ca_bundle_from_env({"REQUESTS_CA_BUNDLE": "/r", "SSL_CERT_FILE": "/s"}) == Path("/s")
    assert ca_bundle_from_env({"PIP_CERT": "/p", "SSL_CERT_FILE": "/s"}) == Path("/p")


def test_context_without_a_ca_bundle(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    (context / "stale").write_text("x")
    prepare_context(context, None)
    assert sorted(p.name for p in context.iterdir()) == [
        "Dockerfile",
        "build-ca",
        "mcs_agent",
        "mcs_session_packages.pth",
        "node_env.py",
        "requirements.txt",
    ]
    assert (context / SESSION_SITE_PTH[0]).read_text() == SESSION_SITE_PTH[1]
    assert list((context / "build-ca").iterdir()) == []
    assert (context / "mcs_agent" / "__main__.py").is_file()
    assert (context / "mcs_agent" / "protocol.py").is_file()
    assert not list(context.rglob("__pycache__"))
    assert (context / "requirements.txt").read_text() == requirements_text()


def test_context_with_a_ca_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "corp.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    prepare_context(tmp_path / "context", bundle)
    assert (tmp_path / "context" / "build-ca" / "ca.pem").read_text() == bundle.read_text()


def test_unreadable_ca_bundle_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="CA bundle"):
        prepare_context(tmp_path / "context", tmp_path / "missing.pem")


def test_dockerfile_keeps_the_contract() -> None:
    text = (
        Path(provision_image.__file__).resolve().parents[3] / "images" / "Dockerfile"
    ).read_text()
    assert "ARG BASE=python:3.11-slim" in text
    assert "FROM ${BASE} AS venv" in text
    assert 'sandbox.runner="true"' in text
    assert 'sandbox.language="python"' in text
    assert "USER 1000:1000" in text
    assert "WORKDIR /mnt/data" in text
    # The CA bundle only enters the first stage; the final stage copies the venv alone.
    final = text.split("\nFROM ${BASE}\n", 1)[1]
    assert "build-ca" not in final
    assert "COPY --from=venv /opt/sandbox/venv /opt/sandbox/venv" in final


def test_all_is_honest() -> None:
    for name in provision_image.__all__:
        assert hasattr(provision_image, name), name
