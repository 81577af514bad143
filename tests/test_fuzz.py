"""Schemathesis against the live /openapi.json of a real server: generated requests, valid and invalid, to every
operation; no answer may be a 5xx, and every answer must match the schema the service publishes for it."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance
from service_process import running_service

EXAMPLES = 25  # per operation and mode: a bounded run (seconds here), the same requests every time
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def served():
    with running_service(warmup_runs=0, max_upload_bytes=2_000_000) as base:
        yield base


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx_or_an_answer_outside_the_schema(served, mode):
    schema = schemathesis.openapi.from_url(f"{served}/openapi.json")
    operations, sent = [result.ok() for result in schema.get_all_operations()], []
    assert {"POST /classify", "POST /expression", "GET /attention-map", "POST /v2/models/{name}/infer"} <= {
        op.label for op in operations}
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def answers_within_its_schema(case):
            sent.append(case.call_and_validate(base_url=served, timeout=30, checks=CHECKS).status_code)

        try:
            answers_within_its_schema()
        except Unsatisfiable:  # nothing in this operation can be made invalid (no body, only free-form strings)
            assert mode == GenerationMode.NEGATIVE
    print(f"\n{mode.value}: {len(sent)} requests, statuses {sorted(set(sent))}")
    assert len(sent) >= 3 * EXAMPLES  # requests were made, not all skipped
