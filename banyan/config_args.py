"""The engine's settings: one table read from the config dataclasses (banyan/config.py), each field once, its
docstring as help, under the one name every surface gives it (vLLM's):

    ModelConfig.max_model_len ──► --max-model-len           banyan generate | chat | serve | bench
                              ──► LLM(max_model_len=...)    the offline API (config_from_kwargs)
                              ──► engine_flags(config)      bench compare's `banyan serve` launcher

The engine core process gets the EngineConfig itself, as JSON (msgspec reads the same dataclasses).
Also here: flags for any other config dataclass (ServerConfig, bench's CompareConfig) and back.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import re
import textwrap
import typing
from typing import Any

from banyan.config import EngineConfig
from banyan.errors import InvalidParameterError
from banyan.spec.config import SpeculativeConfig

RENAMED = {"policy": "scheduling_policy"}  # field -> vLLM's name (its flag keeps the field's name too)
NOT_FLAGS = {"trust_remote_code", "num_pages", "worker_fault", "replicas_on_host"}  # set from Python only
SIZES = {"kv_cache_memory", "max_body_bytes", "memory_budget"}  # flags that take 4GiB, 512MB, ...
KINDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string", dict: "a JSON object"}
"""The field types a keyword's value is checked against (_checked), as its error names them."""
SEVERAL = {"lora_modules"}  # repeatable flags that also take several values at once (vLLM's --lora-modules a=x b=y)
SECTIONS: dict[str, type] = {  # model -> ModelConfig, cache -> ..., ...: a section of fields, each its own setting
    name: hint for name, hint in typing.get_type_hints(EngineConfig).items() if dataclasses.is_dataclass(hint)}
OBJECT_SETTINGS = {"speculative_config": ("speculative", SpeculativeConfig)}
"""A section given whole as one JSON object under vLLM's name (None: off): setting -> (EngineConfig field, class)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine field: EngineConfig.<section>.<field>, known outside as `name`."""

    section: str
    field: str
    name: str
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS: dict[str, Setting] = {
    RENAMED.get(f.name, f.name): Setting(section, f.name, RENAMED.get(f.name, f.name), f.default)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}


