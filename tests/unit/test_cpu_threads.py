"""CPU thread count from the cgroup quota (a pod's limits.cpu), not only the affinity mask."""

from phasesplit.runtime.engine.model_runner import _cgroup_cpu_quota


def test_cgroup_cpu_quota_v1_and_v2(tmp_path) -> None:
    assert _cgroup_cpu_quota(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) is None  # v1 unlimited
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) is None  # v2 wins: unlimited
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path)) == 2.5
