"""What models one `banyan serve` runs: ModelSpecs from the command line, a models.yaml, or the admin API.

    banyan serve --port 8000 --max-model-len 2048 \\            common: server flags, engine defaults
        --model smollm2-135m-instruct --served-model-name smol \\  model 1: its flags after its --model
        --model ./tiny --served-model-name tiny --kv-cache-memory 64MiB      model 2

    banyan serve --models models.yaml     models: [{name, model, engine_args: {...}, memory_share}], routes: {...}

With one --model (or none) the command line means what it always meant. With several, each model is
parsed from the common flags followed by its own segment, so a flag after one --model never reaches
another. engine_args (YAML, admin API) go through the one settings table (config_args.SETTINGS): an
unknown name or a value of the wrong type is an InvalidParameterError naming `engine_args.<name>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from banyan.config import EngineConfig
from banyan.config_args import (
    OBJECT_SETTINGS,
    SECTIONS,
    SETTINGS,
    SIZES,
    config_from_kwargs,
    engine_config,
    parse_size,
)
from banyan.errors import InvalidParameterError
from banyan.server.routing import Route, make_route


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: the names clients use for it, its engine settings, its share of the memory budget."""

    names: tuple[str, ...]
    engine: EngineConfig
    memory_share: float | None = None
    """Fraction of --memory-budget this model's KV cache may grow into (None: its own kv_cache_memory)."""
    fault: str | None = None  # test-only fault injection for its core (--fault)
    chat_template: str | None = None  # --chat-template for this model (None: the server's)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def source(self) -> str:
        return self.engine.model.model


def served_names(value: str | None, source: str) -> tuple[str, ...]:
    """--served-model-name 'a,b' -> ('a', 'b'); none given: the --model value."""
    names = tuple(n.strip() for n in (value or source).split(",") if n.strip())
    return names or (source,)


# -- the command line ---------------------------------------------------------------------------
def split_model_segments(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """serve's arguments -> (common, [each --model with the flags after it]); `--models` is not `--model`."""
    common: list[str] = []
    segments: list[list[str]] = []
    for token in argv:
        if token == "--model" or token.startswith("--model="):
            segments.append([])
        (segments[-1] if segments else common).append(token)
    return common, segments


def specs_from_command_line(parser: argparse.ArgumentParser, before: list[str], argv: list[str],
                            args: argparse.Namespace) -> list[ModelSpec]:
    """The models `banyan serve ARGV` names (before: the arguments in front of `serve`, e.g. --log-level)."""
    common, segments = split_model_segments(argv)
    if len(segments) <= 1:  # one model: exactly as always
        return [ModelSpec(served_names(args.served_model_name, args.model), engine_config(args), fault=args.fault)]
    specs = []
    for segment in segments:
        ns = parser.parse_args([*before, "serve", *common, *segment])
        specs.append(ModelSpec(served_names(ns.served_model_name, ns.model), engine_config(ns), fault=ns.fault,
                               chat_template=ns.chat_template))
    check_unique_names(specs)
    return specs


def models_to_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[ModelSpec], list[Route]]:
    """`banyan serve`'s models (several --model, or --models FILE) and the routes a models file adds."""
    if args.models:
        if any(t == "--model" or t.startswith("--model=") for t in args.argv):
            raise InvalidParameterError("models", "give the models with --models FILE or with --model, not both")
        file = specs_from_yaml(args.models, engine_config(args))
        return file.models, [make_route(name, variants) for name, variants in file.routes.items()]
    at = args.argv.index("serve")
    return specs_from_command_line(parser, args.argv[:at], args.argv[at + 1:], args), []


