"""One typed source of defaults for the CLI and the server.

Precedence, highest first: explicit values (command-line flags) > ``KVBLEND_*``
environment variables (nested with ``__``: ``KVBLEND_STORE__REDIS_URL``) > the YAML file
given by ``--config`` (or ``KVBLEND_CONFIG``) > the defaults written here. Sizes accept
units (``"1GiB"``, ``"512MB"``). ``Settings.load`` merges them; ``redacted()`` is what
``kvblend serve --print-config`` prints (keys hidden).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource,
)

from kvblend.blend.config import MAX_SINKS, SELECTIONS, BlendConfig, check_layers_fit
from kvblend.engine.fair import TenantShare
from kvblend.errors import InvalidRequestError, KvblendError
from kvblend.models.registry import DEFAULT_MODEL
from kvblend.rag.chunking import MAX_CHUNK_TOKENS, ChunkerConfig
from kvblend.rag.retriever import MAX_TOP_K
from kvblend.store.config import TIER_NAMES, StoreConfig
from kvblend.store.keys import validate_tenant
from kvblend.store.plan import parse_size
from kvblend.store.remote import cluster_nodes, hide_password

DTYPES = ("float32", "float16", "bfloat16")
GiB = 1024**3
MiB = 1024**2
MIN_KEY_CHARS = 8  # API keys and the admin key alike


class SettingsError(KvblendError):
    """A configuration value (flag, environment variable or YAML entry) that is invalid."""


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


Size = Annotated[int, BeforeValidator(_size), Field(ge=0)]


def _unit_interval(value: float, info: ValidationInfo) -> float:
    """A ratio: a finite number in [0, 1]. NaN and infinities are named as such, never
    answered with a bound they only fail because every comparison with NaN is false."""
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{info.field_name or 'ratio'} must be a finite number in [0, 1]; got {value!r}")
    return value


def _unit_interval_or_auto(value: float | str, info: ValidationInfo) -> float | str:
    return value if value == "auto" else _unit_interval(value, info)


Ratio = Annotated[float, AfterValidator(_unit_interval)]
RatioOrAuto = Annotated[float | Literal["auto"], AfterValidator(_unit_interval_or_auto)]  # one error, not one per branch


def _array(value: Any) -> Any:
    """A list (YAML, JSON) as the tuple a knob holds: a request body is validated strictly
    (``server.translate.parse``), where a tuple field takes no list."""
    return tuple(value) if isinstance(value, list) else value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreSettings(_Section):
    """Chunk KV store tiers (see ``kvblend.store.config.StoreConfig``), read alike by
    ``kvblend serve`` and ``kvblend ingest`` so that they share one store. The disk tier is
    on by default, in ``disk_dir`` or else ``$KVBLEND_HOME/kv`` (where ``kvblend ingest``
    writes), capped at ``disk_bytes``; leave ``disk`` out of ``tiers`` to turn it off."""

    tiers: tuple[Literal["memory", "disk", "redis"], ...] = TIER_NAMES
    memory_bytes: Size = 1 * GiB
    disk_dir: str | None = None
    disk_bytes: Size = 10 * GiB
    redis_url: str | None = None
    redis_bytes: Size = 10 * GiB
    redis_ttl_s: float | None = Field(None, gt=0, le=10 * 365 * 86400, allow_inf_nan=False)  # None: no expiry
    redis_prefix: str = "kvblend"
    redis_cluster: bool = False  # redis_url names a Redis Cluster (node URLs, comma-separated)
    redis_groups: int = Field(16, ge=1, le=256)  # a cluster tier's hash-tag groups: caps hold per group
    redis_timeout_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False)  # per call: then a miss
    redis_retry_s: float = Field(5.0, ge=0, le=3600, allow_inf_nan=False)  # a failed node is skipped this long
    kv_dtype: Literal["fp32", "fp16", "bf16", "int8"] = "fp16"  # fp32: the exact reference
    tenant_bytes: Size | None = None
    # exact prefixes and whole blends, in the compute dtype: fp32 SmolLM2 is 45 KB a token, so
    # 2 GiB keeps ~47k tokens, ~35 RAG prompts (512 MiB kept ~9: repeats were evicted; issue #40)
    prefix_cache_bytes: Size = 2 * GiB

    @model_validator(mode="after")
    def _valid_redis(self) -> StoreSettings:
        """A cluster URL is checked when settings load, not when the first request misses."""
        if self.redis_url is not None and self.redis_cluster:
            cluster_nodes(self.redis_url)
        elif self.redis_url is not None and "," in self.redis_url:
            raise ValueError("store.redis_url lists several nodes: set store.redis_cluster to use a Redis Cluster")
        return self

    @property
    def disk_folder(self) -> str:
        """The disk tier's folder: ``disk_dir``, else ``$KVBLEND_HOME/kv``."""
        from kvblend.models.gguf import cache_home

        return self.disk_dir or str(cache_home() / "kv")

    def flagged(self, disk_dir: str | None, redis_url: str | None, kv_dtype: str | None = None,
                compute_dtype: str = "fp32") -> StoreConfig:
        """``kvblend profile``'s ``--store-dir``/``--redis-url`` store (it measures the tiers
        named, and writes only there; ``ask`` and ``ingest`` use the settings' store with the
        flags over it, ``commands.ingest.store_config``): memory, plus a disk tier at ``disk_dir`` and a Redis tier at
        ``redis_url`` when given, Redis reached and capped as these settings say (a Redis
        Cluster, groups, prefix, timeouts, ``redis_bytes`` and ``tenant_bytes``: a command
        writing into the server's Redis must not evict down to another cap) and KV stored in
        ``kv_dtype`` (else these settings'). Derived from ``store_config``, so that a store
        setting added there reaches these commands too (a copy of the fields missed the caps)."""
        return dataclasses.replace(self.store_config(compute_dtype), tiers=TIER_NAMES, disk_dir=disk_dir,
                                   redis_url=redis_url, kv_dtype=kv_dtype or self.kv_dtype)

    def store_config(self, compute_dtype: str = "fp32") -> StoreConfig:
        return StoreConfig(tiers=self.tiers, memory_bytes=self.memory_bytes, disk_dir=self.disk_folder,
                           disk_bytes=self.disk_bytes, redis_url=self.redis_url, redis_bytes=self.redis_bytes,
                           redis_ttl_s=self.redis_ttl_s, redis_prefix=self.redis_prefix,
                           redis_cluster=self.redis_cluster, redis_groups=self.redis_groups,
                           redis_timeout_s=self.redis_timeout_s, redis_retry_s=self.redis_retry_s,
                           kv_dtype=self.kv_dtype, compute_dtype=compute_dtype, tenant_bytes=self.tenant_bytes)


