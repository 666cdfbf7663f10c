"""Node checks, network interface, all-reduce and gathering of per-rank rows."""

from __future__ import annotations

import ipaddress

import pytest
from slurm_cluster import slurm  # noqa: F401  (session fixture)

from dsr1kit import params as P
from dsr1kit.cluster import allreduce, checks, net, rank_check
from dsr1kit.cluster.rendezvous import free_port
from dsr1kit.steps.cluster_check import rank_check_config


def _iface(name: str, cidr: str | None) -> net.Interface:
    if cidr is None:
        return net.Interface(name, None, None, True)
    i = ipaddress.IPv4Interface(cidr)
    return net.Interface(name, str(i.ip), i.network, True)


IFACES = {
    "lo": _iface("lo", "127.0.0.1/8"),
    "eth0": _iface("eth0", "10.1.0.5/16"),
    "ib0": _iface("ib0", "10.9.0.5/16"),
    "docker0": _iface("docker0", "172.17.0.1/16"),
}
NO_IB = {k: v for k, v in IFACES.items() if k != "ib0"}


# -- network -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,names,chosen",
    [
        ("ib0", ["lo", "eth0", "ib0"], ["ib0"]),
        ("^lo,docker0", ["lo", "docker0", "eth0", "ib0"], ["ib0", "eth0"]),  # NCCL prefers ib*
        ("eth", ["eth0", "eth1", "ib0"], ["eth0", "eth1"]),  # prefixes
        ("=eth0", ["eth0", "eth01"], ["eth0"]),  # exact
        ("ib0", ["lo", "eth0"], []),
    ],
)
def test_nccl_socket_ifname_selects_like_nccl(spec, names, chosen):
    assert net.nccl_matches(spec, names) == chosen


def test_interface_that_does_not_exist_fails_with_fix():
    row = net.check_interface(True, False, {"NCCL_SOCKET_IFNAME": "ib9"}, IFACES)
    assert row.status == "fail" and "ib9" in row.measured and "^lo,docker0" in row.fix


def test_infiniband_is_picked_and_passes():
    row = net.check_interface(True, False, {"NCCL_SOCKET_IFNAME": "^lo,docker0"}, IFACES)
    assert (row.status, row.measured.split()[0]) == ("pass", "ib0")


def test_gpu_run_without_infiniband_warns():
    row = net.check_interface(True, False, {"NCCL_SOCKET_IFNAME": "^lo,docker0"}, NO_IB)
    assert row.status == "warn" and "no ib*" in row.measured and "ibstat" in row.fix


def test_loopback_across_hosts_fails():
    row = net.check_interface(False, False, {"GLOO_SOCKET_IFNAME": "lo"}, IFACES)
    assert row.status == "fail" and "^lo,docker0" in row.fix


def test_this_machine_has_an_interface_for_collectives():
    assert net.check_interface(False, False, {}).status == "pass"  # the real interfaces here


@pytest.mark.parametrize(
    "ip,env,status",
    [
        ("10.9.0.5", {"GLOO_SOCKET_IFNAME": "ib0"}, "pass"),
        ("10.1.0.5", {"GLOO_SOCKET_IFNAME": "ib0"}, "warn"),  # Ray on Ethernet, NCCL on IB
        ("127.0.0.3", {"GLOO_SOCKET_IFNAME": "lo"}, "pass"),  # loopback alias on one host
        ("192.0.2.77", {"GLOO_SOCKET_IFNAME": "ib0"}, "fail"),  # not this node's address
    ],
)
def test_advertised_ip_must_be_on_the_collectives_interface(ip, env, status):
    row = net.check_advertised_ip(ip, env, IFACES)
    assert row.status == status, row
    if status != "pass":
        assert row.fix


def test_host_resolution_fails_naming_the_unknown_node(slurm):
    row = net.check_resolution(["localhost", "nowhere-node.invalid"], env=slurm.env)
    assert row.status == "fail" and "nowhere-node.invalid" in row.measured and "/etc/hosts" in row.fix


def test_node_known_only_to_slurm_warns(slurm):
    row = net.check_resolution(["localhost", "n2"], env=slurm.env)
    assert row.status == "warn" and "n2→127.0.0.1" in row.measured and "DNS" in row.fix


