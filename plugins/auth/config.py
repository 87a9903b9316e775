"""The auth plugin's settings: `auth:` and each tenant's keys (`tenants.NAME`).

Pydantic models live apart from the plugin so that the plugin's module can be compiled (setup.py): mypyc
compiles no class whose attributes default to a pydantic `Field`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from gateway.settings import Strict


class AuthSection(Strict):
    """`auth:`"""

    required: bool = True  # false: a request without a known key is served as tenant "anonymous"
    cache_ttl_s: float = Field(30.0, gt=0)  # how long a key looked up in Redis (or found missing) is trusted


class AuthTenant(Strict):
    """Its keys under `tenants.NAME`."""

    keys: list[Annotated[str, Field(pattern=r"^sha256:[0-9a-fA-F]{64}$")]] = Field(default_factory=list)
    models: list[str] | None = None  # the models the tenant may use; None: every model