_BLEND = BlendConfig()  # the engine's defaults: the one place a default blend is decided
DEVIATION_KNOBS = ("check_layers", "schedule", "signal")  # what only deviation selection reads


def _knob(name: str, value: Any) -> Any:
    """A knob's value as ``BlendConfig`` holds it (lists from YAML or JSON as tuples)."""
    return tuple(value) if isinstance(value, list) else value


def deviation_selection(knobs: Sequence[str], selection: str | None) -> str | None:
    """The one rule for knobs only deviation selection reads (``DEVIATION_KNOBS``), for a
    request's ``kvblend`` options, the ``blend.*`` settings and the command line: given
    ``knobs`` and no selection select by deviation; with another selection named they
    would change nothing and are refused (InvalidRequestError naming the first); else
    ``selection`` as given (None: not named)."""
    if not knobs:
        return selection
    if selection is None:
        return "deviation"
    if selection != "deviation":
        raise InvalidRequestError(f"{knobs[0]} applies to selection 'deviation' only, not {selection!r}", knobs[0])
    return selection


SERVED_SELECTIONS = tuple(s for s in SELECTIONS if s != "oracle")  # oracle costs a full prefill: eval only


class BlendOptions(_Section):
    """The blend knobs a server default (``blend.*``) or a request (``"kvblend": {...}``)
    may set, each typed and bounded here once; None: not given. ``BlendSettings`` fills
    what is not given with the engine's defaults (``BlendConfig()``) and the request's
    ``KvblendOptions`` is this model as it is."""

    method: Literal["full", "prefix", "reuse", "blend", "auto"] | None = None
    ratio: RatioOrAuto | None = None  # auto: the loading controller picks it per request
    check_layers: Annotated[tuple[int, ...], BeforeValidator(_array)] | None = Field(None, min_length=1, max_length=256)
    schedule: Annotated[tuple[float, ...], BeforeValidator(_array)] | None = Field(None, min_length=1, max_length=256)
    signal: Literal["v", "k", "kv"] | None = None
    chunk_prefix: Literal["bos", "prompt"] | None = None
    selection: str | None = Field(None, max_length=32)
    budget: bool | None = None
    sinks: int | None = Field(None, ge=0, le=MAX_SINKS)
    shift: bool | None = None
    # false (the default): a document no tier holds is computed alone first (stored at once) and
    # blended; true: computed exactly in the prompt and written back later by the jobs lane
    recompute_misses: bool | None = None

    @field_validator("selection")
    @classmethod
    def _served(cls, value: str | None) -> str | None:
        if value is not None and value not in SERVED_SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SERVED_SELECTIONS)}; got {value!r}")
        return value