def check_unique_names(specs: list[ModelSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise InvalidParameterError("served_model_name", f"{name!r} names two models; give each its own")
            seen.add(name)


# -- engine_args: a dict of settings by name ------------------------------------------------------
def settings_of(config: EngineConfig) -> dict[str, Any]:
    """Every setting of `config` by its outside name (config_from_kwargs(settings_of(c)) == c)."""
    values = {s.name: getattr(getattr(config, s.section), s.field) for s in SETTINGS.values()}
    for name, (field, _) in OBJECT_SETTINGS.items():
        values[name] = getattr(config, field)
    return values


def engine_from_args(base: EngineConfig, source: str, engine_args: Any, where: str = "engine_args") -> EngineConfig:
    """`base` with `model` = source and the settings in engine_args (JSON values) over it, checked."""
    if engine_args is None:
        engine_args = {}
    if not isinstance(engine_args, dict):
        raise InvalidParameterError(where, "must be an object of engine settings")
    values = settings_of(base)
    for name, value in engine_args.items():
        values[name] = _coerce(name, value, where)
    values["model"] = source
    try:
        return config_from_kwargs(values, caller=where)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"{where}.{e.param}", str(e).removeprefix(f"{e.param}: ")) from None


def _coerce(name: str, value: Any, where: str) -> Any:
    """A JSON value for the setting `name`, as its field's type wants it."""
    param = f"{where}.{name}"
    if name in OBJECT_SETTINGS:
        if value is not None and not isinstance(value, dict):
            raise InvalidParameterError(param, "must be an object")
        return value
    setting = SETTINGS.get(name)
    if setting is None or setting.field == "model":
        close = difflib.get_close_matches(name, list(SETTINGS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidParameterError(param, f"is not an engine setting{hint}")
    hint = typing.get_type_hints(SECTIONS[setting.section])[setting.field]
    optional = type(None) in typing.get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if setting.field in SIZES and isinstance(value, str):
        try:
            return parse_size(value)
        except argparse.ArgumentTypeError as e:
            raise InvalidParameterError(param, str(e)) from None
    wanted = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}.get(hint)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidParameterError(param, "must be a list of strings")
        return tuple(value)
    if typing.get_origin(hint) is dict:
        wanted = (dict,)
    if wanted is not None and (not isinstance(value, wanted) or (bool not in wanted and isinstance(value, bool))):
        raise InvalidParameterError(param, f"must be {_kind(hint)}, got {type(value).__name__}")
    return float(value) if hint is float else value


def _kind(hint: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, "an object")


# -- models.yaml ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelsFile:
    models: list[ModelSpec]
    routes: dict[str, dict[str, float]]


def specs_from_yaml(path: str, base: EngineConfig) -> ModelsFile:
    """models.yaml -> the models (each over the command line's engine settings) and routes.

        models:
          - name: chat                 # or a list of names: [chat, chat-v2]
            model: smollm2-135m-instruct
            engine_args: {max_model_len: 2048, kv_cache_memory: 256MiB}
            memory_share: 0.5
        routes:
          assistant: {chat: 90, tiny: 10}
    """
    import yaml  # only when a models file is given

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise InvalidParameterError("models", f"cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise InvalidParameterError("models", f"{path}: expected a mapping with a non-empty `models` list")
    specs = [_spec_from_entry(entry, i, base) for i, entry in enumerate(doc["models"])]
    check_unique_names(specs)
    routes = doc.get("routes") or {}
    if not isinstance(routes, dict):
        raise InvalidParameterError("routes", f"{path}: `routes` must map a route name to {{model: weight}}")
    return ModelsFile(specs, routes)


def _spec_from_entry(entry: Any, index: int, base: EngineConfig) -> ModelSpec:
    where = f"models[{index}]"
    if not isinstance(entry, dict):
        raise InvalidParameterError(where, "must be a mapping with name and model")
    unknown = set(entry) - {"name", "model", "engine_args", "memory_share"}
    if unknown:
        raise InvalidParameterError(f"{where}.{min(unknown)}", "is not a field (name, model, engine_args, "
                                    "memory_share)")
    names = entry.get("name")
    names = [names] if isinstance(names, str) else names
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidParameterError(f"{where}.name", "must be a name or a list of names")
    source = entry.get("model")
    if not isinstance(source, str) or not source:
        raise InvalidParameterError(f"{where}.model", "must be a model path or alias")
    share = entry.get("memory_share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
        raise InvalidParameterError(f"{where}.memory_share", "must be a fraction in (0, 1]")
    engine = engine_from_args(base, source, entry.get("engine_args"), where=f"{where}.engine_args")
    return ModelSpec(tuple(names), engine, None if share is None else float(share))


def with_engine(spec: ModelSpec, **sections: Any) -> ModelSpec:
    return dataclasses.replace(spec, engine=spec.engine.replace(**sections))
