"""Where cache entries live in Redis: `sluice:cache:v3:{<tenant>}:<model>:<sha256>`.

The tenant and the public model are in the key in clear, so that one tenant's entries (or one model's of
one tenant) are one prefix: `sluice cache purge` scans that prefix and can never reach another tenant's keys,
and `sluice cache stats` counts by tenant and model without reading values. Both parts are percent-encoded
where they hold anything but letters, digits and `-_.`, so that neither `:` nor a glob character (`*?[]\\`)
nor a brace can appear in them: a prefix is a safe SCAN pattern, and `{<tenant>}` is the Redis Cluster hash
tag (a tenant's entries share a slot). Entries shared by every tenant (`cache: {shared: true}`) have the
tenant `*`, which no encoded tenant name can be.

Keys of the earlier layouts (`sluice:cache:v1:<sha256>`, `sluice:cache:v2:<sha256>`: no tenant, no model) are
no longer read; they expire with their TTL.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

ROOT = "sluice:cache:v3:"
OLD_PATTERN = "sluice:cache:v[12]:*"  # the earlier layouts, counted by `sluice cache stats`
SHARED = "*"


def encode(part: str) -> str:
    return part if part == SHARED else quote(part, safe="-_.")


def prefix(tenant: str, model: str | None = None) -> str:
    """The key prefix of `tenant`'s entries, or of its entries for `model`."""
    head = f"{ROOT}{{{encode(tenant)}}}:"
    return head if model is None else f"{head}{encode(model)}:"


def pattern(tenant: str | None = None, model: str | None = None) -> str:
    """A SCAN MATCH pattern for every entry, a tenant's, or a tenant's for one model."""
    if tenant is None:
        return ROOT + "*"
    head = prefix(tenant, model)
    return head.replace("*", "\\*") + "*"  # the shared tenant's `*` is matched literally


def parts(key: str) -> tuple[str, str] | None:
    """(tenant, model) of a key of this layout; None for anything else."""
    if not key.startswith(ROOT + "{"):
        return None
    tenant, sep, rest = key[len(ROOT) + 1 :].partition("}:")
    model, sep2, _digest = rest.rpartition(":")
    if not sep or not sep2:
        return None
    return (tenant if tenant == SHARED else unquote(tenant)), unquote(model)
