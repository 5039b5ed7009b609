"""A package index the tests build and serve themselves: wheels behind a PEP 503 "simple"
index for pip, and npm tarballs behind packuments for npm and bun. No public registry is
involved; the server runs inside a test namespace (:mod:`tests.labnet`).

Layout under the root directory (what :data:`SERVER` serves)::

    simple/<name>/index.html         pip: links to the wheels, with sha256 fragments
    files/<wheel>                    the wheels
    <npm-name>/index.json            npm/bun: the packument (GET /<npm-name>)
    <npm-name>/-/<name>-<v>.tgz      the tarballs
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

#: Serves a directory: a file by its path; a directory by its index.html or index.json.
#: argv: root address port. Not http.server: its bind looks the address up in DNS.
SERVER = """
import os, socketserver, sys
root, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
class H(socketserver.StreamRequestHandler):
    def handle(self):
        line = self.rfile.readline().decode("latin-1").split()
        while self.rfile.readline().strip():
            pass
        path = os.path.normpath("/" + (line[1] if len(line) > 1 else "/").split("?")[0])
        path = os.path.join(root, path.lstrip("/").replace("%40", "@"))
        if os.path.isdir(path):
            for index in ("index.html", "index.json"):
                if os.path.isfile(os.path.join(path, index)):
                    path = os.path.join(path, index)
                    break
        if not os.path.isfile(path):
            self.wfile.write(b"HTTP/1.0 404 Not Found\\r\\nContent-Length: 0\\r\\n\\r\\n")
            return
        body = open(path, "rb").read()
        kind = {".html": "text/html", ".json": "application/json"}.get(
            os.path.splitext(path)[1], "application/octet-stream")
        head = f"HTTP/1.0 200 OK\\r\\nContent-Type: {kind}\\r\\n"
        head += f"Content-Length: {len(body)}\\r\\n\\r\\n"
        self.wfile.write(head.encode() + body)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer((address, port), H).serve_forever()
"""


def add_wheel(
    root: Path,
    name: str,
    files: dict[str, bytes],
    *,
    version: str = "1.0.0",
    scripts: dict[str, str] | None = None,
) -> None:
    """A pure-Python wheel of ``files`` (paths inside site-packages) in the simple index."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    members = dict(files)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    members[f"{info}/METADATA"] = metadata.encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: mcs-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if scripts:
        lines = "".join(f"{cmd} = {target}\n" for cmd, target in scripts.items())
        members[f"{info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    record = "".join(
        f"{path},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}\n"
        for path, data in members.items()
    )
    members[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in members.items():
            wheel.writestr(path, data)
    filename = f"{dist}-{version}-py3-none-any.whl"
    data = buffer.getvalue()
    (root / "files").mkdir(parents=True, exist_ok=True)
    (root / "files" / filename).write_bytes(data)
    page = root / "simple" / name
    page.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()
    (page / "index.html").write_text(
        f'<html><body><a href="/files/{filename}#sha256={digest}">{filename}</a></body></html>\n'
    )


def add_npm_package(root: Path, base_url: str, name: str, files: dict[str, str]) -> None:
    """An npm package of ``files`` (``package.json`` made here) with its packument."""
    version = "1.0.0"
    manifest = {"name": name, "version": version, "main": "index.js"}
    members = {"package/package.json": json.dumps(manifest).encode()}
    members |= {f"package/{path}": text.encode() for path, text in files.items()}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, data in members.items():
            entry = tarfile.TarInfo(path)
            entry.size, entry.mode = len(data), 0o644
            tar.addfile(entry, io.BytesIO(data))
    data = buffer.getvalue()
    tarball = f"{name}-{version}.tgz"
    (root / name / "-").mkdir(parents=True, exist_ok=True)
    (root / name / "-" / tarball).write_bytes(data)
    dist = {
        "tarball": f"{base_url}/{name}/-/{tarball}",
        "shasum": hashlib.sha1(data).hexdigest(),
        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode(),
    }
    packument = {
        "name": name,
        "dist-tags": {"latest": version},
        "versions": {version: {**manifest, "dist": dist}},
    }
    (root / name / "index.json").write_text(json.dumps(packument))


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
