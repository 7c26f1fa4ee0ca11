"""LoRA over HTTP on a live server with the real Qwen-Image 2.1 family: adapters, patch tables,
steps naming a table, refusals and a table dying with its model instance."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import requests
from gmlx_contract import wire
from gmlx_contract.hashing import canonical_json, table_id, tensor_hash
from gmlx_contract.lora_keys import linear_layers
from gmlx_server.app import ServerThread, build_context, create_app, make_server
from gmlx_server.config import AdapterSpec, ImageConfig, ModelSettings, ServerConfig
from gmlx_server.engine.base import StepRow
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.engine.sampling import DirectTransport, ImageRequest, generate, to_uint8
from gmlx_server.lora_files import DefaultAdapters, adapter_table
from gmlx_server.routes.common import PREFIX
from PIL import Image

from tests.lora.conftest import MODEL_ID
from tests.lora.forms import client_table, random_lora, write_form
from tests.lora.reference import layer_shapes, plain_model
from tests.server.conftest import out_of

HEADERS = {"X-Gmlx-Steps-Contract": "1.0"}
CONTAINER = {**HEADERS, "Content-Type": wire.CONTAINER_TYPE}


class Server:
    def __init__(self, root, models: dict[str, ModelSettings] | None = None, families=None):
        config = replace(ServerConfig(host="127.0.0.1", port=0), model_dirs=[root])
        config = replace(config, image=ImageConfig(), models=models or {})
        hooks = DefaultAdapters(config.models) if models else None
        registry = ModelRegistry([root], MODEL_ID, families=families, load_hooks=hooks)
        self.ctx = build_context(config, registry)
        self.thread = ServerThread(make_server(create_app(self.ctx), config, port=0)).start()
        self.url = f"http://127.0.0.1:{self.thread.port}{PREFIX}/"
        self.session = requests.Session()

    def put(self, path: str, body: bytes, json_body: bool = False, **params):
        headers = {**HEADERS, "Content-Type": "application/json"} if json_body else CONTAINER
        return self.session.put(self.url + path, data=body, headers=headers, params=params)

    def upload(self, kind: str, array: np.ndarray) -> str:
        digest = tensor_hash(array)
        r = self.put(f"{kind}/{digest}", wire.write_container({"t": array}))
        assert r.status_code == 200, r.text
        return digest

    def put_table(self, doc: dict, digest: str | None = None):
        digest = digest or table_id(doc)
        return self.put(f"patch-tables/{digest}", canonical_json(doc), True, model=MODEL_ID)

    def step(self, x, sigma, cond_hash, table=None):
        fields = {"rows": [{"cond": cond_hash}], "model": MODEL_ID, "patch_table": table}
        body = wire.write_container({"x": x, "timestep": np.array([sigma], np.float32)}, fields)
        return self.session.post(self.url + "step", data=body, headers=CONTAINER)

    def close(self) -> None:
        self.session.close()
        self.thread.stop()
        self.ctx.service.close()


@pytest.fixture(scope="module")
def server(tiny_folder) -> Iterator[Server]:
    live = Server(tiny_folder[0])
    yield live
    live.close()


@pytest.fixture(scope="module")
def lora_doc(tiny_folder, engine):
    shapes = layer_shapes(plain_model(tiny_folder[1]))
    files = [
        (write_form(random_lora(shapes, seed=40), "kohya"), 0.9),
        (write_form(random_lora(shapes, seed=41, rank=2), "comfy"), 0.5),
    ]
    return client_table(MODEL_ID, files, linear_layers(engine.manifest()))


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((1, 7, 64)).astype(np.float32)
    x = rng.standard_normal((1, 16, 4, 4)).astype(np.float32)
    return cond, x


def test_a_step_with_a_table_equals_the_engine_direct(server, lora_doc):
    doc, adapters = lora_doc
    for array in adapters.values():
        server.upload("adapters", array)
    r = server.put_table(doc)
    assert r.status_code == 200 and r.json() == {"id": table_id(doc)}
    cond, x = inputs(50)
    cond_hash = server.upload("tensors", cond)

    first = server.step(x, 0.6, cond_hash, table_id(doc))
    assert first.headers["X-Gmlx-Prefix-Cache"] == "miss"
    again = server.step(x, 0.6, cond_hash, table_id(doc))
    assert again.headers["X-Gmlx-Prefix-Cache"] == "hit"
    untabled = server.step(x, 0.6, cond_hash)
    assert untabled.headers["X-Gmlx-Prefix-Cache"] == "miss"  # the table is in the state's key

    loaded = server.ctx.registry.loaded(MODEL_ID)
    table = loaded.tables[table_id(doc)]
    row = StepRow(cond=cond[0], cond_key=f"wire:{cond_hash}")

    def direct(table):
        return loaded.model.denoise_step(x, np.array([0.6], np.float32), [row], table=table).out

    np.testing.assert_array_equal(out_of(first), server.ctx.service.worker.call(direct, table))
    np.testing.assert_array_equal(out_of(again), out_of(first))
    np.testing.assert_array_equal(out_of(untabled), server.ctx.service.worker.call(direct, None))
    assert not np.allclose(out_of(first), out_of(untabled), atol=1e-3)


def bad_table(key: str, up_shape, down_shape, band=None, **patch):
    rng = np.random.default_rng(60)
    up = rng.standard_normal(up_shape).astype(np.float32)
    down = rng.standard_normal(down_shape).astype(np.float32)
    entry = {
        "key": key,
        "band": band,
        "patches": [{"up": tensor_hash(up), "down": tensor_hash(down), **patch}],
    }
    return {"entries": [entry]}, (up, down)


TO_Q = "diffusion_model.transformer_blocks.0.attn.to_q.weight"


@pytest.mark.parametrize(
    "doc_and_pair, message",
    [
        (bad_table("diffusion_model.transformer_blocks.9.attn.to_q.weight", (32, 2), (2, 32)),
         "not a linear layer"),
        (bad_table("diffusion_model.transformer_blocks.0.attn.to_q.bias", (32, 2), (2, 32)),
         "bias"),
        (bad_table(TO_Q, (32, 2), (2, 31)), "do not fit"),
        (bad_table(TO_Q, (8, 2), (2, 32), band=[0, 30, 8]), "runs past"),
        (bad_table(TO_Q, (32, 2), (2, 32), kind="loha"), "kind"),
        (bad_table(TO_Q, (32, 2), (2, 32), strength_model=2.0), "strength_model"),
        (bad_table(TO_Q, (32, 2), (2, 32), dora_scale=1.0), "unknown members"),
    ],
)  # fmt: skip
def test_refusals_are_400_with_the_reason(server, doc_and_pair, message):
    doc, pair = doc_and_pair
    for array in pair:
        server.upload("adapters", array)
    r = server.put_table(doc)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_absent_matrices_are_409_missing(server):
    doc, (up, down) = bad_table(TO_Q, (32, 3), (3, 32))
    r = server.put_table(doc)
    assert r.status_code == 409
    assert r.json()["missing"] == sorted({tensor_hash(up), tensor_hash(down)})


def test_a_table_dies_with_its_model_instance(server, lora_doc):
    doc, adapters = lora_doc
    for array in adapters.values():
        server.upload("adapters", array)
    digest = table_id(doc)
    assert server.put_table(doc).status_code == 200
    cond, x = inputs(51)
    cond_hash = server.upload("tensors", cond)
    before = out_of(server.step(x, 0.3, cond_hash, digest))

    r = server.session.post(server.url + "models/unload", json={"model": MODEL_ID}, headers=HEADERS)
    assert r.status_code == 200 and r.json()["unloaded"] is True
    r = server.step(x, 0.3, cond_hash, digest)  # the model loads again, without its tables
    assert r.status_code == 409 and r.json()["missing"] == [digest]

    assert server.put_table(doc).status_code == 200
    np.testing.assert_array_equal(out_of(server.step(x, 0.3, cond_hash, digest)), before)


def test_an_unknown_table_is_409_missing(server):
    cond, x = inputs(52)
    cond_hash = server.upload("tensors", cond)
    r = server.step(x, 0.5, cond_hash, "ab" * 32)
    assert r.status_code == 409 and r.json()["missing"] == ["ab" * 32]


def with_strength(doc: dict, strength: float) -> dict:
    """The table with every patch at `strength`: another table id over the same matrices."""
    entries = [
        {**entry, "patches": [{**patch, "strength": strength} for patch in entry["patches"]]}
        for entry in doc["entries"]
    ]
    return {**doc, "entries": entries}


def test_tables_beyond_their_bound_go_least_recently_used_first(tiny_folder, lora_doc):
    """Each new strength is a new table holding float32 matrices (counted by memory plans); an
    instance keeps tables up to twice the adapter cache's bound, dropping the least recently used
    (a step refreshes one), and a step naming a dropped table gets 409 missing until it is
    defined again."""
    doc, adapters = lora_doc
    live = Server(tiny_folder[0])
    try:
        for array in adapters.values():
            live.upload("adapters", array)
        docs = [with_strength(doc, s) for s in (0.25, 0.5, 0.75)]
        ids = [table_id(d) for d in docs]
        held = live.ctx.service.memory.held
        live.ctx.service.release(live.ctx.service.acquire(MODEL_ID))  # loaded, no table yet
        before = held(states=False)
        assert live.put_table(docs[0]).status_code == 200
        loaded = live.ctx.registry.loaded(MODEL_ID)
        one_table = loaded.tables[ids[0]].nbytes
        assert one_table >= sum(a.nbytes for a in adapters.values())
        assert held(states=False) == before + one_table  # memory plans count the tables
        live.ctx.service.adapters.set_bound(one_table)  # tables: two fit, not three
        assert live.put_table(docs[1]).status_code == 200
        cond, x = inputs(53)
        cond_hash = live.upload("tensors", cond)
        first = out_of(live.step(x, 0.4, cond_hash, ids[0]))  # 0 is now the most recent

        assert live.put_table(docs[2]).status_code == 200
        assert list(loaded.tables) == [ids[0], ids[2]]  # 1 went, the least recently used
        r = live.step(x, 0.4, cond_hash, ids[1])
        assert r.status_code == 409 and r.json()["missing"] == [ids[1]]
        np.testing.assert_array_equal(out_of(live.step(x, 0.4, cond_hash, ids[0])), first)

        for array in adapters.values():  # the shrunk cache let some go: upload them again
            live.upload("adapters", array)
        assert live.put_table(docs[1]).status_code == 200
        assert list(loaded.tables) == [ids[0], ids[1]]
        assert live.step(x, 0.4, cond_hash, ids[1]).status_code == 200
    finally:
        live.close()


# ---------------------------------------------------------------- an entry's configured adapters


def lora_path(tmp_path, shapes, seed: int, layers=None):
    lora = random_lora(shapes, seed=seed, **({"layers": layers} if layers else {}))
    path = tmp_path / f"lora{seed}.safetensors"
    path.write_bytes(wire.write_container(write_form(lora, "comfy")))
    return path


def test_steps_naming_no_table_run_under_the_entrys_adapters(tmp_path, tiny_folder, lora_doc):
    """docs/contract.md §2.9: a step with no table runs under the entry's configured adapters, a step
    naming a table under that table alone; memory plans count the configured table."""
    shapes = layer_shapes(plain_model(tiny_folder[1]))
    spec = AdapterSpec(lora_path(tmp_path, shapes, 70), 0.7)
    live = Server(tiny_folder[0], {MODEL_ID: ModelSettings(adapters=(spec,))})
    try:
        cond, x = inputs(54)
        cond_hash = live.upload("tensors", cond)
        configured = out_of(live.step(x, 0.5, cond_hash))
        loaded = live.ctx.registry.loaded(MODEL_ID)
        assert loaded.default_adapters == (spec,)
        row = StepRow(cond=cond[0], cond_key=f"wire:{cond_hash}")
        worker = live.ctx.service.worker

        def direct(table):
            timestep = np.array([0.5], np.float32)
            return loaded.model.denoise_step(x, timestep, [row], table=table).out

        from_file = worker.call(adapter_table, loaded, [spec])
        np.testing.assert_array_equal(configured, worker.call(direct, from_file))
        assert not np.allclose(configured, worker.call(direct, None), atol=1e-3)

        doc, adapters = lora_doc
        for array in adapters.values():
            live.upload("adapters", array)
        assert live.put_table(doc).status_code == 200
        named = out_of(live.step(x, 0.5, cond_hash, table_id(doc)))
        np.testing.assert_array_equal(named, worker.call(direct, loaded.tables[table_id(doc)]))

        memory = live.ctx.service.memory
        caches = sum(cache.total for cache in memory.caches)
        tables = loaded.default_table.nbytes + loaded.tables[table_id(doc)].nbytes
        assert memory.held(states=False) == caches + loaded.model.weight_bytes + tables
        resident = loaded.model.status()["memory"]["resident_bytes"]  # the cache bounds' plan
        assert memory._footprint(loaded) == resident + loaded.default_table.nbytes

        # the OpenAI routes sample under them too
        request = ImageRequest(prompt="a boat", width=64, height=64, seed=3, steps=2)
        r = live.session.post(
            f"http://127.0.0.1:{live.thread.port}/v1/images/generations",
            json={"prompt": "a boat", "size": "64x64", "seed": 3, "steps": 2},
        )
        assert r.status_code == 200, r.text
        with Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))) as image:
            served = np.asarray(image.convert("RGB"))

        def sampled(table):
            transport = DirectTransport(loaded.model, call=worker.call, table=table)
            latents, _ = generate(transport, loaded.model.status(), request)
            return to_uint8(transport.decode(latents))

        np.testing.assert_array_equal(served, sampled(loaded.default_table))
        assert not np.array_equal(served, sampled(None))
    finally:
        live.close()


class CountedFamily:
    """The Qwen-Image 2.1 family, counting its weight loads."""

    def __init__(self) -> None:
        from gmlx_server.engine.families.qwen_image21.family import QWEN_IMAGE21

        self.family = QWEN_IMAGE21
        self.loads = 0

    def __getattr__(self, name: str):
        return getattr(self.family, name)

    def load(self, *args, **options):
        self.loads += 1
        return self.family.load(*args, **options)


def refused_load(tiny_folder, spec: AdapterSpec, seed: int) -> tuple[str, int]:
    """A step on a server whose entry names `spec`: (the 400's message, weight loads)."""
    family = CountedFamily()
    models = {MODEL_ID: ModelSettings(adapters=(spec,))}
    live = Server(tiny_folder[0], models, families={"qwen_image21": family})
    try:
        cond, x = inputs(seed)
        r = live.step(x, 0.5, live.upload("tensors", cond))
        assert r.status_code == 400, r.text
        assert live.ctx.registry.loaded(MODEL_ID) is None
        message = r.json()["error"]
        assert MODEL_ID in message and spec.path.name in message
        return message, family.loads
    finally:
        live.close()


def test_a_configured_file_gone_since_start_fails_before_the_weights_load(tmp_path, tiny_folder):
    shapes = layer_shapes(plain_model(tiny_folder[1]))
    spec = AdapterSpec(lora_path(tmp_path, shapes, 72))
    spec.path.unlink()
    message, loads = refused_load(tiny_folder, spec, 56)
    assert "cannot read it" in message and loads == 0


def test_configured_adapters_that_do_not_fit_fail_the_load_by_name(tmp_path, tiny_folder):
    """Keys naming no layer are found from the folder's manifest, before the weights load;
    matrices that do not fit their layer, by the loaded model."""
    state = write_form(random_lora({"img_in": (32, 64)}, seed=71, layers=["img_in"]), "comfy")
    renamed = {key.replace("img_in", "no_such_layer"): value for key, value in state.items()}
    path = tmp_path / "wrong.safetensors"
    path.write_bytes(wire.write_container(renamed))
    message, loads = refused_load(tiny_folder, AdapterSpec(path), 55)
    assert "no_such_layer" in message and loads == 0

    shapes = layer_shapes(plain_model(tiny_folder[1]))
    out_dim, in_dim = shapes["img_in"]
    misfit = write_form(
        random_lora({"img_in": (out_dim, in_dim + 1)}, seed=73, layers=["img_in"]), "comfy"
    )
    path = tmp_path / "misfit.safetensors"
    path.write_bytes(wire.write_container(misfit))
    message, loads = refused_load(tiny_folder, AdapterSpec(path), 57)
    assert "img_in" in message and loads == 1
