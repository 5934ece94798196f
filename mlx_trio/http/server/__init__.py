"""The server plumbing: app, hypercorn server, SSE framing, errors, guards, drain, admin, info, metrics."""