class BlendSettings(BlendOptions):
    """Server-wide defaults of the per-request ``kvblend`` options: every knob not set is
    the engine's own default (``BlendConfig()``, method ``blend``), so the CLI, the server
    and the library agree; ``r_min``/``r_max`` bound ``ratio: auto`` and ``escalate`` is the
    quantile of moved risk past which a blend recomputes again (server-wide only);
    ``calibrate``: test once per model whether the shift helps it and drop it where it does
    not (``kvblend.engine.calibration``; off: the shift as configured, on every model)."""

    r_min: Ratio = _BLEND.r_min
    r_max: Ratio = _BLEND.r_max
    calibrate: bool = True
    # a quantile (null: off): a question-selected blend whose risk is above this quantile of its
    # tenant's recent ones of the same kind recomputes at twice its ratio (``BlendConfig.escalate``)
    escalate: Ratio | None = _BLEND.escalate
    # a blend reusing less than this share of its prompt (and storing nothing) runs as an exact
    # prefill instead, which is cheaper there (``BlendConfig.min_reuse``)
    min_reuse: Ratio = _BLEND.min_reuse

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaults = {name: getattr(_BLEND, name, None) for name in BlendOptions.model_fields} | {"method": "blend"}
        # a knob set away from its default is a given one (a request's options arrive merged
        # over these settings, every field present: ``server.translate`` applies the rule to
        # what the request itself gave)
        knobs = [k for k in DEVIATION_KNOBS if data.get(k) is not None and _knob(k, data[k]) != defaults[k]]
        data = {**data, "selection": deviation_selection(knobs, data.get("selection"))}
        return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}

    @model_validator(mode="after")
    def _valid(self) -> BlendSettings:
        self.blend_config()  # InvalidRequestError is a ValueError: pydantic reports it
        return self

    def check_model(self, num_layers: int) -> None:
        """ValueError when these defaults cannot run on a model of ``num_layers`` layers
        (checked when the server loads its model, not by every request's 400)."""
        check_layers_fit(self.check_layers, num_layers, "blend.check_layers")

    def blend_config(self) -> BlendConfig:
        """The engine's ``BlendConfig`` of these settings (every knob they share)."""
        shared = set(BlendSettings.model_fields) & {f.name for f in dataclasses.fields(BlendConfig)}
        return BlendConfig(**{name: getattr(self, name) for name in shared})


class LimitSettings(_Section):
    """Bounds on what one request may send; checked before tokenizing or allocating."""

    max_body_bytes: Size = Field(8 * MiB, gt=0)
    max_documents: int = Field(32, ge=0)
    max_document_bytes: Size = Field(256 * 1024, gt=0)
    max_document_tokens: int = Field(8192, gt=0)
    max_messages: int = Field(256, gt=0)
    max_tokens: int = Field(4096, gt=0)  # cap on max_tokens a client may ask for
    default_max_tokens: int = Field(256, gt=0)  # when the client gives none
    max_stop: int = Field(8, ge=0)
    max_stored_documents: int = Field(10_000, ge=0)  # per tenant, documents API
    # ``"kvblend": {"explain": true}``: token texts and selections shown per prompt document,
    # and in all (documents past either bound are cut, and say so)
    explain_document_tokens: int = Field(512, ge=0)
    explain_total_tokens: int = Field(4096, ge=0)