# -- node checks -------------------------------------------------------------------------------
def test_shm_below_threshold_fails_with_cleanup_hint():
    row = checks.check_shm(1e6)[0]
    assert row.status == "fail" and "rm -rf /dev/shm/ray*" in row.fix and "shm_min_free_gib" in row.fix


def test_missing_scratch_dir_fails_with_fix(tmp_path):
    row = checks.check_scratch(str(tmp_path / "nvme"), 1.0)
    assert row.status == "fail" and "does not exist" in row.measured and "mkdir -p" in row.fix


# -- all-reduce ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,factor", [(1, 0.0), (2, 1.0), (8, 1.75), (16, 1.875)])
def test_bus_bandwidth_factor_is_2_n_minus_1_over_n(n, factor):
    assert allreduce.bus_factor(n) == factor


@pytest.mark.parametrize("busbw,status", [(45.0, "pass"), (25.0, "warn"), (10.0, "fail")])
def test_bus_bandwidth_is_judged_against_the_expected_figure(busbw, status):
    result = {
        "backend": "nccl",
        "world_size": 16,
        "rank": 0,
        "results": [
            {"size_mib": 16, "busbw_gbps": busbw / 4, "correct": True},
            {"size_mib": 1024, "busbw_gbps": busbw, "correct": True},
        ],
    }
    row = allreduce.bandwidth_row(result, 40)
    assert row.status == status and f"{busbw:.2f} GB/s at 1024 MiB" in row.measured
    assert ("NET/IB" in row.fix) == (status != "pass")


def test_rank_that_nobody_joins_reports_an_error_instead_of_hanging():
    result = allreduce.run(1, 2, f"tcp://127.0.0.1:{free_port()}", [1], timeout_s=3)
    row = allreduce.correctness_row(result)
    assert row.status == "fail" and "rank 1/2" in row.measured and "MASTER_ADDR" in row.fix


def test_local_ranks_sum_correctly_and_measure_bandwidth(tmp_path):
    p = P.load("00_cluster_check", ["params/tiny/00_cluster_check.yaml"], {"allreduce_sizes_mib": [0.5]})
    ranks = checks.load_ranks(rank_check.run_local(rank_check_config(p), tmp_path, world_size=2))
    assert [r["rank"] for r in ranks] == [0, 1]
    rows = checks.gathered_rows(ranks, expected_nodes=1)
    assert [r.status for r in rows if r.name == "all-reduce"] == ["pass", "pass"]
    result = checks.bandwidth_results(ranks)
    assert (
        result["backend"] == "gloo" and result["world_size"] == 2 and result["results"][0]["busbw_gbps"] > 0
    )


# -- gathering ------------------------------------------------------------------------------------
def _rank(rank: int, world: int, node: str, gpus: list | None = None) -> dict:
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": 0,
        "node": node,
        "node_ip": None,
        "gpus": gpus or [],
        "allreduce": {},
        "rows": [],
    }


def test_missing_rank_is_a_failing_row_naming_it():
    rows = checks.gathered_rows([_rank(0, 3, "n1"), _rank(2, 3, "n3")], expected_nodes=3)
    row = next(r for r in rows if r.name == "ranks reported")
    assert row.status == "fail" and "missing 1" in row.measured and "%x-%j.out" in row.fix


def test_fewer_nodes_than_expected_fails_with_the_sbatch_option():
    row = next(r for r in checks.gathered_rows([_rank(0, 1, "n1")], expected_nodes=2) if r.name == "nodes")
    assert row.status == "fail" and "sbatch -N 2" in row.fix


def test_different_gpus_across_nodes_fail():
    h100 = [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1}] * 8
    a100 = [{"name": "NVIDIA A100-SXM4-80GB", "memory_gib": 79.2}] * 8
    rows = checks.gathered_rows([_rank(0, 2, "n1", h100), _rank(1, 2, "n2", a100)], expected_nodes=2)
    row = next(r for r in rows if r.name == "gpu inventory across nodes")
    assert row.status == "fail" and "A100" in row.measured and "--constraint" in row.fix
