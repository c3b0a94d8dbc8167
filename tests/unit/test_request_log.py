"""The gateway's one log line per request says why a refused request was refused."""
import logging

import grpc

from gateway.core.metrics import RequestRecord
from rpcserver.errors import InvalidArgument


def test_a_refused_request_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.requests"):
        RequestRecord("r-1").done(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument("top_p must be in (0, 1], got 2"))
        RequestRecord("r-2").done(grpc.StatusCode.OK)
    refused, served = (r.getMessage() for r in caplog.records)
    assert refused.startswith("request r-1: INVALID_ARGUMENT")
    assert "why 'top_p must be in (0, 1], got 2'" in refused
    assert served.startswith("request r-2: OK") and "why" not in served


def test_the_line_names_the_workers_id_once_the_request_went_there(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.requests"):
        RequestRecord("shared", worker_request_id="0f" * 16).done(grpc.StatusCode.OK)
        RequestRecord("refused").done(grpc.StatusCode.INVALID_ARGUMENT)
    sent, refused = (r.getMessage() for r in caplog.records)
    assert sent.startswith("request shared: OK") and sent.endswith(f", worker request {'0f' * 16}")
    assert "worker request" not in refused
