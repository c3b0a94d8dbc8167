"""The gateway's one log line per request says why a refused request was refused."""
import logging

import grpc

from gateway.metrics import RequestRecord
from rpcserver.errors import InvalidArgument


def test_a_refused_request_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.requests"):
        RequestRecord("r-1").done(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument("top_p must be in (0, 1], got 2"))
        RequestRecord("r-2").done(grpc.StatusCode.OK)
    refused, served = (r.getMessage() for r in caplog.records)
    assert refused.startswith("request r-1: INVALID_ARGUMENT")
    assert "why 'top_p must be in (0, 1], got 2'" in refused
    assert served.startswith("request r-2: OK") and "why" not in served
