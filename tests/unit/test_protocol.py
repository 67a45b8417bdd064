"""Pure tests of psgrad.wire.protocol's error mapping: each kind of failed call, with the status
details grpcio 1.85 gives for it, becomes a message saying what happened."""
from __future__ import annotations

import grpc
import pytest

from psgrad import errors
from psgrad.wire.local_socket import LocalCallError
from psgrad.wire.protocol import ERROR_METADATA_KEY, connection_problem, not_sent, to_psgrad_error

pytestmark = pytest.mark.timeout(60)


# A failed call as grpc raises it (code, details, trailing metadata): the local socket's error is one.
FailedCall = LocalCallError


# The details grpcio 1.85 gave on Linux for each case (seen by calling such addresses, the routes in
# a network namespace): a closed port, a route marked unreachable, a network without a route, an
# unknown host, a port whose process takes TCP but never speaks HTTP/2, a server that went away.
DETAILS = {
    "refused": "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:33823: Failed to connect "
               "to remote host: Connection refused",
    "no-route": "failed to connect to all addresses; last error: FAILED_PRECONDITION: ipv4:10.7.0.1:7000: connect "
                "failed: addr: ipv4:10.7.0.1:7000 error: No route to host",
    "no-network": "failed to connect to all addresses; last error: FAILED_PRECONDITION: ipv4:10.9.0.1:7000: connect "
                  "failed: addr: ipv4:10.9.0.1:7000 error: Network is unreachable",
    "unresolved": "errors resolving nonexistent.invalid:7000: [field:hostname lookup error:address lookup failed for "
                  "nonexistent.invalid:7000: Domain name not found]",
    "no-grpc": "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:36795: connection attempt "
               "timed out before receiving SETTINGS frame",
    "closed": "Socket closed",
}


@pytest.mark.parametrize(
    "case, words, unsent",
    [
        ("refused", "refused the connection (nothing listens on that port", True),
        ("no-route", "is unreachable (no route to that address", True),
        ("no-network", "is unreachable (no route to that address", True),
        ("unresolved", "could not be resolved (is the host name right?)", True),
        ("no-grpc", "took the TCP connection but did not speak gRPC", True),
        ("closed", "closed the connection (did it stop or crash, or did its TLS refuse this client", False),
    ],
)
def test_what_an_unavailable_status_says_happened(case: str, words: str, unsent: bool) -> None:
    problem = connection_problem(DETAILS[case])
    assert problem is not None and problem[0].startswith(words) and problem[1] is unsent
    err = to_psgrad_error(FailedCall(grpc.StatusCode.UNAVAILABLE, DETAILS[case]), "h:1", "the push", 60.0,
                          waited=" for 12.3 s of --reconnect-timeout-s 60")
    assert type(err) is errors.ServerUnavailableError
    outcome = "the push was not sent" if unsent else "the push failed"
    assert str(err) == f"server h:1 {problem[0]} for 12.3 s of --reconnect-timeout-s 60: {outcome}"


def test_an_unknown_unavailable_status_keeps_its_details() -> None:
    assert connection_problem("something new") is None
    err = to_psgrad_error(FailedCall(grpc.StatusCode.UNAVAILABLE, "something new"), "h:1", "the pull", 5.0)
    assert str(err) == "server h:1 did not answer the pull (UNAVAILABLE: something new)"


def test_a_deadline_says_how_long_and_what_a_second_call_found() -> None:
    late = FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    err = to_psgrad_error(late, "h:1", "the join request", 10.0, diagnosis="a second call found that it is gone")
    assert isinstance(err, errors.DeadlineExceededError) and isinstance(err, errors.ServerUnavailableError)
    assert str(err) == "server h:1 did not answer the join request within 10 s (deadline exceeded): a second call found that it is gone"
    assert "paused or overloaded" in str(to_psgrad_error(late, "h:1", "the pull", 10.0))  # no second call made


def test_a_server_error_is_raised_as_its_own_class() -> None:
    named = FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "lr differs", ((ERROR_METADATA_KEY, "JobMismatchError"),))
    err = to_psgrad_error(named, "h:1", "the join request", 10.0)
    assert type(err) is errors.JobMismatchError and str(err) == "server h:1: lr differs"


def test_not_sent_agrees_with_its_subject() -> None:
    assert not_sent("the push") == "the push was not sent"
    assert not_sent("the push and pull") == "the push and pull were not sent"
