"""A Redis round trip over loopback TCP against a Unix socket, side by side on one redis-server.

What `conveyor up` chose its Redis connection by (shared/redis_server.RedisServer, unix_socket): every hop of a
request's way and every step's publish is a round trip. Measured: PING, and a script shaped like a decode step's
publish at 32 sequences (services/worker/publish_scripts.TOKENS_LUA: a list append + EXPIRE per sequence, one XADD of
the step's event). Rounds alternate TCP and Unix (drift hits both alike); each round's median call is kept, the
median round reported, with the ratio TCP / Unix.

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.scale.redis_socket [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import redis

from benchmarks.common import median_s
from shared.redis_io.redis_server import RedisServer

logger = logging.getLogger(__name__)

STEP_LUA = """
for i = 1, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[i]) redis.call('EXPIRE', KEYS[i], 600) end
redis.call('XADD', 'bench:replies', 'MAXLEN', '~', 1000, '*', 'e', ARGV[1])
return 1
"""
SEQUENCES = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-redis-") as tmp:
        server = RedisServer(Path(tmp), unix_socket=True).start()
        try:
            clients = {"tcp": redis.Redis.from_url(server.tcp_url), "unix": redis.Redis.from_url(server.url)}
            keys = [f"bench:tokens:{i}" for i in range(SEQUENCES)]
            tokens = [str(1000 + i) for i in range(SEQUENCES)]
            results: dict[str, dict[str, list[float]]] = {k: {"ping": [], "step": []} for k in clients}
            for _ in range(args.rounds):
                for name, client in clients.items():
                    script = client.register_script(STEP_LUA)
                    results[name]["ping"].append(median_s(client.ping, args.calls) * 1e6)
                    results[name]["step"].append(median_s(lambda: script(keys=keys, args=tokens), args.calls) * 1e6)
                    client.delete(*keys)
        finally:
            server.stop()
    for what in ("ping", "step"):
        tcp, unix = (statistics.median(results[k][what]) for k in ("tcp", "unix"))
        logger.info("%-4s  tcp %7.1f us  unix %7.1f us  tcp/unix %.2fx", what, tcp, unix, tcp / unix)


if __name__ == "__main__":
    main()
