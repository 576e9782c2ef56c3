"""A throwaway ``redis-server`` on a free loopback port, and a throwaway Redis Cluster of
several such servers, for tests and benchmarks.

No persistence (``--save '' --appendonly no``), each server in its own temporary
directory, stopped on exit. Install the binary with ``scripts/ensure-redis.sh``.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import redis


class RedisServerMissing(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_BUS_OFFSET = 10000  # Redis Cluster listens for its peers on port + 10000
_claimed: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_port(tries: int = 500) -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too.

    Both lie below the kernel's ephemeral range and above Ray's worker ports (10002-19999), so
    neither another ``free_port()`` nor a connection's source port can take them between this
    call and the server's start; every pair handed out in this process is claimed, so two nodes
    of one cluster never get each other's bus port (they are all chosen before any starts)."""
    low, high = 20000, _ephemeral_low() - _BUS_OFFSET - 1
    for _ in range(tries):
        port = random.randint(low, high) if high > low else free_port()
        pair = {port, port + _BUS_OFFSET}
        if port + _BUS_OFFSET > 65535 or pair & _claimed or not all(_bindable(p) for p in pair):
            continue
        _claimed.update(pair)
        return port
    raise RuntimeError("no free loopback port pair for a cluster node")


class LocalRedis:
    """``with LocalRedis() as r: r.url`` — a private server; ``stop()``/``start()`` simulate
    an outage (the same port is reused)."""

    def __init__(self, port: int | None = None, startup_s: float = 10.0, extra_args: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerMissing("redis-server not found: run scripts/ensure-redis.sh")
        self.binary = binary
        self.port = port or free_port()
        self.startup_s = startup_s
        self.extra_args = tuple(extra_args)
        self._dir = tempfile.TemporaryDirectory(prefix="kvblend-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> LocalRedis:
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", self._dir.name, "--protected-mode", "yes", "--daemonize", "no", *self.extra_args]
        log = open(Path(self._dir.name) / "redis.log", "ab")
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.startup_s
        try:
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
            raise RuntimeError(f"redis-server did not answer within {self.startup_s} s")
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crashed machine: no goodbye to clients or cluster peers."""
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGKILL)
        self._proc.wait()
        self._proc = None

    def log_tail(self, n: int = 2000) -> str:
        path = Path(self._dir.name) / "redis.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRedisCluster:
    """``with LocalRedisCluster() as c: c.url`` — ``n`` cluster-enabled masters on free
    loopback ports, the 16384 slots split into ``n`` equal contiguous ranges (as
    ``redis-cli --cluster create`` does), each with ``replicas`` replicas (``replicas_of(i)``),
    ready when every node reports ``cluster_state:ok`` and every replica is in sync. Nodes run
    with ``cluster-require-full-coverage no`` and ``cluster-allow-reads-when-down yes``, as
    ``docs/deploy.md`` advises for a cache: a dead master without replicas takes only its
    own slots away. ``nodes[i].kill()`` crashes master i (a replica takes over after the
    node timeout); ``nodes[i].start()`` brings it back (its ``nodes.conf`` is kept), empty."""

    SLOTS = 16384

    def __init__(self, n: int = 3, node_timeout_ms: int = 1000, startup_s: float = 20.0, replicas: int = 0) -> None:
        if n < 1 or replicas < 0:
            raise ValueError("a cluster needs at least one master, and replicas >= 0")
        args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes", "--repl-diskless-sync-delay", "0")
        self.nodes = [LocalRedis(free_cluster_port(), startup_s=startup_s, extra_args=args) for _ in range(n)]
        self.replica_nodes = [LocalRedis(free_cluster_port(), startup_s=startup_s, extra_args=args)
                              for _ in range(n * replicas)]
        self.replicas = replicas
        self.startup_s = startup_s

    @property
    def url(self) -> str:
        """Every master's URL, comma-separated (the cluster tier's ``redis_url``)."""
        return ",".join(f"redis://127.0.0.1:{node.port}" for node in self.nodes)

    def slot_range(self, i: int) -> range:
        """The slots master ``i`` was given."""
        n = len(self.nodes)
        return range(i * self.SLOTS // n, (i + 1) * self.SLOTS // n)

    def replicas_of(self, i: int) -> list[LocalRedis]:
        return self.replica_nodes[i * self.replicas:(i + 1) * self.replicas]

    def start(self) -> LocalRedisCluster:
        everyone = [*self.nodes, *self.replica_nodes]
        for node in everyone:
            node.start()
        clients = [_client(node.port) for node in everyone]
        try:
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for i, client in enumerate(clients[:len(self.nodes)]):
                client.execute_command("CLUSTER", "ADDSLOTS", *self.slot_range(i))
            for node in everyone[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait(lambda: all(int(c.cluster("info")["cluster_known_nodes"]) == len(everyone) for c in clients))
            for i, master in enumerate(clients[:len(self.nodes)]):
                master_id = _text(master.execute_command("CLUSTER", "MYID"))
                for replica in self.replicas_of(i):
                    _client(replica.port).execute_command("CLUSTER", "REPLICATE", master_id)
            self.wait_ok()
        finally:
            for client in clients:
                client.close()
        return self

    def wait_ok(self) -> None:
        """Wait until every running node sees the whole cluster and reports it ok, and every
        running replica is in sync with its master."""
        everyone = [*self.nodes, *self.replica_nodes]
        clients = [_client(n.port) for n in everyone if n.pid]
        replicas = [_client(n.port) for n in self.replica_nodes if n.pid]

        def ok() -> bool:
            infos = [client.cluster("info") for client in clients]
            return all(str(i.get("cluster_state")) == "ok" and int(i.get("cluster_known_nodes", 0)) == len(everyone)
                       and int(i.get("cluster_slots_assigned", 0)) == self.SLOTS for i in infos) and \
                all(r.info("replication").get("master_link_status") == "up" for r in replicas)

        try:
            self._wait(ok)
        finally:
            for client in [*clients, *replicas]:
                client.close()

    def _wait(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster not ready within {self.startup_s} s")
            time.sleep(0.05)

    def close(self) -> None:
        for node in [*self.nodes, *self.replica_nodes]:
            node.close()

    def __enter__(self) -> LocalRedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
