"""docs/openapi.yaml against a live server, with schemathesis: for every operation, generated
requests (valid and invalid by the description) never get a 5xx, and every answer conforms to
the description (status documented, content type, body schema, headers).

The default run is short (a bounded number of examples per operation); `pytest -m heavy` runs
many more.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import schemathesis
import yaml
from gmlx_contract import wire
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ..server.conftest import start_server

OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
SCHEMA = schemathesis.openapi.from_path(OPENAPI)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
VERSION = {"X-Gmlx-Steps-Contract": "1.0"}
QUICK_EXAMPLES = 8
HEAVY_EXAMPLES = int(os.environ.get("GMLX_FUZZ_EXAMPLES", "300"))  # per operation and mode
# What "conform" means here. Not `positive_data_acceptance`: a body can fit the description and
# still be refused for what JSON Schema cannot say (a hash that was never uploaded, a container
# whose bytes do not parse, a model id that does not exist).
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@schemathesis.serializer(wire.CONTAINER_TYPE)
def _container_bytes(ctx, value) -> bytes:
    """Generated container bodies are binary strings: sent as they are."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    data = getattr(value, "data", None)
    return bytes(data) if data is not None else str(value).encode("utf-8")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own: generated runs/begin calls fill its 32 run slots."""
    live = start_server(tmp_path_factory.mktemp("openapi"))
    yield live
    live.close()


def operation_id(operation) -> str:
    return f"{operation.method.upper()} {operation.path.removeprefix('/internal/image-steps/v1')}"


def rejects_invalid_data(ctx, response, case):
    """schemathesis' negative_data_rejection, less the cases it gets wrong here: a JSON route
    reads an empty or blank body as {} (docs/contract.md §1.1), which is valid; and a multipart
    body whose mutations the form cannot carry (`form_reads_them_valid`)."""
    body = case.body
    if isinstance(body, (bytes, str)) and not body.strip():
        return None
    if form_reads_them_valid(case):
        return None
    return negative_data_rejection(ctx, response, case)


def form_reads_them_valid(case) -> bool:
    """Whether a multipart case's every mutation is lost in the form, as docs/openapi.yaml
    says a form reads its parts: a text field given another type is sent as text the field
    takes (an array as "[]"), and a field whose invalid value is sent as an empty part, or as
    no part, is absent."""
    from schemathesis.core.mutations import OperatorKind
    from schemathesis.core.parameters import ParameterLocation

    if not str(case.media_type or "").startswith("multipart/form-data") or case.meta is None:
        return False
    mutations = getattr(case.meta.phase.data, "mutations", ())

    def lost(mutation) -> bool:
        if mutation.parameter_location != ParameterLocation.BODY:
            return False
        retyped_text = (
            mutation.operator == OperatorKind.CHANGE_TYPE
            and mutation.keywords == ("type",)
            and mutation.original_value == "string"
        )
        field = mutation.path[0] if mutation.path else None
        sent_empty = isinstance(case.body, dict) and field in case.body
        return retyped_text or (sent_empty and empty_in_a_form(case.body[field]))

    return bool(mutations) and all(lost(mutation) for mutation in mutations)


def empty_in_a_form(value) -> bool:
    """Whether a form sends the value as an empty part or as none (a list: a part each)."""
    if isinstance(value, (list, tuple)):
        return all(empty_in_a_form(item) for item in value)
    return value is None or value == ""


def exercise(server, operation, mode: GenerationMode, examples: int, headers=None) -> None:
    """Up to `examples` generated requests (fewer where the description allows fewer
    distinct ones); prints how many were sent and their answers by status class."""
    checks = CONFORMANCE + ([rejects_invalid_data] if mode is GenerationMode.NEGATIVE else [])
    strategy = operation.as_strategy(generation_mode=mode, headers=headers)
    answers: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case) -> None:
        response = case.call(base_url=server.base, session=server.session, timeout=30)
        answers[f"{response.status_code // 100}xx"] += 1
        assert response.status_code < 500, (response.status_code, response.text[:300])
        case.validate_response(response, checks=checks)

    try:
        check()
    except Unsatisfiable:
        pytest.skip("the operation has no parameter or body to make invalid")
    finally:
        tally = ", ".join(f"{status} {count}" for status, count in sorted(answers.items()))
        sent = sum(answers.values())
        print(f"FIGURE schemathesis {operation_id(operation)} {mode.value}: {sent} ({tally})")
    assert server.ctx.service.worker.alive


def test_the_description_lists_every_route():
    """Every route of the app is described, and nothing else."""
    from gmlx_server.app import HEALTH_PATH, METRICS_PATH, step_routes
    from gmlx_server.openai import (
        EDITS_PATH,
        FILES_PATH,
        GENERATIONS_PATH,
        MODELS_PATH,
        VARIATIONS_PATH,
    )
    from gmlx_server.routes.common import PREFIX

    doc = yaml.safe_load(OPENAPI.read_text())
    described = set(doc["paths"])
    served = {HEALTH_PATH, METRICS_PATH, GENERATIONS_PATH, EDITS_PATH, VARIATIONS_PATH}
    served |= {FILES_PATH, MODELS_PATH}
    served |= {PREFIX + "/" + path for path, _ in step_routes(None)}
    assert described == served


def test_the_openai_fields_are_described_as_served():
    """The OpenAI routes' bounds and choices in the description are the code's."""
    from gmlx_server import imagefiles, openai
    from gmlx_server.engine.sampling import MAX_MASK_BLUR, SAMPLERS

    schemas = yaml.safe_load(OPENAPI.read_text())["components"]["schemas"]
    job = schemas["ImageJobFields"]["properties"]
    assert job["size"]["pattern"] == f"^(auto|{openai.SIZE_RE.pattern})$"
    assert job["n"]["maximum"] == openai.MAX_IMAGES_PER_REQUEST
    assert job["steps"]["maximum"] == openai.MAX_STEPS
    assert job["seed"]["maximum"] == openai.MAX_SEED
    assert job["cfg"]["maximum"] == job["guidance"]["maximum"] == openai.MAX_GUIDANCE
    assert job["sampler"]["enum"] == [*SAMPLERS, None]
    assert job["output_format"]["enum"] == [*imagefiles.OUTPUT_FORMATS, None]
    assert job["response_format"]["enum"] == [*openai.RESPONSE_FORMATS, None]
    assert job["partial_images"]["maximum"] == openai.MAX_PARTIAL_IMAGES
    assert job["mask_blur"]["maximum"] == MAX_MASK_BLUR
    assert (job["strength"]["minimum"], job["strength"]["maximum"]) == (0, 1)


def test_the_readiness_parameter_is_described_as_read():
    """/health's `ready`: the values the description allows are those the route takes."""
    import re

    from gmlx_contract.errors import ContractError
    from gmlx_server.routes.models import ready_asked

    (ready,) = yaml.safe_load(OPENAPI.read_text())["paths"]["/health"]["get"]["parameters"]
    pattern = ready["schema"]["pattern"]
    for value in ["1", "0", "true", "True", "TRUE", "false", "FaLsE", "yes", "", "2", "truee"]:
        try:
            ready_asked(value)
            taken = True
        except ContractError:
            taken = False
        assert bool(re.search(pattern, value)) == taken, value


