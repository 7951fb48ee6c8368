"""The three stages of a batch processor, as Ray Data callable classes (one instance per
actor of each stage's pool). Rows carry plain columns between them:

    line, text                  the input line (its index in the file, its JSON text)
      │ Preprocess (CPU)        parse the batch line; routes.prepare: the server's checks,
      ▼                         chat template, token ids
    line, custom_id, plan, output      plan: the pickled prepared request; output: the
      │ EngineStage (engine)           finished result line, already, for a refused line
      ▼                         every plan's prompts into this actor's engine at once
    ... results, replica stats         results: pickled RequestOutputs, or the exception
      │ Postprocess (CPU)       routes.respond: the server's body; the result line
      ▼
    line, custom_id, output, status_code, num_output_tokens, replica, replica_*

Each engine actor owns one engine (the SchedulerActor's step loop, in its process at
TP = 1; its worker actors in the actor's placement group at TP > 1). Ray Data hands an actor
up to `max_concurrent_batches` batches at once and they all run on the actor's one event
loop, so their requests meet in the engine's continuous batching: while one batch waits
for its slowest row, the others keep the engine full.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle

import pyarrow as pa

from rayserve_paged.batch.format import LineError, output_line, parse_line, parse_request

logger = logging.getLogger(__name__)

NO_BYTES = b""
PREPARED = ["line", "custom_id", "plan", "output", "status_code"]
REPLICA = ["replica", "replica_steps", "replica_busy_s", "replica_idle_s", "replica_span_s"]  # the engine actor's counters
ANSWERED = ["line", "custom_id", "output", "status_code", "num_output_tokens", *REPLICA]


def _rows(batch: pa.Table) -> list[dict]:
    return batch.to_pylist()


def _columns(rows: list[dict], names: list[str]) -> pa.Table:
    """The next stage's columns; `line` is the input's own (-1 where it had none)."""
    table = {name: [row[name] for row in rows] for name in names if name != "line"}
    return pa.table({"line": pa.array([row.get("line", -1) for row in rows], pa.int64()), **table})


def _load_tokenizer(engine: dict):
    from rayserve_paged.models.loader import load_tokenizer

    return load_tokenizer(engine.get("tokenizer") or engine["model"], engine.get("trust_remote_code", False))


class _RoutesStage:
    """A CPU stage: the routes over this actor's tokenizer."""

    def __init__(self, routes: type, engine: dict, info: dict, served_model_name: str, tool_call_parser: str | None):
        lora_modules = dict(engine.get("lora_modules") or {})
        self.routes = routes(_load_tokenizer(engine), info, served_model_name, lora_modules, tool_call_parser)

    def answer(self, custom_id: str | None, exc: BaseException, plan=None) -> tuple[int, str]:
        status, body = self.routes.error(exc, plan)
        return status, output_line(custom_id, status, body)


class Preprocess(_RoutesStage):
    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = _rows(batch)
        for row in rows:  # one at a time: the tokenizer work queues in the routes' bounded pool
            await self._prepare(row)
        return _columns(rows, PREPARED)

    async def _prepare(self, row: dict) -> None:
        row.update(custom_id="", plan=NO_BYTES, output="", status_code=0)
        try:
            if "text" in row:  # a batch file's line
                custom_id, url, body = parse_line(row["text"], self.routes.urls)
            else:  # a dataset with the line's fields as columns (a JSON or parquet reader's)
                custom_id, url, body = parse_request(row, self.routes.urls)
        except LineError as exc:
            row["custom_id"] = exc.custom_id or ""
            row["status_code"], row["output"] = self.answer(exc.custom_id, exc)
            return
        row["custom_id"] = custom_id
        try:
            row["plan"] = pickle.dumps(await self.routes.prepare(url, body))
        except Exception as exc:  # the server's answer to this body is an error
            row["status_code"], row["output"] = self.answer(custom_id, exc)


class EngineStage:
    def __init__(self, engine: dict, worker_cpus: float = 1.0) -> None:
        from ray.util import get_node_ip_address

        from rayserve_paged.config import EngineConfig
        from rayserve_paged.engine.frontend import EngineFrontend
        from rayserve_paged.engine.ray_executor import show_info_logs
        from rayserve_paged.engine.scheduler_actor import SchedulerActor

        show_info_logs()
        self.core = SchedulerActor(EngineConfig(**engine), worker_cpus=worker_cpus)  # loads the model
        self.frontend = EngineFrontend(self.core, _load_tokenizer(engine))
        self.replica = f"{get_node_ip_address()}:{os.getpid()}"

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = _rows(batch)
        results = await asyncio.gather(*(self._generate(row["plan"]) for row in rows))
        timing = self.core.timing
        for row, result in zip(rows, results):
            row.update(results=result, replica=self.replica, replica_steps=timing.steps,
                       replica_busy_s=timing.step_s, replica_idle_s=timing.idle_s, replica_span_s=timing.span_s)  # fmt: skip
        return _columns(rows, PREPARED + ["results", *REPLICA])

    async def _generate(self, plan_bytes: bytes) -> bytes:
        """The pickled results of the line's prompts, or of the exception that ended them."""
        if not plan_bytes:
            return NO_BYTES  # answered before the engine
        from rayserve_paged.engine.frontend import EngineUnavailable

        plan = pickle.loads(plan_bytes)
        tasks = [
            asyncio.ensure_future(self.frontend.generate(p.token_ids, plan.params, request_id, lora_name=plan.lora_name))
            for p, request_id in zip(plan.prompts, plan.request_ids)
        ]
        try:
            return pickle.dumps(await asyncio.gather(*tasks))
        except EngineUnavailable as exc:
            # The engine is gone: this actor ends, so Ray Data replaces it and retries its
            # batches there (a clean exit would not be retried; ray-project/ray#59522).
            logger.error("the engine failed; the actor exits to be replaced: %r", exc)
            os._exit(1)
        except Exception as exc:  # this line's own failure (RequestFailed, a grammar, ...)
            for task in tasks:
                task.cancel()  # a cancelled generate aborts its engine request
            return _pickled_error(exc)


def _pickled_error(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # an exception that does not pickle still says what it was
        return pickle.dumps(RuntimeError(repr(exc)))


class Postprocess(_RoutesStage):
    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = _rows(batch)
        for row in rows:
            self._respond(row)
        return _columns(rows, ANSWERED)

    def _respond(self, row: dict) -> None:
        row["num_output_tokens"] = 0
        custom_id = row["custom_id"] or None
        if row["output"]:  # answered before the engine
            return
        plan = pickle.loads(row["plan"])
        results = pickle.loads(row["results"])
        if isinstance(results, BaseException):
            row["status_code"], row["output"] = self.answer(custom_id, results, plan)
            return
        try:
            body = self.routes.respond(plan, results)
        except Exception as exc:
            row["status_code"], row["output"] = self.answer(custom_id, exc, plan)
            return
        row["status_code"] = 200
        row["num_output_tokens"] = sum(len(c.token_ids) for r in results for c in r.outputs)
        row["output"] = output_line(custom_id, 200, body)
