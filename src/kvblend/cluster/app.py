"""The Ray Serve application, and running it (``kvblend serve --replicas N``).

``build_application(settings, replicas=N, router=...)`` binds two deployments:
``KvblendModel`` (N ``model.ModelReplica``s, routed by ``router.DocumentAffinityRouter``
or Ray's default power of two choices) and ``KvblendIngress`` (``ingress.Ingress``: the
HTTP app, ``cluster.ingress_replicas`` of it). ``start_local`` runs it on the Ray instance
this process is connected to (or joins ``cluster.ray_address``, or starts a local one),
once ``cluster.placement`` found room for it there (a one-line ``SettingsError`` naming the
setting to change otherwise; before a local instance starts), and returns its base URL
once every replica is ready; ``shutdown`` deletes it. ``serve_cluster`` is the blocking
command: a SIGTERM/SIGINT while it starts stops it at once (exit 128 + the signal); the
first once it serves shuts Serve down gracefully (each replica finishes its requests for
up to ``drain_timeout_s``, then drains its scheduler and flushes write-back), a second
stops the drain. Whichever way it ends, the Ray instance it started is shut down with it
(GCS, raylet, dashboard, workers). While it starts, what Serve says of replicas that wait
(for room, or failing to start) is logged every ``STARTUP_REPORT_S``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvblend.cluster.ingress import MODEL_DEPLOYMENT, Ingress
from kvblend.cluster.metrics import BOARD_NAME, NAMESPACE, board_actor
from kvblend.cluster.model import ModelReplica, max_ongoing
from kvblend.cluster.placement import Demand, free_per_node, host_cpus, place
from kvblend.server.main import configure_logging
from kvblend.settings import Settings, SettingsError

log = logging.getLogger("kvblend.cluster")
APP_NAME = "kvblend"
INGRESS_DEPLOYMENT = "KvblendIngress"
ROUTERS = ("affinity", "default")
STARTUP_REPORT_S = 10.0
FREED_WAIT_S = 10.0


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
    """The ``serve.Application``; None arguments come from ``settings.cluster``
    (``replica_cpus`` unset there: 1; ``start_local`` sets it from ``cluster.placement``).
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
        ray_actor_options={"num_cpus": next(x for x in (replica_cpus, c.replica_cpus, 1.0) if x is not None)},
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
    local instance (with ``num_cpus``). True when a local instance was started here.
    ``ray.init`` sets its own SIGTERM handler; a Python handler set before it is put back."""
    import ray

    if ray.is_initialized():
        return False
    address = settings.cluster.ray_address
    handler = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, num_cpus=None if address else num_cpus, log_to_driver=False)
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return address is None


def sized(settings: Settings, replicas: int, num_cpus: int | None = None, **options: Any) -> tuple[Settings, bool]:
    """Connect to Ray (``connect``) once the application fits there, and return the settings
    with ``cluster.replica_cpus`` set (``cluster.placement``), and whether a local instance
    was started. A local instance is sized before it starts (``num_cpus``, else the host's
    CPUs); a cluster joined or already connected, from its nodes' free resources.
    ``options``: ``build_application``'s ``replica_cpus``, ``ingress_cpus``,
    ``ingress_replicas`` over the settings'. SettingsError when it does not fit."""
    import ray

    over = {k: v for k, v in options.items() if v is not None}
    cluster = settings.cluster.model_copy(update=over)
    demand = Demand.of(cluster, replicas)
    local = not ray.is_initialized() and cluster.ray_address is None
    if local:
        cpus = num_cpus if num_cpus is not None else int(host_cpus())
        replica_cpus = place(demand, [{"CPU": float(cpus)}])
        started = connect(settings, cpus)
    else:
        started = connect(settings)
        try:
            replica_cpus = _place_when_free(demand)
        except SettingsError:
            if started:
                ray.shutdown()
            raise
    cluster = cluster.model_copy(update={"replica_cpus": replica_cpus})
    return settings.model_copy(update={"cluster": cluster}), started


def _place_when_free(demand: Demand, wait_s: float = FREED_WAIT_S) -> float:
    """``place`` on the connected cluster's free resources, read again for up to ``wait_s``
    while it does not fit (actors of an application just shut down free theirs a moment
    after, as the nodes report it)."""
    until = time.monotonic() + wait_s
    while True:
        try:
            return place(demand, free_per_node())
        except SettingsError:
            if time.monotonic() >= until:
                raise
            time.sleep(1.0)


