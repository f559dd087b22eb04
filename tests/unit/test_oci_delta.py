"""hack/node/oci_delta.py: a docker-archive becomes an OCI archive that carries only the layers
containerd lacks and names the others by the descriptors containerd holds them under."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("oci_delta", Path(__file__).parents[2] / "hack" / "node" / "oci_delta.py")
oci_delta = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oci_delta)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def docker_archive(layers: list[bytes], legacy_links: bool = False) -> tuple[bytes, list[str]]:
    """What `buildah push IMAGE docker-archive:...` writes: layers named by digest, then the config
    and manifest.json (with legacy <id>/layer.tar symlinks when asked)."""
    diff_ids = [sha(b) for b in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        paths = []
        for i, (d, b) in enumerate(zip(diff_ids, layers, strict=True)):
            add(f"{d.split(':')[1]}.tar", b)
            paths.append(f"{d.split(':')[1]}.tar")
            if legacy_links:
                link = tarfile.TarInfo(f"id{i}/layer.tar")
                link.type, link.linkname = tarfile.SYMTYPE, f"../{d.split(':')[1]}.tar"
                t.addfile(link)
                paths[-1] = f"id{i}/layer.tar"
        cfg_name = f"{sha(config).split(':')[1]}.json"
        add(cfg_name, config)
        add("manifest.json", json.dumps([{"Config": cfg_name, "RepoTags": ["ghcr.io/x/rt:1"], "Layers": paths}]).encode())
    return buf.getvalue(), diff_ids


def read_oci(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return {m.name: t.extractfile(m).read() for m in t if m.isfile()}


@pytest.mark.parametrize("legacy_links", [False, True])
def test_only_the_layers_containerd_lacks_travel(legacy_links):
    torch, deps, code = b"t" * 5000, b"d" * 700, b"code v2"
    archive, diff_ids = docker_archive([torch, deps, code], legacy_links)
    # containerd holds torch compressed (pulled) and deps as imported: the code layer is new.
    known = {diff_ids[0]: {"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                           "digest": "sha256:" + "a" * 64, "size": 1234},
             diff_ids[1]: {"mediaType": "application/vnd.docker.image.rootfs.diff.tar", "digest": diff_ids[1],
                           "size": len(deps)}}
    out = io.BytesIO()
    layers, passed, skipped = oci_delta.convert(io.BytesIO(archive), out, "ghcr.io/x/rt:1", known)
    assert (layers, passed, skipped) == (3, 1, len(torch) + len(deps))
    files = read_oci(out.getvalue())
    blobs = {name.split("/")[-1] for name in files if name.startswith("blobs/")}
    assert diff_ids[2].split(":")[1] in blobs and diff_ids[0].split(":")[1] not in blobs
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "ghcr.io/x/rt:1"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    manifest_bytes = files[f"blobs/sha256/{entry['digest'].split(':')[1]}"]
    assert sha(manifest_bytes) == entry["digest"] and len(manifest_bytes) == entry["size"]
    manifest = json.loads(manifest_bytes)
    assert manifest["layers"] == [known[diff_ids[0]], known[diff_ids[1]],
                                  {"mediaType": oci_delta.DOCKER_LAYER, "digest": diff_ids[2], "size": len(code)}]
    config = files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"]
    assert json.loads(config)["rootfs"]["diff_ids"] == diff_ids
    assert files[f"blobs/sha256/{diff_ids[2].split(':')[1]}"] == code


def test_with_nothing_known_every_layer_travels():
    archive, diff_ids = docker_archive([b"a" * 10, b"b" * 20])
    out = io.BytesIO()
    assert oci_delta.convert(io.BytesIO(archive), out, "r:1", {})[:2] == (2, 2)
    files = read_oci(out.getvalue())
    assert all(f"blobs/sha256/{d.split(':')[1]}" in files for d in diff_ids)


def test_an_archive_without_a_manifest_is_refused():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w"):
        pass
    with pytest.raises(SystemExit, match="no manifest.json"):
        oci_delta.convert(io.BytesIO(buf.getvalue()), io.BytesIO(), "r:1", {})
