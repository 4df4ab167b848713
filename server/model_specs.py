"""The models one server serves, as declared: a models file (``--models``, TOML or JSON),
``--model`` given more than once, or the one ``--model`` (the bundled model by default).

A models file is a list of tables, one per model (relative paths are read from the file's folder)::

    [[models]]
    names = ["smollm2", "local-model"]    # what clients send as `model`; the first is its id
    path = "SmolLM2-135M-Instruct.Q4_1.gguf"
    chat_template = "chat.jinja"          # optional: instead of the GGUF's
    json_separators = [", ", ": "]        # optional: how structured outputs lay JSON out
    kind = "generate"                     # or "embed" (POST /v1/embeddings)
    max_slots = 8                         # optional: any engine setting, as the flag's name
                                          # (max_seq_len, kv_cache_tokens, n_batch, ...)
    [[models]]
    names = ["embed"]
    path = "..."
    kind = "embed"
    pooling = "mean"                      # optional: the GGUF's by default (mean, cls, last)

JSON is the same as ``{"models": [{...}, ...]}``. Each model runs in its own engine process
(docs/models.md). A model's names default to its GGUF's ``general.name`` (:func:`served_name`),
the first model's with ``local-model`` (:data:`ALIAS`) beside it; the engine settings a model
does not set are the server's flags'.
"""
from __future__ import annotations

import functools
import json
import os
import tomllib
from dataclasses import dataclass
from typing import NamedTuple

from engine.config import EMBED_DEFAULTS, ConfigError, EngineConfig, check_model_file
from server.gguf import metadata, metadata_strings
from server.structured.schema import SEPARATORS, separator_error

#: What a model serves: text generation (chat, completions, scoring, ``/infer``) or embeddings.
GENERATE, EMBED = "generate", "embed"
KINDS = (GENERATE, EMBED)
#: Pooling of an embedding model's token vectors ("": the GGUF's ``<arch>.pooling_type``).
POOLINGS = ("", "mean", "cls", "last")
#: The GGUF's ``<arch>.pooling_type`` values an embedding can use (llama.h's
#: ``LLAMA_POOLING_TYPE_MEAN``, ``CLS``, ``LAST``; ``NONE`` and ``RANK`` give no one vector).
GGUF_POOLINGS = (1, 2, 3)
#: The name served beside the first model's own by default: the only one before names were drawn
#: from the model file, so clients written then keep working.
ALIAS = "local-model"
#: GGUF metadata keys: the model's name, its chat template.
NAME_KEY, TEMPLATE_KEY = "general.name", "tokenizer.chat_template"
#: Keys of a model's table besides the engine settings.
_OWN_KEYS = ("names", "path", "chat_template", "kind", "pooling", "json_separators")


@functools.lru_cache(maxsize=16)
def model_metadata(path: str) -> dict[str, str]:
    """The model file's name and chat template (:data:`NAME_KEY`, :data:`TEMPLATE_KEY`; absent
    when the file has none), read once a process: the gunicorn master reads them at start, and
    its workers fork with them.

    Raises:
        ConfigError: the file's metadata cannot be read (:func:`server.gguf.metadata_strings`).
    """
    return metadata_strings(path, (NAME_KEY, TEMPLATE_KEY))


def served_name(path: str, name: str | None) -> str:
    """The model id drawn from a GGUF: its ``general.name`` (``Gemma 3 270m``), else the file's
    name without ``.gguf``, with each run of whitespace one ``-`` (``Gemma-3-270m``), as an id
    in a URL path (``/v1/models/{model}``) and a shell argument wants it."""
    name = (name or "").strip() or os.path.basename(path).removesuffix(".gguf")
    return "-".join(name.split())


class Setting(NamedTuple):
    """An engine setting a model may set itself: its ``EngineConfig`` field and its type (the
    server's flag's: ``server.config.engine_settings`` makes the table, keyed by the flag's field
    name, which a models file uses)."""

    engine: str
    type: type


