"""Which served model a request is for (both front ends, so here in the root package, which may
import every package it puts together): ``model`` picks it on every route (vLLM's and OpenAI's
field), among every name of every model (:mod:`server.model_specs`), within what the tenant may
use, and for what the route needs (text generation, chat, embeddings).

One :class:`ServedModel` per model and process: its engine client, tokenizer, and the request
path of its kind (a :class:`~server.generation.pipeline.Generator` or an
:class:`~server.generation.embedding.Embedder`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from engine.client import EngineClient
from engine.config import ConfigError
from engine.errors import InvalidRequest
from engine.llama.tokenizer import Tokenizer
from server.api.errors import ModelNotFound
from server.config import ServerConfig
from server.control.accounting import Accounting, Prices
from server.control.state import ControlPlane
from server.generation.embedding import Embedder
from server.generation.pipeline import Generator
from server.gguf import metadata
from server.model_specs import EMBED, GENERATE, ModelSpec
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant
from server.text.chat_template import ChatTemplate

#: What a route needs of its model: text generation (completions, scoring, ``/infer``), a chat
#: (a generation model with a chat template), embeddings, or any model (the tokenizer routes).
GENERATION, CHAT, EMBEDDINGS, ANY = "generation", "chat", "embeddings", "any"


@functools.cache
def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of the GGUF at ``path``, loaded once a process. The gunicorn master loads
    every model's (:meth:`ModelRouter.preload`) before its workers fork, so that they share its
    pages rather than hold a copy each: Gemma 3's 262,144-token vocabulary is about 60 MB in a
    process (llama.cpp's vocabulary, 46 MB, and ``Tokenizer.pieces``).

    Raises:
        ConfigError: the file is missing or not GGUF.
    """
    return Tokenizer(path)


@dataclass
class ServedModel:
    """One model as a front-end process serves it.

    Attributes:
        spec: its declaration. engine: the client of its engine process. tokenizer: its
        vocabulary. generator: its request path (kind ``generate``; None otherwise). embedder:
        its embeddings path (kind ``embed``; None otherwise).
    """

    spec: ModelSpec
    engine: EngineClient
    tokenizer: Tokenizer
    generator: Generator | None = None
    embedder: Embedder | None = None

    @property
    def accounting(self):
        """Its spend and usage accounting (``server/control/accounting.py``; None: not kept)."""
        return (self.generator or self.embedder).accounting

    @property
    def chat(self) -> bool:
        """It serves chat: a generation model with a chat template."""
        return self.generator is not None and self.generator.template is not None


class Picked(NamedTuple):
    """The model a request is for: ``name`` as the request sent it (what the answer echoes),
    ``model``, and the ``tenant`` with its limits for that model (``Tenant.for_model``)."""

    name: str
    model: ServedModel
    tenant: Tenant


