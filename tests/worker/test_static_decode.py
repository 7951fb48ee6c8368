"""The static-shape decode path (worker/static_decode.py): decode batches padded to a bucket
over persistent inputs give exactly the tokens of the unpadded eager path; what runs where
(static for decode-only steps within the buckets, eager otherwise); the bucket list; and,
where CUDA exists, one captured graph per bucket replaying to the same tokens."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.core.outputs import NewRequest, StepMessage
from rayserve_paged.core.sequence import SamplingParams
from rayserve_paged.models.loader import get_model_config, load_model
from rayserve_paged.models.sampler import Sampler
from rayserve_paged.models.tiny import make_tiny_model
from rayserve_paged.ops.attention import PAD_SLOT
from rayserve_paged.ops.paged_attention import TorchReferenceBackend
from rayserve_paged.worker.input_batch import InputBatch
from rayserve_paged.worker.kv_sizing import kv_cache_budget_bytes
from rayserve_paged.worker.model_runner import ModelRunner
from rayserve_paged.worker.static_decode import StaticDecode, decode_buckets, decode_rows
from tests.core.views import GroupView, SeqView
from tests.models.conftest import one_torch_thread  # noqa: F401  (an autouse fixture)

BLOCK_SIZE = 8
MAX_MODEL_LEN = 128
PREFIX = 2 * BLOCK_SIZE  # tokens of the shared prompt prefix: two full blocks


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    return {arch: str(make_tiny_model(arch, tmp_path_factory.mktemp(f"static-{arch}"))) for arch in ("opt", "llama")}


def test_bucket_lists():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 4)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert decode_buckets(33) == (1, 2, 4, 8, 16, 24, 32, 48)
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112)
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16))
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def step_message(groups: list[GroupView]) -> StepMessage:
    """The step message for groups described one object per sequence: parameters for the
    groups that carry them, every row's whole block table (a valid update, if not the
    smallest), the rows and their flags."""
    msg = StepMessage()
    for g in groups:
        if g.sampling_params is not None:
            msg.new_requests.append(NewRequest(g.request_id, g.seqs[0].seq_id, g.sampling_params, g.num_prompt_tokens))
        for s in g.seqs:
            msg.block_table_updates.append((s.seq_id, 0, list(s.block_table)))
            msg.seq_ids.append(s.seq_id)
            msg.start_positions.append(s.start_pos)
            msg.num_query_tokens.append(len(s.token_ids))
            msg.token_ids.extend(s.token_ids)
            if not g.do_sample:
                msg.unsampled_seq_ids.append(s.seq_id)
        if g.is_first_step and g.do_sample:
            msg.first_step_seq_ids.append(g.seqs[0].seq_id)
    return msg


def rows_of(groups: list[GroupView]):
    """decode_rows of the groups' step, on a fresh persistent batch that knows them."""
    batch = InputBatch()
    batch.apply(StepMessage(new_requests=[
        NewRequest(g.request_id, g.seqs[0].seq_id, SamplingParams(), g.num_prompt_tokens) for g in groups
    ]))
    msg = step_message([GroupView(g.request_id, g.seqs, None, g.num_prompt_tokens, g.is_first_step, g.do_sample)
                        for g in groups])
    msg.forks = [(g.seqs[0].seq_id, s.seq_id, i) for g in groups for i, s in enumerate(g.seqs) if i]
    batch.apply(msg)
    return decode_rows(msg, batch.rows(msg), BLOCK_SIZE)


