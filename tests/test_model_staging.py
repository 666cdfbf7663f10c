"""Staging a checkpoint before a job and proving it complete: the R1-format tiny checkpoint (FP8 shards, an
index, a repo id) copied out of hub caches laid out as the hub writes them (snapshot links into sha256
blobs), cut short, damaged and resumed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsr1kit.embedded import r1_format
from dsr1kit.model import staging

REPO = r1_format.REPO_ID


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache holding the R1-format checkpoint as huggingface_hub stores a download: blobs named by their
    sha256, the snapshot's files relative links to them, refs/main naming the snapshot."""
    built = r1_format.build()
    cache = tmp_path_factory.mktemp("shared") / "hub"
    repo = staging.repo_folder(cache, REPO)
    snap = repo / "snapshots" / built.name
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(built.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(os.path.relpath(repo / "blobs" / digest, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(built.name)
    return cache


def shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / r1_format.INDEX_FILE).read_text())["weight_map"].values()))


def test_staged_from_a_shared_cache_is_complete_and_resolves_by_repo_id(hub_cache, tmp_path):
    staged = staging.stage(REPO, to=tmp_path / "node" / "hub", source=hub_cache)
    done = staged.completeness
    assert done.complete, done.describe()
    src = staging.snapshot(hub_cache, REPO)
    assert done.folder == staging.snapshot(tmp_path / "node" / "hub", REPO)
    assert done.files == len(list(src.iterdir())) and done.bytes == sum(
        p.stat().st_size for p in src.iterdir()
    )
    assert staged.copied_bytes == done.bytes and (done.folder / staging.MANIFEST).is_file()
    for name in shards(src):  # a hub cache again: links into blobs, the same bytes
        link = done.folder / name
        assert link.is_symlink() and link.resolve().parent.name == "blobs"
        with safe_open(link, "pt") as a, safe_open(src / name, "pt") as b:
            assert all(
                torch.equal(a.get_tensor(k).view(torch.uint8), b.get_tensor(k).view(torch.uint8))
                for k in a.keys()
            )
    again = staging.stage(REPO, to=tmp_path / "node" / "hub", source=hub_cache)  # nothing left to copy
    assert again.copied_files == 0 and again.completeness.complete


def test_truncated_missing_and_dangling_files_are_named_and_a_second_stage_copies_only_them(
    hub_cache, tmp_path
):
    to = tmp_path / "hub"
    folder = staging.stage(REPO, to=to, source=hub_cache).completeness.folder
    names = shards(folder)
    cut, gone, dangling = names[0], names[1], names[2]
    blob = (folder / cut).resolve()
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # a copy cut off half-way
    (folder / gone).unlink()  # a shard never copied
    (folder / dangling).resolve().unlink()  # the link is there, its blob is not
    result = staging.check(REPO, to)
    assert not result.complete
    problems = {f.name: f.problem for f in result.faults}
    assert set(problems) == {cut, gone, dangling}, problems
    assert problems[gone] == problems[dangling] == "missing"
    assert problems[cut].startswith("truncated: ") and " of " in problems[cut]
    assert cut in result.describe() and "3 faulty file(s)" in result.describe()
    resumed = staging.stage(REPO, to=to, source=hub_cache)
    assert resumed.completeness.complete
    assert resumed.copied_files == 2  # the cut and the lost blob; the unlinked shard's blob was still whole


def test_the_shard_header_alone_tells_a_truncated_file_without_a_manifest(hub_cache, tmp_path):
    folder = tmp_path / "plain"
    staging.stage("unused-name", to=folder, source=staging.snapshot(hub_cache, REPO))
    (folder / staging.MANIFEST).unlink()  # e.g. a copy made by hand
    assert staging.check_folder(folder).complete
    shard = folder / shards(folder)[-1]
    shard.write_bytes(shard.read_bytes()[:-1])
    [fault] = staging.check_folder(folder).faults
    assert fault.name == shard.name and fault.problem.startswith("truncated")


