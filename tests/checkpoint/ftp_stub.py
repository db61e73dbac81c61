"""A small real FTP server over a local folder (a thread per control connection), enough for fsspec's FTP
filesystem: login, PASV, MLSD/LIST, RETR/STOR with REST, DELE, MKD, RMD, RNFR/RNTO. For tests of a remote that
is unreachable for a while and then answers again on the same port (the stdlib has an FTP client only)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path


class FtpStub:
    """Serves ``root`` on ``127.0.0.1:port`` (0: any free port) until :meth:`close`.

    Attributes:
        port: the port it listens on.
        logins: number of sessions that logged in.
    """

    def __init__(self, root: str | os.PathLike[str], port: int = 0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(16)
        self.port = self.srv.getsockname()[1]
        self.logins = 0
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stops listening and drops every session."""
        try:  # wakes the accept() blocked in the other thread; a bare close() leaves the port listening
            self.srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.srv.close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _local(self, arg: str) -> Path:
        return self.root / arg.strip().lstrip("/")

    def _session(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        send = lambda line: conn.sendall((line + "\r\n").encode())  # noqa: E731
        data_srv: socket.socket | None = None
        rest = 0
        rename_from: Path | None = None
        try:
            send("220 stub ready")
            for raw in f:
                line = raw.decode().rstrip("\r\n")
                cmd, _, arg = line.partition(" ")
                cmd = cmd.upper()
                if cmd == "USER":
                    send("331 password")
                elif cmd == "PASS":
                    self.logins += 1
                    send("230 in")
                elif cmd in ("TYPE", "NOOP"):
                    send("200 ok")
                elif cmd == "PWD":
                    send('257 "/"')
                elif cmd == "PASV":
                    data_srv = socket.socket()
                    data_srv.bind(("127.0.0.1", 0))
                    data_srv.listen(1)
                    p = data_srv.getsockname()[1]
                    send(f"227 passive (127,0,0,1,{p >> 8},{p & 255})")
                elif cmd == "REST":
                    rest = int(arg)
                    send("350 rest")
                elif cmd in ("MLSD", "LIST", "RETR", "STOR"):
                    path = self._local(arg)
                    if cmd in ("MLSD", "LIST") and not path.is_dir() or cmd == "RETR" and not path.is_file() \
                            or data_srv is None:
                        send("550 no such file or folder")
                        continue
                    send("150 data")
                    dc, _ = data_srv.accept()
                    data_srv.close()
                    data_srv = None
                    with dc:
                        if cmd == "MLSD":
                            out = "".join(f"type={'dir' if e.is_dir() else 'file'};size={e.stat().st_size}; "
                                          f"{e.name}\r\n" for e in sorted(path.iterdir()))
                            dc.sendall(out.encode())
                        elif cmd == "LIST":
                            dc.sendall(b"")
                        elif cmd == "RETR":
                            with open(path, "rb") as src:
                                src.seek(rest)
                                dc.sendall(src.read())
                        else:
                            with open(path, "r+b" if rest and path.exists() else "wb") as dst:
                                dst.seek(rest)
                                dst.truncate()
                                while chunk := dc.recv(1 << 16):
                                    dst.write(chunk)
                    rest = 0
                    send("226 done")
                elif cmd == "DELE":
                    path = self._local(arg)
                    if path.is_file():
                        path.unlink()
                        send("250 deleted")
                    else:
                        send("550 no such file")
                elif cmd == "MKD":
                    self._local(arg).mkdir(exist_ok=True)
                    send(f'257 "{arg}"')
                elif cmd == "RMD":
                    try:
                        self._local(arg).rmdir()
                        send("250 removed")
                    except OSError:
                        send("550 cannot remove")
                elif cmd == "RNFR":
                    rename_from = self._local(arg)
                    send("350 ready")
                elif cmd == "RNTO" and rename_from is not None:
                    shutil.move(rename_from, self._local(arg))
                    send("250 renamed")
                elif cmd == "QUIT":
                    send("221 bye")
                    return
                else:
                    send("502 not implemented")
        except OSError:
            pass
        finally:
            conn.close()