def start_local(settings: Settings, *, replicas: int | None = None, router: str | None = None,
                num_cpus: int | None = None, **options: Any) -> Running:
    """Run the application and return once every replica is ready. Ray: the instance this
    process is connected to, else ``cluster.ray_address``, else a new local one (with
    ``num_cpus``, default the host's CPUs); ``sized`` checks first that it fits there (a
    SettingsError otherwise). HTTP on ``settings.host:settings.port``. ``options`` go to
    ``build_application``."""
    from ray import serve

    replicas = replicas if replicas is not None else (settings.cluster.replicas or 1)
    settings, started_ray = sized(settings, replicas, num_cpus, **options)
    log.info("placing %d model replicas of %g CPU each", replicas, settings.cluster.replica_cpus)
    app = build_application(settings, replicas=replicas, router=router or settings.cluster.router)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    board_actor()  # replicas push their metrics here (created detached: shutdown removes it)
    with startup_reports(STARTUP_REPORT_S):
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return Running(f"http://{host}:{settings.port}", started_ray)


@contextmanager
def startup_reports(period_s: float) -> Iterator[None]:
    """Within: a thread logging, every ``period_s``, what ``serve.status()`` says of the
    application's deployments that are not healthy yet (Ray's own "taken more than 30s to
    be scheduled", a replica failing to start), each message once."""
    from ray import serve

    done = threading.Event()
    seen: set[str] = set()

    def run() -> None:
        while not done.wait(period_s):
            try:
                app = serve.status().applications.get(APP_NAME)
            except Exception as exc:  # noqa: BLE001 - the controller is busy: next time
                log.debug("serve.status() failed: %s", exc)
                continue
            for name, d in (app.deployments.items() if app is not None else ()):
                if d.message and d.message not in seen and str(getattr(d.status, "value", d.status)) != "HEALTHY":
                    seen.add(d.message)
                    log.warning("%s: %s", name, d.message)

    thread = threading.Thread(target=run, name="kvblend-startup-report", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


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


class Stop(BaseException):
    """A signal that stops ``serve_cluster`` now (while it starts, or drains)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGTERM and SIGINT for ``serve_cluster``, by phase: ``starting`` and ``draining``
    raise ``Stop`` where the main thread is; ``serving`` sets ``drain`` (the first) and
    raises ``Stop`` (the next); ``closing`` only logs (Ray is being shut down)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.drain = threading.Event()
        self._previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}

    def __call__(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.phase == "closing":
            log.info("%s: already stopping", name)
        elif self.phase == "serving" and not self.drain.is_set():
            self.drain.set()
        else:
            raise Stop(signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def serve_cluster(settings: Settings) -> int:
    """``kvblend serve --replicas N``: run until a signal; returns the exit status (0 after
    a drain, 128 + the signal when one stopped it while starting or draining)."""
    import ray

    configure_logging(settings.log_level)
    check_settings(settings)
    own_ray = settings.cluster.ray_address is None and not ray.is_initialized()
    signals = Signals()
    try:
        running = start_local(settings)
        log.info("serving %s on %s with %d model replicas (%s router)", settings.model_id, running.base_url,
                 settings.cluster.replicas, settings.cluster.router)
        signals.phase = "serving"
        while not signals.drain.wait(0.5):
            pass
        signals.phase = "draining"
        log.info("draining: up to %.1f s for running requests", settings.drain_timeout_s)
        shutdown(running)
        log.info("drained; stopping")
        return 0
    except Stop as stop:
        log.warning("%s while %s: stopping now", stop, signals.phase)
        if not own_ray and signals.phase == "starting" and ray.is_initialized():
            signals.phase = "closing"
            shutdown()  # the replicas placed so far on the cluster joined
        return 128 + stop.signum
    finally:
        signals.phase = "closing"
        if own_ray:
            ray.shutdown()  # every process of the instance started here: GCS, raylet, dashboard, workers
        signals.restore()


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


__all__ = ["APP_NAME", "INGRESS_DEPLOYMENT", "MODEL_DEPLOYMENT", "Running", "Signals", "Stop", "build_application",
           "check_settings", "connect", "serve_cluster", "shutdown", "sized", "start_local", "startup_reports",
           "wait_ready"]
