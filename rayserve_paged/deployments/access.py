"""Who may call the HTTP API: the API key comes from the replica's environment, never from
the Serve config.

Serve logs an application's arguments in clear ("Importing application 'llm' with arguments
{...}" in the controller log, and `serve run` prints them), so a key given as an argument
ends up in every log. As vLLM reads VLLM_API_KEY, the replica reads:

    RAYSERVE_PAGED_API_KEY        the key itself: set it in the environment of the Ray nodes
                                  (`ray start`, the shell of a local `serve run`, or a
                                  Kubernetes Secret into the pods' env, as deploy/ does)
    RAYSERVE_PAGED_API_KEY_FILE   a file holding the key: safe to put in the Serve config's
                                  `runtime_env.env_vars` (a mounted Secret, a file only the
                                  Ray user can read)

Tenants with keys of their own, each with a limit on how urgent its requests may be (the
`priority` field under scheduling_policy: priority; lower is more urgent):

    RAYSERVE_PAGED_API_KEYS_FILE  a JSON file of {"<key>": {"min_priority": <int or null>}}:
                                  each key is accepted, and its requests may ask for
                                  priority min_priority or higher (a more urgent one is a
                                  403; an unset priority is max(0, min_priority)); null or
                                  absent: no limit. RAYSERVE_PAGED_API_KEY, when also set,
                                  is the operator's key, without a limit.

Do not put the key itself in `runtime_env.env_vars`: Ray's runtime-env agent logs every
runtime env it creates in full ("Creating runtime env: {...}" in runtime_env_agent.log).

The key cannot fail open: a variable that is set but blank (a Secret with an empty value), a
key file that is missing or empty, or no key where the app requires one (`require_api_key`)
stops the replica at start-up with an error naming the variable. Running without a key is
a choice (`require_api_key: false`, the local configs), logged once at start-up as a WARNING.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAYSERVE_PAGED_API_KEY"
API_KEY_FILE_ENV = "RAYSERVE_PAGED_API_KEY_FILE"
API_KEYS_FILE_ENV = "RAYSERVE_PAGED_API_KEYS_FILE"

# what needs no key when one is set: probes and the Prometheus scrape (vLLM protects /v1 only)
DEFAULT_OPEN_PATHS = ("/health", "/metrics")

API_KEY_REFUSED = (
    "api_key: not accepted as an application argument, because Ray Serve logs the arguments in "
    f"clear (controller log, serve run output). Set the environment variable {API_KEY_ENV} on the "
    f"Ray nodes (or a Kubernetes Secret into the pods' env), or {API_KEY_FILE_ENV}=<a file holding "
    "the key> in runtime_env.env_vars (docs/DEPLOY.md, 'API key')"
)


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key the replica enforces, or None (no key: every route is open).

    RAYSERVE_PAGED_API_KEY wins over RAYSERVE_PAGED_API_KEY_FILE. Surrounding whitespace is
    dropped (a Secret file often ends with a newline). A variable set to a blank key, or a key
    file that cannot be read or is empty, is an error (naming the variable, not the
    contents), never "no key"."""
    environ = os.environ if environ is None else environ
    key = environ.get(API_KEY_ENV, "").strip()
    if API_KEY_ENV in environ and not key:
        raise RuntimeError(
            f"{API_KEY_ENV} is set but blank (an empty Secret?): refusing to start without the key it was "
            "meant to hold. Give it the key, or unset it to run without one"
        )
    if not key and environ.get(API_KEY_FILE_ENV):
        path = Path(environ[API_KEY_FILE_ENV])
        try:
            key = path.read_text().strip()
        except OSError as e:
            raise RuntimeError(f"{API_KEY_FILE_ENV}: cannot read the API key file {path}: {e.strerror}") from None
        if not key:
            raise RuntimeError(f"{API_KEY_FILE_ENV}: the API key file {path} is empty")
    return key or None


def tenant_keys_from_env(environ: Mapping[str, str] | None = None) -> dict[str, int | None]:
    """The tenants' keys of RAYSERVE_PAGED_API_KEYS_FILE, each with the most urgent priority
    it may ask for (None: any); {} when the variable is unset. A file that cannot be read,
    is not such a JSON object, or holds no key is an error naming the variable (never "no
    key"); the error never quotes a key."""
    environ = os.environ if environ is None else environ
    if not environ.get(API_KEYS_FILE_ENV):
        return {}
    path = Path(environ[API_KEYS_FILE_ENV])
    try:
        entries = json.loads(path.read_text())
    except OSError as e:
        raise RuntimeError(f"{API_KEYS_FILE_ENV}: cannot read the API keys file {path}: {e.strerror}") from None
    except ValueError:
        raise RuntimeError(f"{API_KEYS_FILE_ENV}: the API keys file {path} is not JSON") from None
    if not isinstance(entries, dict) or not entries:
        raise RuntimeError(f'{API_KEYS_FILE_ENV}: {path} must be a non-empty object {{"<key>": {{"min_priority": ...}}}}')
    keys: dict[str, int | None] = {}
    for number, (key, entry) in enumerate(entries.items(), 1):
        limit = entry.get("min_priority") if isinstance(entry, dict) else False
        if not key.strip() or not (limit is None or (isinstance(limit, int) and not isinstance(limit, bool))):
            raise RuntimeError(
                f"{API_KEYS_FILE_ENV}: entry {number} of {path} must be a non-blank key mapped to "
                '{"min_priority": <integer or null>}'
            )
        keys[key.strip()] = limit
    return keys


def replica_api_keys(require: bool, environ: Mapping[str, str] | None = None) -> dict[str, int | None]:
    """Every key a replica accepts, each with its priority limit (the operator's key of
    replica_api_key: none); {} serves every route to anyone."""
    keys = tenant_keys_from_env(environ)
    key = replica_api_key(require and not keys, environ, warn=not keys)
    return keys if key is None else {**keys, key: None}


def replica_api_key(require: bool, environ: Mapping[str, str] | None = None, warn: bool = True) -> str | None:
    """The key a replica starts with (api_key_from_env); with `require`, no key is an error.
    Without a key and not required: one WARNING, at start-up, naming the variables."""
    key = api_key_from_env(environ)
    if key is None and require:
        raise RuntimeError(
            f"require_api_key is true but no API key is set: set {API_KEY_ENV} (or {API_KEY_FILE_ENV}) in "
            "the replicas' environment (docs/DEPLOY.md, section 10), or require_api_key: false to serve "
            "without one"
        )
    if key is None and warn:
        logger.warning(
            "no API key: neither %s nor %s is set (require_api_key: false), so every route is open to "
            "anyone who can reach the HTTP port",
            API_KEY_ENV,
            API_KEY_FILE_ENV,
        )
    return key
