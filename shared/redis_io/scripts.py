"""A single Redis's pipelines, asking for a registered script once a connection instead of before every execute.

redis-py's pipeline sends SCRIPT EXISTS (and SCRIPT LOAD for what is missing) before each execute that holds a
script: a round trip more per pipeline, nine a request on its way through the services, seven of them before its
first token (the tokenizer's, the scheduler's and the worker's lifecycle pipelines). Here each connection remembers
the scripts it has found loaded, and the check is made only for one it has not.

Why skipping it is safe: Redis loses its scripts by restarting (or failing over), which closes every connection,
and a connection that connects again loads every script its client's pipelines have run before it sends anything
else (a connect callback): a pipeline retried inside redis-py's execute after a reconnect included. What is not
covered is SCRIPT FLUSH on a serving Redis, which keeps the connections: the pipeline that meets it gets NOSCRIPT
(in a MULTI/EXEC the transaction's other commands have run, as they would after a flush between redis-py's own
check and the EXEC), and every connection checks again from the next one on. Scripts called directly (EVALSHA
with redis-py's fallback to loading) never checked first and are unchanged. The cluster clients keep their own
record of the scripts loaded on each master (shared.redis_io.redis_cluster_client).
"""

from __future__ import annotations

import contextlib

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline as _AsyncPipeline
from redis.client import Pipeline as _SyncPipeline
from redis.exceptions import NoScriptError


class LoadedScripts:
    """The scripts a client's pipelines have run (sha -> body), and which of them each connection has found loaded
    (kept on the connection itself, valid while `epoch` is the one it was found in)."""

    def __init__(self):
        self.bodies: dict[str, str | bytes] = {}
        self.epoch = 0  # moved on by a NOSCRIPT reply: what every connection remembers is then void

    def missing(self, conn, scripts) -> list:
        """Of scripts, those this connection has not found loaded; remembers their bodies for its reconnects."""
        if getattr(conn, "conveyor_scripts", None) is None:
            conn.conveyor_scripts = (self.epoch, set())
            conn.register_connect_callback(self.reconnected)
        for s in scripts:
            self.bodies.setdefault(s.sha, s.script)
        epoch, seen = conn.conveyor_scripts
        return [s for s in scripts if epoch != self.epoch or s.sha not in seen]

    def found(self, conn, scripts) -> None:
        epoch, seen = conn.conveyor_scripts
        conn.conveyor_scripts = (self.epoch, (seen if epoch == self.epoch else set()) | {s.sha for s in scripts})

    def forget(self) -> None:
        self.epoch += 1

    @contextlib.contextmanager
    def forgotten_on_noscript(self):
        """A NOSCRIPT raised inside: what every connection remembers is void (a SCRIPT FLUSH happened)."""
        try:
            yield
        except NoScriptError:
            self.forget()
            raise

    def seen_in(self, replies: list) -> list:
        """A pipeline's replies, read for a NOSCRIPT among them (raise_on_error=False)."""
        if any(isinstance(r, NoScriptError) for r in replies):
            self.forget()
        return replies

    def loaded_all(self, conn) -> None:
        conn.conveyor_scripts = (self.epoch, set(self.bodies))

    def reconnected(self, conn) -> None:
        """A sync connection's connect callback: every script its client's pipelines have run, loaded again."""
        for body in self.bodies.values():
            conn.send_command("SCRIPT", "LOAD", body, check_health=False)
        for _ in self.bodies:
            conn.read_response()
        self.loaded_all(conn)


class AsyncLoadedScripts(LoadedScripts):
    async def reconnected(self, conn) -> None:  # the asyncio connection awaits its callbacks
        for body in self.bodies.values():
            await conn.send_command("SCRIPT", "LOAD", body, check_health=False)
        for _ in self.bodies:
            await conn.read_response()
        self.loaded_all(conn)


class Pipeline(_SyncPipeline):
    loaded: LoadedScripts

    def load_scripts(self):
        if self.connection is None:  # the connection execute() then uses (as immediate_execute_command takes it)
            self.connection = self.connection_pool.get_connection()
        conn = self.connection
        missing = self.loaded.missing(conn, list(self.scripts))
        if missing:
            exists = self.immediate_execute_command("SCRIPT EXISTS", *[s.sha for s in missing])
            for s, there in zip(missing, exists):
                if not there:
                    s.sha = self.immediate_execute_command("SCRIPT LOAD", s.script)
            self.loaded.found(conn, missing)

    def execute(self, raise_on_error: bool = True):
        with self.loaded.forgotten_on_noscript():
            return self.loaded.seen_in(super().execute(raise_on_error))


class AsyncPipeline(_AsyncPipeline):
    loaded: AsyncLoadedScripts

    async def load_scripts(self):
        if self.connection is None:
            self.connection = await self.connection_pool.get_connection()
        conn = self.connection
        missing = self.loaded.missing(conn, list(self.scripts))
        if missing:
            exists = await self.immediate_execute_command("SCRIPT EXISTS", *[s.sha for s in missing])
            for s, there in zip(missing, exists):
                if not there:
                    s.sha = await self.immediate_execute_command("SCRIPT LOAD", s.script)
            self.loaded.found(conn, missing)

    async def execute(self, raise_on_error: bool = True):
        with self.loaded.forgotten_on_noscript():
            return self.loaded.seen_in(await super().execute(raise_on_error))


class _ChecksScriptsOnce:
    """A client whose pipelines are pipeline_class, sharing one record of the scripts loaded (mixed in first)."""

    pipeline_class: type
    loaded_class: type

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded_scripts = self.loaded_class()

    def pipeline(self, transaction=True, shard_hint=None):
        pipe = self.pipeline_class(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.loaded = self.loaded_scripts
        return pipe


class Redis(_ChecksScriptsOnce, redis.Redis):
    """redis-py's client, its pipelines checking a script once a connection."""

    pipeline_class, loaded_class = Pipeline, LoadedScripts


class AsyncRedis(_ChecksScriptsOnce, aioredis.Redis):
    """redis-py's asyncio client, its pipelines checking a script once a connection."""

    pipeline_class, loaded_class = AsyncPipeline, AsyncLoadedScripts