@dataclass(frozen=True)
class ModelSpec:
    """One served model.

    Attributes:
        names: what clients send as ``model``, the first being the model's id (never empty).
        path: the GGUF file.
        chat_template: a Jinja template file to use instead of the GGUF's ("": the GGUF's).
        kind: :data:`GENERATE` or :data:`EMBED`.
        pooling: an embedding model's pooling, one of :data:`POOLINGS`.
        json_separators: the separators structured outputs write JSON with (between items, after a
            key; :func:`json_separators`), where a schema names no layout of its own.
        engine: the engine settings this model sets itself, ``(EngineConfig field, value)``.
        where: how the declaration is named in errors (``--model``, ``models[1] in FILE``; "":
            the server's own flags).
    """

    names: tuple[str, ...]
    path: str
    chat_template: str = ""
    kind: str = GENERATE
    pooling: str = ""
    json_separators: tuple[str, str] = SEPARATORS
    engine: tuple[tuple[str, object], ...] = ()
    where: str = "--model"

    @property
    def id(self) -> str:
        return self.names[0]

    def engine_config(self, shared: dict[str, object], **extra) -> EngineConfig:
        """This model's engine: the server's engine settings ``shared`` (``EngineConfig`` field
        names), then (an embedding model) :data:`engine.config.EMBED_DEFAULTS` over the sizes,
        then this model's own settings, and ``extra`` (metrics, step log).

        Raises:
            ConfigError: a value the engine refuses, named with :attr:`where`.
        """
        settings = dict(shared)
        if self.kind == EMBED:
            settings.update(EMBED_DEFAULTS)
        settings.update(self.engine)
        try:
            return EngineConfig(model_path=self.path, name=self.id, kind=self.kind, pooling=self.pooling, **settings,
                                **extra)
        except ConfigError as e:
            raise ConfigError(f"{self.where}: {e}" if self.where else str(e)) from None

    def chat_template_source(self) -> str | None:
        """The ``chat_template`` file's text (None: the GGUF's template, if it has one).

        Raises:
            ConfigError: the file cannot be read as UTF-8, or it is not a Jinja template.
        """
        if not self.chat_template:
            return None
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self._template_flag()} {self.chat_template}: {e}") from None
        _compile(source, f"{self._template_flag()} {self.chat_template}")
        return source

    def chat_template_origin(self) -> str | None:
        """Where the chat template comes from, as the start-up log says it: the
        ``chat_template`` file, or the model's ``tokenizer.chat_template``; None: neither, so no
        chat is served (a base model, or an embedding model). Either is compiled here, so a
        worker never fails on it.

        Raises:
            ConfigError: a template that cannot be read or does not compile, naming it.
        """
        if self.kind == EMBED:
            return None
        if self.chat_template_source() is not None:
            return f"{self._template_flag()} {self.chat_template}"
        source = model_metadata(self.path).get(TEMPLATE_KEY)
        if not source:
            return None
        _compile(source, f"the model's chat template ({TEMPLATE_KEY} of {self.path}; give one that compiles with "
                         f"{self._template_flag()} FILE)")
        return f"the model's {TEMPLATE_KEY}"

    def check(self, engine: EngineConfig) -> None:
        """Raise ConfigError (one line) unless the GGUF is readable and its metadata whole, the
        chat template compiles and, for an embedding model, the GGUF or ``pooling`` gives a
        pooling and ``engine``'s ``max_seq_len`` holds a vector (what the engine would
        otherwise refuse only once started)."""
        check_model_file(self.path)
        model_metadata(self.path)
        self.chat_template_origin()
        if self.kind != EMBED:
            return
        arch = metadata(self.path, ("general.architecture",)).get("general.architecture", "")
        meta = metadata(self.path, (f"{arch}.pooling_type", f"{arch}.embedding_length"))
        declared = meta.get(f"{arch}.pooling_type", 0)
        if not self.pooling and declared not in GGUF_POOLINGS:
            raise ConfigError(f"{self.where}: {self.path} declares no pooling an embedding can use "
                              f"({arch}.pooling_type {declared}): set pooling = \"mean\", \"cls\" or \"last\"")
        dims = int(meta.get(f"{arch}.embedding_length", 0))
        if dims > engine.max_seq_len:
            raise ConfigError(f"{self.where}: the model's vectors have {dims} dimensions, more than its max_seq_len "
                              f"({engine.max_seq_len}), which bounds a vector in shared memory: set max_seq_len to at "
                              f"least {dims}")

    def _template_flag(self) -> str:
        return "--chat-template" if self.where == "--model" else f"{self.where}: chat_template"


def _compile(source: str, what: str) -> None:
    """Raise ConfigError (one line naming ``what``) unless ``source`` compiles in the chat
    template's environment (a syntax error, or a filter or test it does not have)."""
    import jinja2

    from server.text.chat_template import environment
    try:
        environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{what}: line {e.lineno}: {e.message}") from None


def json_separators(value: object, where: str) -> tuple[str, str]:
    """``value``, a list of two strings as ``json.dumps``' ``separators`` (between items, after a
    key), as a tuple; ``where`` names it in errors.

    Raises:
        ConfigError: not two strings, or one that is not its punctuation with JSON's whitespace
            around it (:func:`server.structured.schema.separator_error`).
    """
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(s, str) for s in value)):
        raise ConfigError(f'{where} must be two strings, between items and after a key (as [", ", ": "])')
    for i, text in enumerate(value):
        if error := separator_error(text, i):
            raise ConfigError(f"{where}: the {('first', 'second')[i]} {error}")
    return (value[0], value[1])