class DocumentSettings(_Section):
    """``POST /v1/documents``: a document is cut by the ``kvblend.rag`` chunker into fixed
    windows of ``chunk_tokens`` tokens of the serving model's tokenizer, each chunk's KV
    stored on its own (default: the rag chunker's size).

    ``match``: a request without a ``documents`` field has its messages' text searched
    for the tenant's stored chunks (registered, or seen in a ``documents`` field), each
    found one becoming a document where it stands (``kvblend.engine.matching``; a request
    turns it off with ``kvblend.match: false``). The index holds at most ``index_bytes``
    of texts and ids, all tenants together (least recently matched go first, from the
    tenant holding the most), and is rebuilt from the registry at startup. ``discover``:
    also treat a prompt's passages (split at blank lines and markdown headings) of at
    least ``discover_tokens`` tokens as documents from the ``discover_after``-th time the
    tenant sends them (admission: a passage pasted once is never stored; the counts are
    kept per server, bounded), each then stored and reused wherever a run of it appears.
    ``span_tokens``: a prompt's run of a stored chunk (the chunk cut elsewhere, or only
    part of it pasted) is reused from the chunk's KV when it holds at least this many of
    the chunk's tokens; texts ``kvblend ingest`` stored are matched too."""

    chunk_tokens: int = Field(ChunkerConfig().size, ge=1, le=MAX_CHUNK_TOKENS)
    match: bool = True
    span_tokens: int = Field(32, ge=1, le=MAX_CHUNK_TOKENS)
    discover: bool = True
    discover_tokens: int = Field(64, ge=1, le=MAX_CHUNK_TOKENS)
    discover_after: int = Field(2, ge=1, le=1000)
    index_bytes: Size = 256 * MiB


class TenantSettings(_Section):
    """One tenant's share of the model worker (``engine.fair.TenantShare``): its weight in
    the fair queue, its own cap on waiting requests, and an optional rate of computed
    tokens per second (prefill tokens the model ran, plus decoded tokens)."""

    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    max_queued: int | None = Field(None, ge=1)
    tokens_per_s: float | None = Field(None, gt=0, allow_inf_nan=False)


class SchedulerSettings(_Section):
    """The model worker (``kvblend.engine.scheduler``). ``prefill_chunk_tokens``: the largest
    prefill slice (or chunk run layer by layer); null runs each prefill whole. While streams
    decode, prefill and fusion work is cut so that a turn carrying it takes about
    ``max_stall_steps`` of their decode steps: the largest gap a running
    stream sees is about that multiple of its pace, and a long prompt arriving beside streams
    takes about 1 + 1/(max_stall_steps - 1) its time alone on a device where a decode step is
    mostly a pass over the weights (a CPU; less on a GPU). ``interleave``: how a prefill keeps
    that pace — "slices", small forwards riding in the decode step's pass (Sarathi-Serve), or
    "layers", larger chunks run a few layers per turn between decode-only steps; "auto" takes
    layers on a CPU (a pass there has a fixed cost small slices never amortise) and slices
    elsewhere. ``max_jobs`` bounds the jobs lane (document precompute,
    write-back: a full lane is a 429 for ``POST /v1/documents``), ``max_background`` the
    low-priority lane (shadow checks; more are dropped and counted). ``tenants`` gives
    tenants weights, queue caps and token rates; ``decode_weight`` is what a decoded token
    counts against a computed prompt token in the fair queue."""

    max_running: int = Field(8, gt=0)
    max_queued: int = 64
    request_deadline_s: float | None = Field(300.0, gt=0)
    max_background: int = Field(16, ge=0, le=4096)
    prefill_chunk_tokens: int | None = Field(1024, ge=1, le=1 << 20)
    max_stall_steps: float = Field(3.0, gt=1, le=1000, allow_inf_nan=False)
    interleave: Literal["auto", "layers", "slices"] = "auto"
    max_jobs: int = Field(32, ge=1, le=4096)
    decode_weight: float = Field(2.0, gt=0, allow_inf_nan=False)
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)

    def shares(self) -> dict[str, TenantShare]:
        return {name: TenantShare(t.weight, t.max_queued, t.tokens_per_s) for name, t in self.tenants.items()}

    @field_validator("max_queued")
    @classmethod
    def _queue_admits(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"scheduler.max_queued must be at least 1 (with {value} every request would get "
                             "a 429); it bounds the requests waiting for the model worker")
        return value


