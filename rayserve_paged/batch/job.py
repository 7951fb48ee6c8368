"""`run_batch_file`: an OpenAI batch file through the processor into a result file, one
result line per input line, resumable.

    INPUT.jsonl ──(lines not yet written)──> processor ──> this process ──> OUTPUT.jsonl.parts/
                                                                             part-000001.arrow
                                                                             part-000002.arrow ...
    every line written: the parts in input order ──> OUTPUT.jsonl; the parts removed

Partial results are safe by rename: a part (the lines answered since the last one, every
`commit_rows` lines or `commit_interval_s`) is written to a temporary file, synced, then
renamed into the parts folder, and the output file is written the same way once every
line has its result. A job stopped at any point (Ctrl-C, a killed driver, a lost node)
and started again with the same input and output skips the lines (custom_ids) already in
a part and runs only the rest; an unfinished temporary file is discarded. The parts
remember a digest of the input they were made for, and refuse another input.

Exactly one line per input line (blank lines are not requests and get none): a line
answered twice (a retried batch) is kept once; a line whose batch failed on every try
(`max_retries`, its engine actor dying each time) is answered 503, as the server answers
when its engine is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc

from rayserve_paged.batch.format import output_line
from rayserve_paged.batch.processor import BatchConfig, build_processor
from rayserve_paged.batch.routes import BatchRoutes

logger = logging.getLogger(__name__)

COMMIT_ROWS = 1000
COMMIT_INTERVAL_S = 10.0
_PART_SCHEMA = pa.schema([("line", pa.int64()), ("output", pa.string())])


@dataclass(slots=True)
class ReplicaStats:
    """One engine actor's counters, as its last batch reported them."""

    num_steps: int = 0
    busy_s: float = 0.0  # in engine steps
    idle_s: float = 0.0  # waiting with nothing to step, after its first step
    span_s: float = 0.0  # from its first step's start to its last step's end


@dataclass(slots=True)
class BatchSummary:
    num_lines: int  # requests in the input (blank lines are not)
    num_skipped: int  # already written by an earlier run of the job
    num_written: int = 0  # answered by this run
    num_errors: int = 0  # of those, answered with an error status
    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    replicas: dict[str, ReplicaStats] = field(default_factory=dict)  # by "node ip:pid"


class PartStore:
    """The committed parts of one output file (see the module docstring)."""

    def __init__(self, output: Path, input_digest: str, commit_rows: int, commit_interval_s: float) -> None:
        self.output = output
        self.folder = output.with_name(output.name + ".parts")
        self.commit_rows = commit_rows
        self.commit_interval_s = commit_interval_s
        self.done: set[int] = set()
        self._lines: list[int] = []
        self._outputs: list[str] = []
        self._last_commit = time.monotonic()
        manifest = self.folder / "manifest.json"
        if self.folder.is_dir() and manifest.is_file():
            written_for = json.loads(manifest.read_text()).get("input_sha256")
            if written_for != input_digest:
                raise ValueError(
                    f"{self.folder} holds results of another input file (sha256 {written_for}); "
                    "remove it, or give this input another output"
                )
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(manifest, json.dumps({"input_sha256": input_digest}).encode())
        self._num_parts = 0
        for path in sorted(self.folder.iterdir()):
            if path.suffix == ".tmp":
                path.unlink()  # a part that was being written when the job stopped
            elif path.suffix == ".arrow":
                self._num_parts += 1
                self.done.update(_read_part(path)["line"].to_pylist())

    def add(self, line: int, output: str) -> bool:
        """Keep one line's result (False: it already has one)."""
        if line in self.done:
            return False
        self.done.add(line)
        self._lines.append(line)
        self._outputs.append(output)
        return True

    def is_commit_due(self) -> bool:
        if not self._lines:
            return False
        return len(self._lines) >= self.commit_rows or time.monotonic() - self._last_commit >= self.commit_interval_s

    def commit(self) -> None:
        if not self._lines:
            return
        self._num_parts += 1
        table = pa.table({"line": self._lines, "output": self._outputs}, schema=_PART_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, _PART_SCHEMA) as writer:
            writer.write_table(table)
        _write_atomic(self.folder / f"part-{self._num_parts:06d}.arrow", sink.getvalue().to_pybytes())
        self._lines, self._outputs = [], []
        self._last_commit = time.monotonic()

    def finish(self) -> None:
        """The output file from every part, in input order; then the parts go."""
        parts = [_read_part(p) for p in sorted(self.folder.glob("part-*.arrow"))]
        table = pa.concat_tables(parts) if parts else _PART_SCHEMA.empty_table()
        outputs = table["output"].take(pc.sort_indices(table["line"]))
        temporary = self.output.with_name(self.output.name + ".tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            for chunk in outputs.chunks:
                for text in chunk.to_pylist():
                    f.write(text)
                    f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.output)
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()