def from_flags(paths: list[str], model_id: str, chat_template: str,
               separators: tuple[str, str] | None = None) -> tuple[ModelSpec, ...]:
    """The models of ``--model`` (each path one model), ``--model-id``, ``--chat-template`` and
    ``--json-separators`` (None: not given, the default's): the three last only with one model (a
    models file names and templates several).

    Raises:
        ConfigError: ``--model-id``, ``--chat-template`` or ``--json-separators`` with several
            models; two models whose GGUFs give the same name.
    """
    if len(paths) > 1 and (model_id or chat_template or separators is not None):
        raise ConfigError("--model-id, --chat-template and --json-separators apply to one model; with several, "
                          "declare them in a models file (--models FILE)")
    separators = separators or SEPARATORS
    if model_id:
        names = tuple(dict.fromkeys(n.strip() for n in model_id.split(",") if n.strip()))
        if not names:
            raise ConfigError("--model-id must name at least one model")
        return (ModelSpec(names, paths[0], chat_template, json_separators=separators),)
    specs = [ModelSpec(_default_names(path, first=i == 0), path, chat_template, json_separators=separators)
             for i, path in enumerate(paths)]
    return _checked(specs)


def _default_names(path: str, first: bool) -> tuple[str, ...]:
    own = served_name(path, model_metadata(path).get(NAME_KEY))
    return tuple(dict.fromkeys((own, ALIAS) if first else (own,)))


def load_file(path: str, settings: dict[str, Setting]) -> tuple[ModelSpec, ...]:
    """The models a models file declares (TOML, or JSON by the ``.json`` suffix); ``settings``:
    the engine settings a model may set (keyed by the server flag's field name).

    Raises:
        ConfigError: one line naming the file and the model (``models[i]``) and key at fault:
            unreadable, not the format, no models, an unknown key, a value of the wrong type, a
            name declared twice.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
        doc = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"--models {path}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"--models {path}: not {'JSON' if path.endswith('.json') else 'TOML'}: "
                          f"{' '.join(str(e).split())}") from None
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, list) or not models or set(doc) != {"models"}:
        raise ConfigError(f"--models {path}: must hold `models`, a non-empty list of tables, and nothing else")
    folder = os.path.dirname(os.path.abspath(path))
    specs = [_spec(entry, f"models[{i}] in {path}", folder, i == 0, settings) for i, entry in enumerate(models)]
    return _checked(specs)


def _spec(entry: object, where: str, folder: str, first: bool, settings: dict[str, Setting]) -> ModelSpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = sorted(set(entry) - set(_OWN_KEYS) - set(settings))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(_OWN_KEYS)}, "
                          f"and the engine settings {', '.join(settings)})")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: path must be the GGUF file's path")
    path = os.path.join(folder, os.path.expanduser(path))
    texts = {}
    for key in ("chat_template", "kind", "pooling"):
        value = entry.get(key, "")
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string")
        texts[key] = value
    if texts["chat_template"]:
        texts["chat_template"] = os.path.join(folder, os.path.expanduser(texts["chat_template"]))
    kind = texts["kind"] or GENERATE
    if kind not in KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if texts["pooling"] not in POOLINGS:
        raise ConfigError(f"{where}: pooling must be one of {', '.join(POOLINGS[1:])}, got {texts['pooling']!r}")
    if texts["pooling"] and kind != EMBED:
        raise ConfigError(f"{where}: pooling applies to kind = \"embed\" only")
    if texts["chat_template"] and kind == EMBED:
        raise ConfigError(f"{where}: chat_template applies to kind = \"generate\" only")
    separators = json_separators(entry.get("json_separators", list(SEPARATORS)), f"{where}: json_separators")
    if "json_separators" in entry and kind == EMBED:
        raise ConfigError(f"{where}: json_separators applies to kind = \"generate\" only")
    if "names" in entry:
        names = entry["names"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ConfigError(f"{where}: names must be a non-empty list of non-empty strings")
        names = tuple(dict.fromkeys(n.strip() for n in names))
    else:
        check_model_file(path)
        names = _default_names(path, first)
    engine = tuple(sorted((settings[key].engine, _engine_value(entry[key], key, settings[key].type, where))
                          for key in settings if key in entry))
    return ModelSpec(names, path, texts["chat_template"], kind, texts["pooling"], separators, engine, where)


def _engine_value(value: object, key: str, typ: type, where: str) -> object:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not typ:
        raise ConfigError(f"{where}: {key} must be {'a boolean' if typ is bool else typ.__name__}, got {value!r}")
    return value


def _checked(specs: list[ModelSpec]) -> tuple[ModelSpec, ...]:
    """``specs``, unless two declare the same name (which ``model`` could not pick)."""
    seen: dict[str, ModelSpec] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                other = seen[name]
                raise ConfigError(f"model name {name!r} is declared twice ({other.where} {other.path} and "
                                  f"{spec.where} {spec.path}); give each model its own names in a models file")
            seen[name] = spec
    return tuple(specs)
