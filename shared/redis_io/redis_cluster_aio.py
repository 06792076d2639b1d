"""The asyncio half of shared.redis_io.redis_cluster_client (the gateway's cluster client): what it adds to redis-py's
and why is said there."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Callable

import redis
from redis._parsers import AsyncCommandsParser
from redis.asyncio import cluster as _async_cluster
from redis.exceptions import NoScriptError

from shared.redis_io.redis_cluster_client import (
    NoConnectionAvailable,
    _Attempts,
    _Deadline,
    _retryable,
    _Scripts,
    known_keys,
)
from shared.redis_io.replies import as_text


class _CommandsParser(AsyncCommandsParser):
    """Finds the keys of stream reads and scripts itself (shared.redis_io.redis_cluster_client.known_keys says why)."""

    async def get_keys(self, *args):
        keys = known_keys(args)
        return await super().get_keys(*args) if keys is None else keys


_IN_FLIGHT = contextvars.ContextVar("conveyor_redis_in_flight", default=None)  # the client whose turn this task holds


class AsyncClusterClient(_async_cluster.RedisCluster):
    """redis.asyncio.cluster.RedisCluster whose commands, pipelines and scripts ride out a failover, with at most
    max_in_flight operations in flight (module docstring)."""

    def __init__(self, *args, max_in_flight: int = 64, pool_timeout_s: float = 30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands_parser = _CommandsParser()  # initialized by initialize(), as redis-py's own
        self._turns = asyncio.Semaphore(max_in_flight)
        self._pool_timeout_s = pool_timeout_s
        self._scripts = _Scripts()

    @contextlib.asynccontextmanager
    async def turn(self):
        """Hold one of the max_in_flight turns (re-entrant within a task: a pipeline's re-sent commands)."""
        if _IN_FLIGHT.get() is self:
            yield
            return
        try:
            await asyncio.wait_for(self._turns.acquire(), self._pool_timeout_s)
        except asyncio.TimeoutError:
            raise NoConnectionAvailable("No connection available.") from None
        token = _IN_FLIGHT.set(self)
        try:
            yield
        finally:
            _IN_FLIGHT.reset(token)
            self._turns.release()

    async def execute_command(self, *args, **kwargs):
        call = super().execute_command
        if "target_nodes" in kwargs:  # chosen nodes may be gone after a failover: redis-py does not retry them either
            async with self.turn():
                return await call(*args, **kwargs)
        return await self._retrying(call, args, kwargs)

    async def _retrying(self, call: Callable, args: tuple, kwargs: dict):
        deadline = _Deadline()
        while True:
            async with self.turn():  # not held while pausing: others may use the healthy nodes meanwhile
                try:
                    if self._initialize:  # else redis-py routes a keyed command as keyless, to any node
                        await self.initialize()
                    return await call(*args, **kwargs)
                except Exception as e:
                    if not _retryable(e):
                        raise
                    error = e
            self._scripts.loaded.clear()
            await asyncio.sleep(deadline.pause(error))

    def register_script(self, script):
        s = super().register_script(script)
        self._scripts.source[s.sha] = s.script
        return s

    async def load_scripts(self, shas: list[str]) -> None:
        """SCRIPT LOAD these registered scripts on every master."""
        await self.initialize()
        primaries = [n.name for n in self.get_primaries()]
        for sha in shas:
            await self.script_load(self._scripts.source[sha])  # redis-py sends SCRIPT LOAD to every master
            self._scripts.loaded.update((p, sha) for p in primaries)

    def pipeline(self, transaction=None, shard_hint=None):
        if shard_hint:
            raise redis.RedisClusterException("shard_hint is deprecated in cluster mode")
        return AsyncClusterPipeline(self, transaction)


class AsyncClusterPipeline(_async_cluster.ClusterPipeline):
    """An asyncio cluster pipeline (transaction or not) that retries what failed, and runs registered scripts."""

    def __init__(self, client: AsyncClusterClient, transaction=None):
        super().__init__(client, transaction)
        self._watched = self._multi = False

    def execute_command(self, *args, **kwargs):
        if args and as_text(args[0]).upper() == "WATCH":
            self._watched = True
        return super().execute_command(*args, **kwargs)

    async def watch(self, *names):
        self._watched = True
        return await super().watch(*names)

    def multi(self):
        self._multi = True
        return super().multi()

    async def reset(self):
        self._watched = self._multi = False
        return await super().reset()

    async def initialize(self) -> "AsyncClusterPipeline":
        # redis-py's empties the queue: AsyncScript(..., client=pipe) awaits the pipeline after queueing its
        # EVALSHA (`await pipe.evalsha(...)`), which would drop every command queued so far.
        if self.cluster_client._initialize:
            await self.cluster_client.initialize()
        return self

    def evalsha(self, sha, numkeys, *keys_and_args):  # redis-py blocks it in cluster pipelines
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def script_load(self, script):  # Script's NOSCRIPT fallback while WATCHing: load it through the client
        return self.cluster_client.script_load(script)

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list:
        client: AsyncClusterClient = self.cluster_client
        queue = list(self._execution_strategy._command_queue)
        if not queue:
            return await super().execute(raise_on_error, allow_redirections)
        transaction = isinstance(self._execution_strategy, _async_cluster.TransactionStrategy)
        if not transaction:
            groups = await self._by_node(queue)
            if len(groups) > 1:
                await self.reset()
                return await self._execute_per_node(queue, groups, raise_on_error, allow_redirections)
        attempts, multi = _Attempts(queue, transaction, self._watched), self._multi
        while True:
            sent = list(self._execution_strategy._command_queue)
            try:
                await self._load_scripts([c.args for c in sent])
                async with client.turn():
                    got = await super().execute(raise_on_error=False, allow_redirections=allow_redirections)
            except Exception as e:
                attempts.raised(e, sent)
            else:
                if not transaction and any(isinstance(r, NoScriptError) for r in got):  # a master lost its scripts
                    got = await self._resend_noscript(sent, got)
                attempts.returned(got)
            pause = attempts.next_pause()
            if pause is None:
                break
            client._scripts.loaded.clear()  # a node may have restarted without them
            await asyncio.sleep(pause)
            client._initialize = True  # refresh the topology after the failure, before sending again
            if multi:
                self.multi()
            for i in attempts.todo:
                self.execute_command(*queue[i].args, **queue[i].kwargs)
        if any(isinstance(r, NoScriptError) for r in attempts.results):
            client._scripts.loaded.clear()
        return attempts.outcome(raise_on_error)

    async def _by_node(self, queue: list) -> list[list[int]]:
        """The queue's positions grouped by the node each command goes to now."""
        client: AsyncClusterClient = self.cluster_client
        await client.initialize()
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(queue):
            target = c.kwargs.get("target_nodes")
            try:
                if isinstance(target, _async_cluster.ClusterNode):  # e.g. a WAIT after the writes it waits for
                    node = target.name
                elif target is not None:
                    node = ""
                else:
                    node = client.nodes_manager.get_node_from_slot(await client._determine_slot(*c.args)).name
            except Exception:  # no key: redis-py routes it by its own policy
                node = ""
            groups.setdefault(node, []).append(i)
        return list(groups.values())

    async def _execute_per_node(
        self, queue: list, groups: list[list[int]], raise_on_error: bool, allow_redirections: bool
    ) -> list:
        """A plain pipeline spanning nodes, as one pipeline per node, sent at once. redis-py sends to every node at
        once too but raises as soon as one fails, while the others may still be running theirs: what ran there
        could not be told from what did not, and would be sent again. Apart, a node failing leaves the others'
        results, and only its own commands are retried."""
        parts = []
        for indices in groups:
            part = AsyncClusterPipeline(self.cluster_client, False)
            for i in indices:
                part.execute_command(*queue[i].args, **queue[i].kwargs)
            parts.append(part)
        outs = await asyncio.gather(*(p.execute(False, allow_redirections) for p in parts), return_exceptions=True)
        results: list = [None] * len(queue)
        for indices, out in zip(groups, outs):
            for j, i in enumerate(indices):
                results[i] = out if isinstance(out, BaseException) else out[j]
        if raise_on_error:
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        return results

    async def _resend_noscript(self, sent: list, got: list) -> list:
        """A NOSCRIPT command did not run: load its script everywhere and send it again (a plain pipeline)."""
        client: AsyncClusterClient = self.cluster_client
        client._scripts.loaded.clear()
        await client.load_scripts([as_text(c.args[1]) for c, r in zip(sent, got) if isinstance(r, NoScriptError)])
        out = []
        for c, r in zip(sent, got):
            if isinstance(r, NoScriptError):
                try:
                    r = await client.execute_command(*c.args, **c.kwargs)
                except Exception as e:
                    r = e
            out.append(r)
        return out

    async def _load_scripts(self, commands: list[tuple]) -> None:
        client: AsyncClusterClient = self.cluster_client
        await client.initialize()
        missing = client._scripts.missing(commands, [n.name for n in client.get_primaries()])
        if missing:
            await client.load_scripts(missing)
