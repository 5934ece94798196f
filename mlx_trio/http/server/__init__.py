"""The server plumbing: app, hypercorn server, JSON bodies, SSE framing, errors, guards, drain, admin, info, metrics."""
