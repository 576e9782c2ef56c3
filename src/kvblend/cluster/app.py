"""The Ray Serve application, and running it (``kvblend serve --replicas N``).

``build_application(settings, replicas=N, router=...)`` binds two deployments:
``KvblendModel`` (N ``model.ModelReplica``s, routed by ``router.DocumentAffinityRouter``
or Ray's default power of two choices) and ``KvblendIngress`` (``ingress.Ingress``: the
HTTP app, ``cluster.ingress_replicas`` of it). ``start_local`` runs it on the Ray instance
this process is connected to (or joins ``cluster.ray_address``, or starts a local one)
and returns its base URL; ``shutdown`` deletes it. ``serve_cluster`` is the blocking
command: the first SIGTERM/SIGINT shuts Serve down gracefully (each replica finishes its
requests for up to ``drain_timeout_s``, then drains its scheduler and flushes write-back),
a second exits at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvblend.cluster.ingress import MODEL_DEPLOYMENT, Ingress
from kvblend.cluster.metrics import BOARD_NAME, NAMESPACE, board_actor
from kvblend.cluster.model import ModelReplica, max_ongoing
from kvblend.server.main import configure_logging
from kvblend.settings import Settings, SettingsError

log = logging.getLogger("kvblend.cluster")
APP_NAME = "kvblend"
INGRESS_DEPLOYMENT = "KvblendIngress"
ROUTERS = ("affinity", "default")


def check_settings(settings: Settings) -> None:
    """Refuse what a replicated deployment cannot honour yet (SettingsError), and blend
    defaults the model cannot run, before any replica starts (its config only, no weights)."""
    import torch

    from kvblend.models import load_model

    try:
        loaded = load_model(settings.model, "cpu", getattr(torch, settings.dtype), weights=False)
        settings.blend.check_model(loaded.config.num_layers)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if "memory" not in settings.store.tiers and settings.cluster.router == "affinity":
        log.warning("the affinity router routes on memory-tier residency, but store.tiers has no memory tier")


def build_application(settings: Settings, *, replicas: int, router: str = "affinity",
                      ingress_replicas: int | None = None, replica_cpus: float | None = None,
                      ingress_cpus: float | None = None) -> Any:
    """The ``serve.Application``; None arguments come from ``settings.cluster``.
    ``router``: "affinity" (``DocumentAffinityRouter``) or "default" (Ray's)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise SettingsError(f"router must be one of {', '.join(ROUTERS)}; got {router!r}")
    if replicas < 1:
        raise SettingsError(f"replicas must be at least 1; got {replicas}")
    check_settings(settings)
    c = settings.cluster
    routing: dict[str, Any] = {"request_routing_stats_period_s": c.routing_stats_period_s,
                               "request_routing_stats_timeout_s": max(5.0, c.routing_stats_period_s)}
    if router == "affinity":
        from kvblend.cluster.router import DocumentAffinityRouter

        routing["request_router_class"] = DocumentAffinityRouter
        routing["request_router_kwargs"] = {"load_factor": c.load_factor}
    model = serve.deployment(ModelReplica).options(
        name=MODEL_DEPLOYMENT, num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus if replica_cpus is not None else c.replica_cpus},
        max_ongoing_requests=max_ongoing(settings), request_router_config=RequestRouterConfig(**routing),
        health_check_period_s=c.health_check_period_s, health_check_timeout_s=max(30.0, c.health_check_period_s),
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 5.0, graceful_shutdown_wait_loop_s=1.0,
    ).bind(settings)
    ingresses = ingress_replicas or c.ingress_replicas
    if ingresses != c.ingress_replicas:  # each ingress keeps its part of the tenants' limits (cluster.remote)
        settings = settings.model_copy(update={"cluster": c.model_copy(update={"ingress_replicas": ingresses})})
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=ingresses,
        ray_actor_options={"num_cpus": ingress_cpus if ingress_cpus is not None else c.ingress_cpus,
                           **({"resources": dict(c.ingress_resources)} if c.ingress_resources else {})},
        max_ongoing_requests=max(64, replicas * max_ongoing(settings)),
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 5.0,
    ).bind(model, settings)
    return ingress


@dataclass
class Running:
    """A started application: its base URL and whether ``start_local`` started Ray."""

    base_url: str
    started_ray: bool


def connect(settings: Settings, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray unless it is already: ``cluster.ray_address``, else a new
    local instance (with ``num_cpus``). True when a local instance was started here."""
    import ray

    if ray.is_initialized():
        return False
    address = settings.cluster.ray_address
    ray.init(address=address, num_cpus=None if address else num_cpus, log_to_driver=False)
    return address is None


def start_local(settings: Settings, *, replicas: int | None = None, router: str | None = None,
                num_cpus: int | None = None, **options: Any) -> Running:
    """Run the application and return once every replica is ready. Ray: the instance this
    process is connected to, else ``cluster.ray_address``, else a new local one (with
    ``num_cpus``). HTTP on ``settings.host:settings.port``. ``options`` go to
    ``build_application``."""
    from ray import serve

    started_ray = connect(settings, num_cpus)
    replicas = replicas if replicas is not None else (settings.cluster.replicas or 1)
    app = build_application(settings, replicas=replicas, router=router or settings.cluster.router, **options)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    board_actor()  # replicas push their metrics here (created detached: shutdown removes it)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return Running(f"http://{host}:{settings.port}", started_ray)


def shutdown(running: Running | None = None) -> None:
    """Stop Serve (replicas drain gracefully) and remove the metrics board; stop Ray too
    when ``start_local`` started it."""
    import ray
    from ray import serve

    serve.shutdown()
    try:
        ray.kill(ray.get_actor(BOARD_NAME, namespace=NAMESPACE))
    except ValueError:
        pass
    if running is not None and running.started_ray:
        ray.shutdown()


def serve_cluster(settings: Settings) -> int:
    """``kvblend serve --replicas N``: run until a signal; returns the exit status."""
    configure_logging(settings.log_level)
    check_settings(settings)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():  # second signal: stop now
            raise SystemExit(1)
        log.info("draining: up to %.1f s for running requests", settings.drain_timeout_s)
        stop.set()

    started_ray = connect(settings)  # ray.init sets its own SIGTERM handler: ours goes after it
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    running = start_local(settings)
    running.started_ray = started_ray
    log.info("serving %s on %s with %d model replicas (%s router)", settings.model_id, running.base_url,
             settings.cluster.replicas, settings.cluster.router)
    try:
        while not stop.wait(0.5):
            pass
        shutdown(running)
        log.info("drained; stopping")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def wait_ready(base_url: str, timeout_s: float = 120.0) -> None:
    """Block until ``GET /health`` answers 200 (TimeoutError otherwise)."""
    import httpx

    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} was not ready within {timeout_s} s")


__all__ = ["APP_NAME", "INGRESS_DEPLOYMENT", "MODEL_DEPLOYMENT", "Running", "build_application",
           "check_settings", "connect", "serve_cluster", "shutdown", "start_local", "wait_ready"]
