"""redis-py's cluster clients, made to run Conveyor's code and to ride out a failover (shared.redis_io.redis_client
builds them when settings.redis_cluster is set).

On a single Redis (the default) these are redis-py's plain clients. With settings.redis_cluster the Redis at redis_url
is one node of a Redis Cluster, and they are redis-py's cluster clients (redis.cluster.RedisCluster and
redis.asyncio.cluster.RedisCluster, subclassed here), which discover the other nodes from it.

Riding out a failover (cluster clients). When a master dies, the commands on its slots fail until a replica is
promoted: cluster-node-timeout, then an election (1-3 s on the tests' cluster, whose timeout is 1 s); meanwhile a
command gets a refused connection (ConnectionError), CLUSTERDOWN, TRYAGAIN or, later, MOVED. redis-py 8.1's own
cluster retry does not ride that out: its Retry object is only read for its count (the backoff is unused outside
MULTI/EXEC pipelines), and a command is retried at once after a topology refresh, ~4 ms apart on a refused
connection, so its default 10 retries are spent in ~50 ms. Here redis-py's own retries are off (Retry(NoBackoff, 0):
also because its MULTI/EXEC retry re-sends EXEC on a new connection where the WATCH no longer holds, committing a
transaction whose watched key changed), and every command, pipeline and script call is retried instead, with
exponential backoff, each attempt starting within CLUSTER_RETRY_S of the first; redis-py refreshes the topology
after each such error, so the retry after a promotion goes to the new master. Then the last error is raised.

What is retried, and how often it may run: a single command is retried after a connection error even if it may have
reached Redis (as the plain client's retries do): at least once. A pipeline re-sends those of its commands that did
not succeed (all of them for a MULTI/EXEC transaction). A transaction that WATCHed keys is never retried here: the
WATCH is gone with its connection, so the error is raised and the caller starts over (as on a WatchError).

Scripts in cluster pipelines. redis-py blocks EVALSHA in cluster pipelines (Script(..., client=pipe) raises
RedisClusterException), and a pipeline cannot load a script itself. The cluster pipelines here allow it: before
sending, the registered scripts (client.register_script) used by the pipeline are loaded on every master where this
client has not loaded them yet (a promoted replica does not have them on Redis 7: SCRIPT LOAD is not replicated).
A NOSCRIPT in a plain pipeline is answered by loading the script and re-sending that command; in a MULTI/EXEC
transaction the other commands have run by then, so it is raised.

The asyncio cluster client bounds connections per node (max_connections), but where redis-py's BlockingConnectionPool
waits for a free connection, redis-py 8.1's cluster node raises MaxConnectionsError at once. Here the operations in
flight (a command, or one attempt of a pipeline) are bounded by a semaphore of max_connections instead, each using at
most one connection per node: under a burst, coroutines wait up to pool_timeout_s for their turn, then get
ConnectionError("No connection available.") (NoConnectionAvailable, not retried), as the single-Redis client's
pool does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import redis
from redis import cluster as _sync_cluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterError,
    NoScriptError,
    SlotNotCoveredError,
    TryAgainError,
)

from shared.redis_io.replies import as_text

CLUSTER_RETRY_S = 10.0  # a cluster command failing for a retryable reason is retried for this long in all
_CLUSTER_BACKOFF = ExponentialWithJitterBackoff(base=0.05, cap=0.5)  # pauses up to 0.1, 0.2, 0.4, 0.5, 0.5... s
# ConnectionError (incl. MaxConnectionsError, BusyLoadingError) and TimeoutError: a node gone or not answering.
# ClusterError: CLUSTERDOWN, or redirections exhausted ("TTL exhausted"). SlotNotCoveredError: a slot without a
# master in the client's table. TRYAGAIN: a slot migrating. ASK/MOVED only escape from a MULTI/EXEC.
_CLUSTER_RETRY_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,
    SlotNotCoveredError,
    TryAgainError,
    AskError,
)


class NoConnectionAvailable(redis.ConnectionError):
    """The asyncio cluster client's operations in flight stayed at max_connections for pool_timeout_s."""


def _retryable(e: BaseException) -> bool:
    return isinstance(e, _CLUSTER_RETRY_ERRORS) and not isinstance(e, (AuthenticationError, NoConnectionAvailable))


# --- retries ------------------------------------------------------------------------------------------------------


