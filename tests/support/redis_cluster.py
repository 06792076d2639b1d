"""A local Redis Cluster for tests: 3 masters with one replica each, every node a redis-server child process on a
free loopback port (redis-server 7.0 or newer and redis-cli from PATH).

Failover is made fast and deterministic: a node is flagged as failing after cluster-node-timeout (1 s); its replica
then stands for election at once whatever its replication lag (cluster-replica-validity-factor 0) and is promoted
about 1-3 s after the kill. Replicas sync diskless with no delay, so a freshly created cluster has every replica
online and `WAIT 1 ...` answers at once.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from shared.wire.errors import FatalError
from shared.redis_io.redis_server import die_with_parent, find_redis_cli, find_redis_server
from shared.settings import CommonSettings

SLOTS = 16384
# a one-key script for the clients' tests: KEYS[1] gets ARGV[1] appended; returns its length
APPEND_LUA = "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])"
BUS_PORT_OFFSET = 10_000  # Redis < 7 puts a node's cluster bus on port + 10000, which must be free too


PORT_TRIES = 5  # ports a node is started on before the cluster gives up (see LocalRedisCluster._answering)


class _PortTaken(Exception):
    """A node exited because its port was bound by someone else between the check and its start."""


def _free_port_pair(taken: set[int]) -> int:
    """A port p with p and p + 10000 both free on 127.0.0.1 (bound together to check), not in taken."""
    for _ in range(1000):
        port = random.randrange(20_000, 65_535 - BUS_PORT_OFFSET)
        if port in taken or port + BUS_PORT_OFFSET in taken:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
        return port
    raise FatalError("no free pair of loopback ports (p, p + 10000) found")


@dataclass(eq=False)
class Node:
    """One redis-server of the cluster."""

    port: int
    proc: subprocess.Popen
    log: Path
    node_id: str = ""
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def client(self) -> redis.Redis:
        """A plain (non-cluster) client of this node only, for inspecting it; short timeouts."""
        if self._client is None:
            self._client = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)
        return self._client

    def info(self, section: str) -> dict:
        return self.client.info(section)

    def is_master(self) -> bool:
        return self.client.execute_command("ROLE")[0] in (b"master", "master")


class LocalRedisCluster:
    """`LocalRedisCluster(tmp_dir).start()`: 6 nodes (3 masters + 1 replica each); `.stop()` kills them all.

    Every process dies with the test process (PR_SET_PDEATHSIG), so a crashed test leaves nothing behind."""

    def __init__(self, data_dir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        self.data_dir = Path(data_dir)
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.nodes: list[Node] = []
        self.replica_of: dict[str, str] = {}  # node_id of a replica -> node_id of its master, as created
        self.created_in_s = 0.0  # processes started + `redis-cli --cluster create` + every node ok and in sync
        self.killed_at: dict[int, float] = {}  # port -> time.monotonic() of its kill
        self.last_failover_s = 0.0  # kill -> replica promoted and cluster_state ok everywhere, of the last wait

    @staticmethod
    def binaries() -> tuple[str, str]:
        """(redis-server, redis-cli); FatalError when either is missing (tests skip on it)."""
        return find_redis_server(), find_redis_cli()

    # --- life cycle ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> "LocalRedisCluster":
        t0 = time.monotonic()
        server, cli = self.binaries()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            deadline = t0 + timeout_s
            self._start_nodes(server, deadline)
            self._create_cluster(cli, deadline)
            self._wait_formed(deadline)
        except BaseException:
            self.stop()
            raise
        self.created_in_s = time.monotonic() - t0
        return self

    def _start_nodes(self, server: str, deadline: float) -> None:
        """Every node's redis-server started, each on a free port pair, and answering."""
        taken: set[int] = set()
        for _ in range(self.masters * (1 + self.replicas)):
            port = _free_port_pair(taken)
            taken |= {port, port + BUS_PORT_OFFSET}
            self.nodes.append(self._spawn(server, port))
        for i, node in enumerate(self.nodes):
            self.nodes[i] = self._answering(server, node, taken, deadline)

    def _create_cluster(self, cli: str, deadline: float) -> None:
        """`redis-cli --cluster create` over the nodes: the slots spread over the masters, each given its replicas."""
        create = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        if create.returncode != 0:
            raise FatalError(
                f"redis-cli --cluster create failed ({create.returncode}): "
                f"{create.stdout[-2000:]}{create.stderr[-2000:]}"
            )

    def _wait_formed(self, deadline: float) -> None:
        """Wait until every node is ok and knows the others, and every replica is in sync and listed; records each
        node's id and each replica's master."""
        self._wait(
            lambda: all(self._healthy(n) for n in self.nodes),
            deadline,
            f"every node cluster_state:ok with all {SLOTS} slots and {len(self.nodes)} nodes known",
        )
        for node in self.nodes:
            node.node_id = node.client.execute_command("CLUSTER MYID").decode()
        for node in self.nodes:
            if not node.is_master():
                master_port = node.info("replication")["master_port"]
                self.replica_of[node.node_id] = self._node_by_port(master_port).node_id
        self._wait(
            lambda: all(
                n.info("replication").get("master_link_status") == "up"
                for n in self.nodes
                if n.node_id in self.replica_of
            ),
            deadline,
            "every replica in sync with its master",
        )
        # Redis 7 leaves a replica out of CLUSTER SLOTS (where clients find the nodes) until it looks healthy
        self._wait(
            lambda: all(len(entry) - 3 >= self.replicas for n in self.nodes for entry in self._raw_cluster_slots(n)),
            deadline,
            "every replica listed in CLUSTER SLOTS by every node",
        )

    def stop(self) -> None:
        for node in self.nodes:
            if node._client is not None:
                node._client.close()
            if node.alive:
                node.proc.kill()  # test data: no shutdown save to wait for
        for node in self.nodes:
            node.proc.wait()

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, server: str, port: int) -> Node:
        log = self.data_dir / f"redis-{port}.log"
        cmd = [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--logfile",
            str(log),
            "--save",
            "",
            "--appendonly",
            "no",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{port}.conf",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-replica-validity-factor",
            "0",  # a replica may always stand for election
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",  # replicas in sync at once
            # Redis 7 lists a replica in CLUSTER SLOTS once its replication offset moved: on an idle master, at
            # its first ping of the replicas, after repl-ping-replica-period (10 s by default)
            "--repl-ping-replica-period",
            "1",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        return Node(port, proc, log)

    def _answering(self, server: str, node: Node, taken: set[int], deadline: float) -> Node:
        """node once it answers. A port found free can be taken before the node binds it (by another test process,
        or as an outgoing connection's ephemeral port): such a node is started again on a fresh port."""
        for _ in range(PORT_TRIES):
            try:
                self._wait_answers(node, deadline)
                return node
            except _PortTaken:
                port = _free_port_pair(taken)
                taken |= {port, port + BUS_PORT_OFFSET}
                node = self._spawn(server, port)
        raise FatalError(f"no redis-server of the cluster could bind a port in {PORT_TRIES} tries")

    def _wait_answers(self, node: Node, deadline: float) -> None:
        while True:
            if not node.alive:
                tail = node.log.read_text()[-1500:] if node.log.exists() else ""
                if "Address already in use" in tail:
                    raise _PortTaken(node.port)
                raise FatalError(f"redis-server on port {node.port} exited with {node.proc.returncode}: {tail}")
            try:
                node.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise FatalError(f"redis-server on port {node.port} did not answer in time") from None
                time.sleep(0.02)

    def _healthy(self, node: Node) -> bool:
        fields = {k: str(v) for k, v in node.client.execute_command("CLUSTER INFO").items()}  # parsed by redis-py
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_slots_ok") == str(SLOTS)
            and int(fields.get("cluster_known_nodes", 0)) >= len(self.nodes)
        )

    @staticmethod
    def _wait(check, deadline: float, what: str) -> None:
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass  # a node not answering yet, or answering for a topology still settling
            if time.monotonic() > deadline:
                raise FatalError(f"Redis Cluster: {what}: not reached in time")
            time.sleep(0.02)

    # --- topology ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT of the first node: a cluster client discovers the others from it."""
        return self.nodes[0].url

    @property
    def node_urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def _node_by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == int(port))

    def _node_by_id(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)

    def _slot_owner_port(self, slot: int) -> int:
        dead = {n.port for n in self.nodes if not n.alive}
        for node in self.nodes:
            if node.port in dead:
                continue
            try:
                for start, end, master, *_ in self._raw_cluster_slots(node):
                    # A node that has not heard of a failover yet still names the dead master: ask the next one.
                    if start <= slot <= end and int(master[1]) not in dead:
                        return int(master[1])
            except redis.RedisError:
                continue
        raise FatalError(f"no live node knows a live owner of slot {slot}")

    @staticmethod
    def _raw_cluster_slots(node: Node) -> list:
        # CLUSTER SLOTS as the server sends it: [[start, end, [host, port, id], replica...], ...]
        conn = node.client.connection_pool.get_connection()
        try:
            conn.send_command("CLUSTER", "SLOTS")
            return conn.read_response()
        finally:
            node.client.connection_pool.release(conn)

    def master_for_key(self, key: str | bytes) -> Node:
        """The node currently serving key's slot, as the live nodes see it."""
        return self._node_by_port(self._slot_owner_port(key_slot(key.encode() if isinstance(key, str) else key)))

    def replicas_of(self, master: Node) -> list[Node]:
        """The replicas master had when the cluster was created."""
        return [self._node_by_id(r) for r, m in self.replica_of.items() if m == master.node_id]

    # --- faults --------------------------------------------------------------------------------------------------

    def kill(self, node: Node) -> None:
        """SIGKILL: no shutdown, no last words to the cluster bus."""
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        self.killed_at[node.port] = time.monotonic()

    def wait_promoted(self, old_master: Node, timeout: float = 30.0) -> Node:
        """Wait until a replica of old_master is a master and every live node reports cluster_state:ok; return it.
        Records the time from old_master's kill (if it was killed through kill()) in last_failover_s."""
        replicas = self.replicas_of(old_master)
        if not replicas:
            raise FatalError(f"node {old_master.port} had no replica")
        promoted: list[Node] = []

        def done() -> bool:
            promoted[:] = [r for r in replicas if r.alive and r.is_master()]
            return bool(promoted) and all(self._healthy(n) for n in self.nodes if n.alive)

        self._wait(done, time.monotonic() + timeout, f"a replica of {old_master.port} promoted, cluster ok")
        if old_master.port in self.killed_at:
            self.last_failover_s = time.monotonic() - self.killed_at[old_master.port]
        return promoted[0]


def cluster_settings(cluster: LocalRedisCluster, **kw) -> CommonSettings:
    """The settings a service is given for this cluster (the clients it builds are cluster clients)."""
    return CommonSettings(redis_url=cluster.url, redis_cluster=True, **kw)
