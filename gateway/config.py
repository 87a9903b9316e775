"""Loading a config: YAML -> ${ENV} expansion -> the core's part and each plugin's part -> one list of problems.

The YAML users write is one document; its parts belong to different owners. Top-level keys, and keys under
`models.NAME` and `tenants.NAME`, are the core's (gateway/settings.py) or a plugin's (its `Schema`): a
plugin's top-level section is named after it. The loader hands every part to its owner's model, so a key
is known only where its owner says so, and reports *every* problem at once, one line each, with the file
name, the YAML path and, for an unknown key close to a known one, the likely intended key.

A part whose plugin is not in `plugins:` is a problem, not a feature silently off: `auth.required: true`
without the `auth` plugin would otherwise serve everyone. So are a plugin listed twice, one listed before a
plugin it must follow, and whatever a plugin's own `check` finds (cross-references only it can judge).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gateway import handoff
from gateway.plugin import BUILTIN, Configured, Problem, Schema, advice_of, checks_of, load_class, schema_of
from gateway.settings import ConfigError, ModelSettings, Settings, TenantSettings, references

DEFAULT_PATH = Path("config/gateway.yaml")
# Where the settings came from when no file was named and none was found.
QUICKSTART = "<built-in quickstart: no -c, no $SLUICE_CONFIG, no ./config/gateway.yaml>"
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")
MEANT = re.compile(r"^unknown key \(did you mean `([^`]+)`\?\)$")
MISSING = "Field required"
BACKEND_TYPES = ("openai", "azure", "vllm", "tgi", "llamacpp", "ollama", "simulated")

# The same as config/gateway.yaml (a test keeps them so), for a `sluice serve` run outside the checkout.
QUICKSTART_YAML = """
listen: {host: 127.0.0.1, port: 8080}

backends:
  sim: {type: simulated, ttft_ms: 150, tpot_ms: 15, tokens: 16}

pool: {max_connections: 256, keepalive: 64, warm_connections: 4}

models:
  chat-large:
    backend: sim
    upstream_model: large
    fallback: [chat-small]
  chat-small: {backend: sim, upstream_model: small}
  embed-small: {backend: sim, upstream_model: embed}

