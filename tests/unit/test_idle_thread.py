"""idle_thread.py: which CPUs an idle store thread may use (connector/vllm/idle_thread.py).

Its package imports torch and vLLM: run in vLLM's venv by tests/e2e/test_torch_unit_tests.py; the thread's
policy and cores are checked in test_in_flight.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.vllm.idle_thread import parse_cpu_list, usable_cpus  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "cpus"), [("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set())]
)
def test_kernel_cpu_lists_parse(text: str, cpus: set[int]):
    assert parse_cpu_list(text) == cpus


def test_the_cgroups_cpus_come_first_then_the_online_ones(tmp_path):
    cgroup, online = tmp_path / "cpuset.cpus.effective", tmp_path / "online"
    online.write_text("0-7\n")
    assert usable_cpus((str(cgroup), str(online))) == set(range(8))  # no cgroup file: the online CPUs
    cgroup.write_text("2-3\n")
    assert usable_cpus((str(cgroup), str(online))) == {2, 3}
    cgroup.write_text("garbage\n")
    assert usable_cpus((str(cgroup), str(online))) == set(range(8))  # unreadable: the next
    assert usable_cpus((str(tmp_path / "none"),)) == set()
