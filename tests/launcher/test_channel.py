"""A rank's end of the channel: log calls leave in batches, never out of order, never twice."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from notebook_launcher.launcher import channel
from notebook_launcher.launcher.channel import Outbox, Progress
from notebook_launcher.launcher.metric_batch import MetricBatch


@pytest.fixture
def pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    yield reader, writer
    reader.close()
    writer.close()


def received(reader) -> list[object]:
    messages = []
    while reader.poll(0):
        messages.append(reader.recv())
    return messages


def batch(step: int, values: dict[str, float]) -> MetricBatch:
    return MetricBatch.of_calls([step], [values])


def test_a_call_after_a_quiet_spell_leaves_at_once(pipe, monkeypatch):
    monkeypatch.setattr(channel, "METRICS_WAIT_S", 3600.0)
    reader, writer = pipe
    outbox = Outbox(writer)
    outbox.log(3, {"loss": 0.5})
    assert reader.poll(30)  # well before the hour a batch may wait, and without a flush
    assert received(reader) == [batch(3, {"loss": 0.5})]


def test_calls_in_quick_succession_leave_together_in_order(pipe):
    reader, writer = pipe
    outbox = Outbox(writer)
    messages: list[MetricBatch] = []
    kernel = threading.Thread(target=lambda: messages.extend(iter(reader.recv, "done")))
    kernel.start()  # reads as the kernel does: more than a pipe holds is logged
    calls = 10_000
    for step in range(calls):
        outbox.log(step, {"loss": 1 / (step + 1)})
    outbox.send("done")
    kernel.join()
    assert [step for m in messages for step in m.steps] == list(range(calls))
    assert [v for m in messages for v in m.calls()] == [{"loss": 1 / (s + 1)} for s in range(calls)]
    assert all(len(m.steps) <= channel.METRICS_PER_MESSAGE for m in messages)
    assert len(messages) < calls // 10  # batches, not a message per call (even on a busy machine)


def test_the_last_calls_of_a_burst_leave_by_themselves(pipe, monkeypatch):
    monkeypatch.setattr(channel, "METRICS_WAIT_S", 2.0)  # the second call waits its turn
    reader, writer = pipe
    outbox = Outbox(writer)
    outbox.log(0, {"loss": 1.0})
    assert reader.poll(60)
    assert received(reader) == [batch(0, {"loss": 1.0})]  # read first: however slow the machine
    outbox.log(1, {"loss": 0.5})
    assert reader.poll(60)  # no further call, no flush: the sender thread sends it
    assert received(reader) == [batch(1, {"loss": 0.5})]


def test_another_message_sends_the_waiting_calls_first(pipe, monkeypatch):
    monkeypatch.setattr(channel, "METRICS_WAIT_S", 3600.0)
    reader, writer = pipe
    outbox = Outbox(writer)
    outbox.log(0, {"loss": 1.0})
    assert reader.poll(60)
    outbox.log(1, {"loss": 0.5})  # within the hour after a batch: it waits
    outbox.send(Progress(1, 2, "epoch"))
    assert received(reader) == [
        batch(0, {"loss": 1.0}),
        batch(1, {"loss": 0.5}),
        Progress(1, 2, "epoch"),
    ]


def test_a_process_the_rank_forks_sends_nothing_and_says_so_once(pipe, monkeypatch, capfd):
    monkeypatch.setattr(channel, "METRICS_WAIT_S", 3600.0)
    reader, writer = pipe
    outbox = Outbox(writer)
    outbox.log(0, {"loss": 1.0})
    assert reader.poll(60)
    outbox.log(1, {"loss": 0.5})  # waiting, with the sender thread started
    pid = os.fork()
    if pid == 0:  # a data loader worker, say: its writes would interleave with the rank's
        try:
            outbox.log(7, {"worker": 1.0})
            outbox.send(Progress(1, 2, "worker"))
            outbox.flush()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    outbox.flush()
    # The rank's waiting call is sent once, by the rank; nothing of the worker's.
    assert received(reader) == [batch(0, {"loss": 1.0}), batch(1, {"loss": 0.5})]
    assert capfd.readouterr().err.count(f"forked by rank process {os.getpid()}") == 1
