"""Staging a checkpoint where a job reads it, and telling whether a staged copy is complete.

R1 is ~690 GB. A job that finds it missing on one node downloads it inside the allocation (and a node still
downloading can push the first collective past its timeout); a job that finds one shard truncated fails
after loading the others. So the copy is made once, before the job (``dsr1kit stage``: from the hub into a
shared or local cache, with resume; or from a shared copy to every node's scratch in parallel), and each node
proves its copy complete in the cluster check, without reading the weights:

- every shard the index names is there;
- every safetensors file is as long as its own header says (a truncated copy is shorter);
- every file of the manifest written at staging (sizes, and the hub's sha256 where the hub gave one) is
  there with that size; ``hashes=True`` also compares the sha256 (reads every byte: minutes for R1).

A model is a repo id (resolved in a hub cache folder, ``HF_HUB_CACHE`` by default, as transformers and
vLLM resolve it offline) or a local folder. A folder with ``{node}`` in it is that node's own folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .checkpoint_index import INDEX_FILE

MANIFEST = (
    "dsr1kit-staged.json"  # beside the weights: {"source": …, "files": {name: {"size": n, "sha256": h}}}
)
GIB = 2**30


class StageError(RuntimeError):
    """Staging cannot go on as asked; the message says what to change. Files already copied are kept."""


@dataclass(frozen=True)
class Fault:
    """One file of a staged copy that is not as it should be."""

    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.name} ({self.problem})"


@dataclass
class Completeness:
    """What a node holds of a model: where, how much, and every fault found."""

    model: str
    folder: Path | None
    files: int = 0
    bytes: int = 0
    faults: list[Fault] = field(default_factory=list)
    hashed: bool = False

    @property
    def complete(self) -> bool:
        return self.folder is not None and not self.faults

    def describe(self, limit: int = 5) -> str:
        if self.folder is None:
            return f"{self.model}: not staged here ({self.faults[0].problem if self.faults else 'absent'})"
        if self.complete:
            how = "sizes and sha256" if self.hashed else "sizes"
            return (
                f"{self.model}: complete, {self.files} files, {self.bytes / GIB:.1f} GiB ({how} checked) "
                f"in {self.folder}"
            )
        listed = "; ".join(map(str, self.faults[:limit]))
        more = f"; … and {len(self.faults) - limit} more" if len(self.faults) > limit else ""
        return f"{self.model}: {len(self.faults)} faulty file(s) in {self.folder}: {listed}{more}"

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "folder": str(self.folder) if self.folder else None,
            "files": self.files,
            "bytes": self.bytes,
            "complete": self.complete,
            "hashed": self.hashed,
            "faults": [{"name": f.name, "problem": f.problem} for f in self.faults],
        }


def node_folder(path: str | Path, node: str | None = None) -> Path:
    """``path`` with ``{node}`` replaced by this node's name (Slurm's, else the hostname)."""
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return Path(os.path.expandvars(str(path)).replace("{node}", node)).expanduser()


def default_cache() -> Path:
    """The hub cache jobs read from: HF_HUB_CACHE, else HF_HOME/hub (slurm/prelude.sh puts it on NVMe)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def is_repo_id(model: str) -> bool:
    return (
        not Path(model).expanduser().exists() and model.count("/") == 1 and not model.startswith((".", "/"))
    )


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def snapshot(cache: Path, repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a ref or a commit) in a hub cache, or None."""
    repo = repo_folder(cache, repo_id)
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None


def locate(model: str, cache: str | Path | None = None, revision: str = "main") -> Path | None:
    """The folder that holds ``model`` on this node: the folder itself, or its snapshot in the hub cache."""
    if not is_repo_id(model):
        folder = node_folder(model)
        return folder if folder.is_dir() else None
    return snapshot(node_folder(cache) if cache else default_cache(), model, revision)


# -- completeness ---------------------------------------------------------------------------------------
def safetensors_length(path: Path) -> int:
    """The byte length a safetensors file's header promises (8 + header + the furthest tensor's end)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"header length {n} is not a safetensors header")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError("header cut short")
    header = json.loads(raw)
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return 8 + n + end


