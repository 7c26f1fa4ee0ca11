"""The parts under the routes: the LRU cache, the image worker, the registry."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gmlx_contract.errors import ContractError
from gmlx_server.engine.registry import ModelRegistry
from gmlx_server.service import ByteLRU, CachedTensor
from gmlx_server.worker import ImageWorker, WorkerStopped

from tests.catalog import FAMILIES

from . import linear_family
from .conftest import model_root


def tensor(nbytes: int) -> CachedTensor:
    return CachedTensor(np.zeros(nbytes, np.uint8), "U8")


def test_lru_bounds_recency_and_the_newest_stays():
    cache = ByteLRU("t", 100)
    cache.put("a", tensor(40))
    cache.put("b", tensor(40))
    assert cache.has("a")  # no refresh
    cache.put("c", tensor(40))
    assert (cache.has("a"), cache.has("b"), cache.has("c")) == (False, True, True)
    assert cache.get("b") is not None  # refresh
    cache.put("d", tensor(40))
    assert (cache.has("b"), cache.has("c"), cache.has("d")) == (True, False, True)
    cache.put("huge", tensor(500))  # over the bound alone: it stays, everything else goes
    assert len(cache) == 1 and cache.has("huge") and cache.total == 500
    cache.put("e", tensor(10))
    assert not cache.has("huge") and cache.has("e")
    cache.put("e", tensor(20))  # replacing counts bytes once
    assert cache.total == 20
    cache.set_bound(5)
    assert len(cache) == 1
    assert ByteLRU("x", 4 << 30).limit == 1 << 30


def test_worker_runs_jobs_in_order_and_survives_their_failures():
    worker = ImageWorker()
    worker.start()
    try:
        seen, names = [], set()

        def job(i):
            names.add(threading.current_thread().name)
            seen.append(i)
            if i == 2:
                raise ValueError("two")
            return i * 10

        futures = [worker.submit(job, i) for i in range(5)]
        assert [f.exception() is None for f in futures] == [True, True, False, True, True]
        with pytest.raises(ValueError, match="two"):
            futures[2].result()
        assert [futures[i].result() for i in (0, 1, 3, 4)] == [0, 10, 30, 40]
        assert seen == list(range(5)) and names == {"gmlx-image"}
        assert worker.call(lambda: worker.call(lambda: 7)) == 7  # nested call runs inline
        with pytest.raises(KeyboardInterrupt):
            worker.call(_raise_keyboard_interrupt)
        assert worker.alive and worker.call(lambda: 1) == 1
    finally:
        worker.stop()
    assert not worker.alive
    with pytest.raises(WorkerStopped):
        worker.submit(lambda: 1)


def test_a_worker_stopped_at_once_answers_its_running_and_queued_jobs_at_once():
    """`abandon` (a stop at once): the callers of the job that runs and of those queued get
    WorkerStopped now, not when the job ends; the job's own end is dropped quietly and the
    thread ends; no new job is taken."""
    worker = ImageWorker()
    worker.start()
    release, running = threading.Event(), threading.Event()

    def long_job():
        running.set()
        release.wait(30)
        return "late"

    first = worker.submit(long_job)
    queued = worker.submit(lambda: "never")
    assert running.wait(10)
    worker.abandon()
    for future in (first, queued):
        with pytest.raises(WorkerStopped):
            future.result(timeout=1)
    with pytest.raises(WorkerStopped):
        worker.submit(lambda: 1)
    release.set()
    worker.stop(timeout=10)  # the thread ends once the job it ran returns
    assert not worker.alive


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


def registry(tmp_path, default="alpha", **kw) -> ModelRegistry:
    root = model_root(tmp_path)
    return ModelRegistry([root], default, families={"test_linear": linear_family.LINEAR}, **kw)


def test_registry_resolution_statuses(tmp_path):
    reg = registry(tmp_path)
    assert reg.resolve(None).model_id == "alpha" and reg.resolve("").model_id == "alpha"
    assert reg.resolve("beta").variant == "turbo"
    for model_id, status in [("ghost", 404), ("stranger", 400), (5, 400)]:
        with pytest.raises(ContractError) as info:
            reg.resolve(model_id)
        assert info.value.status == status
    with pytest.raises(ContractError) as info:
        registry(tmp_path / "other", default=None).resolve(None)
    assert info.value.status == 400


def test_an_unknown_model_is_answered_with_the_folders_searched_and_the_models_there(tmp_path):
    reg = registry(tmp_path)
    with pytest.raises(ContractError) as info:
        reg.resolve("qwen-image-2.1")
    message = info.value.message
    assert message.startswith("unknown image model 'qwen-image-2.1': no folder of that name")
    assert f"model_dirs ({tmp_path / 'models'})" in message
    assert "the models here: alpha, beta, broken" in message


def test_an_unknown_model_that_is_published_names_its_gmlx_pull(tmp_path):
    reg = ModelRegistry([tmp_path], default_model=None)
    for name, hint in (("qwen-image-2.1", True), ("qwen-image-2", False)):
        with pytest.raises(ContractError) as info:
            reg.resolve(name)
        assert info.value.status == 404
        assert ("fetch it with `gmlx pull " + name + "`" in info.value.message) is hint


def test_an_unknown_model_near_a_known_name_names_it(tmp_path):
    """A mistyped id: the nearest of the folders', the embedded models' and the published
    models' names is offered."""
    ours = registry(tmp_path)
    for reg, mistyped, meant in (
        (ours, "alpah", "alpha"),
        (ours, "qwen-image-tiny", "qwen-image21-random-tiny"),
        (ModelRegistry([tmp_path], default_model=None), "FLUX2-klein-4B", "flux2-klein-4b"),
    ):
        with pytest.raises(ContractError) as info:
            reg.resolve(mistyped)
        assert info.value.message.endswith(f"; did you mean {meant!r}?"), info.value.message
    with pytest.raises(ContractError) as info:
        ours.resolve("something-else-entirely")
    assert "did you mean" not in info.value.message
    with pytest.raises(ContractError) as info:  # one not served with this default_model
        ours.resolve("z-image-random-tiny")
    assert info.value.message.endswith(
        "; it is an embedded model, served where no default_model is configured or"
        " default_model names it"
    )


