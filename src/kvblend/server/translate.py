"""From an OpenAI-style body to a ``Draft`` for ``kvblend.engine.shaping.shape`` (which
makes the engine ``Request``) and ``SamplingParams``, with every bound checked before
anything is tokenized or allocated (counts and bytes here, token counts and the context
in ``shape``), and ``shape``'s refusals as API errors."""

from __future__ import annotations

import functools
import json
import logging

from pydantic import BaseModel, ValidationError

from kvblend.blend.config import BlendConfig, check_layers_fit
from kvblend.engine import Engine
from kvblend.engine.discovery import Sightings
from kvblend.engine.matching import DocumentIndex
from kvblend.engine.shaping import (
    DocRef, DocumentTooLargeError, Draft, Lookup, ShapeConfig, ShapedRequest, UnknownDocumentError, shape,
)
from kvblend.errors import ContextLengthError, InvalidRequestError
from kvblend.generation import SamplingParams
from kvblend.generation.grammar import ResponseFormat, grammars
from kvblend.generation.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from kvblend.generation.stream import validate_template_kwargs
from kvblend.rag.chunking import Chunk, ChunkerConfig, chunk_text
from kvblend.server.documents import DocumentRegistry
from kvblend.server.errors import APIError, bad_request, from_validation
from kvblend.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DocumentRef, _Common, ignored_fields, unsupported, utf8_size,
)
from kvblend.settings import DEVIATION_KNOBS, BlendSettings, Settings, deviation_selection

log = logging.getLogger("kvblend.server")
MAX_STOP_CHARS = 256
MAX_SCHEMA_CHARS = 65536  # a response_format's JSON Schema, as JSON text


def parse(model: type[BaseModel], data: dict) -> BaseModel:
    """A JSON body as ``model``, each value taken as the type JSON gave it (pydantic's strict
    mode): an integer field takes a JSON integer, not ``true``, ``"5"`` or ``5.0``; a boolean
    a JSON boolean; a number an integer or a float; else a 400 naming the field. The one rule
    for every field of every request body, nested options included."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise from_validation(exc) from None


def utf8_len(text: str, param: str) -> int:
    size = utf8_size(text)
    if size is None:
        raise bad_request("the text is not valid Unicode (lone surrogate escape)", param)
    return size


def check_common(body: _Common, settings: Settings, model_ids: tuple[str, ...]) -> None:
    """Model, refused options, and ignored fields (logged)."""
    if body.model not in model_ids:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model", "NotFoundError")
    refused = unsupported(body)
    if refused is not None:
        raise bad_request(refused[1], refused[0])
    extra = ignored_fields(body)
    if extra:
        log.info("ignored unknown request fields: %s", ", ".join(extra[:20]))
    stops = body.stop_list()
    if len(stops) > settings.limits.max_stop:
        raise bad_request(f"at most {settings.limits.max_stop} stop strings are allowed", "stop")
    for i, s in enumerate(stops):
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(f"stop strings must have 1-{MAX_STOP_CHARS} characters", f"stop.{i}")


def documents_of(body: _Common, settings: Settings) -> list[str | DocRef]:
    """The request's documents with count and byte limits applied before any tokenization:
    texts as given, stored ones as ``DocRef`` (``shape`` expands them to their chunks)."""
    docs = body.documents or []
    limits = settings.limits
    if len(docs) > limits.max_documents:
        raise bad_request(f"at most {limits.max_documents} documents per request; got {len(docs)}", "documents")
    out: list[str | DocRef] = []
    for i, doc in enumerate(docs):
        if isinstance(doc, DocumentRef) and doc.text is None:
            out.append(DocRef(doc.id))
            continue
        text = doc.text if isinstance(doc, DocumentRef) else doc
        size = utf8_len(text, f"documents.{i}")
        if size > limits.max_document_bytes:
            raise APIError(413, f"document {i} has {size} bytes; the limit is {limits.max_document_bytes}",
                           f"documents.{i}")
        out.append(text)
    return out


def blend_options(body: _Common, settings: Settings, num_layers: int) -> tuple[str, BlendConfig]:
    """The request's method and blend config: its ``kvblend`` options over the server's
    defaults, validated as one ``BlendSettings`` (a 400 naming the field when invalid).
    A request that sets a knob of deviation selection (``DEVIATION_KNOBS``) without naming
    a selection gets deviation selection; naming another one with it is a 400: a knob
    that would change nothing is never silently accepted."""
    base = settings.blend
    opts = body.kvblend
    if opts is None:
        return base.method, base.blend_config()
    given = {k: v for k, v in opts.model_dump(exclude={"explain", "match"}).items() if v is not None}
    values = {**base.model_dump(), **given}
    if "check_layers" in given and "schedule" not in given:
        values["schedule"] = None
    knobs = [k for k in DEVIATION_KNOBS if k in given]
    try:
        values["selection"] = deviation_selection(knobs, given.get("selection")) or values["selection"]
    except InvalidRequestError as exc:
        raise bad_request(str(exc), f"kvblend.{exc.field}") from None
    if values["selection"] != "deviation":  # the server's deviation knobs do not follow a request away
        values.update({k: getattr(BlendConfig, k) for k in DEVIATION_KNOBS})
    try:
        check_layers_fit(values["check_layers"], num_layers)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "kvblend.check_layers") from None
    try:
        merged = BlendSettings.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")  # the config's own check names its field
        field = getattr(cause, "field", None) or next((str(p) for p in err["loc"] if str(p) in values), None)
        raise bad_request(err["msg"].removeprefix("Value error, "),
                          f"kvblend.{field}" if field else "kvblend") from None
    return merged.method, merged.blend_config()


def chat_messages(body: ChatCompletionRequest, settings: Settings) -> list[dict[str, str]]:
    if len(body.messages) > settings.limits.max_messages:
        raise bad_request(f"at most {settings.limits.max_messages} messages per request", "messages")
    out = []
    for i, m in enumerate(body.messages):
        try:
            text = m.text(f"messages.{i}")
        except ValueError as exc:
            raise bad_request(str(exc), f"messages.{i}.content") from None
        utf8_len(text, f"messages.{i}.content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def build_draft(body: _Common, settings: Settings, tenant: str, num_layers: int,
                tools: list[dict] | None = None) -> Draft:
    """The ``Draft`` of a body (a 400/413 ``APIError`` when it is refused): what ``shape``
    turns into the engine's request; a chat's ``tools`` (``server.tools``: checked) become
    its template's ``tools`` variable. No registry, no tokenizer: call it on the loop."""
    documents = documents_of(body, settings)
    method, blend = blend_options(body, settings, num_layers)
    match = body.kvblend is None or body.kvblend.match is not False
    explain = bool(body.kvblend and body.kvblend.explain)
    if isinstance(body, ChatCompletionRequest):
        try:
            template_kwargs = validate_template_kwargs(body.chat_template_kwargs)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.field) from None
        if tools:
            template_kwargs = {**(template_kwargs or {}), "tools": tools}
        return Draft(documents=documents, messages=chat_messages(body, settings), method=method, blend=blend,
                     tenant=tenant, match=match, explain=explain, template_kwargs=template_kwargs)
    assert isinstance(body, CompletionRequest)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    utf8_len(prompt, "prompt")
    return Draft(documents=documents, question=prompt, method=method, blend=blend, tenant=tenant,
                 use_chat_template=False, match=match, explain=explain)


