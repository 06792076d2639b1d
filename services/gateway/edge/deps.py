"""What a route is handed besides its body: the gateway's core, as one typed FastAPI dependency.

`core: Core` in a route's signature gives it the process's GatewayCore (made by the app's lifespan). The core is
named as a forward reference: this module does not import it, so a route module that takes the core does not
import the whole of the session package at its import either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore


def core_of(request: Request) -> GatewayCore:
    return request.app.state.core


Core = Annotated["GatewayCore", Depends(core_of)]
