"""The shard plan in one process: what each rank keeps of a weight tree, that the ranks' slices
compute the whole (column slices concatenate, row slices sum), LoRA pairs cut as their weights,
quantized weights cut in whole groups; the group's bookkeeping (heartbeats, rows that travel
light, the launch command)."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import mlx.core as mx
import numpy as np
import pytest
from gmlx_contract.errors import ContractError
from gmlx_server import distributed
from gmlx_server.engine.base import EngineInputError, StepRow
from gmlx_server.engine.lora import LinearSlot, table_pairs
from gmlx_server.engine.precision import Quantization
from gmlx_server.engine.prefix_cache import PrefixCache
from gmlx_server.engine.quantize import SPEC, linear, quantize_tree
from gmlx_server.engine.shard import REDUCE, Shard, ShardPlan, Split, TreeShard, stage_bounds

HEADS, HEAD_DIM, WIDTH, HIDDEN = 6, 32, 192, 384
PLAN = ShardPlan(
    stacks=("blocks",),
    columns={"qkv": Split(3, HEAD_DIM), "gate_up": Split(2)},
    rows={"out": Split(1, HEAD_DIM), "down": Split(1)},
)


def tree(seed: int = 0, layers: int = 3) -> dict:
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        return mx.array(rng.standard_normal((rows, cols)).astype(np.float32))

    blocks = [
        {
            "qkv": matrix(3 * WIDTH, WIDTH),
            "out": matrix(WIDTH, WIDTH),
            "gate_up": matrix(2 * HIDDEN, WIDTH),
            "down": matrix(WIDTH, HIDDEN),
            "norm_q": mx.ones((HEAD_DIM,)),
        }
        for _ in range(layers)
    ]
    return {"img_in": matrix(WIDTH, 4), "blocks": blocks}


def shards(mode: str, size: int, source=tree, quantization=None) -> list[tuple[TreeShard, dict]]:
    out = []
    for rank in range(size):
        cut = TreeShard(PLAN, Shard(mode, rank, size), {"blocks": 3})
        weights = cut.slice(source())
        if quantization is not None:
            quantize_tree(weights, quantization, lambda path: path.startswith("blocks."))
        cut.mark(weights)
        out.append((cut, weights))
    return out


def test_stage_bounds_are_contiguous_and_even():
    assert stage_bounds(6, 2) == [(0, 3), (3, 6)]
    assert stage_bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(EngineInputError, match="2 blocks cannot form a pipeline over 3 ranks"):
        stage_bounds(2, 3)


def test_a_shard_names_a_known_mode_and_rank():
    with pytest.raises(ValueError, match="pipeline, tensor"):
        Shard("data", 0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        Shard("tensor", 2, 2)


def test_pipeline_ranks_keep_their_own_blocks_and_the_rest():
    (_, first), (_, second) = shards("pipeline", 2)[0], shards("pipeline", 2)[1]
    whole = tree()
    assert [bool(b) for b in first["blocks"]] == [True, False, False]
    assert [bool(b) for b in second["blocks"]] == [False, True, True]
    np.testing.assert_array_equal(np.array(second["blocks"][2]["qkv"]), whole["blocks"][2]["qkv"])
    np.testing.assert_array_equal(np.array(second["img_in"]), whole["img_in"])  # replicated


@pytest.mark.parametrize("size", [2, 3])
def test_tensor_slices_compute_the_whole_block_linears(size):
    whole = tree()["blocks"][0]
    x = mx.array(np.random.default_rng(1).standard_normal((5, WIDTH)).astype(np.float32))
    parts = [weights["blocks"][0] for _, weights in shards("tensor", size)]
    # q/k/v: each rank holds whole heads of each of the three segments, in segment order
    outs = [np.array(linear(p, "qkv", x)).reshape(5, 3, -1) for p in parts]
    np.testing.assert_allclose(
        np.concatenate(outs, axis=2).reshape(5, -1), np.array(linear(whole, "qkv", x)), rtol=1e-6
    )
    assert parts[0]["qkv"].shape == (3 * WIDTH // size, WIDTH)
    # the attention output: its input columns split, the partial outputs summed
    chunk = WIDTH // size
    partial = [
        np.array(linear(p, "out", x[:, r * chunk : (r + 1) * chunk])) for r, p in enumerate(parts)
    ]
    expected = np.array(linear(whole, "out", x))
    np.testing.assert_allclose(sum(partial), expected, rtol=1e-5, atol=1e-5)
    assert all(p["out" + REDUCE] and p["down" + REDUCE] for p in parts)
    assert "qkv" + REDUCE not in parts[0]


def test_heads_that_do_not_split_are_refused_naming_the_weight():
    cut = TreeShard(PLAN, Shard("tensor", 0, 4), {"blocks": 3})
    with pytest.raises(EngineInputError, match=r"blocks\.0\.qkv: 3 segment\(s\) of 192 rows"):
        cut.slice(tree())


def test_quantized_input_columns_cut_on_whole_groups():
    quantization = Quantization(8, 32)
    whole = tree()["blocks"][0]
    x = mx.array(np.random.default_rng(1).standard_normal((5, HIDDEN)).astype(np.float32))
    parts = [weights["blocks"][0] for _, weights in shards("tensor", 3, quantization=quantization)]
    assert parts[0]["down" + SPEC] == (8, 32)
    # quantizing each rank's slice equals quantizing the whole weight and slicing it
    quantize_tree(whole, quantization, lambda path: True)
    chunk = HIDDEN // 3
    partial = [
        np.array(linear(p, "down", x[:, r * chunk : (r + 1) * chunk])) for r, p in enumerate(parts)
    ]
    expected = np.array(linear(whole, "down", x))
    np.testing.assert_allclose(sum(partial), expected, rtol=1e-5, atol=1e-4)
    # stored quantized in groups of 128: 384 input columns over 2 ranks are 1.5 groups each
    cut = TreeShard(PLAN, Shard("tensor", 0, 2), {"blocks": 3})
    weights = tree()
    quantize_tree(weights, Quantization(8, 128), lambda path: path.startswith("blocks."))
    with pytest.raises(EngineInputError, match=r"blocks\.0\.down: .*whole quantization groups"):
        cut.slice(weights)


def test_lora_pairs_are_checked_whole_and_cut_as_their_weights():
    slots = {
        "to_k": LinearSlot("qkv", ("blocks", 0), 1, 3),
        "to_out": LinearSlot("out", ("blocks", 2)),
        "img_in": LinearSlot("img_in"),
    }
    rng = np.random.default_rng(2)

    class Patch:
        def __init__(self, up, down):
            self.up, self.down, self.scale, self.strength = up, down, 1.0, 1.0

    class Entry:
        def __init__(self, layer, up, down, band=None):
            self.key, self.layer, self.band, self.patches = layer, layer, band, [Patch(up, down)]

    def pair(rows, cols):
        return rng.standard_normal((rows, 2)).astype(np.float32), rng.standard_normal(
            (2, cols)
        ).astype(np.float32)

    class Table:
        entries = [
            Entry("to_k", *pair(WIDTH, WIDTH)),
            Entry("to_out", *pair(WIDTH, WIDTH)),
            Entry("img_in", *pair(WIDTH, 4)),
        ]

    whole = table_pairs(Table, slots, tree())
    for cut, weights in shards("tensor", 2):
        placed = table_pairs(Table, slots, weights, cut)
        qkv = placed[slots["to_k"].fused][0]
        rows = cut.column_rows(PLAN.columns["qkv"], 3 * WIDTH, "qkv")
        np.testing.assert_array_equal(qkv.up, whole[slots["to_k"].fused][0].up[rows])
        out = placed[slots["to_out"]][0]
        start, stop = cut.input_columns(PLAN.rows["out"], WIDTH, "out")
        np.testing.assert_array_equal(out.down, whole[slots["to_out"]][0].down[:, start:stop])
    first, second = shards("pipeline", 2)
    assert slots["to_out"] not in table_pairs(Table, slots, first[1], first[0])
    assert slots["to_k"] not in table_pairs(Table, slots, second[1], second[0])
    # a pair that does not fit the whole layer is refused on any rank, as on one process
    Table.entries = [Entry("to_out", *pair(WIDTH // 2, WIDTH))]
    with pytest.raises(EngineInputError, match="do not fit a patch of 192 output rows"):
        table_pairs(Table, slots, first[1], first[0])


def test_a_mirror_keeps_only_what_rank_0_holds():
    cache = PrefixCache(1 << 20)

    class State:
        nbytes = 10

    for key in ("a", "b", "c"):
        cache.put((key,), State(), run="r")
    cache.keep_only([("a",), ("c",)])
    assert cache.keys() == [("a",), ("c",)]


def test_rows_of_held_states_travel_without_their_arrays():
    cond = np.ones((7, 16), np.float32)
    row = StepRow(cond=cond, cond_key="wire:a", ref_latents=(np.ones((4, 2, 2), np.float32),))

    class Model:
        def step_keys(self, x_shape, rows, table):
            return {(rows[0].cond_key,)}

    model = distributed.GroupModel(Model(), group=None, rank_weight_bytes=[])
    light = model._light(row, {("wire:a",)}, np.zeros((1, 4, 2, 2)), None)
    assert light.cond == distributed.Absent((7, 16))
    assert distributed.present(light.cond).shape == (7, 16)
    assert distributed.present(light.ref_latents[0]).strides == (0, 0, 0)
    assert model._light(row, {("wire:b",)}, np.zeros((1, 4, 2, 2)), None) is row
    # a row that opts out of the cache is built afresh: it travels whole
    uncached = dataclasses.replace(row, prefix_cache=False)
    assert model._light(uncached, {("wire:a",)}, np.zeros((1, 4, 2, 2)), None) is uncached


def test_heartbeats_name_the_silent_rank(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        address = probe.getsockname()
    now = [100.0]
    beats = distributed.Heartbeats(3, address, clock=lambda: now[0])
    now[0] += distributed.SILENT_S / 2
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"2", address)
    deadline = time.monotonic() + 5
    while beats.heard[2] != now[0]:
        assert time.monotonic() < deadline, "the heartbeat was not heard"
        time.sleep(0.02)
    now[0] += distributed.SILENT_S * 0.75
    assert sorted(beats.silent()) == [1]
    group = distributed.Group.__new__(distributed.Group)
    group.size, group.broken, group.stuck, group.heartbeats = 3, None, None, beats
    with pytest.raises(ContractError, match="rank 1 of 3 has not been heard") as refused:
        group.check()
    assert refused.value.status == 503


def test_the_heartbeat_address_is_beside_rank_0s_ring_port(monkeypatch, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.2:5000"], ["10.0.0.3:5001"]]))
    monkeypatch.delenv("GMLX_HEARTBEAT", raising=False)
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert distributed.heartbeat_address() == ("10.0.0.2", 4999)
    monkeypatch.setenv("GMLX_HEARTBEAT", "127.0.0.1:7000")
    assert distributed.heartbeat_address() == ("127.0.0.1", 7000)


def test_serve_hostfile_launches_the_same_command_without_its_launch_flags(tmp_path):
    argv = ["serve", "--port", "9", "--hostfile", "h.json", "--backend=ring", "--shard", "tensor"]
    command = distributed.launch_command(tmp_path / "h.json", "ring", argv)
    assert command[command.index("--hostfile") + 1] == str(tmp_path / "h.json")
    assert command[command.index("--") + 1 :][-5:] == ["serve", "--port", "9", "--shard", "tensor"]


def test_a_pipeline_rank_reads_only_its_blocks_of_a_gguf_dit(tmp_path, monkeypatch):
    """Rank 1 of 2 reads the tensors of blocks 3..5 and those outside the blocks from the
    memory-mapped file, no tensor of rank 0's blocks, and holds what one process holds of
    them; a rank that holds a part of every block (tensor mode) reads every tensor."""
    from gguf import GGMLQuantizationType as T
    from gmlx_server.engine.embedded import DIFFUSERS_WEIGHTS
    from gmlx_server.engine.families.qwen_image21.dit import QwenImage21DiT
    from gmlx_server.engine.gguf import GGUFFile
    from gmlx_server.engine.nn.dtypes import tree_leaves
    from safetensors.numpy import load_file

    from tests.engine.gguf_files import write_dit
    from tests.shard.folder import build_shard_folder

    folder = build_shard_folder(tmp_path / "model") / "transformer"
    weights = load_file(str(folder / DIFFUSERS_WEIGHTS))
    types = {name: T.Q8_0 for name, value in weights.items() if value.ndim == 2}
    dit = tmp_path / "dit.gguf"
    write_dit(dit, weights, types, np.random.default_rng(0))
    read: list[str] = []
    original = GGUFFile.read
    monkeypatch.setattr(
        GGUFFile,
        "read",
        lambda self, name, *a, **k: read.append(name) or original(self, name, *a, **k),
    )
    whole = QwenImage21DiT.load(folder, dit=dit).weights
    everything = set(read)
    read.clear()
    part = QwenImage21DiT.load(folder, dit=dit, shard=Shard("pipeline", 1, 2)).weights
    blocks = {int(name.split(".")[1]) for name in read if name.startswith("transformer_blocks.")}
    assert blocks == {3, 4, 5}
    assert {name for name in everything if not name.startswith("transformer_blocks.")} <= set(read)
    assert part["blocks"][:3] == [{}, {}, {}]
    for index in (3, 4, 5):
        held = list(tree_leaves(part["blocks"][index]))
        assert held and all(
            np.array_equal(np.array(a), np.array(b))
            for a, b in zip(held, tree_leaves(whole["blocks"][index]), strict=True)
        )
    read.clear()
    QwenImage21DiT.load(folder, dit=dit, shard=Shard("tensor", 1, 2))
    assert set(read) == everything


def test_no_stop_is_broadcast_into_a_group_call_under_way(monkeypatch, caplog):
    """A stop at once that did not wait for the image worker: while its group call is under
    way, rank 0 sends no stop (its broadcast would mix into that call's); after, it does."""
    import threading

    from gmlx_server import distributed

    monkeypatch.delenv("GMLX_HEARTBEAT", raising=False)
    sent = []
    monkeypatch.setattr(distributed, "broadcast", lambda message: sent.append(message))
    group = distributed.Group("pipeline", 2)
    inside, leave = threading.Event(), threading.Event()

    def step() -> None:
        with group.call("step"):
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=step)
    worker.start()
    assert inside.wait(10)
    distributed.stop_group(group)
    assert sent == [] and "still in a group call" in caplog.text
    leave.set()
    worker.join(10)
    distributed.stop_group(group)
    assert sent == [("stop", {})]
