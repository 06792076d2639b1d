"""`conveyor health SERVICE`: the container healthcheck of one service (exit 0 healthy, 1 not, a line why).

The gateway is healthy when its own /health answers 200 (the probe runs inside its container, so 127.0.0.1).
A tokenizer, scheduler or worker has no HTTP port: it is healthy while its own liveness entry in Redis is
fresh, the entry every other service already judges it by. A worker writes its first entry only once its
engine is loaded (model, GEMM plans, kernels), so "healthy" means "serving", which is what `docker compose up
--wait` and `depends_on: condition: service_healthy` need. Its own entry: instance ids are
SERVICE-HOSTNAME-PID-RANDOM (shared.runtime.instance_id) and a container's hostname is its own.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from shared import liveness
from shared import settings as s
from shared.redis_client import sync_client
from shared.service_table import SERVICES


def check(service: str) -> tuple[bool, str]:
    spec = SERVICES[service]
    if spec.http:
        return _gateway(s.GatewaySettings())
    cfg = spec.settings()
    try:
        r = sync_client(cfg)
        live = liveness.read_live(r, cfg.names(), service)
    except Exception as e:  # noqa: BLE001 - any failure to read is "not healthy", said in one line
        return False, f"cannot read liveness from Redis: {type(e).__name__}: {e}"
    mine = [i for i in live if _is_mine(i, service, cfg.instance_id)]
    if mine:
        return True, f"{service} live: {', '.join(mine)}"
    return False, f"no live {service} entry of this host ({socket.gethostname()}); {len(live)} live elsewhere"


def _is_mine(instance: str, service: str, configured: str) -> bool:
    return instance == configured if configured else instance.startswith(f"{service}-{socket.gethostname()}-")


def _gateway(cfg: s.GatewaySettings) -> tuple[bool, str]:
    url = f"http://127.0.0.1:{cfg.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200, f"{url}: {resp.status}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {e}"
