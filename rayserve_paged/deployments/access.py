"""Who may call the HTTP API: the API key comes from the replica's environment, never from
the Serve config.

Serve logs an application's arguments in clear ("Importing application 'llm' with arguments
{...}" in the controller log, and `serve run` prints them), so a key given as an argument
ends up in every log. As vLLM reads VLLM_API_KEY, the replica reads RAYSERVE_PAGED_API_KEY:
set it with `runtime_env.env_vars` in the Serve config, in the environment of the Ray
nodes, or (deploy/) from a Kubernetes Secret into the pods' environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV = "RAYSERVE_PAGED_API_KEY"

# what needs no key when one is set: probes and the Prometheus scrape (vLLM protects /v1 only)
DEFAULT_OPEN_PATHS = ("/health", "/metrics")

API_KEY_REFUSED = (
    "api_key: not accepted as an application argument, because Ray Serve logs the arguments in "
    f"clear (controller log, serve run output). Set the environment variable {API_KEY_ENV} instead: "
    f"runtime_env: {{env_vars: {{{API_KEY_ENV}: ...}}}} in the Serve config, the Ray nodes' "
    "environment, or a Kubernetes Secret (docs/DEPLOY.md, 'API key')"
)


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key the replica enforces, or None (no key: every route is open). Surrounding
    whitespace is dropped (a Secret file often ends with a newline); an empty value is none."""
    environ = os.environ if environ is None else environ
    key = environ.get(API_KEY_ENV, "").strip()
    return key or None