class RetrievalSettings(_Section):
    """Server-side retrieval (``"retrieval": {"top_k": k}`` in a request): off unless enabled.

    ``index_dir``: the folder ``kvblend ingest`` wrote (default ``$KVBLEND_HOME/rag/<tokenizer>``,
    where ``kvblend ingest`` puts it without ``--index``); ``mode``: dense, bm25 or hybrid;
    ``max_top_k``: the most chunks one request may ask for."""

    enabled: bool = False
    index_dir: str | None = None
    mode: Literal["dense", "bm25", "hybrid"] = "hybrid"
    max_top_k: int = Field(8, ge=1, le=MAX_TOP_K)


class GuardSettings(_Section):
    """The quality guard (``kvblend.guard.quality``): off unless enabled. ``shadow_fraction``
    of blended requests are shadow-checked against full prefill off the request's path
    (low-priority jobs of the scheduler's model worker, at most ``max_pending`` queued or
    running; more are dropped and counted), their prefill and teacher forcing run in steps
    of at most ``chunk_tokens`` tokens; ``method: auto`` requests are routed by the guard.
    A served blend whose risk (its estimate of how much of reuse's error it left) is at
    least the ``risk_quantile`` of its tenant's recent risks of the same kind is checked
    whatever the draw, ahead of the drawn ones (null: off)."""

    enabled: bool = False
    shadow_fraction: float = Field(0.05, ge=0.0, le=1.0)
    probe_fraction: float = Field(0.5, ge=0.0, le=1.0)
    window: int = Field(32, ge=1, le=4096)
    min_samples: int = Field(8, ge=1, le=4096)
    min_f1: float | None = Field(0.5, ge=0.0, le=1.0)
    fallback_ratio: Ratio | None = None
    override_explicit: bool = True
    max_pending: int = Field(8, ge=1, le=1024)
    chunk_tokens: int = Field(256, ge=1, le=MAX_CHUNK_TOKENS)
    risk_quantile: float | None = Field(0.9, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _valid(self) -> GuardSettings:
        if self.min_samples > self.window:
            raise ValueError("guard.min_samples must be at most guard.window")
        return self

    def guard_config(self):  # noqa: ANN201 - kvblend.guard.quality.GuardConfig (imported lazily: torch)
        from kvblend.guard.quality import GuardConfig

        return GuardConfig(shadow_fraction=self.shadow_fraction, probe_fraction=self.probe_fraction,
                           window=self.window, min_samples=self.min_samples, min_f1=self.min_f1,
                           fallback_ratio=self.fallback_ratio, override_explicit=self.override_explicit,
                           risk_quantile=self.risk_quantile)


class ClusterSettings(_Section):
    """``kvblend serve --replicas N``: the service as a Ray Serve application
    (``kvblend.cluster``, the ``cluster`` extra). ``replicas``: model replicas, each with
    its own scheduler and memory tier over the shared disk/Redis tiers (None: one process,
    no Ray); ``ray_address``: a running Ray cluster to join (None: start a local Ray
    instance); ``router``: ``affinity`` (documents' tokens held in a replica's memory tier)
    or ``default`` (Ray's power of two choices); ``ingress_replicas``: HTTP front ends (sharing the registry file,
    so on one host: see ``ingress_resources``; each keeps its part of the tenants' own
    ``max_queued`` and ``tokens_per_s``, which hold across the model replicas);
    ``replica_cpus``/``ingress_cpus``: Ray CPUs each replica reserves (a model replica runs
    torch on ``max(1, round(replica_cpus))`` threads; ``replica_cpus`` unset: an equal share
    of the CPUs the ingresses leave, at least 0.25, ``cluster.placement``; what does not fit
    the Ray cluster is refused at start); ``ingress_resources``: Ray custom
    resources the ingress needs, to pin it to the node holding ``state_dir`` (the document
    registry) and the retrieval index (``ray start --resources='{"kvblend_ingress": 1}'``
    there, ``{"kvblend_ingress": 0.01}`` here); ``routing_stats_period_s``: how often
    replicas report their resident documents to the router; ``load_factor``: the affinity
    router's load bound: a replica takes a request only while its requests not answering
    yet (queued or in prefill) stay under this multiple of the mean (rounded up), else the
    request goes to the replica next in its documents' order (consistent hashing with
    bounded loads; 1.0: none above the mean, of two replicas the less loaded: a shorter
    tail and fewer memory hits); ``health_check_period_s``: how often Ray checks a replica's
    model worker (a dead one is restarted)."""

    replicas: int | None = Field(None, ge=1, le=256)
    ray_address: str | None = None
    router: Literal["affinity", "default"] = "affinity"
    ingress_replicas: int = Field(1, ge=1, le=64)
    replica_cpus: float | None = Field(None, gt=0, le=1024, allow_inf_nan=False)
    ingress_cpus: float = Field(0.5, ge=0, le=1024, allow_inf_nan=False)
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    routing_stats_period_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False)
    load_factor: float = Field(1.25, ge=1.0, le=64.0, allow_inf_nan=False)
    health_check_period_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False)


