"""Which failed publishes the trainer tries again (`PublishError.retryable`): a corrupt or cut
stream and a service away for a moment, and the INTERNAL that gRPC Python reports in place of
the service's status when this side was still sending as the service ended the call (seen under
load: the service's DATA_LOSS for a corrupt bucket arrived as INTERNAL "Internal error from
Core"); never a version the service refuses as stale, nor a genuine internal error."""
from __future__ import annotations

import grpc
import pytest

from kiln.services.weight_sync.client import SEND_FAILED, PublishError

C = grpc.StatusCode


@pytest.mark.parametrize(("code", "details", "retryable"), [
    (C.DATA_LOSS, "bucket 3 digest mismatch", True),
    (C.UNAVAILABLE, "connection refused", True),
    (C.CANCELLED, "stream cut", True),
    (C.INTERNAL, SEND_FAILED, True),
    (C.INTERNAL, "Unexpected <class 'KeyError'>: 'x'", False),
    (C.FAILED_PRECONDITION, "version 3 is not newer than the latest committed 4", False),
    (C.INVALID_ARGUMENT, "manifest", False),
])
def test_what_a_publish_retries(code, details, retryable) -> None:
    assert PublishError(7, code, details).retryable is retryable
