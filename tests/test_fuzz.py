"""Schemathesis against the live /openapi.json of a real server: generated requests, valid and invalid, to every
operation; no answer may be a 5xx (but the 504 of a deadline the request set itself), and every answer must match the
schema the service publishes for it."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance
from service_process import running_service

EXAMPLES = 25  # per operation and mode: a bounded run (seconds here), the same requests every time


def not_a_server_fault(ctx, response, case) -> None:
    """not_a_server_error, but for the 504 a request's own deadline (a generated timeout_ms of 1, say) asks for."""
    if response.status_code == 504 and response.json()["error"]["code"] == "deadline_exceeded":
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [not_a_server_fault, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def served():
    with running_service(warmup_runs=0, max_upload_bytes=2_000_000) as base:
        yield base


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx_or_an_answer_outside_the_schema(served, mode):
    schema = schemathesis.openapi.from_url(f"{served}/openapi.json")
    operations, sent = [result.ok() for result in schema.get_all_operations()], []
    assert {"POST /classify", "POST /embed", "POST /expression", "GET /attention-map",
            "POST /v2/models/{name}/infer"} <= {op.label for op in operations}
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
