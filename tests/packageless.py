"""One Python interpreter that cannot import angelspec_hf, kept for a test run, running the snippets of the remote-code
tests: each would otherwise start its own interpreter and pay torch's and transformers' imports (about 6 s) for a
second of work. Snippets share it as a user's session would share it between drafters loaded from several folders
(each test saves its own folder, so each loads its own `transformers_modules` copy of the code).

Run as a script, this file is that interpreter: one JSON request per line on stdin ({"code": ...}), one JSON answer
per line ({"stdout": ..., "error": traceback or null}) on the file descriptor it was given; its own stdout goes to
stderr, so that nothing a library prints can break the exchange.
"""

import contextlib
import io
import json
import os
import selectors
import subprocess
import sys
import tempfile
import traceback


class PackagelessInterpreter:
    """`run(code)` executes `code` in the shared interpreter (started on first use) and returns what it printed and
    the traceback of what it raised (None when nothing)."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.process = None

    def _start(self):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(write_end)],
            stdin=subprocess.PIPE,
            stdout=self.stderr,
            stderr=self.stderr,
            pass_fds=(write_end,),
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        os.close(write_end)
        self.answers = os.fdopen(read_end, "r")

    def run(self, code: str) -> tuple[str, str | None]:
        if self.process is None:
            self._start()
        self.process.stdin.write(json.dumps({"code": code}) + "\n")
        self.process.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.answers, selectors.EVENT_READ)
            line = self.answers.readline() if selector.select(self.timeout) else ""
        if not line:
            self.stderr.seek(0)
            raise RuntimeError(f"the package-less interpreter did not answer:\n{self.stderr.read()[-3000:]}")
        answer = json.loads(line)
        return answer["stdout"], answer["error"]

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
            self.answers.close()
            self.stderr.close()


def serve(answer_fd: int) -> None:
    sys.modules["angelspec_hf"] = None  # the package cannot be imported: only a folder's remote code can load
    import torch  # noqa: F401  (paid once, here)
    import transformers  # noqa: F401

    answers = os.fdopen(answer_fd, "w")
    for line in sys.stdin:
        printed = io.StringIO()
        error = None
        try:
            with contextlib.redirect_stdout(printed):
                exec(json.loads(line)["code"], {"__name__": "__packageless__"})
        except BaseException:  # reported to the test, which decides
            error = traceback.format_exc()
        answers.write(json.dumps({"stdout": printed.getvalue(), "error": error}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
