"""The static-shape decode path (worker/static_decode.py): decode batches padded to a bucket
over persistent inputs give exactly the tokens of the unpadded eager path; what runs where
(static for decode-only steps within the buckets, eager otherwise); the bucket list; and,
where CUDA exists, one captured graph per bucket replaying to the same tokens."""

from __future__ import annotations

import pytest
import torch

from rayserve_paged.core.outputs import NewRequest, ScheduledGroup, ScheduledSeq, StepMessage
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

BLOCK_SIZE = 8
MAX_MODEL_LEN = 128
PREFIX = 2 * BLOCK_SIZE  # tokens of the shared prompt prefix: two full blocks


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def step_message(groups: list[ScheduledGroup]) -> StepMessage:
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


def rows_of(groups: list[ScheduledGroup]):
    """decode_rows of the groups' step, on a fresh persistent batch that knows them."""
    batch = InputBatch()
    batch.apply(StepMessage(new_requests=[
        NewRequest(g.request_id, g.seqs[0].seq_id, SamplingParams(), g.num_prompt_tokens) for g in groups
    ]))
    msg = step_message([ScheduledGroup(g.request_id, g.seqs, None, g.num_prompt_tokens, g.is_first_step, g.do_sample)
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
        first = [ScheduledGroup(ids[0], [ScheduledSeq(0, prompts[0], 0, tables[0], 0, 0)], params, len(prompts[0]), True)]
        rest = [
            ScheduledGroup(ids[s], [ScheduledSeq(s, prompts[s][PREFIX:], PREFIX, tables[s], 0, 0)], params,
                           len(prompts[s]), True)
            for s in range(1, num_seqs)
        ]
        for groups in (first, rest):
            if groups:
                for group, sample in zip(groups, self._step(groups)):
                    outputs[int(group.request_id.rsplit("-", 1)[1])].append(sample)
        for _ in range(steps):
            groups = [
                ScheduledGroup(ids[s], [ScheduledSeq(s, [outputs[s][-1]], len(prompts[s]) + len(outputs[s]) - 1,
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
        ScheduledGroup(f"m{i}", [ScheduledSeq(i, [5, 6, 7], 0, tables[i], 0, 0)], params, 3, True) for i in range(2)
    ]), static.caches)
    mixed = [
        ScheduledGroup("m0", [ScheduledSeq(0, [9], 3, tables[0], 1, 0)], None, 3, False),
        ScheduledGroup("m1", [ScheduledSeq(1, [9], 3, tables[1], 1, 0)], None, 3, False),
        ScheduledGroup("m2", [ScheduledSeq(2, [5, 6, 7], 0, tables[2], 0, 0)], params, 3, True),
    ]
    assert rows_of(mixed) is None
    static.runner.execute(step_message(mixed), static.caches)
    assert static.runner.last_path == "eager" and static.static.runs == {"graph": 0, "eager": 0}
    decode_only = [ScheduledGroup(f"m{i}", [ScheduledSeq(i, [9], 4, tables[i], 2, 0)], None, 3, False) for i in range(3)]
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
        ScheduledGroup("r", [ScheduledSeq(0, [17], 0, [0], 0, 0)], SamplingParams(temperature=0.0), 1, True)
    ])
    caches_before = [(k.clone(), v.clone()) for k, v in harness.caches]
    with torch.inference_mode():
        hidden = static.forward(rows, harness.caches)  # 1 real row padded to a bucket of 1
        assert hidden.shape[0] == 1 and torch.isfinite(hidden).all()
        rows5 = rows_of([
            ScheduledGroup(f"r{i}", [ScheduledSeq(i, [17 + i], 0, [0], 0, 0)], None, 1, False) for i in range(5)
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
    group = ScheduledGroup("x", [ScheduledSeq(0, [5], MAX_MODEL_LEN, [0] * 17, 1, 0)], None, 1, False)
    assert not static.fits(rows_of([group]))  # longer than max_model_len
    assert not static.fits(None)
    assert not static.can_capture  # CPU: never captured
    assert static.capture([]) == [] and static.graphs == {}


def test_kv_budget_reserves_the_cuda_graph_memory():
    gib = 1 << 30
    base = kv_cache_budget_bytes(80 * gib, 68 * gib, 2 * gib, 6 * gib, 0.9, workspace=gib)
    assert kv_cache_budget_bytes(80 * gib, 68 * gib, 2 * gib, 6 * gib, 0.9, workspace=gib,
                                 cuda_graph_bytes=gib // 2) == base - gib // 2


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_worker_builds_the_static_path_unless_enforce_eager(enforce_eager):
    from rayserve_paged.config import EngineConfig
    from rayserve_paged.models.tiny import resolve_model
    from rayserve_paged.worker.worker import Worker

    config = EngineConfig(model="tiny-opt", device="cpu", max_num_seqs=20, max_model_len=96, num_cpu_threads=1,
                          enforce_eager=enforce_eager)
    worker = Worker(config, str(resolve_model("tiny-opt")))
    worker.load_model()
    worker.init_cache(8, 0)
    static = worker.runner.static_decode
    if enforce_eager:
        assert static is None
    else:
        assert static.buckets == (1, 2, 4, 8, 16, 24) and static.max_blocks == 96 // config.block_size
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
            ScheduledGroup(f"g{i}", [ScheduledSeq(i, [5 + i], 0, [1 + i], 0, 0)], None, 1, False)
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
        ScheduledGroup("beam", [ScheduledSeq(0, [11], 9, [4, 7], 1, 0), ScheduledSeq(1, [12], 9, [4, 8], 1, 1)],
                       None, 5, False),
        ScheduledGroup("chunk", [ScheduledSeq(2, [13], 16, [1, 2, 3], 0, 0)], None, 30, True, do_sample=False),
        ScheduledGroup("one", [ScheduledSeq(3, [14], 0, [9], 0, 0)], None, 1, True),
    ]
    rows = rows_of(groups)
    assert rows.token_ids == [11, 12, 13, 14] and rows.positions == [9, 9, 16, 0]
    assert rows.seq_lens == [10, 10, 17, 1] and rows.block_tables == [[4, 7], [4, 8], [1, 2, 3], [9]]
    assert rows.slot_mapping == [7 * BLOCK_SIZE + 1, 8 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE, 9 * BLOCK_SIZE]
    assert rows.sampled == [0, 1, 3]  # the chunk that ends before its group's last token samples nothing
    assert rows_of([]) is None