def test_every_json_body_takes_a_null_model_as_the_default():
    """The server reads a JSON body's `model` null as absent, the default model
    (routes/common.model_field, openai.model_field): each description says so, or the negative
    runs would count an answer to `"model": null` as a refusal missed whenever they send one."""
    doc = yaml.safe_load(OPENAPI.read_text())
    shared = doc["components"]["requestBodies"]
    described = []
    for route, methods in doc["paths"].items():
        for method, operation in methods.items():
            body = operation.get("requestBody") if isinstance(operation, dict) else None
            if body is None:
                continue
            body = shared[body["$ref"].rsplit("/", 1)[-1]] if "$ref" in body else body
            schema = (body["content"].get("application/json") or {}).get("schema", {})
            schema = _resolved(doc, schema)
            model = schema.get("properties", {}).get("model")
            if model is not None:
                described.append(route)
                assert "type" not in model or model.get("nullable"), (method, route, model)
    assert "/internal/image-steps/v1/encode" in described and "/v1/images/generations" in described


def _resolved(doc: dict, schema: dict) -> dict:
    """`schema` with its $ref and allOf parts merged into one object's properties."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return _resolved(doc, doc["components"]["schemas"][name])
    properties = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        properties |= _resolved(doc, part).get("properties", {})
    return {**schema, "properties": properties}


@pytest.mark.parametrize("operation", OPERATIONS, ids=operation_id)
def test_valid_requests_conform(server, operation):
    exercise(server, operation, GenerationMode.POSITIVE, QUICK_EXAMPLES, VERSION)


@pytest.mark.parametrize("operation", OPERATIONS, ids=operation_id)
def test_invalid_requests_conform(server, operation):
    exercise(server, operation, GenerationMode.NEGATIVE, QUICK_EXAMPLES)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("operation", OPERATIONS, ids=operation_id)
def test_long_schemathesis_run(server, operation, mode):
    headers = VERSION if mode is GenerationMode.POSITIVE else None
    exercise(server, operation, mode, HEAVY_EXAMPLES, headers)