def test_a_file_a_family_cannot_read_is_named_and_looked_at_again_once_mended(tmp_path):
    """A Z-Image folder whose text encoder's config.json is not JSON: the refusal names the
    file and the family that read it; mended, the folder is served without a restart."""
    import json

    folder = tmp_path / "half-edited"
    (folder / "text_encoder").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    config = folder / "text_encoder" / "config.json"
    config.write_text("{x")
    reg = ModelRegistry([tmp_path], None)
    with pytest.raises(ContractError) as info:
        reg.resolve("half-edited")
    assert info.value.status == 400
    assert "not of a family this server can load" in info.value.message
    assert f": read as z_image: {config} is not JSON (" in info.value.message
    config.write_text(json.dumps({"model_type": "qwen3"}))
    assert reg.resolve("half-edited").family == "z_image"


def test_registry_extra_folder_and_first_wins(tmp_path):
    extra = linear_family.make_model_folder(tmp_path / "embedded", "alpha", variant="embedded")
    reg = ModelRegistry(
        [model_root(tmp_path)],
        None,
        extra_models=[extra],
        families={"test_linear": linear_family.LINEAR},
    )
    assert reg.resolve("alpha").path == extra and reg.resolve("alpha").variant == "embedded"


def test_registry_load_hold_unload(tmp_path):
    reg = registry(tmp_path)
    first = reg.acquire("alpha")
    assert reg.holds("alpha") == 1 and reg.resident_ids() == ["alpha"]
    with pytest.raises(ContractError) as info:
        reg.unload("alpha")
    assert info.value.status == 409 and info.value.body["in_flight"] == 1
    with pytest.raises(ContractError) as info:
        reg.acquire("beta")  # one resident model at a time, alpha is held
    assert info.value.status == 503
    reg.release(first)
    second = reg.acquire("beta")  # evicts alpha
    assert first.model.closed and reg.resident_ids() == ["beta"]
    reg.release(second)
    assert reg.unload("beta") is True and reg.unload("beta") is False
    again = reg.acquire("alpha")
    assert again.generation > first.generation and again.tables == {}


