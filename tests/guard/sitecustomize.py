"""The test suite's isolation guard: a test may read nothing beside the checkout and reach no other host.

`tests/conftest.py` installs it in the pytest processes and puts this folder on `PYTHONPATH`, so that every Python
subprocess a test starts (the CLI, the example scripts) imports it at start-up as `sitecustomize` and is guarded
too. An audit hook (PEP 578) sees every `open`, directory listing and socket connection: one that touches a
forbidden folder (`../shared` beside the checkout: this workplace's data, which no user has) or a host other than
this machine raises `PermissionError` at the call and is appended to the file `$ANGELSPEC_TEST_GUARD_LOG`, which
the conftest reads after each test and fails it with, even when the code under test caught the error and fell back.
"""

import os
import sys


GUARD_LOG_ENV = "ANGELSPEC_TEST_GUARD_LOG"
FORBIDDEN_ENV = "ANGELSPEC_TEST_FORBIDDEN_DIRS"
LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost", "0.0.0.0", ""}
PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.chdir"}


def install() -> None:
    """Guard this process (once) when the conftest has set the log file; both settings are read at each event, so a
    pytest worker that inherited its parent's log file at start-up reports to its own once its conftest set it."""
    if not os.environ.get(GUARD_LOG_ENV) or getattr(sys, "_angelspec_test_guard", False):
        return
    sys._angelspec_test_guard = True

    def violation(message: str) -> None:
        with open(os.environ[GUARD_LOG_ENV], "a", encoding="utf-8") as log:
            log.write(f"[pid {os.getpid()}] {message}\n")
        raise PermissionError(f"test isolation: {message}")

    def hook(event: str, args: tuple) -> None:
        if event in PATH_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            absolute = os.path.abspath(path)
            for folder in filter(None, os.environ.get(FORBIDDEN_ENV, "").split(os.pathsep)):
                if absolute == folder or absolute.startswith(folder + os.sep):
                    violation(f"{event} {path!r}: a test reads outside the repository ({folder})")
        elif event == "socket.connect" and len(args) > 1 and isinstance(args[1], tuple) and args[1]:
            host = str(args[1][0])
            if host not in LOCAL_HOSTS and not host.startswith("127."):
                violation(f"socket.connect to {args[1]!r}: a test reaches the network")
        elif event == "socket.getaddrinfo" and args:
            host = args[0].decode() if isinstance(args[0], bytes) else str(args[0] or "")
            if host not in LOCAL_HOSTS and not host.startswith("127."):
                violation(f"getaddrinfo {host!r}: a test reaches the network")

    sys.addaudithook(hook)


install()
