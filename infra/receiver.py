"""A standalone receive buffer: registers memory with a transport and waits for one-sided writes.

Used by tests and benchmarks as "the decode side" in a separate process, and by operators to check
that a prefill host can reach a decode host (``python -m infra.receiver --transport mooncake
--nbytes 1048576`` on the decode host). Protocol over stdin/stdout, one line each:

- on start it prints one JSON line: ``{"endpoint", "addr", "nbytes", "metadata_b64", "pid"}``;
- ``dump PATH``  writes the whole buffer to PATH, answers ``ok``;
- ``sha256 OFFSET NBYTES``  answers the hex digest of that range;
- ``fill BYTE``  sets every byte of the buffer, answers ``ok``;
- ``quit`` (or end of input)  unregisters and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np

from shared.transport import TRANSPORTS, create_transport

# How long a receiver may take to go after quit, and again after SIGKILL: generous, since only a
# host under load makes it matter.
EXIT_WAIT_S = 60.0


class ReceiverProcess:
    """Start a receiver in a child process and talk to it (tests, benchmarks)."""

    def __init__(self, transport: str, nbytes: int, *, fill: int = 0, agent_name: str | None = None,
                 start_timeout_s: float = 30.0, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "infra.receiver", "--transport", transport,
               "--nbytes", str(nbytes), "--fill", str(fill)]
        if agent_name:
            cmd += ["--agent-name", agent_name]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL, env=env)
        try:
            hello = json.loads(self._readline(start_timeout_s))
        except Exception:
            self.kill()
            raise
        self.transport: str = transport
        self.endpoint: str = hello["endpoint"]
        self.addr: int = hello["addr"]
        self.nbytes: int = hello["nbytes"]
        self.metadata_b64: str = hello["metadata_b64"]

    def _readline(self, timeout_s: float) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if box and not box[0]:  # end of its output: it has exited or is exiting
            try:
                code = self.proc.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"receiver (pid {self.proc.pid}) closed its output without answering (exit "
                               f"code {code}); run python -m infra.receiver with the same arguments to see why")
        if not box:
            raise RuntimeError(f"receiver (pid {self.proc.pid}) did not answer within {timeout_s} s")
        return box[0].strip()

    def _ask(self, line: str, timeout_s: float = 30.0) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._readline(timeout_s)

    def read(self, path: str) -> bytes:
        """The whole receive buffer (via a dump file)."""
        if self._ask(f"dump {path}") != "ok":
            raise RuntimeError("receiver could not dump its buffer")
        with open(path, "rb") as f:
            return f.read()

    def sha256(self, offset: int, nbytes: int) -> str:
        return self._ask(f"sha256 {offset} {nbytes}")

    def fill(self, value: int) -> None:
        self._ask(f"fill {value}")

    def kill(self) -> None:
        """End the receiver at once (a decode node that has gone away)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self._reap(EXIT_WAIT_S)

    def _reap(self, timeout_s: float) -> bool:
        """Wait until the child has exited; False if it is still there after ``timeout_s``."""
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        """Ask the receiver to exit; kill it if it has not.

        Closing is cleanup: a receiver that is slow to go (a loaded host tearing down the transfer
        engine's threads) is waited for, then killed, and never turns a finished test or benchmark
        into a failure. The transfer engine's own shutdown takes about a second.
        """
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            if not self._reap(EXIT_WAIT_S):
                self.proc.kill()
                if not self._reap(EXIT_WAIT_S):
                    print(f"receiver pid {self.proc.pid} has not exited {2 * EXIT_WAIT_S:.0f} s after quit "
                          "and SIGKILL; leaving it", file=sys.stderr)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


def _serve(buf: np.ndarray, out) -> None:
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            return
        if cmd == "dump":
            buf.tofile(args[0])
            reply = "ok"
        elif cmd == "sha256":
            off, n = int(args[0]), int(args[1])
            reply = hashlib.sha256(buf[off : off + n].tobytes()).hexdigest()
        elif cmd == "fill":
            buf.fill(int(args[0]))
            reply = "ok"
        else:
            reply = f"error unknown command {cmd!r}"
        print(reply, file=out, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.receiver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=TRANSPORTS, default="mooncake")
    parser.add_argument("--nbytes", type=int, required=True, help="size of the receive buffer")
    parser.add_argument("--host", default="127.0.0.1", help="address writers reach (mooncake)")
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"), help="mooncake protocol")
    parser.add_argument("--agent-name", default=None, help="nixl agent name (default: random)")
    parser.add_argument("--fill", type=int, default=0, help="initial value of every byte")
    args = parser.parse_args(argv)
    out = sys.stdout
    # Libraries may log to stdout: keep our protocol on a private copy of it.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    transport = create_transport(args.transport, host=args.host, protocol=args.protocol,
                                 agent_name=args.agent_name)
    buf = np.full(args.nbytes, args.fill, dtype=np.uint8)
    addr = buf.ctypes.data
    transport.register(addr, args.nbytes)
    hello = {"endpoint": transport.endpoint, "addr": addr, "nbytes": args.nbytes,
             "metadata_b64": transport.metadata_b64, "pid": os.getpid()}
    print(json.dumps(hello), file=out, flush=True)
    try:
        _serve(buf, out)
    finally:
        transport.unregister(addr)
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
