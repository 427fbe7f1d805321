"""flaxgpt.train.preemption: SIGTERM becomes a flag the training loop checks."""

import os
import signal
import time

import pytest

from flaxgpt.train.preemption import StopSignal


def test_stop_signal_turns_sigterm_into_a_flag():
    stop = StopSignal()
    try:
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the handler
        time.sleep(0.01)
        assert stop.requested(2) and stop.received == "SIGTERM"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ctrl_c_stops_like_sigterm_and_twice_interrupts():
    stop = StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: save and exit cleanly, as for a preemption
        time.sleep(0.01)
        assert stop.requested(2) and stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # pressed again: the user means it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
