"""The commit protocol: a checkpoint exists only once its marker, with a manifest of every file, is durable.

    python -m ckpt verify runs/tiny/checkpoints/step-000020 --jobs 4

Order on save: each rank writes and fsyncs its DCP files, checksumming the bytes as they go out
(checksum.py, in the thread or process that uploads); DCP's finish step gathers every rank's write
results, digests included, to rank 0, which writes .metadata; then rank 0 writes commit.json from
those digests and the files .metadata references, never from a directory listing (on NFS a listing
can miss files other nodes just wrote), via tmp + fsync + rename + directory fsync. Rank 0 reads
only the small files it wrote itself; before the marker it checks, with one listing (sizes only; a lookup by name
of what the listing lacks), that it sees every file the manifest names (`check_visible`): a folder that the
writing ranks do not share with it gets no marker. A crash at any moment leaves either no marker (ignored on
resume) or a complete one.

Verification is in parts so it can be split: `check_marker` and `check_listing` (marker, no stray data
files, meta.json: small files and one listing, one rank), `check_references` (every file .metadata references is in the
manifest: it unpickles .metadata, O(tensors x W); on resume each rank checks instead the references of the metadata
index entries it reads, metadata_index.py, resume.py) and `check_files` (sizes and checksums of any subset of the
files). `check_manifest` is the first three. Resume gives each rank its share (`shares`, resume.py); `python -m
ckpt verify` checks every file, on `--jobs` threads, then that the index says what .metadata says (`check_index`).
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from common.shared_paths import unseen
from . import metadata_index
from .checksum import ALGORITHM, LEGACY_ALGORITHM, data_files, file_digest
from .layout import COMMIT_FILE, step_of
from .storage import join, storage_for

METADATA_FILE = ".metadata"


class VerifyError(Exception):
    """A checkpoint failed verification; the message names the file and the problem."""


def referenced_files(metadata) -> set[str]:
    """The data files a DCP Metadata (or a save's commit summary, checksum.py SavedMetadata) reads from."""
    return data_files(metadata)


def build_manifest(ckpt_path: str, digests: dict[str, dict], metadata, own_files: list[str]) -> dict[str, dict]:
    """Every rank's data-file digests, plus .metadata and `own_files` (small files this rank wrote), hashed here
    unless `digests` has them (a memory-tier node without .metadata: rank 0 hashed it, memory_tier/replicate.py)."""
    unreported = sorted(referenced_files(metadata) - set(digests))
    if unreported:
        raise VerifyError(f"{ckpt_path}: no rank reported a checksum for {', '.join(unreported[:4])}; "
                          "refusing to commit")
    files, store = dict(digests), storage_for(ckpt_path)
    for name in (n for n in (METADATA_FILE, *own_files) if n not in digests):
        full = join(ckpt_path, name)
        if not store.exists(full):
            raise VerifyError(f"{full}: missing after save; refusing to commit")
        files[name] = file_digest(full, opener=store.open_read)
    return files


def check_visible(ckpt_path: str, files: dict[str, dict], names: list[str]) -> None:
    """Every file of `names` is here with its manifest size, as this rank (the committer) sees the folder: one
    listing with sizes (an object store: one request per 1,000 objects; a folder: one stat per file), no read; a
    lookup by name only for what the listing lacks (an NFS listing can lag behind other nodes' writes). Raises
    VerifyError naming what is missing: the ranks that wrote it do not share this folder with this one."""
    store = storage_for(ckpt_path)
    listed = store.sizes(ckpt_path)

    def seen_by_name(name: str) -> bool:
        try:
            return store.size(join(ckpt_path, name)) == files[name]["size"]
        except FileNotFoundError:
            return False
    missing = unseen(names, [n for n in names if listed.get(n) == files[n]["size"]], seen_by_name)
    if missing:
        raise VerifyError(f"{ckpt_path}: {len(missing)} of the {len(names)} files the manifest names are not visible "
                          f"with their sizes to the committing rank on {socket.gethostname()} (e.g. "
                          f"{', '.join(missing[:3])}): the ranks that wrote them do not share this folder; use a folder "
                          "every node mounts, or an object store. Refusing to commit")


def commit_checkpoint(ckpt_path: str, world_size: int, digests: dict[str, dict], metadata,
                      own_files: list[str], **extra) -> dict:
    """Write the commit marker from the gathered digests. Call on one rank after the save finished. `extra`:
    more fields (the memory tier's "held", the files this node's folder holds, memory_tier/replicate.py)."""
    files = build_manifest(ckpt_path, digests, metadata, own_files)
    check_visible(ckpt_path, files, sorted(extra.get("held") or files))
    marker = {"step": step_of(ckpt_path), "world_size": world_size, "committed_at": time.time(),
              "algorithm": ALGORITHM, "files": files, **extra}
    # seen whole or not at all: a folder's tmp + rename after its entries are durable; an object store's create-only PUT
    storage_for(ckpt_path).publish(join(ckpt_path, COMMIT_FILE), json.dumps(marker, indent=1, sort_keys=True).encode())
    return marker


def read_marker(ckpt_path: str) -> dict:
    path = join(ckpt_path, COMMIT_FILE)
    try:
        marker = json.loads(storage_for(ckpt_path).read(path))
        marker.setdefault("algorithm", LEGACY_ALGORITHM)  # written before the field existed
        files, algorithm = marker["files"], marker["algorithm"]
        assert algorithm in (ALGORITHM, LEGACY_ALGORITHM)
        assert isinstance(files, dict) and all("size" in v and algorithm in v for v in files.values())
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise VerifyError(f"{path}: missing commit marker (checkpoint never committed)") from None
    except ConnectionError as e:  # an object store out of reach says nothing about the marker
        raise VerifyError(f"{path}: cannot be read ({e})") from None
    except Exception as e:  # noqa: BLE001 - any unreadable marker is the same verdict
        raise VerifyError(f"{path}: corrupt commit marker ({type(e).__name__})") from None
    return marker


def check_manifest(ckpt_path: str) -> dict:
    """The checks that read no data file: check_marker, check_references, check_listing, in that order.
    Returns the marker; raises VerifyError."""
    marker = check_marker(ckpt_path)
    check_references(ckpt_path, marker)
    check_listing(ckpt_path, marker)
    return marker


def check_index(ckpt_path: str, marker: dict, metadata) -> None:
    """The metadata index (metadata_index.py), which resume reads instead of .metadata, says exactly what .metadata
    says. A checkpoint without one: nothing to check. Raises VerifyError."""
    if metadata_index.INDEX not in marker["files"]:
        return
    store = storage_for(ckpt_path)
    try:
        metadata_index.check_agrees(metadata, lambda name: store.read(join(ckpt_path, name)), ckpt_path)
    except metadata_index.MetadataIndexError as e:
        raise VerifyError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a torn index file: the same verdict
        raise VerifyError(f"{join(ckpt_path, metadata_index.INDEX)}: unreadable ({type(e).__name__})") from None


def check_marker(ckpt_path: str) -> dict:
    """The marker is well formed and names .metadata. Returns it; raises VerifyError."""
    store = storage_for(ckpt_path)
    if store.has_folders and not store.is_folder(ckpt_path):  # an object store has no folders
        raise VerifyError(f"{ckpt_path}: not a directory")
    marker = read_marker(ckpt_path)
    if METADATA_FILE not in marker["files"]:
        raise VerifyError(f"{ckpt_path}: {METADATA_FILE} not in the commit manifest")
    return marker


def check_listing(ckpt_path: str, marker: dict) -> None:
    """No data file outside the manifest (one listing), meta.json readable; raises VerifyError."""
    store = storage_for(ckpt_path)
    for name in store.listdir(ckpt_path):
        if name.endswith(".distcp") and name not in marker["files"]:
            raise VerifyError(f"{join(ckpt_path, name)}: data file not in manifest")
    meta = join(ckpt_path, "meta.json")
    try:
        json.loads(store.read(meta))
    except (OSError, ValueError):
        raise VerifyError(f"{meta}: unreadable") from None


def check_references(ckpt_path: str, marker: dict):
    """Every file .metadata references is in the manifest; returns DCP's Metadata, raises VerifyError."""
    try:
        metadata = storage_for(ckpt_path).dcp_reader(ckpt_path).read_metadata()
    except Exception as e:  # noqa: BLE001 - missing, torn or not a pickle: the same verdict
        raise VerifyError(f"{join(ckpt_path, METADATA_FILE)}: unreadable ({type(e).__name__})") from None
    for name in sorted(referenced_files(metadata) - set(marker["files"])):
        raise VerifyError(f"{join(ckpt_path, name)}: referenced by {METADATA_FILE} but not in the manifest")
    return metadata


def check_file(ckpt_path: str, name: str, expected: dict, algorithm: str) -> str | None:
    """None if the file has its manifest size and checksum, else the problem, naming the file."""
    full, store = join(ckpt_path, name), storage_for(ckpt_path)
    try:
        size = store.size(full)
        if size != expected["size"]:
            return f"{full}: size {size} != {expected['size']} in manifest"
        if file_digest(full, algorithm, store.open_read)[algorithm] != expected[algorithm]:
            return f"{full}: checksum mismatch ({algorithm})"
    except FileNotFoundError:
        return f"{full}: missing"
    except OSError as e:
        return f"{full}: unreadable ({e.strerror or e})"  # an object store's errors have no strerror
    return None


def check_files(ckpt_path: str, marker: dict, names: list[str], jobs: int = 1) -> str | None:
    """The first problem among `names` (in the order given), or None; `jobs` threads hash in parallel
    (file reads and both hashes release the GIL)."""
    files, algorithm = marker["files"], marker["algorithm"]
    if jobs <= 1 or len(names) <= 1:
        results = (check_file(ckpt_path, n, files[n], algorithm) for n in names)
    else:
        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckpt-verify") as pool:
            results = list(pool.map(lambda n: check_file(ckpt_path, n, files[n], algorithm), names))
    return next((r for r in results if r is not None), None)


def held_files(marker: dict) -> list[str]:
    """The files a checkpoint folder holds: all of the manifest, or a memory step's "held" list (one node's folder
    holds its own ranks' files and its replicas, docs/memory-tier.md)."""
    return sorted(marker.get("held") or marker["files"])


def shares(files: dict[str, dict], world_size: int) -> list[list[str]]:
    """Split the manifest's files over ranks by size (largest first to the least loaded rank), the same
    on every rank, so each verifies about total/W bytes."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += files[name]["size"]
    return out


def verify_checkpoint(ckpt_path: str, jobs: int = 1) -> dict:
    """The full check in one process: manifest, then every file's size and checksum, then that the metadata index
    says what the intact .metadata says. Returns the marker; raises VerifyError naming the first bad file."""
    marker = check_marker(ckpt_path)
    held = held_files(marker)
    # .metadata and the index's top intact before they are read, as resume checks what it reads (resume.py)
    problem = check_files(ckpt_path, marker, [n for n in (METADATA_FILE, metadata_index.INDEX) if n in held])
    if problem:
        raise VerifyError(problem)
    metadata = check_references(ckpt_path, marker) if METADATA_FILE in held else check_index_references(ckpt_path,
                                                                                                          marker)
    check_listing(ckpt_path, marker)
    problem = check_files(ckpt_path, marker, held, jobs)
    if problem:
        raise VerifyError(problem)
    if metadata is not None:
        check_index(ckpt_path, marker, metadata)
    return marker


def check_index_references(ckpt_path: str, marker: dict) -> None:
    """A memory-tier node's folder without .metadata (docs/memory-tier.md): every file the index files it holds
    reference is in the manifest (what they say is checked against .metadata in node 0's folder). Raises
    VerifyError."""
    store, held = storage_for(ckpt_path), held_files(marker)
    try:
        md = metadata_index.read_index(ckpt_path, lambda name: store.read(join(ckpt_path, name)), marker["files"])
        for name in held:
            if metadata_index.bucket_of(name) is not None:
                metadata_index.add_bucket(md, name)
    except metadata_index.MetadataIndexError as e:
        raise VerifyError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - missing, torn or not a pickle: the same verdict
        raise VerifyError(f"{ckpt_path}: its metadata index is unreadable ({type(e).__name__})") from None