class ModelRouter:
    """Every served model by each of its names; the first model is the default.

    Args:
        models: the served models, in the declared order.
    """

    def __init__(self, models: list[ServedModel]):
        self.models = models
        self.by_name = {name: m for m in models for name in m.spec.names}

    @classmethod
    def single(cls, spec: ModelSpec, generator: Generator) -> "ModelRouter":
        """One generation model served by ``generator`` (an app over one engine: tests)."""
        return cls([ServedModel(spec, generator.engine, generator.tokenizer, generator=generator)])

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def engines(self) -> dict[str, EngineClient]:
        """Each model's engine client, by model id."""
        return {m.spec.id: m.engine for m in self.models}

    def visible(self, tenant: Tenant = DEFAULT_TENANT) -> list[tuple[str, ServedModel]]:
        """``(name, model)`` for every name of every model ``tenant`` may use."""
        return [(name, m) for m in self.models if tenant.may_use(m.spec.names) for name in m.spec.names]

    def pick(self, body: dict, tenant: Tenant = DEFAULT_TENANT, needs: str = GENERATION) -> Picked:
        """The model ``body["model"]`` names (:class:`Picked`); without ``model``, the first
        model that serves what the route ``needs`` (the default model for the generation
        routes).

        Raises:
            InvalidRequest: ``model`` not a string; a model that does not serve what the route
                needs, naming the models that do (``model``).
            ModelNotFound: no model of that name, or one ``tenant`` may not use: OpenAI's 404
                ``model_not_found`` for both, so a key learns nothing of models it cannot use.
            NoChatTemplate: ``needs`` chat, of a generation model without a chat template
                (raised by its generator, naming ``messages``: the routes ask it).
        """
        name = body.get("model")
        if name is None:
            model = next((m for m in self.models if _serves(m, needs) and tenant.may_use(m.spec.names)), None)
            if model is None:
                raise InvalidRequest(f"no model here that you may use serves {needs}; models here: "
                                     f"{', '.join(n for n, _ in self.visible(tenant)) or 'none'}", "model")
            return Picked(model.spec.id, model, tenant.for_model(model.spec.id))
        if not isinstance(name, str):
            raise InvalidRequest("model must be a string", "model")
        model = self.by_name.get(name)
        if model is None or not tenant.may_use(model.spec.names):
            served = ", ".join(n for n, _ in self.visible(tenant))
            raise ModelNotFound(f"The model {name!r} does not exist or you do not have access to it; models here: "
                                f"{served}", "model")
        if not _serves(model, needs):
            able = [m.spec.id for m in self.models if _serves(m, needs) and (needs != CHAT or m.chat)
                    and tenant.may_use(m.spec.names)]
            what = "embeds" if model.spec.kind == EMBED else "generates text"
            raise InvalidRequest(f"model {name!r} {what} and cannot serve {needs}; models that can: "
                                 f"{', '.join(able) or 'none'}", "model")
        return Picked(name, model, tenant.for_model(model.spec.id))

    @staticmethod
    def preload(config: ServerConfig) -> None:
        """Load every declared model's tokenizer into this process (:func:`load_tokenizer`): the
        gunicorn master, before its workers fork.

        Raises:
            ConfigError: llama.cpp refused a model's file (one whose metadata is whole but whose
                tensors are cut short: llama.cpp checks their bounds even for the vocabulary).
        """
        for spec in config.models:
            try:
                load_tokenizer(spec.path)
            except RuntimeError as e:
                raise ConfigError(f"the vocabulary of {spec.id} cannot be loaded: {e} (llama.cpp's lines above "
                                  "say why)") from None

    @classmethod
    def attach(cls, config: ServerConfig, transports: list[str], control: ControlPlane | None) -> "ModelRouter":
        """A front-end process's models: each declared model (``config.models``) over its
        engine's shared memory (``transports``, in the same order: the master's
        ``INFERENCE_SHM``), with its tokenizer (the GGUF loaded ``vocab_only``), chat template,
        and the accounting of its spend and usage under ``control`` (None: none kept). The rate
        limiter's node-shared buckets are the first engine's."""
        if len(transports) != len(config.models):
            raise RuntimeError(f"{len(config.models)} models but {len(transports)} engine transports")
        prices = Prices.load(config.prices_file)
        engines = [EngineClient.attach(name) for name in transports]
        limiter = RateLimiter(engines[0].buckets, config.redis_url)
        models = []
        for spec, engine in zip(config.models, engines):
            tokenizer = load_tokenizer(spec.path)
            api = "embeddings" if spec.kind == EMBED else "completions"  # the usage API it counts under
            accounting = Accounting(control, prices, spec.names, api=api) if control is not None else None
            if spec.kind == EMBED:
                arch = metadata(spec.path, ("general.architecture",)).get("general.architecture", "")
                dims = int(metadata(spec.path, (f"{arch}.embedding_length",))[f"{arch}.embedding_length"])
                models.append(ServedModel(spec, engine, tokenizer,
                                          embedder=Embedder(engine, tokenizer, dims, limiter, accounting)))
            else:
                template = ChatTemplate.of(tokenizer, spec.chat_template_source())
                models.append(ServedModel(spec, engine, tokenizer,
                                          generator=Generator(engine, tokenizer, template, limiter, accounting,
                                                              spec.json_separators)))
        return cls(models)

    def close(self) -> None:
        for m in self.models:
            m.engine.close()


def _serves(model: ServedModel, needs: str) -> bool:
    if needs == ANY:
        return True
    if needs == EMBEDDINGS:
        return model.spec.kind == EMBED
    return model.spec.kind == GENERATE  # a chat without a template is the generator's refusal