class _Deadline:
    """Pauses between the attempts of one operation, until CLUSTER_RETRY_S after its first."""

    def __init__(self):
        self.start, self.failures = time.monotonic(), 0

    def next_pause(self) -> float | None:
        """The pause before the next attempt; None when that attempt would start past the deadline."""
        self.failures += 1
        pause = _CLUSTER_BACKOFF.compute(self.failures)
        return None if time.monotonic() + pause - self.start > CLUSTER_RETRY_S else pause

    def pause(self, error: BaseException) -> float:
        """next_pause(), raising error past the deadline."""
        pause = self.next_pause()
        if pause is None:
            raise error
        return pause


_NOT_RUN = object()


class _Attempts:
    """A pipeline's attempts: which of its commands still need sending, and their results so far.

    A transaction (MULTI/EXEC) is all or nothing: re-sent whole after a retryable error, never when it WATCHed keys.
    A plain pipeline re-sends the commands that did not succeed: those that never ran (the attempt failed before
    sending them) and those that got a retryable error. (The asyncio client runs a plain pipeline spanning nodes as
    one pipeline per node: see AsyncClusterPipeline._execute_per_node.)"""

    def __init__(self, queue: list, transaction: bool, watched: bool):
        self.queue, self.transaction, self.watched = queue, transaction, watched
        self.results: list = [_NOT_RUN] * len(queue)
        self.todo = list(range(len(queue)))
        self.error: BaseException | None = None
        self.deadline = _Deadline()

    def raised(self, error: Exception, sent: list) -> None:
        """The attempt raised error; sent: its PipelineCommands (a plain pipeline's may hold results)."""
        if not _retryable(error) or self.watched:
            raise error
        self.error = error
        if not self.transaction:
            for i, c in zip(self.todo, sent):
                if c.result is not None:
                    self.results[i] = c.result

    def returned(self, results: list) -> None:
        self.error = None
        for i, r in zip(self.todo, results):
            self.results[i] = r

    def next_pause(self) -> float | None:
        """None when done; else the pause before sending self.todo again (raises when out of time, for a
        transaction; a plain pipeline's unsent commands get the error as their result)."""
        if self.transaction:
            pending = list(self.todo) if self.error is not None else []
        else:
            pending = [i for i in self.todo if self.results[i] is _NOT_RUN or _retryable_result(self.results[i])]
        if not pending:
            return None
        pause = self.deadline.next_pause()
        if pause is None:
            if self.transaction:
                raise self.error
            for i in pending:
                if self.results[i] is _NOT_RUN:
                    self.results[i] = self.error
            return None
        self.todo = pending
        return pause

    def outcome(self, raise_on_error: bool) -> list:
        if raise_on_error:
            for r in self.results:
                if isinstance(r, Exception):
                    raise r
        return self.results


def _retryable_result(r) -> bool:
    return isinstance(r, Exception) and _retryable(r)


class _Scripts:
    """The scripts registered on a cluster client, and the masters this client has loaded each on."""

    def __init__(self):
        self.source: dict[str, Any] = {}  # sha -> script text
        self.loaded: set[tuple[str, str]] = set()  # (node name, sha)

    def missing(self, commands: list[tuple], primaries: list[str]) -> list[str]:
        """The shas of registered scripts that commands (args tuples) run and some master may not have."""
        shas = {as_text(args[1]) for args in commands if as_text(args[0]).upper() == "EVALSHA"}
        return [sha for sha in shas if sha in self.source and any((p, sha) not in self.loaded for p in primaries)]


_STREAM_READS = {"XREAD": 1, "XREADGROUP": 4}  # where each one's options start (after GROUP group consumer)


