"""lm-evaluation-harness against the served model: the field's own harness, run as its command line
(``python -m lm_eval run``) on the server notebook 10 started, so its numbers are lm-eval's numbers.

Generative tasks go through ``local-chat-completions`` (the server applies the model's chat template; R1's
reasoning is cut at ``</think>`` before lm-eval's filters see it), log-likelihood tasks through
``local-completions``. lm-eval's request cache lives in the run folder, so a rerun asks nothing twice; its
samples and results are kept there too, and its log in ``logs/lm_eval-<model>.log``. A task given as a path
(a YAML file, e.g. over a local jsonl) is found through ``--include_path``; a name is one of lm-eval's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..run.paths import PROJECT_ROOT, resolve
from . import auth

CHAT, COMPLETIONS = "local-chat-completions", "local-completions"


class HarnessError(RuntimeError):
    """lm-eval failed, or a task it was given does not exist; the log's tail says why."""


@dataclass(frozen=True)
class HarnessConfig:
    """How lm-eval is run: built from notebook 10's parameters by the step."""

    tasks: tuple[str, ...]  # lm-eval task names, or paths of task YAML files
    model_type: str  # CHAT or COMPLETIONS
    num_concurrent: int
    max_retries: int
    timeout_s: float
    system_prompt: str
    think_end_token: str  # "" when the model does not reason in <think>…</think>
    tokenizer: str  # the served model's folder (local-completions tokenizes with it)
    key_env: str = ""  # the environment variable holding the served model's key ('' for none); never the key
    extra_args: tuple[str, ...] = ()  # verbatim, e.g. ("--limit", "50", "--num_fewshot", "5")
    gen_kwargs: tuple[str, ...] = ()  # the evaluation's sampling ("temperature=0.6", "top_p=0.95"); () greedy


def task_names(tasks: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the names lm-eval is asked for, the folders to include): a YAML path is read for its ``task`` name."""
    import yaml

    names, folders = [], []
    for task in tasks:
        path = resolve(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise HarnessError(f"lm_eval_tasks: {task} does not exist")
            spec = yaml.safe_load(path.read_text()) or {}
            if not isinstance(spec, dict) or "task" not in spec:
                raise HarnessError(f"lm_eval_tasks: {task} has no 'task' name")
            names.append(str(spec["task"]))
            folders.append(str(path.parent))
        else:
            names.append(task)
    return names, sorted(set(folders))


def check_tasks(tasks: tuple[str, ...]) -> None:
    """Every task is one lm-eval knows (its own, or a YAML given): raise HarnessError naming the unknown."""
    from lm_eval.tasks import TaskManager

    names, folders = task_names(tasks)
    manager = TaskManager(include_path=folders or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise HarnessError(
            f"lm_eval_tasks: lm-eval knows no task {', '.join(map(repr, unknown))} "
            f"(`python -m lm_eval ls tasks` lists its {len(manager.all_tasks)} tasks; a local task is a YAML path)"
        )


def command(config: HarnessConfig, base_url: str, served_name: str, out_dir: Path) -> list[str]:
    """The ``lm_eval run`` command line for one served model (no key in it: lm-eval reads it from its env)."""
    names, folders = task_names(config.tasks)
    endpoint = "/v1/chat/completions" if config.model_type == CHAT else "/v1/completions"
    model_args = {
        "model": served_name,
        "base_url": f"{base_url.rstrip('/')}{endpoint}",
        "num_concurrent": config.num_concurrent,
        "max_retries": config.max_retries,
        "timeout": int(config.timeout_s),
        "tokenized_requests": False,
    }
    if config.model_type == CHAT:
        model_args["think_end_token"] = config.think_end_token or None
    else:
        model_args["tokenizer"] = config.tokenizer
        model_args["tokenizer_backend"] = "huggingface"
    model_args = {k: v for k, v in model_args.items() if v is not None}
    cmd = [
        sys.executable, "-m", "lm_eval", "run",
        "--model", config.model_type,
        "--model_args", json.dumps(model_args),
        "--tasks", ",".join(names),
        "--output_path", str(out_dir),
        "--use_cache", str(out_dir / "cache" / "requests"),
        "--log_samples",
    ]  # fmt: skip
    for folder in folders:
        cmd += ["--include_path", folder]
    if config.model_type == CHAT:
        cmd.append("--apply_chat_template")
        if config.system_prompt:
            cmd += ["--system_instruction", config.system_prompt]
    if config.gen_kwargs and "--gen_kwargs" not in config.extra_args:  # lm_eval_args' own --gen_kwargs wins
        cmd += ["--gen_kwargs", *config.gen_kwargs]
    return cmd + list(config.extra_args)


def harness_dir(run_dir: str | Path, label: str) -> Path:
    return Path(run_dir) / "lm_eval" / label


def run(
    config: HarnessConfig, base_url: str, served_name: str, run_dir: str | Path, label: str
) -> dict[str, Any]:
    """Run lm-eval on ``served_name`` at ``base_url``; return its results JSON (also kept in the run folder).
    The server's key reaches lm-eval in its environment (its ``OPENAI_API_KEY``), never its command line."""
    out = harness_dir(run_dir, label)
    out.mkdir(parents=True, exist_ok=True)
    log = Path(run_dir) / "logs" / f"lm_eval-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = command(config, base_url, served_name, out)
    with open(log, "a") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()
        proc = subprocess.run(
            cmd,
            cwd=PROJECT_ROOT,
            env=auth.harness_env(config.key_env, dict(os.environ)),
            stdout=sink,
            stderr=sink,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        refused = f" ({auth.refused_note(config.key_env)})" if "401" in tail else ""
        raise HarnessError(
            f"lm-eval failed for {label} (exit {proc.returncode}){refused}; {log} ends:\n{tail}"
        )
    return latest_results(out)


def latest_results(out: Path) -> dict[str, Any]:
    found = sorted(out.rglob("results_*.json"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise HarnessError(f"lm-eval wrote no results under {out}")
    return json.loads(found[-1].read_text())


def results_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """lm-eval's results table: one row per task, filter and metric, with its stderr."""
    rows = []
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in sorted(metrics.items()):
            # metrics are "metric,filter"; "alias", "name", "sample_len" (lm-eval 0.4.13) are not
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(
                {
                    "task": task,
                    "filter": filt,
                    "metric": metric,
                    "value": value,
                    "stderr": stderr if isinstance(stderr, (int, float)) and stderr == stderr else None,
                    "n": results.get("n-samples", {}).get(task, {}).get("effective"),
                }
            )
    return rows
