"""A secret in the environment reaches no file of a run folder (of any size), no log stream and no error
message, even when a cell prints it, writes it and raises with it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from conftest import run_cli

from dsr1kit import params
from dsr1kit.run import parameters_cell
from dsr1kit.run.redact import redact_file, secret_values

SENTINEL = "hf_" + "Sentinel9876543210zyxwvuTSR"
SHORT = "k3y!"  # shorter than a token, still a secret's value
BIG = 210 * 2**20  # larger than any "skip big files" shortcut


def _notebook(folder: Path) -> Path:
    """A cluster-check-shaped notebook whose cells leak the environment's secrets every way they can."""
    cells = [
        parameters_cell.render(params.ClusterCheckParams),
        "import os, sys\nfrom pathlib import Path\nfrom IPython.display import HTML, display\n"
        "from dsr1kit import params, steps\n"
        "p, run_dir = steps.begin(params.ClusterCheckParams, globals())\n"
        "token, short = os.environ['HF_TOKEN'], os.environ['WANDB_API_KEY']\n"
        "print('stdout', token, short)\n"
        "sys.stderr.write(f'stderr {token} {short}\\n')\n"
        "display(HTML(f'<b>{token}</b>'))\n"
        "(run_dir / 'notes.txt').write_text(f'written {token} {short} and false stays false')\n"
        f"with open(run_dir / 'big.bin', 'wb') as f:\n    f.seek({BIG})\n    f.write(token.encode())\n",
        "raise ValueError(f'failed with {token}')",
    ]
    nb = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "dsr1kit", "language": "python", "display_name": "dsr1kit"}},
        "cells": [
            {
                "cell_type": "code",
                "id": f"c{i}",
                "metadata": {"tags": ["parameters"] if i == 0 else []},
                "execution_count": None,
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(cells)
        ],
    }
    path = folder / "00_cluster_check.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_environment_secret_reaches_no_file_no_stream_no_message(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli(
        "run",
        str(_notebook(tmp_path)),
        "--runs-dir",
        str(runs),
        env={"HF_TOKEN": SENTINEL, "WANDB_API_KEY": SHORT, "TOKENIZERS_PARALLELISM": "false"},
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"failed in cell \d+ \(ValueError: failed with \*{%d}\)" % len(SENTINEL), proc.stderr)
    assert "stderr *" in proc.stderr  # the cell's stderr reached the log, masked
    for stream in (proc.stdout, proc.stderr):
        assert SENTINEL not in stream and SHORT not in stream
    (run_dir,) = runs.iterdir()
    leaks = []
    for path in run_dir.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while chunk := f.read(64 * 2**20):
                    if SENTINEL.encode() in chunk or SHORT.encode() in chunk:
                        leaks.append(str(path.relative_to(run_dir)))
                        break
    assert not leaks, leaks
    assert (run_dir / "big.bin").stat().st_size == BIG + len(SENTINEL)  # masked in place, layout kept
    assert "and false stays false" in (run_dir / "notes.txt").read_text()  # a flag-like value is no secret
    assert {"report.ipynb", "report.html", "status.json", "params.yaml"} <= {
        p.name for p in run_dir.iterdir()
    }


def test_secret_names_and_values():
    env = {
        "HF_TOKEN": SENTINEL,
        "GITHUB_TOKEN": "ghp_x1234",
        "AWS_SECRET_ACCESS_KEY": "abcd",
        "MY_PASSWORD": "pw",
        "TOKENIZERS_PARALLELISM": "false",
        "JUPYTER_TOKEN": "true",
        "SLURM_JOB_ID": "12345",
        "HOME": "/root",
    }
    assert secret_values(env) == [SENTINEL, "ghp_x1234", "abcd"]


def test_a_secret_across_a_chunk_boundary_is_masked(tmp_path, monkeypatch):
    import dsr1kit.run.redact as r

    monkeypatch.setattr(r, "CHUNK", 16)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 13 + SENTINEL.encode() + b"y" * 40 + SENTINEL.encode())
    assert redact_file(path, [SENTINEL])
    assert path.read_bytes() == b"x" * 13 + b"*" * len(SENTINEL) + b"y" * 40 + b"*" * len(SENTINEL)
    assert not redact_file(path, [SENTINEL])
    assert os.path.getsize(path) == 13 + 40 + 2 * len(SENTINEL)
