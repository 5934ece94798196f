"""The quart-trio application: routes, guards and error handling around one engine.

The app is a client of the embeddable API only (`state.EngineLike` is the
small surface it uses), so tests can serve a fake engine and the HTTP layer
never touches MLX.
"""

from __future__ import annotations

from quart_trio import QuartTrio

from mlx_trio.http.server.admin import install_fault_point, register_admin
from mlx_trio.http.openai.endpoints import register_completions
from mlx_trio.http.server.config import ServerConfig
from mlx_trio.http.server.drain import Drain
from mlx_trio.http.server.errors import install_error_handlers
from mlx_trio.http.server.guards import install_guards
from mlx_trio.http.server.info import register_info
from mlx_trio.http.server.lora_admin import register_lora_admin
from mlx_trio.http.anthropic.endpoint import register_messages
from mlx_trio.http.server.prometheus import Metrics, register_metrics
from mlx_trio.http.responses.endpoint import register_responses
from mlx_trio.http.server.state import AppState, EngineLike, HandlerCrashes
from mlx_trio.http.server.status_page import register_root, register_status_page


def create_app(engine: EngineLike, config: ServerConfig, *, drain: Drain | None = None,
               metrics: Metrics | None = None, crashes: HandlerCrashes | None = None) -> QuartTrio:
    """Build the OpenAI-compatible app for `engine`; serve it with `HttpServer`.

    The handlers' shared `AppState` is `app.extensions["mlx_trio"]`. `drain`,
    `metrics` and `crashes` are the server's, shared across restarts of its
    child; by default the app gets fresh ones.
    """
    drain = drain if drain is not None else Drain()
    metrics = metrics if metrics is not None else server_metrics(engine, drain)
    state = AppState(engine, config, drain, metrics, crashes if crashes is not None else HandlerCrashes())
    app = QuartTrio("mlx_trio.http")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes  # quart raises 413 past it
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False  # preflights are answered by the CORS guard
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["mlx_trio"] = state
    install_fault_point(app, state)  # first: a crash point sits before any other work of a request
    install_guards(app, config)
    install_error_handlers(app, max_body_bytes=config.max_body_bytes, on_crash=state.crashes.record)
    register_metrics(app, state)
    register_info(app, state)
    register_completions(app, state)
    register_messages(app, state)
    register_responses(app, state)
    register_admin(app, state)
    register_lora_admin(app, state)
    register_status_page(app, state)
    register_root(app, state)
    return app


def server_metrics(engine: EngineLike, drain: Drain) -> Metrics:
    """The Prometheus instruments of a server serving `engine`, with its drain's gauges."""
    def http_gauges() -> dict[str, tuple[str, float]]:
        return {
            "http_requests_in_flight": ("HTTP requests being handled", drain.in_flight),
            "http_draining": ("1 while the server drains before shutting down", 1 if drain.draining else 0),
        }

    return Metrics(engine.status, http_gauges)