class Harness:
    """One tiny model, a KV cache, and a ModelRunner, with or without the static path.
    Greedy decoding of a batch whose prompts share a PREFIX-token prefix: the first prompt's
    prefill writes the shared blocks, the others prefill only their own tail (a prefix-cache
    hit), so every decode reads the shared blocks through several block tables."""

    def __init__(self, path: str, max_num_seqs: int | None, num_blocks: int = 200) -> None:
        mc = get_model_config(path)
        self.backend = TorchReferenceBackend()
        model = load_model(path, torch.float32, "cpu", self.backend)
        eos = tuple(mc.eos_token_ids)
        self.static = None
        if max_num_seqs is not None:
            self.static = StaticDecode(model, BLOCK_SIZE, max_num_seqs, MAX_MODEL_LEN, "cpu", self.backend)
        self.runner = ModelRunner(model, BLOCK_SIZE, torch.device("cpu"), Sampler(len(eos), eos), self.backend, self.static)
        shape = (num_blocks, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(mc.num_layers)]
        self.paths: list[str] = []

    def greedy(self, num_seqs: int, steps: int, tag: str) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        prefix = [(7 * i) % 300 + 5 for i in range(PREFIX)]
        prompts = [prefix + [(11 * s + 3 * j) % 300 + 5 for j in range(1 + s % 5)] for s in range(num_seqs)]
        blocks_per_seq = -(-(PREFIX + 5 + steps + 1) // BLOCK_SIZE)
        shared = [1, 2]  # the prefix's two blocks, in every table
        tables = [shared + [3 + s * blocks_per_seq + k for k in range(blocks_per_seq - 2)] for s in range(num_seqs)]
        ids = [f"{tag}-{s}" for s in range(num_seqs)]
        outputs: list[list[int]] = [[] for _ in range(num_seqs)]
        # step 0: sequence 0's whole prompt; step 1: the others' tails after the cached prefix
        first = [GroupView(ids[0], [SeqView(0, prompts[0], 0, tables[0], 0, 0)], params, len(prompts[0]), True)]
        rest = [
            GroupView(ids[s], [SeqView(s, prompts[s][PREFIX:], PREFIX, tables[s], 0, 0)], params,
                           len(prompts[s]), True)
            for s in range(1, num_seqs)
        ]
        for groups in (first, rest):
            if groups:
                for group, sample in zip(groups, self._step(groups)):
                    outputs[int(group.request_id.rsplit("-", 1)[1])].append(sample)
        for _ in range(steps):
            groups = [
                GroupView(ids[s], [SeqView(s, [outputs[s][-1]], len(prompts[s]) + len(outputs[s]) - 1,
                                                     tables[s], len(outputs[s]), 0)], None, len(prompts[s]), False)
                for s in range(num_seqs)
            ]
            for s, sample in enumerate(self._step(groups)):
                outputs[s].append(sample)
        self.runner.execute(StepMessage(finished_request_ids=ids), self.caches)
        return outputs

    def _step(self, groups) -> list[int]:
        samples = self.runner.execute(step_message(groups), self.caches).samples
        self.paths.append(self.runner.last_path)
        return [s.token_ids[0] for s in samples]


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_padded_static_decode_gives_the_tokens_of_the_unpadded_path(tiny_paths, arch):
    eager, static = Harness(tiny_paths[arch], None), Harness(tiny_paths[arch], max_num_seqs=24)
    assert static.static.buckets == (1, 2, 4, 8, 16, 24)
    steps = 3
    # inside buckets (3, 5, 13, 17) and at their edges (1, 2, 8, 24)
    for num_seqs in (1, 2, 3, 5, 8, 13, 17, 24):
        expected = eager.greedy(num_seqs, steps, f"b{num_seqs}")
        before = dict(static.static.runs)
        assert static.greedy(num_seqs, steps, f"b{num_seqs}") == expected, num_seqs
        assert static.static.runs == {"graph": 0, "eager": before["eager"] + steps}
    prefill_steps = [p for p in static.paths if p == "eager"]
    assert len(prefill_steps) == 2 * 8 - 1  # every prefill step (batch 1 has no second one) ran eagerly
    assert static.paths.count("static-eager") == 8 * steps
    assert all(p == "eager" for p in eager.paths)


def test_decodes_above_the_largest_bucket_and_mixed_steps_run_eagerly(tiny_paths):
    eager, static = Harness(tiny_paths["opt"], None), Harness(tiny_paths["opt"], max_num_seqs=4)
    assert static.static.buckets == (1, 2, 4)
    expected = eager.greedy(5, 2, "big")
    assert static.greedy(5, 2, "big") == expected
    assert static.paths == ["eager"] * 4  # two prefill steps, two decode steps of 5 > 4 rows
    assert static.static.runs == {"graph": 0, "eager": 0}
    # a step with a prefill and decodes: eager, though its 3 sequences fit a bucket
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tables = [[10, 11], [20, 21], [30, 31]]
    static.runner.execute(step_message([
        GroupView(f"m{i}", [SeqView(i, [5, 6, 7], 0, tables[i], 0, 0)], params, 3, True) for i in range(2)
    ]), static.caches)
    mixed = [
        GroupView("m0", [SeqView(0, [9], 3, tables[0], 1, 0)], None, 3, False),
        GroupView("m1", [SeqView(1, [9], 3, tables[1], 1, 0)], None, 3, False),
        GroupView("m2", [SeqView(2, [5, 6, 7], 0, tables[2], 0, 0)], params, 3, True),
    ]
    assert rows_of(mixed) is None
    static.runner.execute(step_message(mixed), static.caches)
    assert static.runner.last_path == "eager" and static.static.runs == {"graph": 0, "eager": 0}
    decode_only = [GroupView(f"m{i}", [SeqView(i, [9], 4, tables[i], 2, 0)], None, 3, False) for i in range(3)]
    static.runner.execute(step_message(decode_only), static.caches)
    assert static.runner.last_path == "static-eager" and static.static.runs == {"graph": 0, "eager": 1}


def test_padding_rows_write_nothing_and_read_only_block_zero(tiny_paths):
    harness = Harness(tiny_paths["llama"], max_num_seqs=8, num_blocks=12)
    static = harness.static
    # a NaN anywhere but block 0 would reach a padding row's output if it read past its one slot
    for key, value in harness.caches:
        key[1:] = float("nan")
        value[1:] = float("nan")
    rows = rows_of([
        GroupView("r", [SeqView(0, [17], 0, [0], 0, 0)], SamplingParams(temperature=0.0), 1, True)
    ])
    caches_before = [(k.clone(), v.clone()) for k, v in harness.caches]
    with torch.inference_mode():
        hidden = static.forward(rows, harness.caches)  # 1 real row padded to a bucket of 1
        assert hidden.shape[0] == 1 and torch.isfinite(hidden).all()
        rows5 = rows_of([
            GroupView(f"r{i}", [SeqView(i, [17 + i], 0, [0], 0, 0)], None, 1, False) for i in range(5)
        ])
        static.forward(rows5, harness.caches)  # 5 rows padded to 8: 3 padding rows
    assert static.slot_mapping[5:8].tolist() == [PAD_SLOT] * 3
    assert static.seq_lens[5:8].tolist() == [1] * 3
    assert static.block_tables[5:8, :1].tolist() == [[0]] * 3
    for (key, value), (key0, value0) in zip(harness.caches, caches_before):
        # the real rows wrote slot 0 of block 0 only; nothing else changed
        assert torch.equal(key[1:].isnan(), key0[1:].isnan()) and torch.equal(value[1:].isnan(), value0[1:].isnan())
        assert torch.equal(key[0, 1:], key0[0, 1:]) and torch.equal(value[0, 1:], value0[0, 1:])


def test_static_decode_refuses_what_does_not_fit(tiny_paths):
    static = Harness(tiny_paths["opt"], max_num_seqs=4).static
    assert static.bucket(1) == 1 and static.bucket(3) == 4 and static.bucket(4) == 4
    with pytest.raises(ValueError, match="do not fit the buckets"):
        static.bucket(5)
    group = GroupView("x", [SeqView(0, [5], MAX_MODEL_LEN, [0] * 17, 1, 0)], None, 1, False)
    assert not static.fits(rows_of([group]))  # longer than max_model_len
    assert not static.fits(None)
    assert not static.can_capture  # CPU: never captured
    assert static.capture([]) == [] and static.graphs == {}


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_one_and_two_rows_start_and_decode_on_the_static_path(tiny_paths, max_num_seqs):
    """The buffer's int64 columns at 1 and 2 rows (RoPE lengths once sat at an odd word and
    could not be viewed as int64: every start-up without enforce_eager crashed), each section
    16-byte aligned, and the decodes equal to the eager path's."""
    eager, static = Harness(tiny_paths["llama"], None), Harness(tiny_paths["llama"], max_num_seqs=max_num_seqs)
    sections = static.static._columns(static.static._words) + (static.static.block_tables,)
    assert [t.data_ptr() % 16 for t in sections] == [0] * 6
    assert [t.dtype for t in sections] == [torch.int64] * 3 + [torch.int32, torch.int64, torch.int32]
    expected = eager.greedy(max_num_seqs, 3, "narrow")
    assert static.greedy(max_num_seqs, 3, "narrow") == expected
    assert static.static.runs == {"graph": 0, "eager": 3}


def test_buffer_sections_are_aligned_at_every_width():
    from rayserve_paged.worker.static_decode import column_offsets

    for rows in range(1, 70):
        offsets = column_offsets(rows)
        assert all(at % 4 == 0 for at in offsets)  # 16 bytes
        sizes = [2 * rows] * 4 + [rows]
        assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(5))  # no overlap


