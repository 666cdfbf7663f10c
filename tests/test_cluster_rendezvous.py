"""Ranks and rendezvous come from one parser for the report (which rank writes) and training (who joins)."""

from __future__ import annotations

import pytest

from dsr1kit.cluster.rendezvous import process_ranks
from dsr1kit.run.report import process_rank
from dsr1kit.train.dist import from_env

SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "19242",
}
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.0.0.9",
    "MASTER_PORT": "29511",
}


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, (0, 1, 0, "single")),
        (SRUN, (1, 2, 0, "slurm")),
        ({**SRUN, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, (0, 1, 0, "single")),  # the batch step itself
        ({**SRUN, **TORCHRUN}, (3, 4, 1, "torchrun")),  # torchrun inside sbatch
        ({"RANK": "2"}, (0, 1, 0, "single")),  # RANK alone: not a launcher
    ],
)
def test_one_parser_for_report_and_training(env, expected):
    assert process_ranks(env) == expected
    assert process_rank(env) == expected[0]
    info = from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == expected


def test_rendezvous_from_the_prelude_wins():
    info = from_env(SRUN)
    assert (info.master_addr, info.master_port) == ("10.0.0.7", 19242)
    info = from_env({**SRUN, **TORCHRUN})
    assert (info.master_addr, info.master_port) == ("10.0.0.9", 29511)


def test_without_the_prelude_srun_ranks_meet_at_the_jobs_first_host_and_port():
    env = {k: v for k, v in SRUN.items() if not k.startswith("MASTER_")} | {"SLURM_JOB_NODELIST": "localhost"}
    info = from_env(env)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 15000 + 4242 % 10000)
