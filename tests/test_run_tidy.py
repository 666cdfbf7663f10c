"""The report a teammate reads (dsr1kit.run.tidy): one line per progress bar, stderr messages in one
Warnings section (the kit's own also at the top), a failing cell left as it ran, no machine path."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from dsr1kit.run.tidy import MachinePaths, split_stderr, tidy_cells, tidy_report

TQDM = (
    "\rLoading weights:   0%|          | 0/47 [00:00<?, ?it/s]"
    "\rLoading weights: 100%|██████████| 47/47 [00:00<00:00, 3644.32it/s]"
)
WARNING = (
    "/x/site-packages/transformers/modeling_utils.py:3312: FutureWarning: `a` is deprecated\n"
    "  warnings.warn(\n"
)
KIT_WARNING = (
    "/x/dsr1kit/model/load.py:90: UserWarning: tokenizer has 9 tokens but the model embeds 8\n"
    "  warnings.warn(\n"
)


def _stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def _cell(outputs: list[dict], count: int) -> dict:
    return {"cell_type": "code", "execution_count": count, "metadata": {}, "source": "x", "outputs": outputs}


def test_a_bar_split_over_outputs_is_one_line_and_a_warning_keeps_its_source_line():
    bars, messages = split_stderr(TQDM[:40] + TQDM[40:] + "\n" + WARNING + "\rsteps: 12it [00:01, 9.1it/s]")
    assert bars == [
        "Loading weights: 100%|██████████| 47/47 [00:00<00:00, 3644.32it/s]",
        "steps: 12it [00:01, 9.1it/s]",
    ]
    assert messages == [WARNING.rstrip("\n")]


def test_successful_cells_lose_their_stderr_and_a_failing_cell_keeps_it():
    ok = _cell([_stream("stdout", "run folder\n"), _stream("stderr", TQDM[:50]), _stream("stderr", TQDM[50:] + "\n"),
                _stream("stderr", WARNING), _stream("stderr", KIT_WARNING)], 3)  # fmt: skip
    failed = _cell(
        [_stream("stderr", WARNING), {"output_type": "error", "ename": "E", "evalue": "v", "traceback": []}],
        4,
    )
    nb = {"cells": [ok, failed]}
    tidied = tidy_cells(nb)
    assert [o["name"] for o in ok["outputs"]] == ["stdout", "stdout"]
    assert ok["outputs"][1]["text"] == "Loading weights: 100%|██████████| 47/47 [00:00<00:00, 3644.32it/s]\n"
    assert failed["outputs"][0]["name"] == "stderr"  # the diagnosis stays where it was
    assert list(tidied.messages) == [WARNING.splitlines()[0], KIT_WARNING.splitlines()[0]]
    assert tidied.messages[WARNING.splitlines()[0]] == ["In [3]"]
    assert tidied.kit_warnings == [KIT_WARNING.splitlines()[0]]


def test_machine_paths_are_written_relative_at_path_boundaries(tmp_path):
    run_dir = tmp_path / "runs" / "20261204T000000Z-20_hari_training-abc"
    run_dir.mkdir(parents=True)
    paths = MachinePaths.here(run_dir)
    site = sysconfig.get_paths()["purelib"]
    text = (
        f"run_dir = '{run_dir}'; {site}/tqdm/auto.py:21; {sys.prefix}/bin/python; {Path.home()}/.cache/x; "
        f"/tmpfs/y {tmp_path}/other"
    )
    shown = paths(text)
    assert f"run_dir = 'runs/{run_dir.name}'" in shown and "site-packages/tqdm/auto.py:21" in shown
    assert "~/.cache/x" in shown and "/tmpfs/y" in shown  # /tmpfs is not the temp dir
    for prefix in (str(Path.home()) + "/", "/tmp/", sys.prefix):
        assert prefix not in shown, (prefix, shown)


def test_the_report_file_gets_the_banner_first_and_the_warnings_last(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(
        json.dumps({"verdict": "ok", "headline": "all good", "verdict_lines": []})
    )
    title = {"cell_type": "markdown", "metadata": {}, "source": "# Title"}
    cell = _cell([_stream("stdout", f"run folder: {run_dir}\n"), _stream("stderr", KIT_WARNING)], 1)
    ipynb = run_dir / "report.ipynb"
    ipynb.write_text(
        json.dumps({"cells": [title, cell], "metadata": {"papermill": {"output_path": str(ipynb)}}})
    )
    tidy_report(ipynb, run_dir)
    nb = json.loads(ipynb.read_text())
    assert nb["cells"][0]["source"] == "# Title" and nb["cells"][1]["metadata"]["tags"] == ["dsr1kit-banner"]
    assert "Verdict: OK" in nb["cells"][1]["source"] and "tokenizer has 9 tokens" in nb["cells"][1]["source"]
    assert nb["cells"][-1]["metadata"]["tags"] == ["dsr1kit-warnings"] and len(nb["cells"]) == 4
    assert str(tmp_path) not in ipynb.read_text() and "run folder: runs/r1" in ipynb.read_text()