# set by ``builtin_defaults``: settings built from flags and defaults only
_BUILTIN_ONLY: ContextVar[bool] = ContextVar("kvblend_builtin_settings", default=False)


@contextmanager
def builtin_defaults() -> Iterator[None]:
    """Within: ``load`` reads neither the environment nor ``KVBLEND_CONFIG`` (the built-in
    defaults, for ``kvblend --help`` while the settings are broken)."""
    token = _BUILTIN_ONLY.set(True)
    try:
        yield
    finally:
        _BUILTIN_ONLY.reset(token)


class ModelSettings(BaseSettings):
    """The model arguments every command shares (``--model``, ``--device``, ``--dtype``)."""

    model_config = SettingsConfigDict(env_prefix="KVBLEND_", env_nested_delimiter="__", extra="ignore",
                                      frozen=True)

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # The packed weight copy decode steps read (models.packed): auto = int8 for fp32 on the
    # CPU, none elsewhere; fp32 = the exact reference (decode reads the fp32 weights).
    decode_weights: Literal["auto", "fp32", "fp16", "int8"] = "auto"

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if _BUILTIN_ONLY.get():
            return (init_settings,)
        yaml_file = settings_cls.model_config.get("yaml_file")
        sources = [init_settings, env_settings]
        if yaml_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any):  # noqa: ANN206 - returns cls
        """Merge flags (``overrides``; None values are ignored) > env > YAML > defaults.

        Raises SettingsError naming the offending setting."""
        if _BUILTIN_ONLY.get():
            config_file = None
        else:
            config_file = config_file or os.environ.get("KVBLEND_CONFIG")
            _check_env()
        explicit = {k: v for k, v in overrides.items() if v is not None}
        target = cls
        if config_file:
            path = Path(config_file)
            if not path.is_file():
                raise SettingsError(f"config file {path} does not exist")
            _check_yaml(path)
            target = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "yaml_file": str(path)}})
        try:
            return target(**explicit)
        except ValidationError as exc:
            raise SettingsError(_describe(exc)) from None


# KVBLEND_* variables that are not settings: the model cache, the settings file, tracebacks,
# the allocator (``engine.allocator``), the native kernels' -march (``models.packed``)
NON_SETTINGS_ENV = frozenset({"home", "config", "debug", "malloc_tuning", "native_arch"})


