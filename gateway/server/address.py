"""A connection's addresses, looked up when first read rather than when it is made.

uvicorn's `connection_made` looks up both ends of every new connection (three `getsockname` and a `getpeername`
under uvloop, through socket objects it makes for the purpose), where only the ASGI scope and logs read them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
UNKNOWN: Any = object()  # not looked up yet


class Address(Generic[T]):
    """A protocol's address attribute (`server`, `client`): `lookup(transport)` on first read, then held. Setting
    None (as uvicorn's __init__ does, before there is a transport) means not looked up yet."""

    def __init__(self, lookup: Callable[[asyncio.Transport], T | None]) -> None:
        self.lookup = lookup

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, protocol: Any, owner: type | None = None) -> T | None:
        if protocol is None:  # read on the class
            return self  # type: ignore[return-value]
        found = protocol.__dict__.get(self.slot, UNKNOWN)
        if found is UNKNOWN:
            found = protocol.__dict__[self.slot] = self.lookup(protocol.transport)
        return found  # type: ignore[no-any-return]

    def __set__(self, protocol: Any, value: T | None) -> None:
        if value is None:
            protocol.__dict__.pop(self.slot, None)
        else:
            protocol.__dict__[self.slot] = value