def _read_part(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the rename itself survives a crash
    finally:
        os.close(descriptor)


def read_lines(path: Path) -> tuple[list[tuple[int, str | None]], str]:
    """The file's requests as (line index, text; None: not UTF-8), and the file's sha256."""
    digest = hashlib.sha256()
    lines = []
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            digest.update(raw)
            if not raw.strip():
                continue
            try:
                lines.append((index, raw.decode("utf-8").rstrip("\r\n")))
            except UnicodeDecodeError:
                lines.append((index, None))
    return lines, digest.hexdigest()


def run_batch_file(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    config: BatchConfig,
    routes: type[BatchRoutes],
    *,
    address: str = "local",
    progress: bool = True,
    commit_rows: int = COMMIT_ROWS,
    commit_interval_s: float = COMMIT_INTERVAL_S,
    on_commit: Callable[[BatchSummary], None] | None = None,
) -> BatchSummary:
    """Answer every line of `input_path` into `output_path` (see the module docstring).
    `address`: "local" starts a Ray instance of the job's own, "auto" joins the cluster this
    node is in (or a cluster's address); a process already connected to Ray keeps its
    connection. `on_commit` sees the summary after each part."""
    output = Path(output_path)
    if output.exists():
        raise FileExistsError(f"{output} exists: the job that wrote it has finished; remove it to run again")
    started = time.monotonic()
    lines, digest = read_lines(Path(input_path))
    store = PartStore(output, digest, commit_rows, commit_interval_s)
    pending = [(index, text) for index, text in lines if index not in store.done]
    summary = BatchSummary(num_lines=len(lines), num_skipped=len(lines) - len(pending))
    if pending:
        _run(pending, store, summary, config, routes, address, progress, on_commit, started)
    store.finish()
    summary.elapsed_s = time.monotonic() - started
    return summary


def _run(pending, store, summary, config, routes, address, progress, on_commit, started) -> None:
    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init(address=address)
    context = ray.data.DataContext.get_current()
    context.max_errored_blocks = -1  # a batch that failed every retry: its lines are answered below
    context.enable_progress_bars = progress
    # one batch per block, so each engine actor task is one batch: Ray Data hands an actor up
    # to max_concurrent_batches of them, and blocks spread over the actors as they come up
    block_rows = config.batch_size
    blocks = [
        pa.table({"line": [i for i, _ in chunk], "text": [t for _, t in chunk]},
                 schema=pa.schema([("line", pa.int64()), ("text", pa.string())]))
        for chunk in (pending[start : start + block_rows] for start in range(0, len(pending), block_rows))
    ]  # fmt: skip
    results = build_processor(config, routes)(ray.data.from_arrow(blocks))
    bar = _progress_bar(len(pending)) if progress else None
    batches = iter(results.iter_batches(batch_size=None, batch_format="pyarrow"))
    try:
        for batch in batches:
            _take(batch, store, summary)
            if bar is not None:
                bar.update(batch.num_rows)
                bar.set_postfix_str(f"{summary.num_output_tokens / (time.monotonic() - started):.1f} output tok/s")
            if store.is_commit_due():
                store.commit()
                if on_commit is not None:
                    on_commit(summary)
    finally:
        getattr(batches, "close", lambda: None)()  # stops the pipeline (and its actors) on an early exit
        if bar is not None:
            bar.close()
    missing = [index for index, _ in pending if index not in store.done]
    if missing:
        from rayserve_paged.engine.frontend import EngineUnavailable

        reason = EngineUnavailable(
            f"the batch holding this line failed on each of its {config.max_retries + 1} tries (its engine actor died)"
        )
        status, body = routes.error(reason)
        custom_ids = _custom_ids(dict(pending), missing)
        for index in missing:
            store.add(index, output_line(custom_ids[index], status, body))
        summary.num_written += len(missing)
        summary.num_errors += len(missing)
        logger.error("%d lines were answered %d: their batches failed on every try", len(missing), status)
    store.commit()


def _take(batch: pa.Table, store: PartStore, summary: BatchSummary) -> None:
    columns = batch.to_pydict()
    for i, line in enumerate(columns["line"]):
        if not store.add(line, columns["output"][i]):
            continue  # a retried batch's second answer
        summary.num_written += 1
        summary.num_errors += columns["status_code"][i] != 200
        summary.num_output_tokens += columns["num_output_tokens"][i]
        stats = summary.replicas.setdefault(columns["replica"][i], ReplicaStats())
        if columns["replica_steps"][i] >= stats.num_steps:
            stats.num_steps = columns["replica_steps"][i]
            stats.busy_s = columns["replica_busy_s"][i]
            stats.idle_s = columns["replica_idle_s"][i]
            stats.span_s = columns["replica_span_s"][i]


def _custom_ids(texts: dict[int, str | None], indices: list[int]) -> dict[int, str | None]:
    found = {}
    for index in indices:
        try:
            custom_id = json.loads(texts[index] or "null").get("custom_id")
        except (ValueError, AttributeError):
            custom_id = None
        found[index] = custom_id if isinstance(custom_id, str) else None
    return found


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Batch lines", unit="line", dynamic_ncols=True)
