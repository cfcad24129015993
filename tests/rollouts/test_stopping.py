"""The one stop flag of graft-generate and graft-train (graft.rollouts.stopping): a signal sets it, a second Ctrl-C
stops at once, and uninstalling gives the previous handlers back."""

from __future__ import annotations

import os
import signal

import pytest

from graft.rollouts.stopping import StopFlag


def test_sigterm_sets_the_flag_and_uninstall_restores_the_handler():
    before, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopFlag(signals=(signal.SIGTERM,))
    stop.install()
    try:
        assert signal.getsignal(signal.SIGINT) == sigint  # not asked for: left alone
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_second_ctrl_c_stops_at_once():
    # a process started in the background by a shell without job control begins with SIGINT ignored: what
    # uninstall must give back is what was there
    before = signal.getsignal(signal.SIGINT)
    stop = StopFlag()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) == before
