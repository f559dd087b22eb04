#!/usr/bin/env python3
"""A docker-archive on stdin (as `buildah push IMAGE docker-archive:/dev/stdout` writes it) turned
into an OCI archive on stdout that carries only the layers a containerd lacks.

    buildah push IMAGE docker-archive:/dev/stdout:REF \\
      | oci_delta.py --address SOCK --name REF | ctr --address SOCK -n k8s.io images import -

Why: containerd's importer writes every blob of an archive into its ingest area, hashing it,
before it learns that it already has it; for the runtime image that is torch's 4.3 GB layer on
every code change (4-5 minutes here). Its OCI importer, though, stores the blobs an archive
carries and asks for nothing else: a manifest may name layers by the descriptors containerd
already holds. So the layers it has are read past here (never written anywhere) and named in the
manifest as containerd holds them; the others are passed through. Unpacking then skips the layers
whose snapshots exist. The caller checks the result (`ctr images check`): if a layer turned out
missing after all (garbage-collected meanwhile), it imports the full archive instead.

Layers are matched by their uncompressed digest (the config's rootfs.diff_ids), so layers
containerd holds compressed (pulled from a registry) count as well. Stdlib only: runs with the
host's python3, outside any venv.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import time

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
# One family of media types in the manifest we write: containerd's docker-archive importer stored
# our earlier layers under the Docker ones; a layer it holds under an OCI type means the same bytes.
TO_DOCKER = {"application/vnd.oci.image.layer.v1.tar": DOCKER_LAYER,
             "application/vnd.oci.image.layer.v1.tar+gzip": "application/vnd.docker.image.rootfs.diff.tar.gzip"}
MANIFESTS = {DOCKER_MANIFEST, "application/vnd.oci.image.manifest.v1+json"}
INDEXES = {"application/vnd.docker.distribution.manifest.list.v2+json", "application/vnd.oci.image.index.v1+json"}
LAYER_FILE = re.compile(r"^([0-9a-f]{64})\.tar$")
BUF = 1 << 20


def say(msg: str) -> None:
    print(f"[oci-delta] {msg}", file=sys.stderr)


class Ctr:
    def __init__(self, address: str, namespace: str) -> None:
        self.base = ["ctr", "--address", address, "-n", namespace]

    def run(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True).stdout

    def blob(self, digest: str) -> dict:
        return json.loads(self.run("content", "get", digest))


def known_layers(ctr: Ctr) -> dict[str, dict]:
    """Uncompressed digest -> the descriptor containerd holds that layer under, over every image it
    has whose layer blobs are all in its content store."""
    have = set(ctr.run("content", "ls", "-q").split())
    known: dict[str, dict] = {}
    for line in ctr.run("images", "ls").splitlines()[1:]:
        cols = line.split()
        if len(cols) < 3:
            continue
        media_type, digest = cols[1], cols[2]
        todo = [(media_type, digest)]
        while todo:
            media_type, digest = todo.pop()
            if digest not in have:
                continue
            if media_type in INDEXES:
                todo += [(m["mediaType"], m["digest"]) for m in ctr.blob(digest).get("manifests", [])]
            elif media_type in MANIFESTS:
                manifest = ctr.blob(digest)
                if manifest["config"]["digest"] not in have:
                    continue
                diff_ids = ctr.blob(manifest["config"]["digest"])["rootfs"]["diff_ids"]
                for diff_id, layer in zip(diff_ids, manifest["layers"], strict=True):
                    if layer["digest"] in have:
                        known[diff_id] = {"mediaType": TO_DOCKER.get(layer["mediaType"], layer["mediaType"]),
                                          "digest": layer["digest"], "size": layer["size"]}
    return known


def add_bytes(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    out.addfile(info, io.BytesIO(data))


def convert(src, dst, name: str, known: dict[str, dict]) -> tuple[int, int, int]:
    """Stream src (docker-archive) to dst (OCI archive); returns (layers, passed, skipped bytes)."""
    inp = tarfile.open(fileobj=src, mode="r|", bufsize=BUF)
    out = tarfile.open(fileobj=dst, mode="w|", bufsize=BUF, format=tarfile.PAX_FORMAT)
    out.copybufsize = BUF
    passed: dict[str, int] = {}  # hex -> size, layers written to the output
    small: dict[str, bytes] = {}  # manifest.json and the configs
    links: dict[str, str] = {}
    skipped = 0
    for member in inp:
        if member.issym():
            links[member.name] = member.linkname
            continue
        if not member.isfile():
            continue
        m = LAYER_FILE.match(member.name)
        if m:
            # The docker-archive names each (uncompressed) layer by its digest: its diff ID.
            if f"sha256:{m[1]}" in known:
                skipped += member.size  # read past by the next iteration, never written
                continue
            info = tarfile.TarInfo(f"blobs/sha256/{m[1]}")
            info.size, info.mode, info.mtime = member.size, 0o644, member.mtime
            out.addfile(info, inp.extractfile(member))
            passed[m[1]] = member.size
        elif member.name == "manifest.json" or member.name.endswith(".json") and member.size < (16 << 20):
            small[member.name] = inp.extractfile(member).read()
    if "manifest.json" not in small:
        raise SystemExit("[oci-delta] error: no manifest.json in the docker-archive")
    entries = json.loads(small["manifest.json"])
    if len(entries) != 1:
        raise SystemExit(f"[oci-delta] error: expected one image in the archive, found {len(entries)}")
    entry = entries[0]
    config_bytes = small[entry["Config"]]
    config = json.loads(config_bytes)
    diff_ids = config["rootfs"]["diff_ids"]
    layers = []
    for path, diff_id in zip(entry["Layers"], diff_ids, strict=True):
        path = links.get(path, path).rsplit("/", 1)[-1]
        hex_ = path.removesuffix(".tar")
        if hex_ in passed:
            if f"sha256:{hex_}" != diff_id:
                raise SystemExit(f"[oci-delta] error: layer file {path} is not layer {diff_id} of the config")
            layers.append({"mediaType": DOCKER_LAYER, "digest": diff_id, "size": passed[hex_]})
        elif diff_id in known:
            layers.append(known[diff_id])
        else:
            raise SystemExit(f"[oci-delta] error: layer {diff_id} is neither in the archive nor in containerd")
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
                           "config": {"mediaType": DOCKER_CONFIG, "digest": config_digest, "size": len(config_bytes)},
                           "layers": layers}, separators=(",", ":")).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": DOCKER_MANIFEST, "digest": manifest_digest, "size": len(manifest),
        "platform": {"architecture": config.get("architecture", "amd64"), "os": config.get("os", "linux")},
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}}]}
    add_bytes(out, f"blobs/sha256/{config_digest.split(':')[1]}", config_bytes)
    add_bytes(out, f"blobs/sha256/{manifest_digest.split(':')[1]}", manifest)
    add_bytes(out, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    add_bytes(out, "index.json", json.dumps(index).encode())
    out.close()
    return len(layers), len(passed), skipped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="containerd's socket")
    p.add_argument("--namespace", default="k8s.io")
    p.add_argument("--name", required=True, help="the image reference to import it as")
    a = p.parse_args()
    known = known_layers(Ctr(a.address, a.namespace))
    layers, passed, skipped = convert(sys.stdin.buffer, sys.stdout.buffer, a.name, known)
    say(f"{a.name}: {layers} layers, {passed} sent, {layers - passed} already in containerd "
        f"({skipped / 2**30:.2f} GiB read past)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