def known_keys(args: tuple) -> list | None:
    """The keys of an XREAD or XREADGROUP (the first half of what follows STREAMS) or of an EVAL or EVALSHA (numkeys
    after the script), else None. redis-py asks a node for them (COMMAND GETKEYS, a round trip) before each one
    sent alone (the stream reads) or in a plain pipeline (both): the bus's reads and the lifecycle's scripts."""
    name = as_text(args[0]).upper() if args else ""
    if name in ("EVAL", "EVALSHA"):
        return list(args[3 : 3 + int(args[2])]) if len(args) > 2 else None
    start = _STREAM_READS.get(name)
    if start is None:
        return None
    for i in range(start, len(args)):
        if as_text(args[i]).upper() == "STREAMS":
            rest = args[i + 1 :]
            return list(rest[: len(rest) // 2])
    return None


# --- the synchronous cluster client ---------------------------------------------------------------------------------


class SyncClusterClient(_sync_cluster.RedisCluster):
    """redis.cluster.RedisCluster whose commands, pipelines and scripts ride out a failover (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scripts = _Scripts()

    def execute_command(self, *args, **kwargs):
        call = super().execute_command
        if "target_nodes" in kwargs:  # chosen nodes may be gone after a failover: redis-py does not retry them either
            return call(*args, **kwargs)
        return self._retrying(call, args, kwargs)

    def _retrying(self, call: Callable, args: tuple, kwargs: dict):
        deadline = _Deadline()
        while True:
            try:
                return call(*args, **kwargs)
            except Exception as e:
                if not _retryable(e):
                    raise
                self._scripts.loaded.clear()  # a node may have restarted without them
                time.sleep(deadline.pause(e))

    def _get_command_keys(self, *args):
        keys = known_keys(args)
        return _sync_cluster.RedisCluster._get_command_keys(self, *args) if keys is None else keys  # the pipeline too

    def register_script(self, script):
        s = super().register_script(script)
        self._scripts.source[s.sha] = s.script
        return s

    def load_scripts(self, shas: list[str]) -> None:
        """SCRIPT LOAD these registered scripts on every master."""
        primaries = [n.name for n in self.get_primaries()]
        for sha in shas:
            self.script_load(self._scripts.source[sha])  # redis-py sends SCRIPT LOAD to every master
            self._scripts.loaded.update((p, sha) for p in primaries)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        # redis-py builds its ClusterPipeline with a long list of this client's internals: take it as built and
        # give it the retrying subclass (no state of its own but what _adopt sets).
        pipe.__class__ = SyncClusterPipeline
        pipe._adopt(self)
        return pipe


class SyncClusterPipeline(_sync_cluster.ClusterPipeline):
    """A cluster pipeline (transaction or not) that retries what failed, and runs registered scripts."""

    def _adopt(self, client: SyncClusterClient) -> None:
        self._client = client
        self._watched = self._multi = False
        # redis-py re-sends a command that failed inside a pipeline on its own through this: make it retry too.
        plain = self.parent_execute_command
        self.parent_execute_command = lambda *args, **kwargs: client._retrying(plain, args, kwargs)

    _get_command_keys = SyncClusterClient._get_command_keys

    def execute_command(self, *args, **kwargs):
        if args and as_text(args[0]).upper() == "WATCH":
            self._watched = True
        return super().execute_command(*args, **kwargs)

    def watch(self, *names):
        self._watched = True
        return super().watch(*names)

    def multi(self):
        self._multi = True
        return super().multi()

    def reset(self):
        self._watched = self._multi = False
        return super().reset()

    def evalsha(self, sha, numkeys, *keys_and_args):  # redis-py blocks it in cluster pipelines
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def script_load(self, script):  # Script's NOSCRIPT fallback while WATCHing: load it through the client
        return self._client.script_load(script)

    def execute(self, raise_on_error: bool = True) -> list:
        queue = list(self._execution_strategy.command_queue)
        if not queue:
            return super().execute(raise_on_error)
        transaction = isinstance(self._execution_strategy, _sync_cluster.TransactionStrategy)
        attempts, multi, scripts = _Attempts(queue, transaction, self._watched), self._multi, self._client._scripts
        while True:
            sent = list(self._execution_strategy.command_queue)
            try:
                self._load_scripts([c.args for c in sent])
                got = super().execute(raise_on_error=False)
            except Exception as e:
                attempts.raised(e, sent)
            else:
                if not transaction and any(isinstance(r, NoScriptError) for r in got):  # a master lost its scripts
                    got = self._resend_noscript(sent, got)
                attempts.returned(got)
            pause = attempts.next_pause()
            if pause is None:
                break
            scripts.loaded.clear()  # a node may have restarted without them
            time.sleep(pause)
            self.nodes_manager.initialize()  # the topology after the failure, before sending again
            if multi:
                self.multi()
            for i in attempts.todo:
                self.execute_command(*queue[i].args, **queue[i].options)
        if any(isinstance(r, NoScriptError) for r in attempts.results):
            scripts.loaded.clear()
        return attempts.outcome(raise_on_error)

    def _resend_noscript(self, sent: list, got: list) -> list:
        """A NOSCRIPT command did not run: load its script everywhere and send it again (a plain pipeline)."""
        self._client._scripts.loaded.clear()
        self._client.load_scripts([as_text(c.args[1]) for c, r in zip(sent, got) if isinstance(r, NoScriptError)])
        out = []
        for c, r in zip(sent, got):
            if isinstance(r, NoScriptError):
                try:
                    r = self._client.execute_command(*c.args, **c.options)
                except Exception as e:
                    r = e
            out.append(r)
        return out

    def _load_scripts(self, commands: list[tuple]) -> None:
        missing = self._client._scripts.missing(commands, [n.name for n in self._client.get_primaries()])
        if missing:
            self._client.load_scripts(missing)
