"""The two fixtures vLLM's queue tests take from vLLM's own tests/conftest.py, which imports
far more than a CPU venv without vLLM's full requirements has (models, LLM, datasets)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch):
    """As vLLM's: the "vllm" logger propagates to the root logger, where caplog listens."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    """As vLLM's: caplog at INFO with vLLM's logger propagating."""
    with caplog.at_level(logging.INFO):
        yield caplog


# ---------------------------------------------------------------- the runner's bookkeeping
# Each outcome is appended to $VSA_RESULTS as it happens (and every collected test first), so
# a file killed by its timeout still reports what ran and what was never reached.
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402

_RESULTS = os.environ.get("VSA_RESULTS")
_TEST_TIMEOUT_S = int(os.environ.get("VSA_TEST_TIMEOUT", "300"))


def _record(**row) -> None:
    if _RESULTS:
        with open(_RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        _record(test=item.nodeid, outcome="collected")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2]
        elif report.outcome == "failed":
            reason = getattr(report.longrepr, "reprcrash", None)
            reason = reason.message if reason is not None else str(report.longrepr)[-500:]
            if "Distributed test failed" in reason:
                reason += " " + _child_errors(report)
        _record(test=report.nodeid, when=report.when, outcome=report.outcome, reason=reason)


def _child_errors(report) -> str:
    """The distinct exception lines the test's child processes printed (vLLM's
    ``distributed_run`` reports only their exit codes)."""
    seen: list[str] = []
    for _, text in report.sections:
        for line in text.splitlines():
            m = re.match(r"^(\w+\.)*\w*(Error|Exception|Interrupt): .*", line.strip())
            if m and m.group(0) not in seen:
                seen.append(m.group(0))
    return (
        "children: " + " | ".join(s[:200] for s in seen) if seen else "(children printed no error)"
    )


class TestTimedOut(BaseException):
    """One test ran past VSA_TEST_TIMEOUT (a BaseException: ``except Exception`` in the test
    must not swallow it)."""


def _alarm(signum, frame):
    raise TestTimedOut(f"test ran past {_TEST_TIMEOUT_S} s (VSA_TEST_TIMEOUT)")


@pytest.fixture(autouse=True)
def _per_test_timeout():
    """So one hung test does not use up the whole file's time."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(_TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