plugins: []
"""


def load(path: str | os.PathLike[str] | None = None) -> Settings:
    """The settings from `path`, else $SLUICE_CONFIG, else config/gateway.yaml, else the built-in quickstart."""
    return parse(*read(path))


def read(path: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """(text, where it came from) of the config `load` would use."""
    if path is None:
        path = os.environ.get(handoff.CONFIG) or (DEFAULT_PATH if DEFAULT_PATH.exists() else None)
    if path is None:
        return QUICKSTART_YAML, QUICKSTART
    try:
        return Path(path).read_text(), str(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc


def parse(text: str, source: str = "<config>") -> Settings:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    problems: list[Problem] = []
    raw = expand_env(raw, "", problems)
    found = len(problems)
    unset = {path for path, _ in problems}  # a value left empty by a missing variable: say that, not more
    settings = Loader(raw, problems).settings()
    problems[found:] = [problem for problem in problems[found:] if problem[0] not in unset]
    # `modles:` is one mistake, not two: the required key it was meant to be is not reported missing as well.
    meant = {_join(path.rpartition(".")[0], m.group(1)) for path, message in problems if (m := MEANT.search(message))}
    problems[:] = [(path, message) for path, message in problems if not (message == MISSING and path in meant)]
    if problems:
        raise ConfigError(
            *(f"{source}: {path}: {message}" if path else f"{source}: {message}" for path, message in problems)
        )
    assert settings is not None
    settings._source = str(Path(source).resolve()) if Path(source).is_file() else source  # for the start-up summary
    return settings


def expand_env(value: Any, path: str, problems: list[Problem]) -> Any:
    """Replace ${NAME} and ${NAME:-default} in every string of a parsed YAML tree."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ and (default is None or os.environ[name]):
                return os.environ[name]
            if default is not None:
                return default
            problems.append((path, f"environment variable {name} is not set (use ${{{name}:-default}} for a default)"))
            return ""

        return ENV_REF.sub(substitute, value)
    if isinstance(value, dict):
        return {key: expand_env(item, _join(path, key), problems) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
    return value


class Loader:
    """One config document split between its owners, validated, cross-checked."""

    def __init__(self, raw: dict[str, Any], problems: list[Problem]) -> None:
        self.raw = raw
        self.problems = problems
        self.listed = self._listed(raw.get("plugins", []))
        # Every plugin whose parts might appear: the listed ones and every built-in, so that a built-in's
        # section without the plugin is named as such rather than as an unknown key.
        self.schemas: dict[str, Schema] = {}
        self.classes: dict[str, type[Any]] = {}
        for spec in [*self.listed, *(name for name in BUILTIN if name not in self.listed)]:
            try:
                cls = load_class(spec)
            except ValueError as exc:
                if spec in self.listed:
                    self.problems.append((f"plugins[{self.listed.index(spec)}]", str(exc).removeprefix("plugin ")))
                continue
            self.classes[spec] = cls
            self.schemas[cls.name] = schema_of(cls)
        self.owner = {cls.name: spec for spec, cls in self.classes.items()}  # plugin name -> its spec

    def settings(self) -> Settings | None:
        self._order()
        core, parts = self._split()
        try:
            settings = Settings.model_validate(core)
        except ValidationError as exc:
            self.problems.extend(_problems(exc, ""))
            return None
        self.problems.extend(references(settings))
        configured: dict[str, Any] = {}
        for spec in self.listed:
            cls = self.classes.get(spec)
            if cls is None:
                continue
            config = self._configure(cls.name, parts.get(cls.name, {}), settings)
            if config is not None:
                configured[spec] = config
                for path, message in checks_of(cls)(config, settings, self.listed):
                    self.problems.append((path, message))
        settings._plugin_config = configured
        return settings

    # -- the plugins: listed once each, in an order that meets their needs

    def _listed(self, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            self.problems.append(("plugins", "must be a list of plugin names"))
            return []
        listed: list[str] = []
        for i, spec in enumerate(value):
            if spec in listed:
                self.problems.append((f"plugins[{i}]", f"{spec!r} is listed twice"))
            elif ":" not in spec and spec not in BUILTIN:
                self.problems.append((f"plugins[{i}]", f"unknown plugin {spec!r}{_suggest(spec, BUILTIN)}"))
            else:
                listed.append(spec)
        return listed

    def _order(self) -> None:
        names = [self.classes[spec].name for spec in self.listed if spec in self.classes]
        for position, name in enumerate(names):
            for before in self.schemas[name].after:
                if before in names[position + 1 :]:
                    self.problems.append(
                        ("plugins", f"{before!r} must come before {name!r} (it runs first); list them in that order")
                    )

    # -- the split: every key to its owner

    def _split(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The core's document, and per plugin name {"section": ..., "models": {...}, "tenants": {...}}."""
        core: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        core_keys = set(Settings.model_fields)
        for key, value in self.raw.items():
            if key in core_keys:
                core[key] = value
            elif key in self.schemas:
                self._claim(parts, key, "section", None, value, key)
            else:
                known = core_keys | set(self.schemas)
                self.problems.append((str(key), f"unknown key{_suggest(str(key), known)}"))
        for kind, core_model in (("models", ModelSettings), ("tenants", TenantSettings)):
            entries = core.get(kind)
            if not isinstance(entries, dict):
                continue
            owned = {
                field: name
                for name, schema in self.schemas.items()
                for field in (schema.model if kind == "models" else schema.tenant).model_fields
            }
            own = set(core_model.model_fields)
            split: dict[Any, Any] = {}
            for entry, fields in entries.items():
                if not isinstance(fields, dict):
                    split[entry] = fields  # the core's model reports the type
                    continue
                mine: dict[str, Any] = {}
                for key, value in fields.items():
                    path = f"{kind}.{entry}.{key}"
                    if key in own:
                        mine[key] = value
                    elif key in owned:
                        self._claim(parts, owned[key], kind, str(entry), {key: value}, path)
                    else:
                        self.problems.append((path, f"unknown key{_suggest(str(key), own | set(owned))}"))
                split[entry] = mine
            core[kind] = split
        return core, parts

    def _claim(
        self, parts: dict[str, dict[str, Any]], name: str, kind: str, entry: str | None, value: Any, path: str
    ) -> None:
        if name not in self.owner or self.owner[name] not in self.listed:
            self.problems.append((path, f"set, but the `{name}` plugin is not in `plugins:` (add it, or remove this)"))
            return
        part = parts.setdefault(name, {"section": {}, "models": {}, "tenants": {}})
        if entry is None:
            part["section"] = value
        else:
            part[kind].setdefault(entry, {}).update(value)

    def _configure(self, name: str, part: Mapping[str, Any], settings: Settings) -> Configured[Any, Any, Any] | None:
        schema = self.schemas[name]
        before = len(self.problems)
        section = self._validate(schema.section, part.get("section", {}), name)
        models = {
            model: self._validate(schema.model, part.get("models", {}).get(model, {}), f"models.{model}")
            for model in settings.models
        }
        tenants = {
            tenant: self._validate(schema.tenant, part.get("tenants", {}).get(tenant, {}), f"tenants.{tenant}")
            for tenant in settings.tenants
        }
        if len(self.problems) > before:
            return None
        return Configured(section, models, tenants)

    def _validate(self, model: type[BaseModel], value: Any, path: str) -> Any:
        if value is None:
            value = {}
        try:
            return model.model_validate(value)
        except ValidationError as exc:
            self.problems.extend(_problems(exc, path))
            return None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found, at the file's line and column: its own text names a `<unicode string>` instead."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = f" ({exc.context})" if exc.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{context}"
    return " ".join(str(exc).split())


def _problems(exc: ValidationError, prefix: str) -> Iterable[Problem]:
    for error in exc.errors():
        if error["type"] == "union_tag_invalid":
            # pydantic's "Input tag 'x' found using 'type' does not match any of the expected tags": say it as
            # a user would, with the likely intended kind.
            tag = str((error.get("ctx") or {}).get("tag", ""))
            yield (
                _join(prefix, ".".join(str(p) for p in error["loc"])) + ".type",
                f"unknown backend type {tag!r}{_suggest(tag, BACKEND_TYPES)}; one of: {', '.join(BACKEND_TYPES)}",
            )
            continue
        # Discriminated unions put the tag in the location ("backends.x.openai.api_key"): keep the YAML path.
        path = prefix
        for part in error["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part not in BACKEND_TYPES:
                path = _join(path, part)
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        yield path, message


def _suggest(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def describe(settings: Settings) -> str:
    """The one line `sluice check` prints for a good config."""
    plugins: Sequence[str] = settings.plugins
    return (
        f"ok: {settings.source}: {len(settings.backends)} backend(s), {len(settings.models)} model(s), "
        f"{len(settings.tenants)} tenant(s), plugins: {', '.join(plugins) or 'none'}"
    )


def warnings(settings: Settings) -> list[str]:
    """Lines for a config that is valid but most likely not what was meant: each plugin's `advise`."""
    said: list[str] = []
    for spec in settings.plugins:
        advise = advice_of(load_class(spec))
        for path, message in advise(settings.plugin_config(spec), settings, settings.plugins):
            said.append(f"warning: {settings.source}: {path}: {message}")
    return said