def _check_env() -> None:
    """SettingsError for a ``KVBLEND_*`` variable that names no setting (``KVBLEND_PROT``,
    ``KVBLEND_STORE_MEMORY_BYTES`` with one underscore): pydantic-settings would ignore
    it, and the server would run on a default its operator meant to change. A misspelt
    name inside a section (``KVBLEND_STORE__MEMORYBYTES``) is refused by the section."""
    known = set(Settings.model_fields) | NON_SETTINGS_ENV
    unknown = sorted(name for name in os.environ if name.upper().startswith("KVBLEND_")
                     and name[len("KVBLEND_"):].lower().split("__")[0] not in known)
    if unknown:
        raise SettingsError(f"unknown setting(s) in the environment: {', '.join(unknown)} (a setting is "
                            "KVBLEND_<NAME>, one in a section KVBLEND_<SECTION>__<NAME>)")


class Settings(ModelSettings):
    """Everything ``kvblend serve`` reads (the model arguments included)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None  # id in /v1/models; default: the name the model was loaded by
    store: StoreSettings = StoreSettings()
    blend: BlendSettings = BlendSettings()
    limits: LimitSettings = LimitSettings()
    documents: DocumentSettings = DocumentSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    guard: GuardSettings = GuardSettings()
    cluster: ClusterSettings = ClusterSettings()
    api_keys: dict[str, str] = Field(default_factory=dict)  # key -> tenant; empty: no auth, tenant "default"
    admin_key: str | None = None  # when set, /metrics needs `Authorization: Bearer <admin_key>`
    drain_timeout_s: float = Field(30.0, ge=0)
    state_dir: str | None = None  # documents registry; default $KVBLEND_HOME/server
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # logprobs of the logits each token was drawn from (after the response format's mask,
    # logit_bias and penalties; vLLM's processed_logprobs) or of the model's raw ones
    logprobs_mode: Literal["processed", "raw"] = "processed"

    @field_validator("api_keys")
    @classmethod
    def _tenants(cls, keys: dict[str, str]) -> dict[str, str]:
        for key, tenant in keys.items():
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"each API key needs at least {MIN_KEY_CHARS} characters")
            validate_tenant(tenant)
        return keys

    @field_validator("admin_key")
    @classmethod
    def _admin_key(cls, key: str | None) -> str | None:
        if key is not None and len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the admin key needs at least {MIN_KEY_CHARS} characters, as API keys do")
        return key

    @property
    def model_id(self) -> str:
        """The id clients use in ``model``: the served name, or the name the model was loaded by."""
        return self.served_model_name or self.model

    def redacted(self) -> dict[str, Any]:
        """The merged settings as plain data with API and admin keys, and the password of
        a Redis URL, hidden."""
        data = self.model_dump(mode="json")
        data["api_keys"] = {f"{_mask(k)}#{i}": t for i, (k, t) in enumerate(self.api_keys.items())}
        data["admin_key"] = _mask(self.admin_key) if self.admin_key else None
        if self.store.redis_url:
            data["store"]["redis_url"] = hide_password(self.store.redis_url)
        return _finite(data)


def _finite(data: Any) -> Any:
    """``data`` with non-finite floats as the strings a setting takes back ("inf"), so that
    it prints as JSON (``Infinity`` is not JSON)."""
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    return data


def _mask(key: str) -> str:
    return key[:3] + "..." if len(key) > 6 else "***"


def _check_yaml(path: Path) -> None:
    """Unknown top-level keys in the YAML file are typos: refuse them (env is more lenient)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of settings")
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise SettingsError(f"config file {path}: unknown setting(s) {', '.join(map(str, unknown))}")


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        parts.append(f"{where}: {err['msg']}")
    return "invalid settings: " + "; ".join(parts)


def blend_defaults() -> BlendSettings:
    """The ``blend.*`` settings (``KVBLEND_BLEND__*``, the ``KVBLEND_CONFIG`` file, the
    engine's defaults), for the blend flags of ``kvblend ask``: the command line blends as
    the server does unless a flag says otherwise."""
    return Settings.load().blend


def model_defaults() -> ModelSettings:
    """Model, device and dtype from the environment (and ``KVBLEND_CONFIG``), for the
    model arguments of every command."""
    return ModelSettings.load()


__all__ = ["BlendOptions", "BlendSettings", "ClusterSettings", "DTYPES", "GuardSettings", "LimitSettings", "RetrievalSettings", "ModelSettings", "SchedulerSettings", "Settings", "SettingsError",
           "StoreSettings", "blend_defaults", "builtin_defaults", "model_defaults"]
