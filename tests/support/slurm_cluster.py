"""A real Slurm cluster on this machine, for tests: a login host and compute nodes, each in a network namespace.

    cluster = SlurmCluster(tmp_path, nodes=2).start()
    subprocess.run(cluster.on_login(["sbatch", "job.sh"]), env=cluster.env(), ...)
    cluster.stop()

Debian's slurm-wlm (slurmctld, slurmd, sbatch, squeue, ...) and munge do the work; nothing is imitated. Each host is
a network namespace with an address of its own on a bridge (10.77.0.1 = login, .2, .3 ... = n1, n2 ...), its own
hostname (a UTS namespace) and its own /etc/hosts (ip-netns bind-mounts /etc/netns/<ns>/hosts), so that Monarch,
which refuses a host whose name resolves to a loopback address, sees real separate hosts. Each compute node also has a
/dev/shm of its own (a directory of this machine's, `shm(node)`, bind-mounted over /dev/shm in its mount namespace), as
separate machines do: what one node leaves in shared memory only that node can see or clean; the login host keeps
this machine's. Processes are not isolated (one pid namespace): /proc shows every host's. slurmctld and the
controller of a test's run live on the login host; each slurmd on its node, and every job step it starts inherits
the node's namespaces. munged runs with a key and socket of the cluster's own; the whole thing is torn down by
stop(), which also removes the namespaces, the bridge and /etc/netns/<ns>.

Needs root (namespaces, a bridge) and the packages slurm-wlm, munge and iproute2; `missing()` says what is absent.
"""

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.77.0"
BRIDGE = "forge-br0"
PACKAGES = {
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "munged": "munge",
    "ip": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}


def missing() -> str | None:
    """Why a cluster cannot be made here, or None."""
    absent = sorted({pkg for exe, pkg in PACKAGES.items() if shutil.which(exe) is None})
    if absent:
        return (
            f"Debian packages {', '.join(absent)} are not installed (`apt-get install -y {' '.join(absent)}`; "
            ".ci/run and `make setup-slurm` install them)"
        )
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (network namespaces, a bridge, daemons run as root)"
    probe = subprocess.run(["ip", "netns", "add", "forge-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not available here: `ip netns add` said {probe.stderr.strip()!r}"
    subprocess.run(["ip", "netns", "del", "forge-probe"], capture_output=True)
    return None


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int | None = None):
        self.root = Path(root)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.hosts = {"login": f"{SUBNET}.1", **{n: f"{SUBNET}.{i + 2}" for i, n in enumerate(self.nodes)}}
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._daemons: list[subprocess.Popen] = []

    # --- running things on a host -------------------------------------------------------------------------------
    @staticmethod
    def netns(host: str) -> str:
        return f"forge-{host}"

    def on(self, host: str, argv: list[str]) -> list[str]:
        """argv run on `host`: inside its network namespace, with its hostname, /etc/hosts and (a node) /dev/shm."""
        # nsenter, not `ip netns exec`: that remounts /sys, which hides the cgroup hierarchy slurmd needs
        hosts = f"/etc/netns/{self.netns(host)}/hosts"
        shm = f" && mount --bind {self.shm(host)} /dev/shm" if host in self.nodes else ""
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns(host)}",
            "unshare",
            "--mount",
            "--uts",
            "--",
            "sh",
            "-c",
            f'mount --bind {hosts} /etc/hosts{shm} && hostname {host} && exec "$@"',
            "sh",
            *argv,
        ]

    @staticmethod
    def shm(node: str) -> Path:
        """Where `node`'s /dev/shm lies on this machine (a tmpfs directory; inside the node it is /dev/shm)."""
        return Path(f"/dev/shm/forge-slurm-{node}")

    def on_login(self, argv: list[str]) -> list[str]:
        return self.on("login", argv)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands and anything started through them."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        try:
            self._network()
            self._munge()
            self._write_conf()
            self._daemon("login", ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for node in self.nodes:
                self._daemon(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons.clear()
        # job steps that outlived their slurmd (they share its namespace): nothing of the cluster may survive it
        for i, host in enumerate(self.hosts):
            subprocess.run(["ip", "link", "del", f"forge-v{i}"], capture_output=True)
            pids = subprocess.run(["ip", "netns", "pids", self.netns(host)], capture_output=True, text=True).stdout
            for pid in pids.split():
                with _suppress():
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", self.netns(host)], capture_output=True)
            shutil.rmtree(f"/etc/netns/{self.netns(host)}", ignore_errors=True)
            if host in self.nodes:
                shutil.rmtree(self.shm(host), ignore_errors=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- pieces ---------------------------------------------------------------------------------------------------
    def _network(self) -> None:
        self.stop()  # what a killed test left behind
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE])  # this host reaches the cluster too
        _run(["ip", "link", "set", BRIDGE, "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in self.hosts.items())
        for i, (host, ip) in enumerate(self.hosts.items()):
            ns, outer, inner = self.netns(host), f"forge-v{i}", f"forge-i{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", BRIDGE])
            _run(["ip", "link", "set", outer, "up"])
            for cmd in (
                ["ip", "addr", "add", f"{ip}/24", "dev", inner],
                ["ip", "link", "set", inner, "up"],
                ["ip", "link", "set", "lo", "up"],
            ):
                _run(["ip", "netns", "exec", ns, *cmd])
            etc = Path(f"/etc/netns/{ns}")
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            if host in self.nodes:
                self.shm(host).mkdir(mode=0o1777)
                self.shm(host).chmod(0o1777)  # as /dev/shm (mkdir's mode is masked by the umask)

    def _munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        self._daemon(
            None,
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={d}/munged.pid",
                f"--seed-file={d}/munged.seed",
                f"--log-file={d}/munged.log",
            ],
            "munged",
        )
        _wait(lambda: self.munge_socket.exists(), 20, "munged did not create its socket", lambda: self.log("munged"))

    def _write_conf(self) -> None:
        for d in ("state", *[f"spool/{n}" for n in self.nodes]):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.hosts[n]} CPUs={self.cpus} State=UNKNOWN" for n in self.nodes)
        # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
        self.conf.write_text(f"""\
ClusterName=forge-test
SlurmctldHost=login({self.hosts["login"]})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
KillWait=10
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, host: str | None, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "ab")
        cmd = argv if host is None else self.on(host, argv)
        self._daemons.append(
            subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                start_new_session=True,
            )
        )
        log.close()

    def _wait_idle(self, timeout_s: float) -> None:
        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env())
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            return all(states.get(n) == "idle" for n in self.nodes)

        _wait(
            idle,
            timeout_s,
            "the Slurm nodes did not come up idle",
            lambda: "\n".join(self.log(n)[-2000:] for n in ("slurmctld", *[f"slurmd-{n}" for n in self.nodes])),
        )


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


def _wait(ready, timeout_s: float, what: str, logs=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} within {timeout_s:.0f} s\n{logs()}")


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, ValueError))


if __name__ == "__main__":  # a cluster to try things by hand: python -m tests.support.slurm_cluster /tmp/slurm [NODES]
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    root, nodes = (
        Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/forge-slurm"),
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
    )
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root, nodes).start()
    print(f"up: SLURM_CONF={cluster.conf}; login shell: {' '.join(cluster.on_login(['bash']))}; Ctrl-C stops it")
    try:
        signal.pause()
    finally:
        cluster.stop()