def config_from_kwargs(kwargs: dict[str, Any], caller: str = "LLM()") -> EngineConfig:
    """EngineConfig from settings by name; an unknown name is a TypeError naming it, as Python's own."""
    for name in kwargs:
        if name not in SETTINGS and name not in OBJECT_SETTINGS:
            close = difflib.get_close_matches(name, [*SETTINGS, *OBJECT_SETTINGS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
    parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in kwargs.items():
        if name not in OBJECT_SETTINGS:
            parts[SETTINGS[name].section][SETTINGS[name].field] = _checked(name, _size_from_text(name, value))
    sections = {section: cls(**parts[section]) for section, cls in SECTIONS.items()}
    return EngineConfig(**sections, **_object_sections(kwargs))


def _size_from_text(name: str, value: Any) -> Any:
    """A size setting given as text in Python ("4GiB"), as its flag takes it; a bad one names the setting."""
    if name not in SIZES or not isinstance(value, str):
        return value
    try:
        return parse_size(value)
    except argparse.ArgumentTypeError as error:
        raise InvalidParameterError(name, str(error)) from None


def _checked(name: str, value: Any) -> Any:
    """A setting's value if it has its field's type (X | None: None too), else a typed error naming it: the flags
    parse text into these types, and from Python a wrong one failed deep in the engine ('8' for max_num_seqs) or
    passed ('yes' for a bool)."""
    setting = SETTINGS[name]
    hint = typing.get_type_hints(SECTIONS[setting.section])[setting.field]
    kinds = [typing.get_origin(arg) or arg for arg in typing.get_args(hint)] or [hint]
    known = [kind for kind in kinds if kind in KINDS]
    if not known or str in kinds and int in kinds:  # tuples of repeatable flags, int | str: the field checks them
        return value
    if value is None and type(None) in kinds or any(_is_a(value, kind) for kind in known):
        return value
    wanted = " or ".join(KINDS[kind] for kind in known) + (" or None" if type(None) in kinds else "")
    raise InvalidParameterError(name, f"must be {wanted}, got {value!r}")


def _is_a(value: Any, kind: type) -> bool:
    """isinstance, except that a bool is no number and an int is a float too."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) or kind is float and isinstance(value, int)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for section, cls in SECTIONS.items():
        add_config_args(parser, section, cls)
    for name, (field, _) in OBJECT_SETTINGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=json.loads, metavar="JSON", default=None,
                            help=field_docs(EngineConfig).get(field, ""))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from flags that add_engine_args added (the settings set from Python only keep their defaults)."""
    sections = {section: config_from_args(cls, args) for section, cls in SECTIONS.items()}
    return EngineConfig(**sections, **_object_sections(vars(args)))


def _object_sections(values: dict[str, Any]) -> dict[str, Any]:
    """The OBJECT_SETTINGS among `values` as EngineConfig fields: a dict is checked by the class's from_dict
    (InvalidParameterError naming the field), an instance is taken as it is, None leaves the section off."""
    sections = {}
    for name, (field, cls) in OBJECT_SETTINGS.items():
        value = values.get(name)
        sections[field] = value if value is None or isinstance(value, cls) else cls.from_dict(value)
    return sections


def engine_flags(config: EngineConfig) -> list[str]:
    """Command-line flags that rebuild `config` through `banyan serve`'s parser (the settings off their defaults)."""
    flags = []
    for s in SETTINGS.values():
        value = getattr(getattr(config, s.section), s.field)
        if s.field in NOT_FLAGS or value == s.default:
            continue
        if isinstance(value, bool):
            flags.append(s.flag if value else "--no-" + s.flag[2:])
        elif isinstance(value, tuple):
            flags += [part for item in value for part in (s.flag, str(item))]
        else:
            flags += [s.flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    for name, (field, _) in OBJECT_SETTINGS.items():
        value = getattr(config, field)
        if value is not None:
            options = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
            flags += ["--" + name.replace("_", "-"), json.dumps(options)]
    return flags


def add_config_args(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    """One flag per field of the dataclass `cls`, named as vLLM names it, with the field's docstring as help."""
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in NOT_FLAGS:
            continue
        names = ["--" + name.replace("_", "-") for name in dict.fromkeys((RENAMED.get(f.name, f.name), f.name))]
        options = {"dest": f.name, "default": f.default, "help": docs.get(f.name, "")}
        parse = _parse_as(f.name, hints[f.name])
        if f.default is not None and type(None) in typing.get_args(hints[f.name]) and "type" in parse:
            parse["type"] = _or_none(parse["type"])  # a field that may be set to None off its default (seed)
        group.add_argument(*names, **(options | parse))


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass `cls` from flags that add_config_args added; a repeatable flag given no times keeps its default."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in NOT_FLAGS:
            value = getattr(args, f.name)
            values[f.name] = (tuple(value) or f.default) if isinstance(value, list) else value
    return cls(**values)


def _parse_as(name: str, hint: Any) -> dict[str, Any]:
    """argparse options for a field of this type."""
    if name == "max_model_len":
        return {"type": parse_context_length}
    if type(None) in typing.get_args(hint):  # X | None parses as X
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is tuple:
        if name in SEVERAL:
            return {"action": "extend", "nargs": "+", "default": [], "type": typing.get_args(hint)[0]}
        return {"action": "append", "default": [], "type": typing.get_args(hint)[0]}
    if typing.get_origin(hint) is dict:
        return {"type": json.loads, "metavar": "JSON"}
    return {"type": parse_size if name in SIZES else hint}


def _or_none(parse: Any) -> Any:
    """`parse`, and 'none' for None."""
    def parse_or_none(text: str) -> Any:
        return None if text.lower() == "none" else parse(text)
    return parse_or_none


def parse_context_length(text: str) -> int | str:
    """'4096' -> 4096; 'auto' stays 'auto' (the longest context the KV budget holds)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens or auto: {text!r}") from None


def parse_size(text: str) -> int:
    """'4GiB', '4G', '512MB', '1073741824' -> bytes (G and GiB are powers of 1024; GB of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?B)?)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4GiB)")
    number, unit, suffix = match.groups()
    base = 1000 if (suffix or "").lower() == "b" else 1024
    power = "KMGT".index(unit.upper()) + 1 if unit else 0
    return int(float(number) * base**power)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The string under each dataclass field, which the CLI shows as that flag's help (cached: reading the
    source costs milliseconds per class, and every subcommand's parser asks again). A "%" is doubled: argparse
    formats help text with %, so "5% w" would end every --help in a ValueError."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(following.value.value).split()).replace("%", "%%")
    return docs
