"""torchrun as pipec starts it: every store it serves listens only where its address says, and
it ends with the process that started it.

    python -m pipec.runtime.agent [torchrun's options] SCRIPT [ARGS]

torchrun's TCP stores (the c10d rendezvous's, and the one its ranks bootstrap from) listen on
every interface, IPv4 and IPv6, whatever address they are given: anyone who reaches the
machine can read and set their keys, unauthenticated. Here each store this agent serves listens
on its own address only: a socket bound to it is handed to the store (TCPStore's
`master_listen_fd`). `pipec run` gives 127.0.0.1 (the rendezvous endpoint and `--local-addr`,
the ranks' MASTER_ADDR), so a run on one machine listens on loopback alone; a run on several
nodes listens on the endpoint's address (rendezvous) and `--local-addr` (the ranks' store).

Started by `pipec run` (PARENT_PID set), the agent dies with it (runtime/faults.py's
`end_with_parent`), and its ranks die with the agent: SIGKILL to `pipec run` ends the run.
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist
from torch.distributed import run
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

from pipec.runtime.faults import PARENT_PID, end_with_parent


class BoundStore(dist.TCPStore):
    """A TCPStore whose server listens on `host_name`'s address only (not every interface)."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        **kwargs: object,
    ) -> None:
        if is_master and kwargs.get("master_listen_fd") is None:
            family, *_, address = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
            try:
                server = socket.create_server(address, family=family)
            except OSError as e:  # as TCPStore's own failure to listen, which torchrun retries
                raise RuntimeError(e.strerror or str(e)) from None
            port = server.getsockname()[1]
            kwargs["master_listen_fd"] = server.detach()  # the store closes it
        super().__init__(host_name, port, world_size, is_master, **kwargs)


def main(argv: list[str]) -> None:
    """torchrun's main on `argv`, its stores `BoundStore`s."""
    if PARENT_PID in os.environ:  # started by pipec run (or a test): end with it
        end_with_parent()
    os.environ[PARENT_PID] = str(os.getpid())  # the ranks end with this process
    dist.TCPStore = BoundStore  # read at each call by the rendezvous handler's store
    c10d_rendezvous_backend.TCPStore = BoundStore  # imported by name
    static_tcp_rendezvous.TCPStore = BoundStore
    run.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
