"""Hub datasets (``cais/mmlu``, ``openlifescienceai/medmcqa``, ...) in a local Hugging Face cache, loaded offline.

Offline, ``datasets`` 5.2 never reads the hub snapshot of a dataset repo: ``dataset_module_factory`` raises
``OfflineModeIsEnabled`` before touching it and falls back to ``CachedDatasetModuleFactory``, which reloads the
Arrow files an earlier online ``load_dataset`` prepared under ``HF_DATASETS_CACHE``. So each repo is written as a
cluster user's cache holds it after one online run: the snapshot (``refs/main``, parquet per config and split,
README ``configs:``) under ``<HF_HOME>/hub``, and the Arrow cache that datasets' own builder prepares from it,
under the repo id, config and revision, in ``<HF_HOME>/datasets``. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import yaml


def snapshot_dir(home: Path, repo_id: str) -> Path:
    revision = hashlib.sha1(f"dsr1kit-tests-{repo_id}".encode()).hexdigest()
    return home / "hub" / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / revision


def _feature(spec: Any) -> Any:
    """``"int64"`` -> ``Value("int64")``, ``["string"]`` -> a list of strings; datasets feature types as given."""
    from datasets import List, Value

    if isinstance(spec, str):
        return Value(spec)
    if isinstance(spec, list):
        return List(_feature(spec[0]))
    return spec


def _write_readme(snap: Path, config: str, data_dir: str, splits: list[str]) -> None:
    """The card's YAML ``configs:`` block, as push_to_hub writes it, keeping the configs already there."""
    readme = snap / "README.md"
    configs = yaml.safe_load(readme.read_text().split("---")[1])["configs"] if readme.is_file() else []
    entry = {
        "config_name": config,
        "data_files": [{"split": s, "path": f"{data_dir}/{s}-*"} for s in splits],
    }
    configs = sorted(
        [c for c in configs if c["config_name"] != config] + [entry], key=lambda c: c["config_name"]
    )
    readme.write_text(f"---\n{yaml.safe_dump({'configs': configs}, sort_keys=False)}---\n")


def write_hub_dataset(
    home: Path,
    repo_id: str,
    splits: dict[str, list[dict]],
    config: str | None = None,
    features: dict | None = None,
) -> Path:
    """Write ``splits`` (split -> rows) as ``repo_id``'s ``config`` (``"default"`` when None); return the snapshot.

    ``features`` maps columns to dtypes (``"int64"``, ``["string"]`` or datasets feature types); the columns it
    does not name are inferred from the rows (a column of only None is then ``Value("null")``). Afterwards
    ``load_dataset(repo_id, config, split=...)`` works under ``offline_env(home)``.
    """
    from datasets import Dataset, Features
    from datasets.load import dataset_module_factory, get_dataset_builder_class
    from datasets.naming import camelcase_to_snakecase

    snap = snapshot_dir(home, repo_id)
    name = config or "default"
    # as the repos lay them out: cais/mmlu all/test-*.parquet; a repo's default config data/train-*.parquet
    data_dir = config or "data"
    shutil.rmtree(snap / data_dir, ignore_errors=True)
    (snap / data_dir).mkdir(parents=True)
    for split, rows in splits.items():
        inferred = Dataset.from_list(rows).features
        feats = Features({**inferred, **{k: _feature(v) for k, v in (features or {}).items()}})
        Dataset.from_list(rows, features=feats).to_parquet(
            snap / data_dir / f"{split}-00000-of-00001.parquet"
        )
    _write_readme(snap, name, data_dir, list(splits))
    (snap.parent.parent / "refs").mkdir(exist_ok=True)
    (snap.parent.parent / "refs" / "main").write_text(snap.name)
    # What the online load_dataset does with the downloaded snapshot: the parquet builder configured from the
    # README prepares the Arrow cache, in the directory named by the repo id and the revision (the module hash
    # of a hub dataset is its commit). The builder is not given repo_id: it accepts only hf:// data files then.
    module = dataset_module_factory(str(snap))
    dataset_name = camelcase_to_snakecase(repo_id.split("/")[-1])
    builder = get_dataset_builder_class(module, dataset_name=dataset_name)(
        cache_dir=str(home / "datasets"), dataset_name=dataset_name, config_name=name, base_path=str(snap)
    )
    cache = home / "datasets" / f"{repo_id.split('/')[0]}___{dataset_name}" / builder.config_id
    builder.download_and_prepare(
        str(cache / str(builder.config.version) / snap.name), download_mode="force_redownload"
    )
    return snap


def offline_env(home: Path) -> dict[str, str]:
    """Environment under which those repo ids load from ``home`` only (set it before ``datasets`` is imported)."""
    return {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
