"""Ctrl-C and termination signals reach the app whatever the shell it was started from did.

A process started in the background by a non-interactive shell (`cmd &` in a script, nohup, CI, a Slurm
batch step) inherits SIGINT *ignored*; Python then installs no KeyboardInterrupt handler and asyncio.run
no cancelling one, so Ctrl-C (or `kill -INT`) does nothing. `handle_stop_signals()` installs both
explicitly before the app's event loop starts: SIGINT raises KeyboardInterrupt (asyncio.run turns it into
cancelling the app's main task, which writes its final checkpoint), and SIGTERM (scancel, a time limit)
is handled exactly like SIGINT.
"""

import signal


def handle_stop_signals() -> None:
    """Call in the main thread before asyncio.run()."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
