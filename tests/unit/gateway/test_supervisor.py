"""The listening sockets of several workers: one address, a socket each, the kernel spreading connections."""

from __future__ import annotations

import socket

from gateway.supervisor import listening_sockets


def test_every_worker_listens_on_the_same_port_with_a_socket_of_its_own() -> None:
    sockets = listening_sockets("127.0.0.1", 0, 3, 16)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1  # port 0: the first picks one, the others share it
        assert ports != {0}
        assert len({sock.fileno() for sock in sockets}) == 3
        assert all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for sock in sockets)
        assert all(sock.get_inheritable() for sock in sockets)  # handed to the workers
        (port,) = ports
        # Listening already, before any worker starts: a connection waits in a queue rather than being refused.
        accepted = 0
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(24)]
        for sock in sockets:
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted += 1
        for client in clients:
            client.close()
        assert accepted == 24
    finally:
        for sock in sockets:
            sock.close()