def shape_config(settings: Settings) -> ShapeConfig:
    """How the server shapes requests: its documents and limits settings."""
    docs = settings.documents
    return ShapeConfig(max_document_tokens=settings.limits.max_document_tokens, match=docs.match,
                       discover=docs.discover, discover_tokens=docs.discover_tokens)


def document_chunks(engine: Engine, text: str, chunk_tokens: int) -> list[Chunk]:
    """``text`` cut as ``POST /v1/documents`` stores it: the ``kvblend.rag`` chunker's token
    windows of ``chunk_tokens`` on the serving model's tokenizer (none for blank text)."""
    return chunk_text(engine.tokenizer, text, ChunkerConfig(size=chunk_tokens), engine.loaded.tokenizer_fingerprint)


def registry_lookup(registry: DocumentRegistry, tenant: str) -> Lookup:
    """The tenant's stored documents for ``shape``: a document's chunks' ids in order (a
    row stored before chunking: its text), None for an id the tenant does not have."""

    def lookup(doc_id: str) -> list[str | tuple[int, ...]] | None:
        record = registry.get(tenant, doc_id)
        if record is None:
            return None
        return [c.token_ids for c in record.chunks] if record.chunks else [record.text]

    return lookup


def shape_body(engine: Engine, draft: Draft, settings: Settings, registry: DocumentRegistry,
               index: DocumentIndex | None, param: str, sightings: Sightings | None = None) -> ShapedRequest:
    """``shape`` for the server, its refusals as API errors (``param`` names the field of
    the messages). Reads the registry and tokenizes: call it off the event loop."""
    try:
        return shape(engine, draft, shape_config(settings), index=index, lookup=registry_lookup(registry, draft.tenant),
                     cut=functools.partial(document_chunks, engine, chunk_tokens=settings.documents.chunk_tokens),
                     sightings=sightings)
    except UnknownDocumentError as exc:
        raise APIError(404, str(exc), f"documents.{exc.index}.id", "NotFoundError") from None
    except DocumentTooLargeError as exc:
        raise APIError(413, str(exc), f"documents.{exc.index}") from None
    except ContextLengthError as exc:
        raise APIError(400, str(exc), "input_tokens", "BadRequestError") from None
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.field or param) from None


