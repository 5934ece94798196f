"""The quart-trio application: routes, guards and error handling around one engine.

The app is a client of the embeddable API only (`state.EngineLike` is the
small surface it uses), so tests can serve a fake engine and the HTTP layer
never touches MLX.
"""

from __future__ import annotations

from quart_trio import QuartTrio

from mlx_trio.http.completions import register_completions
from mlx_trio.http.config import ServerConfig
from mlx_trio.http.errors import install_error_handlers
from mlx_trio.http.guards import install_guards
from mlx_trio.http.info import register_info
from mlx_trio.http.state import AppState, EngineLike


def create_app(engine: EngineLike, config: ServerConfig) -> QuartTrio:
    """Build the OpenAI-compatible app for `engine`; serve it with `HttpServer`.

    The handlers' shared `AppState` is `app.extensions["mlx_trio"]`.
    """
    state = AppState(engine, config)
    app = QuartTrio("mlx_trio.http")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes  # quart raises 413 past it
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False  # preflights are answered by the CORS guard
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["mlx_trio"] = state
    install_guards(app, config)
    install_error_handlers(app, max_body_bytes=config.max_body_bytes)
    register_info(app, state)
    register_completions(app, state)
    return app
