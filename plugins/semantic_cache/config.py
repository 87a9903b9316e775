"""The semantic cache's config: its top-level section, its per-model overrides, and the policy made of both.

Every model of the config is cached unless `models.NAME.semantic_cache.enabled: false` (or the section's
`enabled: false`); the embedding model itself never is. A model's policy is fixed at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from gateway.plugin import Configured, Empty
from gateway.settings import Strict
from plugins.semantic_cache.key import EmbedMode, Rules
from plugins.semantic_cache.store import StoreSection


class SemanticSection(Strict):
    """`semantic_cache:` (the defaults of every model)."""

    enabled: bool = True  # for every model; `models.NAME.semantic_cache.enabled` overrides
    embedding_model: str = ""  # a model of this config on a backend with /v1/embeddings
    embed: EmbedMode = "last_user"
    threshold: float = Field(0.80, gt=0, le=1)  # cosine at or above which an entry may answer (docs: the curve)
    ttl_s: float = Field(3600.0, gt=0)
    # embed + search; past it the request goes upstream. 100 ms: a local CPU embedder meets it (10-30 ms a prompt).
    lookup_deadline_ms: float = Field(100.0, gt=0)
    embed_timeout_ms: float = Field(2000.0, gt=0)  # an embedding still useful for storing the answer
    max_pending: int = Field(256, ge=1)  # lookups still running past their deadline, at most
    max_temperature: float = Field(1.0, ge=0)  # requests sent without one count as 1 (the API's default)
    allow_tools: bool = False  # requests with tools (which may have side effects) are not cached by default
    max_text_chars: int = Field(2000, ge=1)  # longer texts would be truncated by the embedding model
    guards: bool = True
    spelling: bool = True  # slips of the keyboard mended in the text embedded (spelling.py); needs pyspellchecker
    candidates: int = Field(3, ge=1)  # entries above the threshold tried in turn against the guards
    near_margin: float = Field(0.1, ge=0, le=1)  # a best match this close under the threshold is a near miss
    max_entry_bytes: int = Field(1024 * 1024, ge=1)
    store: StoreSection = StoreSection()


class VerifierSpec(Strict):
    """`models.NAME.semantic_cache.verifier`: a chat model asked to confirm each candidate hit."""

    model: str  # a model of this config on a backend with /v1/chat/completions
    deadline_ms: float = Field(300.0, gt=0)  # past it the candidate is a miss (counted `verifier`)


class ModelSemantic(Strict):
    """Per-model overrides."""

    enabled: bool | None = None
    embedding_model: str | None = None
    embed: EmbedMode | None = None
    threshold: float | None = Field(None, gt=0, le=1)
    ttl_s: float | None = Field(None, gt=0)
    lookup_deadline_ms: float | None = Field(None, gt=0)
    max_temperature: float | None = Field(None, ge=0)
    allow_tools: bool | None = None
    guards: bool | None = None
    verifier: VerifierSpec | None = None  # off unless set


class SemanticModel(Strict):
    """Its key under `models.NAME`."""

    semantic_cache: ModelSemantic = ModelSemantic()


Config = Configured[SemanticSection, SemanticModel, Empty]


@dataclass(frozen=True, slots=True)
class Policy:
    rules: Rules
    threshold: float
    near: float
    ttl_s: float
    deadline_s: float
    guards: bool
    verifier: VerifierSpec | None


def policies(config: Config) -> dict[str, Policy]:
    """Each cached model's policy: its overrides over the section's defaults."""
    base = config.section
    found: dict[str, Policy] = {}
    for model, spec in config.models.items():
        own = spec.semantic_cache
        embedding_model = own.embedding_model or base.embedding_model
        if not (base.enabled if own.enabled is None else own.enabled) or model == embedding_model:
            continue
        threshold = own.threshold or base.threshold
        rules = Rules(
            embedding_model=embedding_model,
            embed=own.embed or base.embed,
            max_temperature=base.max_temperature if own.max_temperature is None else own.max_temperature,
            allow_tools=base.allow_tools if own.allow_tools is None else own.allow_tools,
            max_text_chars=base.max_text_chars,
        )
        found[model] = Policy(
            rules=rules,
            threshold=threshold,
            near=threshold - base.near_margin,
            ttl_s=own.ttl_s or base.ttl_s,
            deadline_s=(own.lookup_deadline_ms or base.lookup_deadline_ms) / 1000.0,
            guards=base.guards if own.guards is None else own.guards,
            verifier=own.verifier,
        )
    return found