@pytest.mark.parametrize("copy", [False, True])
def test_eager_step_inputs_are_one_aligned_buffer_and_one_copy(copy):
    """ModelRunner's staging: every column a 16-byte aligned view of one buffer, values and
    dtypes as given; with the copy path (CUDA's, forced here) one copy per step from a host
    buffer reused across steps; without it (CPU) no copy at all."""
    from rayserve_paged.worker.model_runner import StepStaging

    staging = StepStaging("cpu", copy=copy)
    hosts = []
    for step in range(2):
        longs, ints = staging.stage([[1, 2, 3], [], [2**40 + step]], [[4], [5, 6, 7, 8, 9], []])
        assert [t.tolist() for t in longs] == [[1, 2, 3], [], [2**40 + step]]
        assert [t.tolist() for t in ints] == [[4], [5, 6, 7, 8, 9], []]
        assert {t.dtype for t in longs} == {torch.int64} and {t.dtype for t in ints} == {torch.int32}
        assert len({t.untyped_storage().data_ptr() for t in longs + ints}) == 1  # one buffer
        assert all(t.data_ptr() % 16 == 0 for t in longs + ints)
        hosts.append(None if staging._host is None else staging._host.data_ptr())
    assert staging.num_copies == (2 if copy else 0)
    assert hosts == ([hosts[0]] * 2 if copy else [None, None])  # the host buffer reused


