"""Bad input as a new user types it: each case gets its exact message and exit status, never a traceback,
and nothing already done is lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli

from dsr1kit import params as P
from dsr1kit.train import checkpoint, loop

SENTINEL = "hf_" + "Sentinel0123456789abcdefXYZ"


def _files(tmp: Path) -> dict[str, Path]:
    """Bad parameter files, written fresh for each case."""
    out = {
        "syntax": "lr: 0.1\nbatch_size: [1, 2\n",
        "intkey": "3: four\n",
        "list": "- a\n- b\n",
        "nested_secret": f"server_env:\n  HF_TOKEN: {SENTINEL}\n",
        "flag_secret": f"extra_args: [--api-key, {SENTINEL}]\n",
        "empty_adapter": "adapter_dir: ''\n",
    }
    paths = {}
    for name, text in out.items():
        paths[name] = tmp / f"{name}.yaml"
        paths[name].write_text(text)
    return paths


# (case, argv with {name} for a bad file, exit status, the lines stderr must hold)
CASES = [
    (
        "unknown key",
        ["run", "notebooks/20_hari_training.ipynb", "-p", "learning_rate", "0.1"],
        2,
        [
            "error: invalid parameters for 20_hari_training:",
            "  - unknown key 'learning_rate'; valid keys: run_dir, seed, model, dataset, sample_limit,",
        ],
    ),
    (
        "wrong type",
        ["run", "notebooks/20_hari_training.ipynb", "-p", "batch_size", "four"],
        2,
        ["  - 'batch_size': value 'four' (str) is not a valid int: Input should be a valid integer"],
    ),
    (
        "missing params file",
        ["run", "notebooks/20_hari_training.ipynb", "-f", "params/tiny/20_hari.yaml"],
        2,
        [
            "error: invalid parameters for 20_hari.yaml:",
            "  - parameter file not found: params/tiny/20_hari.yaml; in params/tiny: 00_cluster_check.yaml, "
            "10_vllm_inference.yaml, 20_hari_training.yaml, 30_adapter_inspection.yaml",
        ],
    ),
    (
        "YAML syntax error",
        ["run", "notebooks/20_hari_training.ipynb", "-f", "{syntax}"],
        2,
        [
            "error: invalid parameters for syntax.yaml:",
            "syntax.yaml: line 3, column 1: not valid YAML (expected ',' "
            "or ']', but got '<stream end>'); each line is `key: value`",
        ],
    ),
    (
        "non-string key",
        ["run", "notebooks/20_hari_training.ipynb", "-f", "{intkey}"],
        2,
        [
            "  - key 3 (int) is not a parameter name: keys are words such as 'lr'; quote it in YAML if it is one"
        ],
    ),
    (
        "YAML list",
        ["run", "notebooks/20_hari_training.ipynb", "-f", "{list}"],
        2,
        ["list.yaml must hold a mapping of key: value, got list"],
    ),
    (
        "missing notebook",
        ["run", "notebooks/99_nothing.ipynb"],
        2,
        [
            "error: notebook not found: notebooks/99_nothing.ipynb; the kit's notebooks: "
            "notebooks/00_cluster_check.ipynb, "
            "notebooks/10_vllm_inference.ipynb, notebooks/20_hari_training.ipynb, notebooks/30_adapter_inspection.ipynb"
        ],
    ),
    (
        "secret in a dict parameter",
        ["run", "notebooks/10_vllm_inference.ipynb", "-f", "{nested_secret}"],
        2,
        [
            "  - 'server_env.HF_TOKEN' looks like a secret: secrets are never parameters "
            "(they would be written into the "
            "report and params.yaml); remove it and export it in the environment instead, e.g. `export HF_TOKEN=...` "
            "(servers and ranks inherit the environment)"
        ],
    ),
    (
        "secret after a flag in a list",
        ["run", "notebooks/10_vllm_inference.ipynb", "-f", "{flag_secret}"],
        2,
        ["  - the value of 'extra_args[1]' looks like a secret:"],
    ),
    (
        "secret as an override",
        ["run", "notebooks/10_vllm_inference.ipynb", "-p", "extra_args", f"[--api-key={SENTINEL}]"],
        2,
        ["  - the value of 'extra_args[0]' looks like a secret:"],
    ),
    (
        "empty adapter_dir",
        ["run", "notebooks/30_adapter_inspection.ipynb", "-f", "{empty_adapter}"],
        2,
        [
            "  - 'adapter_dir': value '' (str) is not a valid str: Value error, empty: give an adapter folder, or "
            "'latest' for the newest HARI run's adapter"
        ],
    ),
    (
        "plan: missing file",
        ["plan", "params/r1-671b-2x8h100/20_hari.yaml"],
        2,
        ["  - parameter file not found: params/r1-671b-2x8h100/20_hari.yaml; in params/r1-671b-2x8h100: "],
    ),
    (
        "plan: YAML syntax error",
        ["plan", "{syntax}", "--notebook", "20_hari_training"],
        2,
        ["syntax.yaml: line 3, column 1: not valid YAML"],
    ),
]


@pytest.mark.parametrize("case,argv,status,lines", CASES, ids=[c[0] for c in CASES])
def test_cli_bad_input(case, argv, status, lines, tmp_path):
    files = _files(tmp_path)
    runs = tmp_path / "runs"
    args = [a.format(**files) for a in argv] + (["--runs-dir", str(runs)] if argv[0] == "run" else [])
    proc = run_cli(*args, timeout=120)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    for line in lines:
        assert line in proc.stderr, f"{line!r} not in:\n{proc.stderr}"
    assert SENTINEL not in proc.stderr + proc.stdout  # an error never echoes the secret
    assert not runs.exists()  # refused before any run folder is made


def test_demo_refuses_a_missing_notebook_instead_of_a_shorter_demo(tmp_path):
    proc = run_cli(
        "demo", "--notebooks-dir", str(tmp_path), "--runs-dir", str(tmp_path / "runs"), timeout=120
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"error: {tmp_path}/00_cluster_check.ipynb is missing (restore it: git checkout -- " in proc.stderr
    assert proc.stdout.count("MISSING") == 4


def test_runs_lists_a_run_whose_status_is_corrupt(tmp_path):
    for name, text in [
        ("20261201T000000Z-20_hari_training-aaaaaa", '{"status": "ok", "notebook": "20"}'),
        ("20261201T000001Z-10_vllm_inference-bbbbbb", '{"status": "ok", '),
        ("20261201T000002Z-30_adapter_inspection-cccccc", "[1, 2]"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "status.json").write_text(text)
    proc = run_cli("runs", "--runs-dir", str(tmp_path))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    rows = proc.stdout.splitlines()[2:]
    assert len(rows) == 3
    assert "unreadable" in rows[1] and "status.json: Expecting" in rows[1]
    assert "unreadable" in rows[2] and "status.json: holds a list, not an object" in rows[2]


# -- training: a changed config never mixes with the checkpoint in the run folder -------------------------
def _checkpoint(run_dir: Path, **changes) -> Path:
    p = P.load("20_hari_training", overrides={"run_dir": str(run_dir), **changes})
    return checkpoint.save(run_dir, 3, {"trainable": {}, "params": p.to_dict(), "progress": {"step": 3}})


def test_resume_with_other_parameters_names_every_difference(tmp_path):
    saved = _checkpoint(tmp_path, lr=0.02, lora_r=8)
    now = P.load("20_hari_training", overrides={"run_dir": str(tmp_path), "save_every": 5, "log_every": 1})
    with pytest.raises(checkpoint.ResumeMismatch) as err:
        checkpoint.check_resumable(tmp_path, now.to_dict())
    assert str(err.value) == (
        f"{saved} was written with other parameters: lora_r: 8 → 4; lr: 0.02 → 0.01. Resuming would mix two "
        f"runs. Start a new run folder (run_dir '' or another --run-dir), or put the old values back to resume "
        f"(the checkpoint stays as it is)"
    )
    assert (saved / "state.pt").is_file()  # nothing lost
    again = P.load(
        "20_hari_training",
        overrides={
            "run_dir": str(tmp_path),
            "lr": 0.02,
            "lora_r": 8,
            "save_every": 5,
            "device_map": "contiguous",
        },
    )
    assert checkpoint.check_resumable(tmp_path, again.to_dict()) == saved / "state.pt"


def test_resume_mismatch_stops_python_m_train_before_loading(tmp_path):
    _checkpoint(tmp_path, lr=0.02)
    proc = subprocess.run(
        [sys.executable, "-m", "dsr1kit", "train", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "was written with other parameters: lr: 0.02 → 0.01." in proc.stderr


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.9}\n{"step": 6, "lo')  # killed mid-write
    assert [r["step"] for r in loop.read_metric_lines(path)] == [2, 4]
    loop._truncate_metrics(path, 4)
    assert path.read_text() == '{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.9}\n'


def test_cuda_without_bitsandbytes_is_an_error_not_another_optimizer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when it is not installed
    with pytest.raises(
        loop.OptimizerUnavailable, match=r"HARI's GPU optimizer is PagedAdamW8bit. Install it"
    ):
        loop.make_optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3)


def test_a_broken_source_stops_python_m_train(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsr1kit",
            "train",
            "--run-dir",
            str(tmp_path / "run"),
            "-p",
            "dataset",
            f"data/sft_tiny.jsonl,{tmp_path}/gone.jsonl",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"error: the dataset plan has sources that cannot be read (training on the rest would silently use "
        f"part of the data): {tmp_path}/gone.jsonl@train: FileNotFoundError: local file"
    ) in proc.stderr


@pytest.mark.parametrize(
    "shape",
    [
        {"hf_token": SENTINEL},
        {"model": SENTINEL},
        {"server_env": {"HF_TOKEN": "short"}},
        {"server_env": {"X": SENTINEL}},
        {"extra_args": ["--api-key", "short"]},
        {"extra_args": [f"--hf-token={SENTINEL}"]},
        {"extra_args": ["--x", SENTINEL]},
    ],
    ids=lambda s: json.dumps(s)[:40],
)
def test_a_secret_in_any_parameter_shape_is_refused(shape):
    with pytest.raises(P.ParamsError) as err:
        P.load("10_vllm_inference", overrides=shape)
    assert "looks like a secret" in str(err.value) and SENTINEL not in str(err.value)


@pytest.mark.parametrize(
    "shape",
    [
        {"extra_args": ["--tokenizer", "org/tok", "--max-num-batched-tokens", "64"]},
        {"server_env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        {"max_new_tokens": 8},
    ],
    ids=lambda s: json.dumps(s)[:40],
)
def test_token_words_that_are_not_secrets_pass(shape):
    P.load("10_vllm_inference", overrides=shape)


# -- bad adapters: the notebook stops in its first cell with the cause, before any model or server loads ----
def _adapters(tmp: Path) -> dict[str, Path]:
    empty = tmp / "empty"
    empty.mkdir()
    torn = tmp / "torn"
    torn.mkdir()
    (torn / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (torn / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00")
    return {"empty": empty, "torn": torn}


ADAPTER_CASES = [
    (
        "30: not an adapter",
        "30_adapter_inspection",
        "adapter_dir",
        "{empty}",
        "(AdapterError: {empty} is not a PEFT adapter: adapter_config.json is missing (an adapter folder holds "
        "adapter_config.json and adapter_model.safetensors))",
    ),
    (
        "30: truncated weights",
        "30_adapter_inspection",
        "adapter_dir",
        "{torn}",
        "(AdapterError: {torn}/adapter_model.safetensors is truncated or corrupt (",
    ),
    (
        "30: no adapter yet",
        "30_adapter_inspection",
        "adapter_dir",
        "latest",
        "(AdapterError: no HARI adapter under {runs}: run notebook 20 first or set adapter_dir)",
    ),
    (
        "10: not an adapter",
        "10_vllm_inference",
        "lora_adapter",
        "{empty}",
        "(FileNotFoundError: lora_adapter '{empty}' has no adapter_config.json; point it at the folder written by "
        "the HARI run (adapter_model.safetensors + adapter_config.json))",
    ),
]


@pytest.mark.parametrize("case,notebook,key,value,message", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_bad_adapter_stops_the_first_cell_with_its_cause(case, notebook, key, value, message, tmp_path):
    runs = tmp_path / "runs"
    names = {**_adapters(tmp_path), "runs": runs}
    proc = run_cli(
        "run",
        f"notebooks/{notebook}.ipynb",
        "-p",
        key,
        value.format(**names),
        "--runs-dir",
        str(runs),
        "-q",
        timeout=300,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: {notebook} failed in cell " in proc.stderr
    assert message.format(**names) in proc.stderr, proc.stderr[-2000:]
    (run_dir,) = runs.iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "steps.begin" in status["failed_cell"]["source"]  # the first cell
    assert not (run_dir / "logs").exists()  # no server was started


def test_an_eval_set_no_adapter_reads_is_refused_before_any_run_folder(tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"text": "q", "label": 1}) + "\n")
    runs = tmp_path / "runs"
    proc = run_cli(
        "run", "notebooks/10_vllm_inference.ipynb", "-p", "eval_dataset", str(bad), "--runs-dir", str(runs)
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: eval_dataset {bad}: no benchmark adapter reads columns ['label', 'text']. Known: HLE" in (
        proc.stderr
    )
    assert not runs.exists()  # no run folder, no server