def test_hash_check_finds_a_flipped_byte_that_sizes_miss(hub_cache, tmp_path):
    to = tmp_path / "hub"
    staging.stage(REPO, to=to, source=hub_cache, hashes=True)
    folder = staging.snapshot(to, REPO)
    shard = (folder / shards(folder)[0]).resolve()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # inside a tensor's bytes: same length, same header
    shard.write_bytes(bytes(data))
    assert staging.check(REPO, to).complete  # sizes alone cannot see it
    [fault] = staging.check(REPO, to, hashes=True).faults
    assert fault.problem == "sha256 differs from the source's"


def test_a_model_not_in_the_source_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(staging.StageError, match="dsr1kit stage org/absent --to"):
        staging.stage("org/absent", to=tmp_path / "to", source=tmp_path)


def test_cli_check_exits_1_naming_the_node_and_file(hub_cache, tmp_path, cli):
    to = tmp_path / "{node}" / "hub"
    ok = cli("stage", REPO, "--from", str(hub_cache), "--to", str(to), env={"SLURMD_NODENAME": "n7"})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("n7: ") and "complete" in ok.stdout
    folder = staging.snapshot(tmp_path / "n7" / "hub", REPO)
    victim = shards(folder)[1]
    (folder / victim).resolve().unlink()
    bad = cli("stage", REPO, "--to", str(to), "--check", env={"SLURMD_NODENAME": "n7"})
    assert bad.returncode == 1 and f"n7: {REPO}: 1 faulty file(s)" in bad.stdout and victim in bad.stdout


def test_bytes_still_to_stage_are_the_faulty_files_with_or_without_a_manifest(hub_cache, tmp_path):
    to = tmp_path / "hub"
    folder = staging.stage(REPO, to=to, source=hub_cache).completeness.folder
    assert staging.bytes_to_stage(staging.check(REPO, to)) == 0
    names = shards(folder)
    full = {n: (folder / n).resolve().stat().st_size for n in names}
    cut = (folder / names[0]).resolve()
    cut.write_bytes(cut.read_bytes()[: full[names[0]] // 3])
    (folder / names[1]).resolve().unlink()
    by_manifest = staging.bytes_to_stage(staging.check(REPO, to))
    assert by_manifest == full[names[0]] + full[names[1]]  # the manifest's sizes: exact
    (folder / staging.MANIFEST).unlink()
    assert staging.bytes_to_stage(staging.check(REPO, to)) is None  # neither sizes nor the index's total
    index_file = (folder / r1_format.INDEX_FILE).resolve()
    index = json.loads(index_file.read_text())
    headers = {n: 8 + int.from_bytes(_head(hub_cache, n), "little") for n in names}
    index["metadata"] = {
        "total_size": sum(full[n] - headers[n] for n in names)
    }  # tensor bytes, as R1's index
    index_file.write_text(json.dumps(index))
    by_index = staging.bytes_to_stage(staging.check(REPO, to))
    assert by_manifest - sum(headers.values()) <= by_index <= by_manifest


def _head(hub_cache: Path, name: str) -> bytes:
    with open(staging.snapshot(hub_cache, REPO) / name, "rb") as f:
        return f.read(8)


def test_a_node_whose_scratch_cannot_hold_r1_fails_with_the_size_and_where_to_stage(tmp_path):
    """Nothing of R1 on the node: the copy's size comes from R1's config (FP8 blocks as stored, ~627 GiB)
    and is compared with the free space of the filesystem the copy would go to."""
    from dsr1kit.cluster.checks import FAIL, check_staged_model

    free = shutil.disk_usage(tmp_path).free / 2**30
    if free > 700:
        pytest.skip(f"this machine has {free:.0f} GiB free: R1 would fit")
    row = check_staged_model("deepseek-ai/DeepSeek-R1-0528", str(tmp_path / "hub"))
    assert row.status == FAIL and "not staged here" in row.measured
    assert "the copy needs at least 627.1 GiB more" in row.fix
    said = re.search(r"has ([0-9.]+) GiB free on this node", row.fix)
    assert said and abs(float(said[1]) - free) < 1, row.fix
    assert "--to DIR" in row.fix and "staged_model_dir" in row.fix