def test_a_folder_of_no_family_says_when_its_model_index_cannot_be_read(tmp_path):
    reg = registry(tmp_path)
    with pytest.raises(ContractError) as info:
        reg.resolve("stranger")
    assert info.value.message.endswith(")")  # a JSON object of another class: nothing to add
    cut = reg.model_dirs[0] / "cut"
    cut.mkdir()
    (cut / "model_index.json").write_text('{"_class_name": "ZImagePipeline",')
    with pytest.raises(ContractError) as info:
        reg.resolve("cut")
    assert info.value.status == 400
    assert ": its model_index.json cannot be read (Expecting property name" in info.value.message


def test_a_held_model_whose_id_moves_to_another_folder_stays_until_let_go(tmp_path):
    """A folder of the same id appears in an earlier model dir (a pull, a ComfyUI file touched):
    the instance a run holds is not dropped under it; the new folder loads once it is let go."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    linear_family.make_model_folder(second, "alpha")
    now = [0.0]
    reg = ModelRegistry([first, second], "alpha", families={"test_linear": linear_family.LINEAR})
    reg._clock = lambda: now[0]
    held = reg.acquire("alpha")
    linear_family.make_model_folder(first, "alpha")
    now[0] += 3600.0
    with pytest.raises(ContractError) as info:
        reg.acquire("alpha")
    assert info.value.status == 503 and "held by 1 run(s) or step(s)" in info.value.message
    assert reg.loaded("alpha") is held and not held.model.closed
    reg.release(held)
    moved = reg.acquire("alpha")
    assert moved is not held and moved.entry.path == first / "alpha"


def test_registry_vanished_and_broken_models(tmp_path):
    reg = registry(tmp_path)
    with pytest.raises(ContractError) as info:
        reg.acquire("broken")
    assert info.value.status == 400
    (reg.model_dirs[0] / "beta" / "model_index.json").unlink()
    with pytest.raises(ContractError) as info:
        reg.acquire("beta")
    assert info.value.status == 404


def test_the_product_family_table_names_its_families():
    from gmlx_server.engine.spec import family_specs

    specs = family_specs()
    assert list(specs) == FAMILIES
    assert all(spec.name == name for name, spec in specs.items())


def test_a_spec_that_names_another_folder_is_refused(monkeypatch):
    from dataclasses import replace

    from gmlx_server.engine.families.krea2 import spec as krea2
    from gmlx_server.engine.spec import family_specs

    moved = replace(krea2.SPEC, package="gmlx_server.engine.families.z_image")
    monkeypatch.setattr(krea2, "SPECS", (moved,))
    with pytest.raises(LookupError, match="family krea2 of .*krea2 names .*z_image"):
        family_specs()


def test_a_folder_without_a_spec_is_passed_over_and_a_broken_spec_raises(tmp_path, monkeypatch):
    import sys

    from gmlx_server.engine import families
    from gmlx_server.engine.spec import family_specs

    (tmp_path / "aaa_nospec").mkdir()
    (tmp_path / "aaa_nospec" / "__init__.py").write_text("")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    assert list(family_specs()) == FAMILIES
    (tmp_path / "aaa_broken").mkdir()
    (tmp_path / "aaa_broken" / "__init__.py").write_text("")
    (tmp_path / "aaa_broken" / "spec.py").write_text("import gmlx_no_such_module\n")
    try:
        with pytest.raises(ModuleNotFoundError, match="gmlx_no_such_module"):
            family_specs()
    finally:
        for name in [n for n in sys.modules if n.startswith(families.__name__ + ".aaa_")]:
            del sys.modules[name]


def test_a_spec_without_a_folder_says_so_when_its_family_is_looked_up():
    from gmlx_server.engine.spec import FamilySpec

    spec = FamilySpec(name="loose", title="loose", identify=lambda _: None)
    assert spec.module_name("family") is None and spec.load_component_rule() is None
    with pytest.raises(LookupError, match="family loose's folder .its spec names none."):
        spec.load_implementation()


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ('{"_class_name": "Pipe", "fast": true}', ("fam", "quick")),
        ('{"_class_name": "Pipe", "fast": []}', ("fam", "slow")),
        ('{"_class_name": "Pipe"}', ("fam", "slow")),
        ('{"_class_name": "OtherPipe", "fast": true}', None),
        ('["Pipe"]', None),
        ("{not json", ValueError),  # named in the refusal of a folder no family reads
        (None, None),
    ],
)
def test_by_class_tells_the_family_by_class_and_the_variant_by_flag(tmp_path, written, expected):
    from gmlx_server.engine.spec import ByClass

    if written is not None:
        (tmp_path / "model_index.json").write_text(written)
    by_index = ByClass("fam", "Pipe", flag="fast", variants=("quick", "slow"))
    if expected is ValueError:
        with pytest.raises(ValueError, match="model_index.json is not JSON"):
            by_index(tmp_path)
        return
    assert by_index(tmp_path) == expected
    by_config = ByClass(
        "fam", "Pipe", "fast", ("quick", "slow"), document="transformer/config.json"
    )
    assert by_config(tmp_path) is None  # no transformer/ config
    if written is not None:
        (tmp_path / "transformer").mkdir()
        (tmp_path / "transformer" / "config.json").write_text(written)
        assert by_config(tmp_path) == expected


def test_registry_resolve_reuses_a_recent_listing(tmp_path, monkeypatch):
    reg = registry(tmp_path)
    listed = []
    real_folders = reg.folders
    monkeypatch.setattr(reg, "folders", lambda: listed.append(1) or real_folders())
    looked = []
    real_stat = type(tmp_path).stat
    monkeypatch.setattr(type(tmp_path), "stat", lambda p, **kw: looked.append(p) or real_stat(p))
    reg.resolve("alpha")
    listed.clear()
    looked.clear()
    for _ in range(5):
        assert reg.resolve("alpha").model_id == "alpha"
    assert listed == [] and looked == []  # no file-system work per step
    linear_family.make_model_folder(reg.model_dirs[0], "gamma")
    assert reg.resolve("gamma").model_id == "gamma"  # a miss looks again at once
    reg._clock = lambda: 1e12  # the listing has aged past its TTL
    listed.clear()
    reg.resolve("alpha")
    assert listed == [1]


def test_registry_models_listing_is_always_fresh(tmp_path):
    reg = registry(tmp_path)
    reg.resolve("alpha")
    linear_family.make_model_folder(reg.model_dirs[0], "gamma")
    assert "gamma" in {entry.model_id for entry in reg.entries()}


def test_a_component_config_that_is_no_json_is_named_for_a_folder_no_family_reads(tmp_path):
    """FLUX.3 klein tells its folders by transformer/config.json: one that is not JSON is
    named in the refusal, not passed over in silence."""
    import json

    folder = tmp_path / "cut-short"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "SomePipeline"}))
    config = folder / "transformer" / "config.json"
    config.write_text('{"_class_name": "Flux3')
    with pytest.raises(ContractError) as info:
        ModelRegistry([tmp_path], None).resolve("cut-short")
    assert f"read as flux3_klein: {config} is not JSON (" in info.value.message


def test_a_folder_of_no_family_yet_is_looked_at_again_once_its_files_arrive(tmp_path):
    """A FLUX.3 klein folder whose transformer/ config is still being copied is of no family;
    once it is there (its model_index.json untouched) the folder serves, after at most a
    listing's time, without a restart."""
    import json

    from gmlx_server.engine import registry as registry_module

    folder = tmp_path / "arriving"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "Flux3KleinPipeline"}))
    now = [100.0]
    reg = ModelRegistry([tmp_path], None)
    reg._clock = lambda: now[0]
    assert [e.family for e in reg.entries()] == [None]
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(
        json.dumps({"_class_name": "Flux3Transformer2DModel"})
    )
    assert [e.family for e in reg.entries()] == [None]  # within a listing's time: as it was
    now[0] += registry_module.LISTING_TTL_S
    assert reg.resolve("arriving").family == "flux3_klein"
