"""A Ray cluster owned by a bench process, for benches that start cluster front ends (relay_bench, engine_bench).

The bench starts Ray in its own process (loopback, a short temporary directory, no dashboard, no usage report),
hands its GCS address to every ``serve --cluster ADDRESS`` front end it starts, and at exit kills the replicas
(named, detached: they would outlive the driver) and stops Ray. Never ``ray stop``: that would end every Ray
on the machine, other people's included.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

# Ray on loopback, no usage report, no token (a bench on one machine); set before Ray is imported.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}


class LocalRay:
    def __init__(self, num_cpus: float, object_store_mb: int = 200) -> None:
        os.environ.update(RAY_ENV)
        import ray

        self._temp = tempfile.mkdtemp(prefix="mrb", dir="/tmp")  # short: Ray's socket paths live under it
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            namespace="moss_rt",
            _temp_dir=self._temp,
            logging_level="WARNING",
            object_store_memory=object_store_mb * 1024 * 1024,
        )
        self.address: str = ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        import ray

        from moss_rt.cluster.launch import REPLICA_PREFIX

        for i in range(64):
            try:
                ray.kill(ray.get_actor(f"{REPLICA_PREFIX}{i}", namespace="moss_rt"))
            except ValueError:  # no more replicas
                break
        ray.shutdown()
        shutil.rmtree(self._temp, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed): where a front end's time goes."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def per_replica(metrics_text: str, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``{replica: {"name{other labels}": value}}`` for the samples of ``names`` that carry a replica label."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        m = SAMPLE.match(line)
        if m is None or m["name"] not in names or not m["labels"]:
            continue
        labels = dict(part.split("=", 1) for part in m["labels"].split(","))
        replica = labels.pop("replica", None)
        if replica is None:
            continue
        rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        key = f"{m['name']}{{{rest}}}" if rest else m["name"]
        row = out.setdefault(replica.strip('"'), {})
        row[key] = row.get(key, 0.0) + float(m["value"])
    return out