def sampling_params(body: _Common, settings: Settings, prompt_tokens: int, context: int,
                    vocab_size: int) -> SamplingParams:
    """OpenAI defaults (temperature 1) with the server's cap on max_tokens; a requested
    max_tokens that does not fit the context is a 400 (vLLM's behaviour); ``n`` (at most
    ``scheduler.max_running``: each choice takes a row of the batch), logprobs,
    penalties and ``logit_bias`` (ids below ``vocab_size``, the logits' width) checked, a
    400 naming the field."""
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    cap = settings.limits.max_tokens
    room = context - prompt_tokens
    if asked is not None and asked > cap:
        raise bad_request(f"{param} is {asked}; this server allows at most {cap}", param)
    if asked is not None and asked > room:
        raise bad_request(f"'{param}' is too large: {asked}. This model's maximum context length is {context} "
                          f"tokens and your request has {prompt_tokens} input tokens ({asked} > {context} - "
                          f"{prompt_tokens}).", param)
    max_tokens = asked if asked is not None else max(1, min(cap, settings.limits.default_max_tokens, room))
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    rows = settings.scheduler.max_running
    if (body.n or 1) > rows:  # each choice decodes in a row of the batch
        raise bad_request(f"n is {body.n}; this server decodes at most {rows} streams at once "
                          "(scheduler.max_running)", "n")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k, seed=body.seed,
                              stop=tuple(body.stop_list()), ignore_eos=body.ignore_eos, n=body.n or 1,
                              logprobs=logprob_count(body), logprobs_mode=settings.logprobs_mode,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                              logit_bias=logit_bias(body, vocab_size), response_format=response_format(body))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.field) from None


def logprob_count(body: _Common) -> int | None:
    """How many top alternatives each token's logprobs list, None for no logprobs. A
    chat's ``logprobs`` is a flag and ``top_logprobs`` the count (which needs the flag,
    as OpenAI says); a completion's ``logprobs`` is the count itself (0 to 20) and it has
    no ``top_logprobs``. A 400 naming the field otherwise."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise bad_request("logprobs is a boolean in chat completions (the count is top_logprobs)", "logprobs")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None:
        raise bad_request("top_logprobs is a chat option; a completion's logprobs is the count", "top_logprobs")
    if isinstance(body.logprobs, bool):
        raise bad_request("logprobs is an integer count in completions", "logprobs")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}", "logprobs")
    return body.logprobs


def response_format(body: _Common) -> ResponseFormat | None:
    """OpenAI's ``response_format`` (an unknown field of the body; its type was checked by
    ``unsupported``): None for text, else the grammar's ``ResponseFormat``. A json_schema
    needs ``json_schema.schema`` as an object (``name`` and ``strict`` optional); a 400
    naming the field otherwise. Whether the schema compiles is ``check_format``'s."""
    fmt = (body.model_extra or {}).get("response_format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return ResponseFormat("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("a json_schema response_format needs json_schema.schema, a JSON Schema object",
                          "response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("json_schema.strict is a boolean", "response_format.json_schema.strict")
    if len(json.dumps(spec["schema"])) > MAX_SCHEMA_CHARS:
        raise bad_request(f"the schema is over {MAX_SCHEMA_CHARS} characters of JSON",
                          "response_format.json_schema.schema")
    return ResponseFormat.json_schema(spec["schema"], bool(strict))


def check_format(engine: Engine, sampling: SamplingParams, param: str | None = None) -> None:
    """Compile the request's response format now (cached per schema: the decode slots find
    it compiled), so that a schema the grammar engine cannot compile is a 400 naming the
    construct (and ``param``, when the schema came from another field: ``tools``) before
    the request is queued. Compiles: call it off the event loop."""
    if sampling.response_format is None:
        return
    try:
        grammars(engine.tokenizer, engine.loaded.config.vocab_size, engine.loaded.eos_token_ids).compiled(
            sampling.response_format)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param or exc.field) from None


def logit_bias(body: _Common, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: each key a token id of the model's
    vocabulary written as a decimal string, each bias in [-100, 100] (OpenAI); a 400
    naming the entry otherwise."""
    pairs = []
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not int(key) < vocab_size:
            raise bad_request(f"logit_bias keys are token ids in [0, {vocab_size}); got {key!r}", f"logit_bias.{key}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            raise bad_request(f"a logit_bias value is in [-100, 100]; got {value}", f"logit_bias.{key}")
        pairs.append((int(key), float(value)))
    return tuple(pairs)
