"""_SshStream.lines() never loses output that arrived with the channel's close (issue #19).

paramiko's BufferedPipe.read waits on its condition and raises PipeTimeout when its timeout is used
up, even when the data and the close arrived during that wait: the bytes stay in the buffer. Here a
real paramiko Channel gets its output and close exactly then (a clock that says the wait took longer
than the timeout), which is the race that dropped whole probe answers at 64 nodes.
"""

from __future__ import annotations

import socket
import types

import paramiko
import paramiko.buffered_pipe as buffered_pipe
import pytest

from ddp_train.launch.remote.remote import LOST, _SshStream

ANSWER = b'first line\nDDP-PROBE {"python": "3.11.2"}\nlast, no newline'
EXPECTED = ["first line", 'DDP-PROBE {"python": "3.11.2"}', "last, no newline"]


class _Transport:
    def __init__(self, active: bool = True) -> None:
        self.active = active

    def is_active(self) -> bool:
        return self.active


def _channel_closing_during_wait(
    monkeypatch: pytest.MonkeyPatch, exit_status: int | None
) -> paramiko.Channel:
    """A real Channel whose first wait ends with ANSWER buffered and the channel closed, yet times out."""
    channel = paramiko.Channel(0)
    channel.settimeout(0.01)
    pipe = channel.in_buffer
    calls = {"n": 0}

    def fake_time() -> float:
        calls["n"] += 1
        if calls["n"] == 2:  # just after the wait, the reader holding the pipe's lock: as the transport
            pipe._buffer.frombytes(ANSWER)  # thread would have fed and closed it during the wait
            pipe._closed = True
            channel.closed = True
            if exit_status is not None:
                channel.exit_status = exit_status
            channel.status_event.set()
        return calls["n"] * 10.0  # every wait "took" 10 s: longer than the timeout

    monkeypatch.setattr(buffered_pipe, "time", types.SimpleNamespace(time=fake_time))
    return channel


def test_output_that_arrives_with_the_close_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _channel_closing_during_wait(monkeypatch, exit_status=0)
    with pytest.raises(socket.timeout):  # the race itself: paramiko times out with data buffered
        channel.recv(1)
    channel = _channel_closing_during_wait(monkeypatch, exit_status=0)
    stream = _SshStream(channel, _Transport())
    assert list(stream.lines()) == EXPECTED
    assert stream.wait(timeout=1) == (0, None)


def test_a_dead_transport_is_lost_yet_its_buffered_output_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _channel_closing_during_wait(monkeypatch, exit_status=None)  # no exit status: transport died
    stream = _SshStream(channel, _Transport(active=False))
    assert list(stream.lines()) == EXPECTED
    assert stream.lost == LOST
    assert stream.wait(timeout=1) == (None, LOST)


def test_a_closed_channel_without_an_exit_status_on_a_live_transport_is_not_lost() -> None:
    channel = paramiko.Channel(0)
    channel.settimeout(0.01)
    channel._feed(b"output\n")
    channel.lock.acquire()
    try:
        channel._set_closed()  # a signal killed it: sshd closes without exit-status
    finally:
        channel.lock.release()
    stream = _SshStream(channel, _Transport())
    assert list(stream.lines()) == ["output"]
    assert stream.lost is None
    assert stream.wait(timeout=1) == (None, "ended without an exit status (killed by a signal?)")