def test_kv_budget_reserves_the_cuda_graph_memory():
    gib = 1 << 30
    base = kv_cache_budget_bytes(80 * gib, 68 * gib, 2 * gib, 6 * gib, 0.9, workspace=gib)
    assert kv_cache_budget_bytes(80 * gib, 68 * gib, 2 * gib, 6 * gib, 0.9, workspace=gib,
                                 cuda_graph_bytes=gib // 2) == base - gib // 2


@pytest.mark.parametrize("enforce_eager, max_num_seqs", [(False, 20), (True, 20), (False, 1)])
def test_worker_builds_the_static_path_unless_enforce_eager(enforce_eager, max_num_seqs):
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.models.tiny import resolve_model
    from rayserve_paged.worker.worker import Worker

    config = EngineConfig(model="tiny-opt", device="cpu", max_num_seqs=max_num_seqs, max_model_len=96,
                          num_cpu_threads=1, enforce_eager=enforce_eager)
    worker = Worker(config, str(resolve_model("tiny-opt")))
    worker.load_model()
    worker.init_cache(8, 0)
    static = worker.runner.static_decode
    if enforce_eager:
        assert static is None
    else:
        assert static.buckets == decode_buckets(max_num_seqs) and static.max_blocks == 96 // config.block_size
    assert worker.cuda_graphs == []  # CPU: nothing captured either way


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")
@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_captured_graphs_replay_the_eager_tokens(tiny_paths, arch):
    pytest.importorskip("triton")
    from rayserve_paged.ops.backends import get_attention_backend

    path = tiny_paths[arch]
    mc = get_model_config(path)
    backend = get_attention_backend("triton", "cuda")
    model = load_model(path, torch.float32, "cuda", backend)
    static = StaticDecode(model, BLOCK_SIZE, 8, MAX_MODEL_LEN, "cuda", backend)
    shape = (64, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
    caches = [(torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")) for _ in range(mc.num_layers)]
    assert static.capture(caches) == [1, 2, 4, 8]
    for num_rows in (1, 3, 8):
        rows = rows_of([
            GroupView(f"g{i}", [SeqView(i, [5 + i], 0, [1 + i], 0, 0)], None, 1, False)
            for i in range(num_rows)
        ])
        for key, value in caches:
            key.zero_()
            value.zero_()
        with torch.inference_mode():
            replayed = static.forward(rows, caches).clone()
            assert static.last_path == "graph"
            for key, value in caches:
                key.zero_()
                value.zero_()
            eager = static.forward(rows, list(caches))  # other list: not the captured caches -> eager
            assert static.last_path == "eager"
        torch.testing.assert_close(replayed, eager)


def test_decode_rows_from_a_step_message():
    groups = [
        GroupView("beam", [SeqView(0, [11], 9, [4, 7], 1, 0), SeqView(1, [12], 9, [4, 8], 1, 1)],
                       None, 5, False),
        GroupView("chunk", [SeqView(2, [13], 16, [1, 2, 3], 0, 0)], None, 30, True, do_sample=False),
        GroupView("one", [SeqView(3, [14], 0, [9], 0, 0)], None, 1, True),
    ]
    rows = rows_of(groups)
    assert rows.token_ids == [11, 12, 13, 14] and rows.positions == [9, 9, 16, 0]
    assert rows.seq_lens == [10, 10, 17, 1] and rows.block_tables == [[4, 7], [4, 8], [1, 2, 3], [9]]
    assert rows.slot_mapping == [7 * BLOCK_SIZE + 1, 8 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE, 9 * BLOCK_SIZE]
    assert rows.sampled == [0, 1, 3]  # the chunk that ends before its group's last token samples nothing
    assert rows_of([]) is None


# ---------------------------------------------------------------------------- length classes, the host mirror


def test_length_classes_and_the_class_of_a_step():
    from rayserve_paged.worker.static_decode import length_classes

    assert length_classes(8192) == (1024, 4096, 8192)
    assert length_classes(131072) == (1024, 4096, 16384, 65536, 131072)
    assert length_classes(1024) == (1024,) and length_classes(600) == (600,) and length_classes(1025) == (1024, 1025)
    assert length_classes(128, base=16) == (16, 64, 128)
    with pytest.raises(ValueError, match="must be >= 1"):
        length_classes(0)
    static = StaticDecode(torch.nn.Identity(), BLOCK_SIZE, 4, 8192, "cpu")
    assert [static.length_class(n) for n in (1, 1024, 1025, 4096, 4097, 8192)] == [1024, 1024, 4096, 4096, 8192, 8192]
    with pytest.raises(ValueError, match="does not fit the length classes"):
        static.length_class(8193)
    # the plan of a step: the class's length and a table of the class's width
    metadata = static._metadata(2, 4096, [5, 9])
    assert metadata.max_decode_seq_len == 4096 and metadata.decode_block_tables.shape == (2, 4096 // BLOCK_SIZE)


class MinimalSteps:
    """Greedy decoding driven by the smallest step messages the scheduler sends: a block
    table update only when a sequence needs a new block (start = its old length), a table
    replaced from 0 when its blocks move. One runner with the static path, one without; both
    get the same messages."""

    def __init__(self, path: str, length_class_base: int) -> None:
        mc = get_model_config(path)
        backend = TorchReferenceBackend()
        model = load_model(path, torch.float32, "cpu", backend)
        eos = tuple(mc.eos_token_ids)
        self.static = StaticDecode(model, BLOCK_SIZE, 4, MAX_MODEL_LEN, "cpu", backend,
                                   length_class_base=length_class_base)
        shape = (64, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim)
        self.runners = []
        for static in (None, self.static):
            caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(mc.num_layers)]
            self.runners.append((ModelRunner(model, BLOCK_SIZE, torch.device("cpu"), Sampler(len(eos), eos), backend,
                                             static), caches))
        self.next_block = 1
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens cached per sequence
        self.last: dict[int, int] = {}  # the last sampled token per sequence

    def blocks(self, count: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def run(self, msg: StepMessage) -> list[int]:
        samples = []
        for runner, caches in self.runners:
            out = runner.execute(msg, caches)
            samples.append([s.token_ids[0] for s in out.samples])
        assert samples[0] == samples[1], "the static path's tokens differ from the eager path's"
        return samples[1]

    def prefill(self, seq_ids: list[int], prompts: list[list[int]], decodes: list[int] = ()) -> StepMessage:
        """Prefill new sequences (with decodes of running ones, the step then runs eagerly)."""
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        msg = StepMessage()
        for seq_id, prompt in zip(seq_ids, prompts):
            self.tables[seq_id] = self.blocks(-(-len(prompt) // BLOCK_SIZE))
            msg.new_requests.append(NewRequest(f"r{seq_id}", seq_id, params, len(prompt)))
            msg.block_table_updates.append((seq_id, 0, list(self.tables[seq_id])))
            msg.seq_ids.append(seq_id)
            msg.start_positions.append(0)
            msg.num_query_tokens.append(len(prompt))
            msg.token_ids.extend(prompt)
            msg.first_step_seq_ids.append(seq_id)
            self.lengths[seq_id] = len(prompt)
        self._add_decodes(msg, decodes)
        for seq_id, token in zip(msg.seq_ids, self.run(msg)):
            self.last[seq_id] = token
        return msg

    def decode(self, seq_ids: list[int], moved: dict[int, list[int]] | None = None) -> int:
        """One decode step of seq_ids; returns how many tables gained a block."""
        msg = StepMessage()
        for seq_id, table in (moved or {}).items():
            msg.block_table_updates.append((seq_id, 0, list(table)))
        grown = self._add_decodes(msg, seq_ids)
        for seq_id, token in zip(msg.seq_ids, self.run(msg)):
            self.last[seq_id] = token
        return grown

    def _add_decodes(self, msg: StepMessage, seq_ids) -> int:
        grown = 0
        for seq_id in seq_ids:
            table, position = self.tables[seq_id], self.lengths[seq_id]
            if position == len(table) * BLOCK_SIZE:  # the new token starts a block
                msg.block_table_updates.append((seq_id, len(table), self.blocks(1)))
                table.extend(msg.block_table_updates[-1][2])
                grown += 1
            msg.seq_ids.append(seq_id)
            msg.start_positions.append(position)
            msg.num_query_tokens.append(1)
            msg.token_ids.append(self.last[seq_id])
            self.lengths[seq_id] = position + 1
        return grown

    def move_blocks(self, seq_id: int) -> list[int]:
        """Copy a sequence's blocks to fresh ids in both runners' caches and poison the old
        ones (a swap out and in to other blocks): only the new table reads the right K/V."""
        old, new = self.tables[seq_id], self.blocks(len(self.tables[seq_id]))
        for _, caches in self.runners:
            for key, value in caches:
                key[new], value[new] = key[old], value[old]
                key[old], value[old] = float("nan"), float("nan")
        self.tables[seq_id] = new
        return new


def test_host_mirror_rewrites_only_changed_rows_with_one_copy_per_step(tiny_paths):
    steps = MinimalSteps(tiny_paths["opt"], length_class_base=MAX_MODEL_LEN)  # one class: no layout change
    static = steps.static
    steps.prefill([0, 1, 2], [[5, 6, 7, 8, 9], [11] * 8, [13, 14, 15]])
    assert static.num_copies == 0  # a prefill step never uses the static path
    # first decode step: 3 rows of bucket 4 written whole, one padding row (its entry 0)
    grown = steps.decode([0, 1, 2])
    assert grown == 1  # sequence 1's 8 prompt tokens filled its block
    assert (static.num_copies, static.num_rows_written) == (1, 4)
    assert static.num_entries_written == sum(len(steps.tables[s]) for s in (0, 1, 2)) + 1
    # later steps: only the rows whose table gained a block are written, one entry each
    rows, entries = static.num_rows_written, static.num_entries_written
    total_grown = 0
    for step in range(2, 12):
        grown = steps.decode([0, 1, 2])
        total_grown += grown
        assert static.num_copies == step
    assert total_grown == 3  # sequences 0, 2, 1 crossed a block boundary once each
    assert (static.num_rows_written - rows, static.num_entries_written - entries) == (3, 3)
    assert static.last_path == "eager" and static.runs == {"graph": 0, "eager": 11}
    # the old loader wrote every row's whole table each step: 11 steps x (3 tables + 1 padding row)
    assert static.num_rows_written == 7 < 11 * 4


def test_host_mirror_follows_moved_rows_moved_blocks_and_class_changes(tiny_paths):
    """Rows that change sequence, a table replaced in a decode step and in an eager (prefill)
    step, and a step crossing into the next length class: the static path's tokens stay the
    eager path's (MinimalSteps.run compares them every step), old blocks poisoned with NaN."""
    steps = MinimalSteps(tiny_paths["opt"], length_class_base=16)
    static = steps.static
    assert static.length_classes == (16, 64, 128)
    steps.prefill([0, 1, 2], [[5, 6, 7, 8, 9], [11] * 8, [13, 14, 15]])
    steps.decode([0, 1, 2])
    assert static.last_length_class == 16
    # sequence 0 ends: 1 and 2 move up a row (rewritten whole), the padding rows are written once
    rows = static.num_rows_written
    steps.decode([1, 2])
    assert static.num_rows_written - rows == 2  # bucket 2: both rows took another table
    rows = static.num_rows_written
    steps.decode([1, 2])
    assert static.num_rows_written == rows  # nothing changed
    # a table replaced from 0 in a decode step: that row rewritten whole
    rows, entries = static.num_rows_written, static.num_entries_written
    steps.decode([1, 2], moved={1: steps.move_blocks(1)})
    assert static.num_rows_written - rows == 1 and static.num_entries_written - entries == len(steps.tables[1])
    assert static.last_path == "eager" and static.last_length_class == 16
    # grow past 16 tokens: the 64 class, every row rewritten in the new layout
    while static.last_length_class == 16:
        rows, entries = static.num_rows_written, static.num_entries_written
        steps.decode([1, 2])
    assert static.last_length_class == 64 and static.block_tables.shape == (4, 64 // BLOCK_SIZE)
    assert static.num_rows_written - rows == 2
    assert static.num_entries_written - entries == len(steps.tables[1]) + len(steps.tables[2])


def test_a_table_change_in_an_eager_step_reaches_the_mirror(tiny_paths):
    steps = MinimalSteps(tiny_paths["opt"], length_class_base=MAX_MODEL_LEN)
    steps.prefill([0, 1], [[5, 6, 7, 8, 9], [13, 14, 15]])
    steps.decode([0, 1])
    steps.decode([0, 1])  # the mirror holds both tables
    # sequence 0's blocks move while sequence 2 is admitted: the step has a prefill, so it
    # runs eagerly and the static path only hears of the change through note_table_changes
    new = steps.move_blocks(0)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    steps.tables[2] = steps.blocks(1)
    msg = StepMessage(
        new_requests=[NewRequest("r2", 2, params, 3)],
        block_table_updates=[(0, 0, list(new)), (2, 0, list(steps.tables[2]))],
        seq_ids=[2], start_positions=[0], num_query_tokens=[3], token_ids=[21, 22, 23], first_step_seq_ids=[2],
    )
    steps.last[2] = steps.run(msg)[0]
    steps.lengths[2] = 3
    rows = steps.static.num_rows_written
    steps.decode([0, 1, 2])  # NaN in sequence 0's old blocks: a stale mirror row would differ from eager
    assert steps.static.last_path == "eager"
    assert steps.static.num_rows_written - rows == 3  # row 0 rewritten from 0, row 2 new, the padding row
