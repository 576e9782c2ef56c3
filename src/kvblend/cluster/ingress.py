"""The ingress deployment: today's FastAPI app, its model work sent to the model replicas.

The app (``server.app.create_app``) runs unchanged: keys and tenants, validation, the
document registry and matching index, retrieval, shaping (documents resolved, layout
rendered, chunk keys). It is built over an engine that never runs the model (weights on
torch's ``meta`` device: config, tokenizer, fingerprints) whose store holds only the
shared tiers (disk, Redis) — what ``GET /v1/documents/{id}`` and the store view report —
and over a ``cluster.remote.RemoteScheduler`` that sends each shaped request to a model
replica through the model deployment's handle, after checking the tenant's own queue cap
and token rate (this ingress's part of them: ``cluster.remote.tenant_ledger``; what a
replica charged for a call cancelled before its end comes back through this ingress's
inbox, ``cluster.settle``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from kvblend.cluster.metrics import ClusterExposition
from kvblend.cluster.purge import PurgePublisher
from kvblend.cluster.remote import RemoteScheduler, tenant_ledger, watch_replicas
from kvblend.cluster.settle import follow_inbox, start_inbox
from kvblend.engine import Engine, PrefixCache
from kvblend.server.app import create_app
from kvblend.server.main import configure_logging
from kvblend.settings import Settings

log = logging.getLogger("kvblend.cluster")
MODEL_DEPLOYMENT = "KvblendModel"  # the model deployment's name (cluster.app binds it so)
REPLICA_WATCH_S = 2.0  # how often /health's view of the running model replicas is refreshed
COMPUTE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def shaping_engine(settings: Settings) -> Engine:
    """An engine for shaping and keying only: no weights, no self-check, and a store of
    the configured shared tiers (with none, a memory tier too small to hold a chunk)."""
    import torch

    from kvblend.models import load_model
    from kvblend.store.config import build_store

    loaded = load_model(settings.model, "cpu", getattr(torch, settings.dtype), weights=False)
    settings.blend.check_model(loaded.config.num_layers)
    config = settings.store.store_config(COMPUTE[settings.dtype])
    shared = tuple(t for t in config.tiers if t != "memory" and t in config.enabled_tiers)
    config = dataclasses.replace(config, tiers=shared or ("memory",), memory_bytes=0 if shared else 1)
    return Engine(loaded, store=build_store(config), prefix_cache=PrefixCache(0), self_check=False, calibrate=False)


class Ingress:
    """The ingress replica (wrapped by ``serve.ingress()``; Serve calls
    ``__serve_build_asgi_app__`` after the constructor and runs the app's lifespan)."""

    def __init__(self, model: Any, settings: Settings) -> None:
        configure_logging(settings.log_level)
        self.model = model  # DeploymentHandle of the model deployment
        self.settings = settings
        self.engine: Engine | None = None
        self._inbox: Any = None  # the settlement inbox's actor handle: it lives while we hold it
        self._stop = threading.Event()

    def __serve_build_asgi_app__(self) -> Any:
        from ray import serve

        self.engine = shaping_engine(self.settings)
        scheduler = RemoteScheduler(self.model, self.engine, tenant_ledger(self.settings))
        app = create_app(self.engine, self.settings, scheduler=scheduler)
        state = app.state.kvblend
        context = serve.get_replica_context()
        watch_replicas(scheduler, context.replica_id.deployment_id.app_name, MODEL_DEPLOYMENT, REPLICA_WATCH_S, self._stop)
        ingress_id = serve.get_replica_context().replica_id.unique_id
        state.exposition = ClusterExposition(ingress_id, state.metrics.registry)
        scheduler.inbox, self._inbox = start_inbox(ingress_id)
        follow_inbox(self._inbox, scheduler, self._stop)
        app_name = context.replica_id.deployment_id.app_name
        publisher = PurgePublisher(app_name)  # a DELETE's freed chunk keys leave the replicas' own tiers too
        state.purge, state.revive = publisher.purge, publisher.revive
        state.request_id_header = False  # Serve's proxy answers X-Request-ID (the client's, or its own)
        return app

    def __del__(self) -> None:
        self._stop.set()
        if getattr(self, "engine", None) is not None:
            self.engine.close()


__all__ = ["Ingress", "shaping_engine"]