def sha256_of(path: Path, chunk: int = 64 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def check(
    model: str, cache: str | Path | None = None, revision: str = "main", hashes: bool = False
) -> Completeness:
    """Is ``model`` present and complete on this node? Every fault is listed; nothing is changed."""
    folder = locate(model, cache, revision)
    if folder is None:
        where = (
            node_folder(model)
            if not is_repo_id(model)
            else repo_folder(node_folder(cache) if cache else default_cache(), model)
        )
        return Completeness(model, None, faults=[Fault(str(where), "missing")])
    return check_folder(folder, model, hashes)


def check_folder(folder: Path, model: str = "", hashes: bool = False) -> Completeness:
    """Faults of a model folder: missing files (index, manifest), truncated shards, wrong sizes or hashes."""
    result = Completeness(model or str(folder), folder, hashed=hashes)
    expected: dict[str, dict] = dict(read_manifest(folder).get("files", {}))
    if not (folder / "config.json").exists():
        expected.setdefault("config.json", {})
    index = folder / INDEX_FILE
    if index.exists():
        try:
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                expected.setdefault(shard, {})
        except (ValueError, KeyError) as err:
            result.faults.append(Fault(INDEX_FILE, f"unreadable: {err}"))
    elif not (folder / "model.safetensors").exists():
        expected.setdefault(INDEX_FILE, {})
    names = set(expected) | {p.name for p in folder.glob("*.safetensors")}
    for name in sorted(names):
        path = folder / name
        if not path.exists():  # a dangling link into the blobs is missing too
            result.faults.append(Fault(name, "missing"))
            continue
        size = path.stat().st_size
        want = expected.get(name, {})
        if "size" in want and size != want["size"]:
            kind = "truncated" if size < want["size"] else "larger than the source"
            result.faults.append(Fault(name, f"{kind}: {_size(size)} of {_size(want['size'])}"))
            continue
        if name.endswith(".safetensors"):
            try:
                promised = safetensors_length(path)
            except (OSError, ValueError) as err:
                result.faults.append(Fault(name, f"unreadable header: {err}"))
                continue
            if size != promised:
                result.faults.append(Fault(name, f"truncated: {_size(size)} of {_size(promised)}"))
                continue
        if hashes and want.get("sha256") and sha256_of(path) != want["sha256"]:
            result.faults.append(Fault(name, "sha256 differs from the source's"))
            continue
        result.files += 1
        result.bytes += size
    return result


def bytes_to_stage(result: Completeness) -> int | None:
    """Bytes a stage still has to write for a checked copy, from the manifest's sizes or the index's
    total_size (None when the node holds neither: the caller estimates from the config)."""
    if result.folder is None:
        return None
    files = read_manifest(result.folder).get("files", {})
    if files and all("size" in f for f in files.values()):
        return max(0, sum(f["size"] for f in files.values()) - result.bytes)
    try:
        total = int(json.loads((result.folder / INDEX_FILE).read_text())["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # total_size counts tensor bytes only; each present complete shard also has its header (small)
    good = sum(
        p.stat().st_size
        for p in result.folder.glob("*.safetensors")
        if p.exists() and p.name not in {f.name for f in result.faults}
    )
    return max(0, total - good)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n:,} B"


# -- staging --------------------------------------------------------------------------------------------
@dataclass
class Staged:
    """What one stage call did and what the node now holds."""

    completeness: Completeness
    copied_files: int = 0
    copied_bytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        moved = f"copied {self.copied_files} files, {self.copied_bytes / GIB:.2f} GiB in {self.seconds:.0f} s"
        return f"{self.completeness.describe()} ({moved})"


def stage(
    model: str,
    to: str | Path | None = None,
    source: str | Path | None = None,
    revision: str = "main",
    workers: int = 8,
    hashes: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Staged:
    """Put ``model`` into ``to`` on this node and check it: from ``source`` (a hub cache or a model folder,
    e.g. on the shared filesystem) when given, else from the hub. Files already there at the right size are
    kept, so a stage that was cut off resumes where it stopped."""
    start = time.monotonic()
    if source is not None:
        copied = _copy(model, node_folder(source), to, revision, workers, hashes, progress)
    else:
        copied = _download(model, to, revision, workers)
    repo = is_repo_id(model)
    target = node_folder(to) if to else (default_cache() if repo else None)
    result = check(model, target, revision, hashes) if repo else check_folder(target, model, hashes)
    return Staged(result, copied[0], copied[1], time.monotonic() - start)


def _copy(
    model: str,
    source: Path,
    to,
    revision: str,
    workers: int,
    hashes: bool,
    progress: Callable[[int], None] | None,
) -> tuple[int, int]:
    """(files, bytes) copied from a hub cache or folder at ``source`` into ``to``, blob by blob, in parallel."""
    if is_repo_id(model):
        src = snapshot(source, model, revision)
        if src is None:
            raise StageError(
                f"{model} is not in the hub cache {source} (no {repo_folder(source, model).name}/refs/"
                f"{revision}): stage it there first (dsr1kit stage {model} --to {source})"
            )
        cache = node_folder(to) if to else default_cache()
        dst = repo_folder(cache, model) / "snapshots" / src.name
    else:
        if not to:
            raise StageError("copying a model folder needs --to (the folder to copy it into)")
        src, dst = source, node_folder(to)
    if src.resolve() == dst.resolve():
        raise StageError(f"source and destination are the same folder: {dst}")
    jobs = []  # (source file, destination file, link in the snapshot or None)
    for path in sorted(p for p in src.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(src)
        real = path.resolve()
        if path.is_symlink() and real.parent.name == "blobs":  # a hub cache: copy the blob, link it
            blob = dst.parent.parent / "blobs" / real.name
            jobs.append((real, blob, dst / rel))
        else:
            jobs.append((real, dst / rel, None))
    missing = [str(s) for s, _, _ in jobs if not s.exists()]
    if missing:
        raise StageError(
            f"the source copy is incomplete ({len(missing)} missing, e.g. {missing[0]}): fix it first"
        )

    def one(job) -> int:
        src_file, dst_file, link = job
        n = 0
        if not (dst_file.is_file() and dst_file.stat().st_size == src_file.stat().st_size):
            dst_file.parent.mkdir(parents=True, exist_ok=True)
            part = dst_file.with_name(dst_file.name + ".incomplete")
            shutil.copyfile(src_file, part)
            os.replace(part, dst_file)
            n = dst_file.stat().st_size
        if link is not None:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(dst_file, link.parent))
        if progress is not None:
            progress(src_file.stat().st_size)
        return n

    with ThreadPoolExecutor(max(1, workers)) as pool:
        sizes = list(pool.map(one, jobs))
    if is_repo_id(model):  # the refs, so the repo id resolves offline
        src_refs, dst_refs = repo_folder(source, model) / "refs", dst.parent.parent / "refs"
        for ref in src_refs.rglob("*") if src_refs.is_dir() else []:
            if ref.is_file():
                (dst_refs / ref.relative_to(src_refs)).parent.mkdir(parents=True, exist_ok=True)
                (dst_refs / ref.relative_to(src_refs)).write_text(ref.read_text())
    manifest = read_manifest(dst)
    if not manifest or (hashes and not any("sha256" in f for f in manifest["files"].values())):
        # the source's sizes (and hashes with --hash), so a copy cut short or damaged is seen as such
        write_manifest(dst, {"copied_from": str(src)}, file_sizes(src, hashes))
    return sum(1 for n in sizes if n), sum(sizes)


def file_sizes(folder: Path, hashes: bool = False) -> dict[str, dict]:
    """{relative name: {"size": n[, "sha256": h]}} of every file under ``folder`` (links followed), the
    manifest left out."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, **({"sha256": sha256_of(p)} if hashes else {})}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".incomplete")
    }


def write_manifest(folder: Path, source: dict, files: dict[str, dict]) -> Path:
    """What ``folder`` must hold (sizes, and sha256 where the hub gave one), for every later check."""
    out = folder / MANIFEST
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"source": source, "files": files}, indent=1))
    os.replace(tmp, out)
    return out


def _download(model: str, to, revision: str, workers: int) -> tuple[int, int]:
    """From the hub (resumes by itself), then a manifest with the hub's sizes and sha256 to check against."""
    if not is_repo_id(model):
        raise StageError(f"{model} is neither a hub repo id nor an existing folder: nothing to stage from")
    from huggingface_hub import HfApi, snapshot_download

    token = os.environ.get("HF_TOKEN")  # from the environment only; never written anywhere
    cache = node_folder(to) if to else default_cache()
    before = _bytes_under(repo_folder(cache, model))
    folder = Path(
        snapshot_download(model, revision=revision, cache_dir=cache, max_workers=workers, token=token)
    )
    info = HfApi(token=token).model_info(model, revision=revision, files_metadata=True)
    hub_files = {
        s.rfilename: {"size": s.size, **({"sha256": s.lfs.sha256} if s.lfs else {})}
        for s in info.siblings or []
        if s.size is not None
    }
    files = {**file_sizes(folder), **hub_files}  # the hub's word wins
    write_manifest(folder, {"repo": model, "revision": info.sha}, files)
    after = _bytes_under(repo_folder(cache, model))
    return (len(hub_files), max(0, after - before))


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
